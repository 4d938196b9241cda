"""The parameters of a quantized linear layer, and their repacking once loaded.

While loading, a quantized layer holds its shard of the canonical form that
`models.quantization.formats` produces (`weight` uint8 [N, K], `weight_scale`, `weight_zero`
[N, G], `weight_perm` [K] for act-order); the linear layers' own `weight_loader`s shard them
like a 16-bit weight (column-parallel along N; row-parallel along K and, groups aligned, G).
`process_int_linear` then packs them into the kernels' layout
(`asyncengine_kernels.quant_linear`), drops the canonical tensors, and gives the layer a plan that
reads it: the dequantize-then-matmul reference on the CPU; on the GPU the Triton GEMM for small
batches and the reference for large ones, until the start-up tuner refines it.
FP8 layers take their own parameters and plan (`models.quantization.fp8`); which of the two a
layer gets is its format's method (`models.quantization.method`).
"""

from __future__ import annotations

import torch
from torch import nn

from asyncengine_kernels.gemv_split_k import gemv_counters
from asyncengine_kernels.quant_linear import QuantGemmConfig, pack_int_weight
from models.matmul_plan import MatmulPlan, PlanEntry
from models.quantization.config import IntQuantConfig, QuantConfig
from models.quantization.kinds import (
    QUANT_GEMV_MAX_ROWS,
    DequantMatmul,
    QuantTritonGemm,
    TritonDequantMatmul,
    pack_wgmma_copy,
    wgmma_serves,
)
from models.weight_loaders import set_weight_loader

# Rows up to which the GPU's plan before tuning runs the Triton GEMM.
DEFAULT_GEMM_MAX_ROWS = 64
# Activation dtypes the Triton kernels serve; the CPU reference serves any float dtype.
CUDA_DTYPES = (torch.float16, torch.bfloat16)


def create_int_weights(layer: nn.Module, qc: IntQuantConfig, full_in: int) -> None:
    """Give `layer` (in_features, out_features: its shard) the canonical integer parameters;
    `full_in`: the layer's unsharded input width (groups are counted on it)."""
    k, n = layer.in_features, layer.out_features
    gs = qc.group_size_for(full_in)
    if full_in % gs:
        raise ValueError(f"group size {gs} does not divide the input dimension {full_in}")
    channel = qc.group_size == -1
    if not channel and k % gs:
        raise ValueError(
            f"a tensor-parallel shard of {k} input columns would split a group of {gs}"
        )
    if k % qc.pack_factor:
        raise ValueError(f"{qc.bits}-bit weights need an input width divisible by "
                         f"{qc.pack_factor}, got {k}")  # fmt: skip
    groups = 1 if channel else k // gs
    layer.group_size = k if channel else gs
    layer.weight = nn.Parameter(torch.empty(n, k, dtype=torch.uint8), requires_grad=False)
    layer.weight_scale = nn.Parameter(torch.empty(n, groups), requires_grad=False)
    layer.weight_zero = nn.Parameter(torch.empty(n, groups, dtype=torch.int16),
                                     requires_grad=False)  # fmt: skip
    for p in (layer.weight, layer.weight_scale, layer.weight_zero):
        set_weight_loader(p, layer.weight_loader)
        # One group spans a whole row: a row-parallel shard takes all of it.
        p.row_replicated = channel and p is not layer.weight  # type: ignore[attr-defined]
    layer.input_perm = None
    if qc.desc_act:
        layer.weight_perm = nn.Parameter(torch.empty(k, dtype=torch.int64), requires_grad=False)
        set_weight_loader(layer.weight_perm, layer.load_input_perm)


def load_input_perm(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
                    input_sharded: bool) -> None:  # fmt: skip
    """Copy an act-order column order in; the fused projections must share one (GPTQ
    derives it from the input's statistics, which they share)."""
    if input_sharded:
        if not torch.equal(loaded.cpu(), torch.arange(loaded.numel())):
            raise ValueError("act-order (desc_act) weights with a permuted g_idx cannot be split "
                             "along the input dimension across tensor-parallel ranks")  # fmt: skip
        size = param.shape[0]
        loaded = loaded.narrow(0, layer.tp_rank * size, size) - layer.tp_rank * size
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"g_idx has {loaded.numel()} entries; the layer has {param.numel()} "
                         "input columns")  # fmt: skip
    loaded = loaded.to(param.device)
    if getattr(layer, "_perm_loaded", False) and not torch.equal(param.data, loaded):
        raise ValueError("the fused projections of this layer have different act orders (g_idx)")
    param.data.copy_(loaded)
    layer._perm_loaded = True


def process_int_linear(layer: nn.Module) -> None:
    """Repack the loaded canonical integer parameters into the kernels' layout and plan the
    layer."""
    qc: IntQuantConfig = layer.quant_config
    dtype = layer.weight_scale.dtype
    layer.register_buffer("qweight", pack_int_weight(layer.weight.data, qc.bits), False)
    layer.register_buffer("scales", layer.weight_scale.data.t().contiguous(), False)
    layer.register_buffer("zeros", layer.weight_zero.data.t().to(dtype).contiguous(), False)
    if qc.desc_act:
        perm = layer.weight_perm.data
        identity = torch.equal(perm, torch.arange(perm.numel(), device=perm.device))
        layer.input_perm = None if identity else perm
        del layer.weight_perm
    layer.weight = None
    del layer.weight_scale, layer.weight_zero
    # The GEMV's split-K arrival counters: allocated once, outside any CUDA graph capture.
    layer.register_buffer("gemv_counters", gemv_counters(
        QUANT_GEMV_MAX_ROWS, layer.qweight.shape[1], layer.qweight.device), False)
    if layer.qweight.is_cuda and wgmma_serves(layer):
        # Packed now, before the memory profile, so that the KV cache is sized with it;
        # tuning drops it where the plan does not use it.
        pack_wgmma_copy(layer)
    declared = layer.input_transform
    if layer.qweight.is_cuda:
        # Large batches dequantize into a temporary weight; planning it from the start makes
        # the memory profile (run before tuning) count that temporary.
        plan = MatmulPlan((
            PlanEntry(QuantTritonGemm(QuantGemmConfig()), DEFAULT_GEMM_MAX_ROWS, declared),
            PlanEntry(TritonDequantMatmul(), None, declared),
        ))  # fmt: skip
    else:
        plan = MatmulPlan((PlanEntry(DequantMatmul(), input=declared),))
    layer.set_plan(plan)


def quantized_linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if getattr(m, "quant_config", None) is not None]


def check_cuda_dtype(qc: QuantConfig, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, before anything is allocated, an activation dtype the GPU kernels of either
    format do not serve."""
    if device.type == "cuda" and dtype not in CUDA_DTYPES:
        raise ValueError(f"{qc.method} weights on CUDA need dtype float16 or bfloat16, got "
                         f"{str(dtype).removeprefix('torch.')}")  # fmt: skip
