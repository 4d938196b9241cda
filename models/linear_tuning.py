"""Per-shape choice of the matmul behind each linear layer, made once at start-up by timing.

- GPU, batch 1: the Triton GEMV (`kernels.gemv`) against cuBLAS, in a CUDA graph over the
  layers' own weights; for a layer whose input needs SiLU-and-mul or RMSNorm first, also
  with that transform fused into the GEMV.
- CPU, small batches: a oneDNN-packed weight (`kernels.cpu_linear`) against the BLAS call.

A layer keeps the library unless the alternative is clearly faster, so a wrong guess costs
nothing but the tuning time.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_linear import cpu_packing_available, pack_weight, time_packed_against_blas
from kernels.gemv import tune_gemv
from models.layers import LinearBase, ParallelLMHead, RowParallelLinear

# The packed CPU path must win by this much: timings on a busy CPU are noisy.
CPU_PACKED_MIN_GAIN = 0.9
# Layers whose packed copy would exceed this many bytes keep the BLAS call alone (the copy
# doubles the layer's memory).
CPU_PACKED_MAX_BYTES = 256 * 2**20


def tune_decode_gemvs(model: nn.Module) -> dict[tuple[int, int], dict[str, float]]:
    """Time the Triton GEMV against the BLAS library once per weight shape (CUDA, batch 1)
    over the layers holding that shape, and switch them to the faster one. Returns the
    timings per shape."""
    groups: dict[tuple[int, int, bool, bool, bool], list[LinearBase]] = {}
    for module in model.modules():
        if isinstance(module, LinearBase) and module.weight.is_cuda:
            has_bias = module.bias is not None and not isinstance(module, RowParallelLinear)
            key = (*module.weight.shape, has_bias, module.gated_input, module.normed_input)
            groups.setdefault(key, []).append(module)
    timings: dict[tuple[int, int], dict[str, float]] = {}
    for (n, k, has_bias, gated, normed), layers in groups.items():
        biases = [m.bias for m in layers] if has_bias else None
        weights = [m.weight for m in layers]
        best, fuses, timings[(n, k)] = tune_gemv(weights, biases, gated=gated, normed=normed)
        for m in layers:
            m.gemv_config, m.gemv_fuses_input = best, fuses
    return timings


def tune_cpu_linears(model: nn.Module) -> dict[tuple[int, int], tuple[float, float]]:
    """On the CPU, give small-batch steps a oneDNN-packed weight in every linear layer (and
    the LM head) whose shape runs clearly faster that way. Returns (BLAS, packed)
    microseconds per shape at 32 rows."""
    if not cpu_packing_available():
        return {}
    timings: dict[tuple[int, int], tuple[float, float]] = {}
    for module in model.modules():
        if not isinstance(module, (LinearBase, ParallelLMHead)):
            continue
        weight = module.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            continue
        if weight.numel() * weight.element_size() > CPU_PACKED_MAX_BYTES:
            continue
        shape = (weight.shape[0], weight.shape[1])
        packed = None
        if shape not in timings:  # the first layer of a shape is timed with its own copy
            packed = pack_weight(weight)
            timings[shape] = time_packed_against_blas(weight, packed)
        blas, fast = timings[shape]
        if fast < CPU_PACKED_MIN_GAIN * blas:
            module.cpu_packed = packed if packed is not None else pack_weight(weight)
        else:
            module.cpu_packed = None
    return timings
