"""Checkpoint formats -> one canonical form per linear layer, before any sharding.

Each format stores a linear layer `prefix` as a few packed tensors; `read_int_weights`
gathers them (they may sit in different safetensors files), checks their shapes and dtypes
against each other, and yields the layer in the canonical form the model's parameters take:
- `prefix.weight`: uint8 [N, K], the integer values, columns in the input's order (for GPTQ
  act-order: sorted by group, see `prefix.weight_perm`);
- `prefix.weight_scale`: float32 [N, G]; `prefix.weight_zero`: int16 [N, G], the zero point
  as the format means it (GPTQ v1 stores zero - 1; AWQ stores it as is; symmetric
  compressed-tensors has none: 2^(bits-1));
- `prefix.weight_perm` (GPTQ with desc_act): int64 [K], the input column of each canonical
  column, so W[:, j] is the checkpoint's column perm[j] and x[:, perm] meets it.
FP8 (`read_fp8_weights`): `prefix.weight` float8_e4m3fn [N, K], `prefix.weight_scale`
float32 [N, 1] (a per-tensor scale expanded to every row), `prefix.input_scale` float32 (one
value, static activations only). From a 16-bit checkpoint (`quantization="fp8"`) each
projection is quantized here, per output channel, on the whole tensor, so every
tensor-parallel shard gets the scales one GPU would.
Tensors that are not part of a quantized layer pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from asyncengine_kernels.fp8_linear import FP8_DTYPE, quantize_weight_per_channel
from models.quantization.config import Fp8QuantConfig, IntQuantConfig

# AWQ packs eight output columns per word in this order: nibble i holds column ORDER[i].
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

_PARTS = {
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "awq": (("qweight", "qzeros", "scales"), ()),
    "compressed-tensors": (("weight_packed", "weight_scale"), ("weight_shape",)),
}


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 // bits values each, lowest bits first, packed along `dim`
    -> the values (int32), that dimension `32 // bits` times longer."""
    pack = 32 // bits
    shifts = torch.arange(pack, dtype=torch.int32) * bits
    vals = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., pack] last
    vals = vals.movedim(-1, dim + 1)
    shape = list(words.shape)
    shape[dim] *= pack
    return vals.reshape(shape)


def pack_words(vals: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of `unpack_words`: values (0 <= v < 2^bits) -> int32 words along `dim`."""
    pack = 32 // bits
    shape = list(vals.shape)
    shape[dim : dim + 1] = [shape[dim] // pack, pack]
    v = vals.to(torch.int64).reshape(shape)
    shifts = (torch.arange(pack, dtype=torch.int64) * bits).view(
        [pack if i == dim + 1 else 1 for i in range(len(shape))]
    )
    words = (v << shifts).sum(dim=dim + 1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]
            ) -> None:  # fmt: skip
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; the format needs {shape}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} is {t.dtype}; the format needs {' or '.join(map(str, dtypes))}")


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _groups(prefix: str, k: int, qc: IntQuantConfig) -> int:
    gs = qc.group_size_for(k)
    if k % gs:
        raise ValueError(f"{prefix}: group size {gs} does not divide the input dimension {k}")
    return k // gs


def _gptq(prefix: str, t: dict[str, torch.Tensor], qc: IntQuantConfig) -> dict[str, torch.Tensor]:
    pack, qw = qc.pack_factor, t["qweight"]
    if qw.dim() != 2 or qw.dtype != torch.int32:
        raise ValueError(f"{prefix}.qweight must be a 2-D int32 tensor, got {tuple(qw.shape)} "
                         f"{qw.dtype}")  # fmt: skip
    k, n = qw.shape[0] * pack, qw.shape[1]
    g = _groups(prefix, k, qc)
    _expect(f"{prefix}.scales", t["scales"], (g, n), _FLOATS)
    if n % pack:
        raise ValueError(f"{prefix}: {n} output columns do not pack {pack} to a qzeros word")
    _expect(f"{prefix}.qzeros", t["qzeros"], (g, n // pack), (torch.int32,))
    q = unpack_words(qw, qc.bits, 0).t()  # [N, K]
    # v1 checkpoints store zero - 1 (without wrapping): every GPTQ kernel adds the 1 back.
    zeros = unpack_words(t["qzeros"], qc.bits, 1) + 1
    out = {"weight_scale": t["scales"].float().t(), "weight_zero": zeros.to(torch.int16).t()}
    g_idx = t.get("g_idx")
    if g_idx is not None:
        _expect(f"{prefix}.g_idx", g_idx, (k,), (torch.int32, torch.int64))
    in_order = torch.arange(k) // (k // g)
    if qc.desc_act:
        perm = torch.arange(k) if g_idx is None else torch.argsort(g_idx.long(), stable=True)
        if g_idx is not None and not torch.equal(g_idx.long()[perm], in_order):
            raise ValueError(f"{prefix}.g_idx does not assign {k // g} columns to each group")
        q, out["weight_perm"] = q[:, perm], perm
    elif g_idx is not None and not torch.equal(g_idx.long(), in_order):
        raise ValueError(f"{prefix}.g_idx is permuted but quantization_config has desc_act=false")
    out["weight"] = q.to(torch.uint8).contiguous()
    return out


def _awq(prefix: str, t: dict[str, torch.Tensor], qc: IntQuantConfig) -> dict[str, torch.Tensor]:
    pack, qw = qc.pack_factor, t["qweight"]
    if qw.dim() != 2 or qw.dtype != torch.int32:
        raise ValueError(f"{prefix}.qweight must be a 2-D int32 tensor, got {tuple(qw.shape)} "
                         f"{qw.dtype}")  # fmt: skip
    k, n = qw.shape[0], qw.shape[1] * pack
    g = _groups(prefix, k, qc)
    _expect(f"{prefix}.scales", t["scales"], (g, n), _FLOATS)
    _expect(f"{prefix}.qzeros", t["qzeros"], (g, n // pack), (torch.int32,))
    # Word j, nibble i holds output column 8j + ORDER[i]: undo the interleave.
    undo = torch.argsort(torch.tensor(AWQ_PACK_ORDER))

    def unpack(words: torch.Tensor) -> torch.Tensor:
        vals = unpack_words(words, qc.bits, 1)
        return vals.view(vals.shape[0], -1, pack)[:, :, undo].reshape(vals.shape[0], -1)

    return {
        "weight": unpack(qw).t().to(torch.uint8).contiguous(),
        "weight_scale": t["scales"].float().t(),
        "weight_zero": unpack(t["qzeros"]).to(torch.int16).t(),
    }


def _compressed(prefix: str, t: dict[str, torch.Tensor], qc: IntQuantConfig
                ) -> dict[str, torch.Tensor]:  # fmt: skip
    pack, wp = qc.pack_factor, t["weight_packed"]
    if wp.dim() != 2 or wp.dtype != torch.int32:
        raise ValueError(f"{prefix}.weight_packed must be a 2-D int32 tensor, got "
                         f"{tuple(wp.shape)} {wp.dtype}")  # fmt: skip
    n, k = wp.shape[0], wp.shape[1] * pack
    if "weight_shape" in t:
        shape = tuple(int(v) for v in t["weight_shape"].tolist())
        if shape[0] != n or not k - pack < shape[1] <= k:
            raise ValueError(f"{prefix}.weight_shape {shape} disagrees with weight_packed "
                             f"{tuple(wp.shape)}")  # fmt: skip
        k = shape[1]
    g = _groups(prefix, k, qc)
    _expect(f"{prefix}.weight_scale", t["weight_scale"], (n, g), _FLOATS)
    # Symmetric: the stored value is q + 2^(bits-1).
    q = unpack_words(wp, qc.bits, 1)[:, :k]
    zero = torch.full((n, g), 1 << (qc.bits - 1), dtype=torch.int16)
    return {"weight": q.to(torch.uint8).contiguous(), "weight_scale": t["weight_scale"].float(),
            "weight_zero": zero}  # fmt: skip


_CONVERT = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed}


def read_int_weights(
    weights: Iterable[tuple[str, torch.Tensor]], qc: IntQuantConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` (HF names) with each integer-quantized layer's tensors replaced by its
    canonical form (module docstring). A layer missing a part, or a linear stored
    unquantized, fails."""
    required, optional = _PARTS[qc.method]
    parts = set(required) | set(optional)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part == "weight_zero_point":
            raise ValueError(f"{name}: asymmetric compressed-tensors weights are not supported")
        if part == "weight" and prefix.endswith("_proj"):
            raise ValueError(f"{name} is stored unquantized in a {qc.method} checkpoint; every "
                             "linear layer must be quantized")  # fmt: skip
        if part not in parts:
            yield name, tensor
            continue
        # Parts of one layer may lie in different files: each layer is converted once the
        # whole checkpoint has been read.
        pending.setdefault(prefix, {})[part] = tensor
    for prefix, got in pending.items():
        missing = [p for p in required if p not in got]
        if missing:
            raise ValueError(f"checkpoint is missing {', '.join(f'{prefix}.{p}' for p in missing)}")
        if qc.method == "gptq" and qc.desc_act and "g_idx" not in got:
            raise ValueError(f"checkpoint is missing {prefix}.g_idx (desc_act=true needs it)")
        for part, tensor in _CONVERT[qc.method](prefix, got, qc).items():
            yield f"{prefix}.{part}", tensor


def _is_projection(prefix: str, part: str) -> bool:
    return part == "weight" and prefix.endswith("_proj")


def _fp8_scale(name: str, t: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's weight scale, per tensor (one value) or per channel ([N, 1] or [N]),
    as float32 [N, 1]."""
    if not t.is_floating_point() or t.element_size() == 1:
        raise ValueError(f"{name} is {t.dtype}; the format needs a float16/32 scale")
    if t.numel() == 1:
        t = t.reshape(1, 1).expand(rows, 1)
    elif tuple(t.shape) in ((rows, 1), (rows,)):
        t = t.reshape(rows, 1)
    else:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; the format needs one value (per "
                         f"tensor) or [{rows}, 1] (per channel)")  # fmt: skip
    t = t.float().contiguous()
    if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
        raise ValueError(f"{name} holds a scale that is not a positive finite number")
    return t


def _fp8_layer(prefix: str, got: dict[str, torch.Tensor], qc: Fp8QuantConfig
               ) -> dict[str, torch.Tensor]:  # fmt: skip
    w = got["weight"]
    if w.dtype != FP8_DTYPE:
        if w.dtype.is_floating_point and w.element_size() == 1:
            raise ValueError(f"{prefix}.weight is {w.dtype}; only e4m3 (torch.float8_e4m3fn) "
                             "weights are supported")  # fmt: skip
        raise ValueError(f"{prefix}.weight is stored unquantized ({w.dtype}) in an fp8 "
                         "checkpoint; every linear layer must be quantized")  # fmt: skip
    if w.dim() != 2:
        raise ValueError(f"{prefix}.weight must be 2-D, got {tuple(w.shape)}")
    if "weight_scale" not in got:
        raise ValueError(f"checkpoint is missing {prefix}.weight_scale")
    out = {"weight": w, "weight_scale": _fp8_scale(f"{prefix}.weight_scale",
                                                   got["weight_scale"], w.shape[0])}  # fmt: skip
    if qc.activation == "static":
        if "input_scale" not in got:
            raise ValueError(f"checkpoint is missing {prefix}.input_scale (static activation "
                             "scales need it)")  # fmt: skip
        a = got["input_scale"]
        if a.numel() != 1:
            raise ValueError(f"{prefix}.input_scale has shape {tuple(a.shape)}; the format "
                             "needs one value")  # fmt: skip
        out["input_scale"] = _fp8_scale(f"{prefix}.input_scale", a, 1).reshape(())
    return out


def read_fp8_weights(
    weights: Iterable[tuple[str, torch.Tensor]], qc: Fp8QuantConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` with each projection in the FP8 canonical form (module docstring): quantized
    here from a 16-bit checkpoint, else checked and its scales expanded."""
    if qc.source == "online":
        for name, tensor in weights:
            prefix, _, part = name.rpartition(".")
            if not _is_projection(prefix, part):
                yield name, tensor
                continue
            if not tensor.is_floating_point() or tensor.element_size() == 1:
                raise ValueError(f"{name} is {tensor.dtype}; quantization='fp8' quantizes a "
                                 "16/32-bit checkpoint")  # fmt: skip
            q, scale = quantize_weight_per_channel(tensor)
            yield name, q
            yield f"{prefix}.weight_scale", scale
        return
    parts = ("weight", "weight_scale", "input_scale")
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part in ("weight_zero_point", "input_zero_point"):
            raise ValueError(f"{name}: asymmetric fp8 quantization is not supported")
        if part not in parts or not prefix.endswith("_proj"):
            yield name, tensor
            continue
        # Parts of one layer may lie in different files: each layer is converted once the
        # whole checkpoint has been read.
        pending.setdefault(prefix, {})[part] = tensor
    for prefix, got in pending.items():
        if "weight" not in got:
            raise ValueError(f"checkpoint is missing {prefix}.weight")
        for part, tensor in _fp8_layer(prefix, got, qc).items():
            yield f"{prefix}.{part}", tensor
