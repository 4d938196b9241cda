"""Per-shape choice of the matmul behind each linear layer, made once at start-up by timing.

- GPU, batch 1: the Triton GEMV (`kernels.gemv`) against cuBLAS, in a CUDA graph over the
  layers' own weights; for a layer whose input needs SiLU-and-mul or RMSNorm first, also
  with that transform fused into the GEMV; for the MLP, also with SiLU-and-mul in the
  gate/up GEMV's epilogue.
- CPU, small batches: a oneDNN-packed weight (`kernels.cpu_linear`) against the BLAS call.

A layer keeps the library unless the alternative is clearly faster, so a wrong guess costs
nothing but the tuning time.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from kernels.cpu_linear import cpu_packing_available, pack_weight, time_packed_against_blas
from kernels.gemv import GemvChoice, tune_gemv
from models.layers import LinearBase, ParallelLMHead, RowParallelLinear

# The packed CPU path must win by this much: timings on a busy CPU are noisy.
CPU_PACKED_MIN_GAIN = 0.9
# Layers whose packed copy would exceed this many bytes keep the BLAS call alone (the copy
# doubles the layer's memory).
CPU_PACKED_MAX_BYTES = 256 * 2**20


def _set_choice(layers: list[LinearBase], choice: GemvChoice, applies_glu: bool) -> None:
    for m in layers:
        m.gemv_config, m.gemv_fuses_input = choice.config, choice.fuses_input
        m.gemv_applies_glu = applies_glu and choice.config is not None


class _GemvGroup(NamedTuple):
    """Layers tuned together: one weight shape, one input and output form."""

    n: int
    k: int
    has_bias: bool
    gated_input: bool
    normed_input: bool
    glu_output: bool


def tune_decode_gemvs(model: nn.Module) -> dict[tuple[int, int], dict[str, float]]:
    """Time the Triton GEMV against the BLAS library once per weight shape (CUDA, batch 1)
    over the layers holding that shape, and switch them to the faster one. Returns the
    timings per shape.

    The MLP is then timed as a pair: SiLU-and-mul applied by the down projection to its
    [gate, up] input (either form above), against the gate/up GEMV applying it in its
    epilogue and the down projection taking a plain input; the faster pair is kept."""
    groups: dict[_GemvGroup, list[LinearBase]] = {}
    for module in model.modules():
        if isinstance(module, LinearBase) and module.weight.is_cuda:
            has_bias = module.bias is not None and not isinstance(module, RowParallelLinear)
            key = _GemvGroup(
                *module.weight.shape, has_bias, module.gated_input, module.normed_input,
                module.glu_output,
            )  # fmt: skip
            groups.setdefault(key, []).append(module)
    timings: dict[tuple[int, int], dict[str, float]] = {}
    choices: dict[_GemvGroup, GemvChoice] = {}
    for key, layers in groups.items():
        biases = [m.bias for m in layers] if key.has_bias else None
        choice = tune_gemv(
            [m.weight for m in layers], biases, gated=key.gated_input, normed=key.normed_input
        )
        choices[key], timings[(key.n, key.k)] = choice, dict(choice.timings)
        _set_choice(layers, choice, applies_glu=False)
    producers = [key for key in groups if key.glu_output]
    consumers = [key for key in groups if key.gated_input]
    if len(producers) != 1 or len(consumers) != 1:
        return timings  # one MLP shape per model; anything else keeps the separate forms
    prod, cons = producers[0], consumers[0]
    prod_layers, cons_layers = groups[prod], groups[cons]
    biases = [m.bias for m in prod_layers] if prod.has_bias else None
    glu = tune_gemv([m.weight for m in prod_layers], biases, normed=prod.normed_input, glu=True)
    plain = tune_gemv([m.weight for m in cons_layers])
    timings[(prod.n, prod.k)].update({f"glu {name}": t for name, t in glu.timings.items()})
    timings[(cons.n, cons.k)].update(
        {f"plain input {name}": t for name, t in plain.timings.items()}
    )
    if glu.config is not None and glu.ms + plain.ms < choices[prod].ms + choices[cons].ms:
        _set_choice(prod_layers, glu, applies_glu=True)
        _set_choice(cons_layers, plain, applies_glu=False)
    return timings


def describe_decode_gemvs(model: nn.Module) -> list[str]:
    """One line per weight shape: what its batch-1 matmul runs, as tuning left it."""
    lines: dict[tuple[int, ...], str] = {}
    for m in model.modules():
        if not isinstance(m, LinearBase) or tuple(m.weight.shape) in lines:
            continue
        what = "BLAS" if m.gemv_config is None else f"Triton {list(m.gemv_config)}"
        if m.gemv_fuses_input:
            what += ", input transform in the prologue"
        if m.gemv_applies_glu:
            what += ", SiLU-and-mul in the epilogue"
        lines[tuple(m.weight.shape)] = f"{m.weight.shape[0]}x{m.weight.shape[1]}: {what}"
    return list(lines.values())


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
