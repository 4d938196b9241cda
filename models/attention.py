"""Paged attention layer: writes this step's K/V into the cache (rotating q and k on the way
when given the rotary table), then attends over it.

A decode-only step whose plan (`AttentionMetadata.decode_plan`, decided by the model runner)
fuses rotary folds the rotary and the K/V write into the attention kernel itself
(`asyncengine_kernels.rotary_paged_attention`): one kernel per layer instead of two.

On the CPU the layer runs `asyncengine_kernels.cpu_attention`, which works out what it needs from
the step's metadata once per step (in the first layer) rather than once per layer.

With an FP8 cache (`kv_cache_dtype="fp8"`) every op quantizes K and V as it writes them and
dequantizes inside attention, with the layer's `k_scale` and `v_scale`: float32 buffers of one
entry per KV head of this rank, from the checkpoint (`load_kv_scale`) or calibrated at
start-up (`asyncengine.kv_calibration`), else 1.0. They stay device tensors, so CUDA graphs
read their values at replay.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncengine_kernels import (
    paged_attention,
    paged_decode_attention_with_rotary,
    rotary_and_write_kv,
    write_kv_cache,
)
from asyncengine_kernels.cpu_attention import cpu_attention_step, step_index
from asyncengine_kernels.paged_attention import DecodePlan, DecodeRotary
from models.forward_context import get_attention_metadata
from models.parallel import local_kv_heads

# Checkpoint names of the KV-cache scales (vLLM's, then compressed-tensors') under a layer's
# `self_attn.`, and which of the layer's scales each one fills.
KV_SCALE_NAMES = {
    "k_scale": "k_scale",
    "v_scale": "v_scale",
    "k_proj.output_scale": "k_scale",
    "v_proj.output_scale": "v_scale",
}


def kv_scale_target(hf_name: str) -> tuple[str, str] | None:
    """For a checkpoint's KV-cache scale (`model.layers.N.self_attn.k_scale`, ...): the
    attention module holding it (`model.layers.N.self_attn`) and "k_scale" or "v_scale";
    None for any other tensor."""
    head, sep, tail = hf_name.partition(".self_attn.")
    which = KV_SCALE_NAMES.get(tail) if sep else None
    return None if which is None else (head + ".self_attn", which)


class Attention(nn.Module):
    """Attention over the paged KV cache bound by the model runner (`k_cache`, `v_cache`)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor
        self.v_scale: torch.Tensor
        ones = torch.ones(num_kv_heads, dtype=torch.float32)
        self.register_buffer("k_scale", ones, persistent=False)
        self.register_buffer("v_scale", ones.clone(), persistent=False)
        # Whether the checkpoint set either scale (start-up calibration keeps those by default).
        self.kv_scales_loaded = False

    def load_kv_scale(self, which: str, loaded: torch.Tensor, total_kv_heads: int) -> None:
        """Set `k_scale` or `v_scale` from a checkpoint tensor: one value (per tensor) or one
        per KV head of the whole model ([total_kv_heads]; this rank keeps its heads)."""
        target = getattr(self, which)
        values = loaded.detach().float().flatten()
        if values.numel() == 1:
            target.fill_(float(values[0]))
        elif values.numel() == total_kv_heads and loaded.dim() == 1:
            heads = local_kv_heads(total_kv_heads)  # this rank's, as the QKV projection's
            target.copy_(values[heads.start : heads.stop])
        else:
            raise ValueError(
                f"{which} must hold one value or one per KV head ({total_kv_heads}), got "
                f"shape {list(loaded.shape)}"
            )
        if not bool(torch.isfinite(target).all()) or bool((target <= 0).any()):
            raise ValueError(f"{which} must be finite and positive, got {values.tolist()}")
        self.kv_scales_loaded = True

    def _cpu_path(
        self, q: torch.Tensor, positions: torch.Tensor | None,
        cos_sin_cache: torch.Tensor | None, plan: DecodePlan | None,
    ) -> bool:  # fmt: skip
        """The CPU path takes CPU tensors, contiguous caches, a rotary table (if any) over the
        whole head and a step without split-KV or fused-rotary plan (the engine gives CPU
        steps neither); anything else runs the reference ops."""
        assert self.k_cache is not None and self.v_cache is not None
        if q.device.type != "cpu" or not self.k_cache.is_contiguous():
            return False
        if not self.v_cache.is_contiguous():
            return False
        if plan is not None and (plan.segments > 1 or plan.fuse_rotary):
            return False
        if cos_sin_cache is None:
            return True
        return positions is not None and cos_sin_cache.shape[-1] == self.head_dim

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
        cos_sin_cache: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q/k/v [T, H, D]; with `positions` and `cos_sin_cache`, q and k are rotated first."""
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("KV cache is not bound: the model runner binds it before a step")
        meta = get_attention_metadata()
        plan = meta.decode_plan if meta.decode_only else None
        if self._cpu_path(q, positions, cos_sin_cache, plan):
            index = step_index(meta, positions, self.k_cache.shape[1])  # type: ignore[arg-type]
            out = cpu_attention_step(
                index, q, k, v, cos_sin_cache, self.k_cache, self.v_cache, meta.block_tables,
                self.scale, self.k_scale, self.v_scale,
            )  # fmt: skip
            return out.reshape(q.shape[0], self.num_heads * self.head_dim)
        segments = 1 if plan is None else plan.segments
        if (
            plan is not None
            and plan.fuse_rotary
            and cos_sin_cache is not None
            and positions is not None
            and cos_sin_cache.shape[-1] == self.head_dim
        ):
            rotary = DecodeRotary(positions, cos_sin_cache, k, v, meta.slot_mapping)
            out = paged_decode_attention_with_rotary(
                q, rotary, self.k_cache, self.v_cache, meta.block_tables,
                meta.query_start_loc, meta.seq_lens, self.scale, segments,
                self.k_scale, self.v_scale,
            )  # fmt: skip
            return out.reshape(q.shape[0], self.num_heads * self.head_dim)
        if cos_sin_cache is not None:
            if positions is None:
                raise ValueError("rotary embedding needs the positions")
            q = rotary_and_write_kv(
                positions, q, k, v, cos_sin_cache, self.k_cache, self.v_cache,
                meta.slot_mapping, self.k_scale, self.v_scale,
            )  # fmt: skip
        else:
            write_kv_cache(
                k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale
            )
        out = paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            self.scale,
            max_query_len=meta.max_query_len,
            decode_only=meta.decode_only,
            max_seq_len=meta.max_seq_len,
            num_segments=segments,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
