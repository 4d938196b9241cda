"""Round-to-nearest writers of GPTQ (v1), AWQ (GEMM), compressed-tensors (int and FP8) and
vLLM-style FP8 checkpoints, for test fixtures: each quantizes an HF directory's linear layers
and writes, beside the quantized directory, the same model with the dequantized weights (the
HF oracle).

The packing is written out word by word from each format's definition, independently of
`models.quantization.formats`, so a convention both got wrong the same way cannot hide.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8_METHODS = ("fp8", "ct-fp8", "fp8-online")
E4M3_MAX = 448.0


@dataclass(frozen=True)
class Scheme:
    """What to write: `method` gptq | awq | compressed-tensors, or FP8 e4m3: fp8 (vLLM's
    `quant_method: "fp8"`), ct-fp8 (compressed-tensors `float-quantized`), fp8-online (the
    16-bit checkpoint unchanged, served with quantization="fp8"; the oracle holds the
    weights as the loader quantizes them). FP8 weight scales are per `fp8_weights`
    (tensor | channel); activations `activation` (dynamic | static, with an input_scale)."""

    method: str
    bits: int = 4
    group_size: int = 32
    sym: bool = False
    desc_act: bool = False
    # A convention deliberately got wrong, for tests that prove such a checkpoint is caught:
    # "gptq_zero" (zero written without the -1), "awq_order" (columns packed in order),
    # "ct_offset" (signed values packed without the 2^(bits-1) offset), "fp8_inverse" (the
    # reciprocal of each FP8 weight scale stored, as a dequantize-by-division format would).
    mistake: str | None = None
    fp8_weights: str = "channel"
    activation: str = "dynamic"

    @property
    def name(self) -> str:
        if self.method in FP8_METHODS:
            return f"{self.method}-{self.fp8_weights}-{self.activation}"
        extra = ("-sym" if self.sym else "") + ("-act" if self.desc_act else "")
        return f"{self.method}-{self.bits}b-g{self.group_size}{extra}"


def _pack_along_rows(vals: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] values -> int32 [R / pack, C]; word r holds rows r*pack + i at bits i*bits."""
    pack = 32 // bits
    out = torch.zeros(vals.shape[0] // pack, vals.shape[1], dtype=torch.int64)
    for r in range(out.shape[0]):
        for i in range(pack):
            out[r] |= vals[r * pack + i].to(torch.int64) << (bits * i)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def _pack_along_cols(vals: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
                     ) -> torch.Tensor:  # fmt: skip
    """[R, C] -> int32 [R, C / pack]; word c, slot i holds column c*pack + order[i]."""
    pack = 32 // bits
    order = order or tuple(range(pack))
    out = torch.zeros(vals.shape[0], vals.shape[1] // pack, dtype=torch.int64)
    for c in range(out.shape[1]):
        for i in range(pack):
            out[:, c] |= vals[:, c * pack + order[i]].to(torch.int64) << (bits * i)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def rtn(w: torch.Tensor, s: Scheme, cols: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Round-to-nearest of w [N, K] in groups of `group_size` columns taken in the order
    `cols`. Returns q [N, K] (in w's column order), scales and zero points [N, G], and the
    dequantized weight."""
    n, k = w.shape
    gs = k if s.group_size == -1 else s.group_size
    maxq = (1 << s.bits) - 1
    wg = w[:, cols].reshape(n, k // gs, gs).float()
    if s.sym:
        absmax = wg.abs().amax(-1).clamp(min=1e-5)
        scale = absmax / (maxq / 2)
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = ((hi - lo) / maxq).clamp(min=1e-5)
        # GPTQ v1 stores zero - 1 without wrapping: keep zero >= 1 so 0 never wraps.
        zero = torch.round(-lo / scale).clamp(1 if s.method == "gptq" else 0, maxq)
    scale = scale.half().float()  # the checkpoint stores 16-bit scales
    q = torch.clamp(torch.round(wg / scale[..., None]) + zero[..., None], 0, maxq)
    deq = ((q - zero[..., None]) * scale[..., None]).reshape(n, k)
    q_in_order = torch.empty(n, k, dtype=torch.int64)
    q_in_order[:, cols] = q.reshape(n, k).long()
    deq_in_order = torch.empty(n, k)
    deq_in_order[:, cols] = deq
    return q_in_order, scale, zero.long(), deq_in_order


def fp8_rtn(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 round-to-nearest of w [N, K]: (e4m3 values, float32 scale [N, 1] or [])."""
    wf = w.float()
    amax = wf.abs().amax(dim=1, keepdim=True) if per_channel else wf.abs().max()
    scale = (amax / E4M3_MAX).clamp(min=1e-12)
    return (wf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def _fp8_quant_config(s: Scheme) -> dict:
    if s.method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": s.activation}
    static = s.activation == "static"
    float8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
              "actorder": None, "block_structure": None, "observer": "minmax"}
    weights = {**float8, "strategy": s.fp8_weights, "dynamic": False}
    inputs = {**float8, "strategy": "tensor" if static else "token", "dynamic": not static,
              "observer": "minmax" if static else None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": inputs,
                                          "output_activations": None,
                                          "format": "float-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None,
            "quantization_status": "compressed"}  # fmt: skip


# Static activation scales of the fixtures, per projection: they differ within q/k/v and
# gate/up so that a loader keeping one of them instead of the largest would show.
INPUT_SCALES = {"q_proj": 0.02, "k_proj": 0.025, "v_proj": 0.015, "o_proj": 0.01,
                "gate_proj": 0.02, "up_proj": 0.03, "down_proj": 0.005}  # fmt: skip


def _write_fp8(prefix: str, module: str, w: torch.Tensor, s: Scheme,
               packed: dict[str, torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """Write one FP8 layer into `packed`; returns its dequantized weight."""
    q, scale = fp8_rtn(w, s.method == "fp8-online" or s.fp8_weights == "channel")
    if s.method == "ct-fp8":  # stored in the model's dtype: the oracle uses the stored value
        scale = scale.to(w.dtype).float()
    deq = (q.float() * scale).to(w.dtype)
    if s.method == "fp8-online":
        packed[prefix + ".weight"] = w
        return deq
    stored = 1 / scale if s.mistake == "fp8_inverse" else scale
    if s.method == "ct-fp8":  # compressed-tensors: [1] or [N, 1], in the model's dtype
        stored = stored.reshape(-1, 1) if s.fp8_weights == "channel" else stored.reshape(1)
        stored = stored.to(w.dtype)
    packed[prefix + ".weight"] = q
    packed[prefix + ".weight_scale"] = stored.contiguous()
    if s.activation == "static":
        packed[prefix + ".input_scale"] = torch.tensor(
            INPUT_SCALES[module] if s.method == "fp8" else [INPUT_SCALES[module]]
        )
    return deq


def _quant_config(s: Scheme) -> dict:
    if s.method in FP8_METHODS:
        return _fp8_quant_config(s)
    if s.method == "gptq":
        return {"quant_method": "gptq", "bits": s.bits, "group_size": s.group_size,
                "sym": s.sym, "desc_act": s.desc_act, "checkpoint_format": "gptq"}  # fmt: skip
    if s.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": s.group_size,
                "zero_point": True, "version": "gemm"}  # fmt: skip
    weights = {"num_bits": s.bits, "type": "int", "symmetric": True, "dynamic": False,
               "strategy": "channel" if s.group_size == -1 else "group",
               "group_size": None if s.group_size == -1 else s.group_size, "actorder": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None, "output_activations": None,
                                          "format": "pack-quantized"}},
            "ignore": ["lm_head"], "quantization_status": "compressed"}  # fmt: skip


def write_quantized(src: Path, dst: Path, s: Scheme, seed: int = 0) -> Path:
    """Quantize the HF directory `src` into `dst` (format `s`) and write the dequantized
    model into `dst.parent / (dst.name + "-dequantized")`. Returns that oracle directory."""
    oracle = dst.parent / f"{dst.name}-dequantized"
    for d in (dst, oracle):
        shutil.copytree(src, d, dirs_exist_ok=True)
        (d / "model.safetensors").unlink()
    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    perms: dict[tuple[str, int], torch.Tensor] = {}
    packed: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        prefix, _, part = name.rpartition(".")
        module = prefix.rsplit(".", 1)[-1]
        if part != "weight" or module not in LINEARS:
            packed[name] = dequantized[name] = w
            continue
        n, k = w.shape
        if s.method in FP8_METHODS:
            dequantized[name] = _write_fp8(prefix, module, w, s, packed)
            continue
        # Projections sharing an input share GPTQ's act order (it comes from that input).
        shared = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
        key = (prefix.replace(module, shared.get(module, module)), k)
        if s.desc_act:
            cols = perms.setdefault(key, torch.randperm(k, generator=gen))
        else:
            cols = torch.arange(k)
        q, scale, zero, deq = rtn(w.float(), s, cols)
        dequantized[name] = deq.to(w.dtype)
        gs = k if s.group_size == -1 else s.group_size
        if s.method == "gptq":
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[cols] = (torch.arange(k) // gs).to(torch.int32)
            packed[prefix + ".qweight"] = _pack_along_rows(q.t(), s.bits)
            stored = zero if s.mistake == "gptq_zero" else zero - 1
            packed[prefix + ".qzeros"] = _pack_along_cols(stored.t(), s.bits)
            packed[prefix + ".scales"] = scale.t().half().contiguous()
            packed[prefix + ".g_idx"] = g_idx
        elif s.method == "awq":
            order = None if s.mistake == "awq_order" else AWQ_ORDER
            packed[prefix + ".qweight"] = _pack_along_cols(q.t(), 4, order)
            packed[prefix + ".qzeros"] = _pack_along_cols(zero.t(), 4, order)
            packed[prefix + ".scales"] = scale.t().half().contiguous()
        else:
            offset = 0 if s.mistake == "ct_offset" else 1 << (s.bits - 1)
            signed = q - zero.repeat_interleave(gs, dim=1)
            mask = (1 << s.bits) - 1  # two's complement bits when the offset is left out
            packed[prefix + ".weight_packed"] = _pack_along_cols((signed + offset) & mask, s.bits)
            packed[prefix + ".weight_scale"] = scale.to(w.dtype).contiguous()
            packed[prefix + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
    save_file(packed, str(dst / "model.safetensors"))
    save_file(dequantized, str(oracle / "model.safetensors"))
    if s.method != "fp8-online":
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = _quant_config(s)
        (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return oracle
