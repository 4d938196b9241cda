"""Building blocks of the Llama family: tensor-parallel linears, embeddings, norms, rotary.

Linear layers own their shard of the weight and a `weight_loader(param, tensor, shard_id)`
that copies a full HF tensor's slice for this rank into place; fused QKV and gate/up
projections are assembled at load time by calling the loader once per HF tensor. With one
rank the shards are the whole tensors, so the same model serves TP=1 and TP=N.

Every linear layer and the LM head multiply through the `MatmulPlan` they hold
(`models.matmul_plan`); the model declares, when it builds a layer, what its input is and
whether its output is a [gate; up] pair, and `models.linear_tuning` may hand it a faster plan.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine_kernels import fused_add_rms_norm, rms_norm
from models.matmul_plan import InputTransform, PlannedMatmul
from models.parallel import (
    all_gather_last_dim,
    all_reduce,
    divide,
    get_tp_rank,
    get_tp_size,
    local_kv_heads,
)
from models.quantization.config import QuantConfig
from models.weight_loaders import set_weight_loader


def _check_shape(name: str, param: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"shape mismatch for {name}: checkpoint has {tuple(loaded.shape)}, "
            f"the model expects {tuple(param.shape)}"
        )


def _check_full_shape(name: str, loaded: torch.Tensor, full: tuple[int, ...]) -> None:
    """Check an unsharded checkpoint tensor before slicing this rank's part out of it."""
    if tuple(loaded.shape) != full[: loaded.dim()] or loaded.dim() > len(full):
        raise ValueError(
            f"shape mismatch for {name}: checkpoint has {tuple(loaded.shape)}, "
            f"the model expects {full[: loaded.dim()]}"
        )


class LinearBase(PlannedMatmul, nn.Module):
    """y = x W^T (+ b) with this rank's shard of W; subclasses define the sharding.

    input_transform: what the layer's input is (see `models.matmul_plan.InputTransform`):
    plain, RMSNorm's input (the layer runs through `forward_normed`), or a [gate, up] pair
    (2 * in_features wide) whose SiLU-and-mul the layer applies. glu_output: the output is a
    [gate; up] pair that the next layer activates, which a plan may do in the epilogue.

    quant_config: the checkpoint's weight format (`models.quantization.config`), as the
    model passes it down, vLLM's way; the layer then holds that format's parameters instead
    of a dense `weight` (its linear method's, `models.quantization.method`)."""

    # Whether tensor parallelism splits the input dimension (row-parallel layers).
    input_is_sharded: bool = False

    def __init__(
        self, in_features: int, out_features: int, bias: bool,
        input_transform: InputTransform = InputTransform.NONE, glu_output: bool = False,
        quant_config: QuantConfig | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant_config = quant_config
        if self.quant_config is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
            set_weight_loader(self.weight, self.weight_loader)
        else:
            from models.quantization.method import get_quant_method

            full_in = in_features * (get_tp_size() if self.input_is_sharded else 1)
            get_quant_method(self.quant_config).create_weights(self, self.quant_config, full_in)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)
        self.init_plan(input_transform, glu_output)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        _check_shape("weight", param, loaded)
        param.data.copy_(loaded)

    def load_input_perm(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        from models.quantization.layer import load_input_perm

        load_input_perm(self, param, loaded, self.input_is_sharded and get_tp_size() > 1)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.plan.apply(self, x, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False,
        input_transform: InputTransform = InputTransform.NONE, glu_output: bool = False,
        quant_config: QuantConfig | None = None,
    ) -> None:  # fmt: skip
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        out = divide(out_features, self.tp_size)
        super().__init__(in_features, out, bias, input_transform, glu_output, quant_config)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        size = param.shape[0]
        _check_full_shape("column-parallel weight", loaded, (size * self.tp_size, *param.shape[1:]))
        shard = loaded.narrow(0, self.tp_rank * size, size)
        param.data.copy_(shard)

    def forward_normed(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer applied to norm(x + residual), or norm(x) without a residual; returns
        that and the new residual (x + residual, or x). The plan says whether the norm runs
        in the matmul kernel's prologue or as a kernel of its own."""
        return self.plan.apply_normed(self, x, residual, norm, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked in one matmul (gate and up projections)."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool = False,
        input_transform: InputTransform = InputTransform.NONE, glu_output: bool = False,
        quant_config: QuantConfig | None = None,
    ) -> None:  # fmt: skip
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, input_transform, glu_output,
                         quant_config)  # fmt: skip

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        _check_full_shape(
            f"merged shard {shard_id}", loaded, (self.output_sizes[shard_id], *param.shape[1:])
        )
        shard = loaded.narrow(0, self.tp_rank * size, size)
        target = param.data.narrow(0, offset, size)
        _check_shape(f"merged shard {shard_id}", target, shard)
        target.copy_(shard)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projection; KV heads are replicated when ranks outnumber them."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
        input_transform: InputTransform = InputTransform.NONE,
        quant_config: QuantConfig | None = None,
    ) -> None:  # fmt: skip
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp)
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        kv_heads = local_kv_heads(num_kv_heads)
        self.num_kv_heads, self.kv_head_start = len(kv_heads), kv_heads.start
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias, input_transform, quant_config=quant_config)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, start, size = 0, self.tp_rank * q_size, q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            start, size = self.kv_head_start * self.head_dim, kv_size
        heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        _check_full_shape(f"{shard_id}_proj", loaded, (heads * self.head_dim, *param.shape[1:]))
        shard = loaded.narrow(0, start, size)
        target = param.data.narrow(0, offset, size)
        _check_shape(f"{shard_id}_proj", target, shard)
        target.copy_(shard)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced."""

    input_is_sharded = True

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False,
        input_transform: InputTransform = InputTransform.NONE,
        quant_config: QuantConfig | None = None,
    ) -> None:  # fmt: skip
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        super().__init__(divide(in_features, self.tp_size), out_features, bias, input_transform,
                         quant_config=quant_config)  # fmt: skip

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        # The bias is added once, after the reduction; a per-channel scale spans every rank.
        if param.dim() == 1 or getattr(param, "row_replicated", False):
            _check_shape("row-parallel bias" if param.dim() == 1 else "scale", param, loaded)
            param.data.copy_(loaded)
            return
        size = param.shape[1]
        _check_full_shape("row-parallel weight", loaded, (self.out_features, size * self.tp_size))
        shard = loaded.narrow(1, self.tp_rank * size, size)
        _check_shape("row-parallel weight", param, shard)
        param.data.copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, None)
        # The layer's own split, not the process's: a draft model built whole runs on rank 0
        # of a tensor-parallel target without a collective.
        if self.tp_size > 1:
            y = all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks; each rank looks up its range and the sum is reduced."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.num_embeddings = num_embeddings
        self.shard_size = math.ceil(num_embeddings / self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, embedding_dim), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        if loaded.shape[1:] != param.shape[1:] or loaded.shape[0] != self.num_embeddings:
            raise ValueError(
                f"shape mismatch for embedding: checkpoint has {tuple(loaded.shape)}, "
                f"the model expects ({self.num_embeddings}, {param.shape[1]})"
            )
        rows = min(self.shard_size, self.num_embeddings - self.vocab_start)
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mask = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight)
        y = y * mask.unsqueeze(-1).to(y.dtype)
        return all_reduce(y)


class ParallelLMHead(PlannedMatmul, VocabParallelEmbedding):
    """Logits over this rank's vocab shard, gathered to the full vocabulary; the product runs
    through a `MatmulPlan`, as the linear layers' do."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.init_plan(InputTransform.NONE, glu_output=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.plan.apply(self, hidden, None)
        if self.tp_size > 1:
            logits = all_gather_last_dim(logits)
        return logits[..., : self.num_embeddings]


class RMSNorm(nn.Module):
    """RMSNorm whose residual form fuses the preceding residual add (one kernel on the GPU)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_cos_sin_cache(
    head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """[max_position, head_dim] float32: cos of the head_dim/2 frequencies, then their sin."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling or {})
    elif rope_type == "linear":
        inv_freq = inv_freq / float((scaling or {})["factor"])
    elif rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r} (default, linear, llama3 are)")
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


# Live cos/sin caches by (head_dim, max_position, base, scaling, device): the layers of a
# model share one, so the CPU attention path reads its rows once per step, not per layer.
_COS_SIN_CACHES: weakref.WeakValueDictionary[tuple[Any, ...], torch.Tensor] = (
    weakref.WeakValueDictionary()
)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin cache, one tensor shared by the layers built with equal settings
    on one device; the attention layer applies rotary (fused with the KV-cache write or the
    decode attention)."""

    def __init__(
        self, head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        key = (head_dim, max_position, base, repr(sorted((scaling or {}).items())),
               str(torch.get_default_device()))  # fmt: skip
        cache = _COS_SIN_CACHES.get(key)
        if cache is None:
            cache = compute_cos_sin_cache(head_dim, max_position, base, scaling)
            _COS_SIN_CACHES[key] = cache
        self.register_buffer("cos_sin_cache", cache, persistent=False)
