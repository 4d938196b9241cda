"""The matmul-plan kinds of a weight-only integer linear layer (`models.matmul_plan.MatmulKind`);
`tuning_kinds` names those the start-up tuner times for such a layer (FP8's are in
`models.quantization.fp8`): by default the few that a rule table (`INT_TUNING_RULES`) names
per weight width and row range, every config with `ASYNCENGINE_TUNE_ALL_KINDS=1`.

All but one read the layer's one internal layout (`asyncengine_kernels.quant_linear`: `qweight`,
`scales`, `zeros`, and `input_perm` for GPTQ act-order) that `models.quantization.layer`
builds at load, so switching between them stores nothing: `DequantMatmul` (dequantize
with torch ops, then the library's matmul: the CPU path and the oracle),
`TritonDequantMatmul` (the same with one Triton dequantization pass: on the GPU, a choice
for large batches),
`QuantTritonGemm` (16-bit weight tiles formed in registers for the tensor cores, from a few
rows to prefill) and `QuantTritonGemv` (a few rows of 16-bit activations, all of a program's
tiles loaded at once; it can also take a [gate, up] input and apply SiLU-and-mul itself).
`QuantWgmma` (int4 and int8 on Hopper's tensor cores, up to 256 rows in both widths:
`asyncengine_kernels.quant_wgmma`) reads a second copy of the codes packed for it at load
(`wgmma_words`, as many bytes as `qweight`), which `release_unplanned_copies` drops once tuning
has planned the layer without it. The engine tunes before its memory profile, so the KV pool
is sized by the copies that stay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from asyncengine_kernels import envs, quant_wgmma
from asyncengine_kernels.activation import silu_and_mul
from asyncengine_kernels.quant_linear import (
    QuantAtOnceGemvConfig,
    QuantGemmConfig,
    at_once_gemv_config,
    dequantize_weight_triton,
    gemm_config,
    quant_gemm,
    quant_gemm_candidates,
    quant_gemv,
    quant_gemv_candidates,
    quant_matmul_ref,
)
from models.matmul_plan import InputTransform, MatmulKind

# The most rows the GEMV serves: it reads each weight block once per row (from L2 after the
# first), so it loses to tensor-core tiles well before this.
QUANT_GEMV_MAX_ROWS = 16


# A kind agrees with the reference when its largest error is within this fraction of the
# reference's largest output (bf16 rounding of the output and of the inputs' sums).
AGREEMENT_RTOL = 0.02


def reference_of(kind: MatmulKind) -> MatmulKind:
    """The kind `kind` is checked against: its own `reference`, else `DequantMatmul`."""
    return getattr(kind, "reference", None) or DequantMatmul()


def reference_output(
    reference: MatmulKind, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`reference`'s output for `layer` on `x`, in float32: what `agrees_with_reference`
    compares against (computed once per layer and input when many kinds are checked)."""
    with torch.inference_mode():
        return reference.apply(layer, x, bias).float()


def agrees_with_reference(
    kind: MatmulKind, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
    want: torch.Tensor | None = None,
) -> bool:  # fmt: skip
    """Whether `kind` computes `layer`'s output on `x` as its reference does (`reference_of`;
    `want`: that output, if already computed by `reference_output`): every value finite and
    within `AGREEMENT_RTOL` of the reference's scale. A NaN compares false with any bound,
    so the check is written to fail on it rather than pass."""
    if want is None:
        want = reference_output(reference_of(kind), layer, x, bias)
    with torch.inference_mode():
        got = kind.apply(layer, x, bias).float()
    if got.shape != want.shape or not bool(torch.isfinite(got).all()):
        return False
    tol = AGREEMENT_RTOL * float(want.abs().max()) + 1e-3
    return float((got - want).abs().max()) <= tol


def tuning_kinds(layer: torch.nn.Module, rows: int) -> list[MatmulKind]:
    """The kinds the start-up tuner times for the integer layer `layer` at `rows` rows:
    those the rule table names (`rule_int_kinds`), or with `ASYNCENGINE_TUNE_ALL_KINDS` every
    one (`all_int_kinds`)."""
    if envs.tune_all_kinds():
        return all_int_kinds(layer, rows)
    return rule_int_kinds(layer, rows)


def all_int_kinds(layer: torch.nn.Module, rows: int) -> list[MatmulKind]:
    """Every kind and launch config that can serve `layer` at `rows` rows; the reference
    first."""
    group, k = layer.group_size, layer.in_features
    kinds: list[MatmulKind] = [DequantMatmul()]
    if layer.qweight.is_cuda:
        kinds.append(TritonDequantMatmul())
    kinds += [QuantTritonGemm(c) for c in quant_gemm_candidates(group, k)]
    if rows <= QUANT_GEMV_MAX_ROWS:
        kinds += [QuantTritonGemv(c) for c in quant_gemv_candidates(group, k)]
    if wgmma_serves_rows(layer, rows):
        kinds.append(QuantWgmma())
    return kinds


@dataclass(frozen=True)
class IntRule:
    """The kinds timed for integer weights at a ladder step of up to `max_rows` rows (None:
    any): GEMVs as (block_n, input rows per program, warps), GEMM tiles as (block_m,
    block_n, block_k, warps, stages, split_k), whether dequantize + BLAS is one, and whether
    the wgmma matmul is (where the layer has its copy of the codes): beside the others, or
    alone (`wgmma_alone`: the others are then not timed)."""

    max_rows: int | None
    at_once: tuple[tuple[int, int, int], ...] = ()
    gemms: tuple[tuple[int, int, int, int, int, int], ...] = ()
    dequantize: bool = False
    wgmma: bool = False
    wgmma_alone: bool = False


# From 3 rows up the GEMM tiles follow the H200's W1 measurement (2026-12-03: Llama-2-7B
# layers in int4 and int8 g128 at 16, 64, 128 and 256 rows, each tile of
# `asyncengine_kernels.quant_linear.QUANT_GEMM_SHAPES` against dequantize + cuBLAS;
# docs/quantization.md, "The integer GEMM on 16-bit tiles"). At 16 rows the small tile split 4 along
# K won every layer (2.3x ahead of dequantize + cuBLAS on gate/up int4) and its unsplit form none.
_SMALL_GEMM = ((16, 64, 128, 4, 4, 4),)
# At 64 rows 64x64x128 won gate/up and q/k/v int8, its split-2 form q/k/v int4 and down,
# dequantize + cuBLAS o. At 128 rows 128x64x64 won gate/up; the split-2 tile came within
# 10 % on o and down (int8), which dequantize + cuBLAS won with q/k/v int4 (64x64x128 won
# q/k/v int8 by 3 % and is not timed there). At 256 rows dequantize + cuBLAS won every
# layer by 1.15-1.97x over the best tile, so from 65 rows no GEMM tile is timed: the
# 65-256 step is timed at its top (`models.linear_tuning.QUANT_ROW_LADDER`), where the tiles
# lose on every layer, so timing them there (and compiling them for it) only lengthened a
# cold start (2026-12-05: in a cold GPTQ int4 start on the H200 tuning took 23 of its 33.7 s).
#
# The int4 wgmma matmul, where a layer has its copy of the codes, is timed at every step up
# to 64 rows, and alone from 2 to 16: there it was 1.5-2.2x ahead of the best of the kinds
# below on every Llama-2-7B layer (H200, 2026-12-03, `bench_kernels --only int4`: per layer
# of four matmuls 57.0 us against 87.0 at 2 rows, 58.3 / 126.6 at 4, 61.2 / 130.7 at 8,
# 75.7 / 131.1 at 16; at 32 rows 105 / 174, where it beats bf16 cuBLAS's 116). At one row
# the at-once GEMVs won q/k/v, o and down (52.8 us a layer against its 54.7; it won
# gate/up), at 64 rows the 64x64x128 tiles won q/k/v and gate/up (192 / 237) until the
# ring below took those rows. Above 64 rows the activations stream through a ring, 128
# rows a launch (int8 too since 2026-12-05, not yet timed there: the 65-256 step times it
# beside the others, as for int4). In int4: at 128 rows it won every layer against the
# tiles and dequantize + cuBLAS (151 us a layer against 256 and 269; 2026-12-04), at 256
# (two launches: 290 us a layer against dequantize + cuBLAS's 302) it won gate/up only
# (93 / 136), so it is timed beside the 256-row step's kinds.
#
# int8 measured the same way (2026-12-04): 81-94 us a layer at 2-16 rows against 127-149
# for the best of the other kinds (1.5-1.7x, every layer). At 17-64 rows both widths stream
# their activations through the ring (`quant_wgmma.RING_MIN_ROWS`), timed alone there: in
# int4 it took 81 us a layer at 32 rows and 105 at 64 against the best GEMM tile's 171 and
# 190 (H200, 2026-12-04); in int8 108 and 121 against 198 and 217 (H100, 2026-12-05), and
# below bf16 cuBLAS's 160 and 163 on the same layers, which bounds dequantize + cuBLAS.
_UP_TO_16_ROWS = IntRule(16, gemms=_SMALL_GEMM, dequantize=True, wgmma=True, wgmma_alone=True)
_64_ROW_GEMMS = ((64, 64, 128, 4, 3, 1), (64, 64, 128, 4, 3, 2))
_UP_TO_64_ROWS = IntRule(64, gemms=_64_ROW_GEMMS, dequantize=True, wgmma=True,
                         wgmma_alone=True)  # fmt: skip
_FROM_65_ROWS = (IntRule(256, dequantize=True, wgmma=True), IntRule(None, dequantize=True))
# Per weight width, the GEMVs that won a Llama-2-7B shape on the H200 at 1-4 rows, or came
# within 5 % of the winner: every kind's time in a cold GPTQ int4 g128 start, and the plans
# of full-sweep starts in GPTQ int8 g128 and AWQ int4 (docs/quantization.md, "Start-up
# tuning by rules"); beside them at 3-4 rows the small GEMM tile (split 4, as it won at 16
# rows; not timed at 4). int8 also planned GEMVs walking K a tile at a time at 2-4 rows
# (q/k/v at 2, o and down at 2-4); no plan used them once the wgmma matmul took 2-16 rows,
# and they were removed (docs/performance.md, 2026-12-05). Where int8's 2-4-row rules run
# without the wgmma matmul (no copy of the codes, or its agreement check failed), the 2-row
# at-once GEMV stands in for them at 3-4 rows too, untimed there.
INT_TUNING_RULES: dict[int, tuple[IntRule, ...]] = {
    4: (
        IntRule(1, at_once=((32, 256, 1), (32, 512, 1), (32, 1024, 4)), wgmma=True),
        IntRule(2, at_once=((32, 256, 1), (32, 512, 1), (32, 1024, 4)), wgmma=True,
                wgmma_alone=True),
        IntRule(4, at_once=((32, 256, 1), (32, 512, 1)), gemms=_SMALL_GEMM, wgmma=True,
                wgmma_alone=True),
        _UP_TO_16_ROWS,
        _UP_TO_64_ROWS,
        *_FROM_65_ROWS,
    ),
    8: (
        IntRule(1, at_once=((32, 256, 2), (32, 512, 1)), wgmma=True),
        IntRule(2, at_once=((32, 256, 2),), wgmma=True, wgmma_alone=True),
        IntRule(4, at_once=((32, 256, 2),), gemms=_SMALL_GEMM, wgmma=True, wgmma_alone=True),
        _UP_TO_16_ROWS,
        _UP_TO_64_ROWS,
        *_FROM_65_ROWS,
    ),
}


# Off the GPU the steps above these rows keep the torch reference alone, as before the GEMM
# joined them: CPU layers are served by the reference, which the interpreted GEMM never
# outruns.
CPU_GEMM_MAX_ROWS = 64


def int_rule(bits: int, rows: int) -> IntRule:
    """The rule of `INT_TUNING_RULES` for `bits`-bit weights at a ladder step of `rows` rows."""
    return next(r for r in INT_TUNING_RULES[bits] if r.max_rows is None or rows <= r.max_rows)


def fallback_kinds(layer: torch.nn.Module, rows: int) -> list[MatmulKind]:
    """Where the rules time the wgmma matmul alone and it disagrees with the reference, the
    kinds the rule would time without it, so that a failing kernel costs speed, not the
    whole step's (the reference dequantizes with torch ops at every call); else none."""
    rule = int_rule(layer.quant_config.bits, rows)
    if envs.tune_all_kinds() or not (rule.wgmma_alone and wgmma_serves_rows(layer, rows)):
        return []
    return rule_int_kinds(layer, rows, with_wgmma=False)


def rule_int_kinds(layer: torch.nn.Module, rows: int,
                   with_wgmma: bool = True) -> list[MatmulKind]:  # fmt: skip
    """The kinds `INT_TUNING_RULES` names for `layer` at `rows` rows, less the configs that
    do not fit its group and K (and off the GPU, the GEMMs above `CPU_GEMM_MAX_ROWS`);
    dequantize + BLAS (the Triton pass on a GPU, the torch one elsewhere) where the rule
    names it or nothing else fits. `with_wgmma=False`: as if the wgmma matmul could not
    serve the layer."""
    group, k = layer.group_size, layer.in_features
    rule = int_rule(layer.quant_config.bits, rows)
    wgmma = with_wgmma and rule.wgmma and wgmma_serves_rows(layer, rows)
    if wgmma and rule.wgmma_alone:
        return [QuantWgmma()]
    kinds: list[MatmulKind] = []
    if rows <= QUANT_GEMV_MAX_ROWS:
        # A row shorter than a rule's rows per program is read whole by each program (the
        # largest power of two it holds): small models keep an at-once GEMV.
        whole = 1 << (k.bit_length() - 1)
        gemvs = [at_once_gemv_config(group, k, bn, min(values, whole), warps)
                 for bn, values, warps in rule.at_once]  # fmt: skip
        kinds += [QuantTritonGemv(c) for c in dict.fromkeys(gemvs) if c is not None]
    if layer.qweight.is_cuda or rows <= CPU_GEMM_MAX_ROWS:
        gemms = (gemm_config(group, k, *shape) for shape in rule.gemms)
        kinds += [QuantTritonGemm(c) for c in dict.fromkeys(gemms) if c is not None]
    if wgmma:
        kinds.append(QuantWgmma())
    if rule.dequantize or not kinds:
        kinds.append(TritonDequantMatmul() if layer.qweight.is_cuda else DequantMatmul())
    return kinds


def has_wgmma_copy(layer: torch.nn.Module) -> bool:
    """Whether `layer` holds the codes packed for `QuantWgmma` (made at load where it can
    serve the layer: `models.quantization.layer`)."""
    return getattr(layer, "wgmma_words", None) is not None


def wgmma_serves_rows(layer: torch.nn.Module, rows: int) -> bool:
    """Whether `QuantWgmma` can run for `layer` at `rows` rows: the layer holds its copy of
    the codes and the kernel takes that many rows at the layer's width."""
    return has_wgmma_copy(layer) and rows <= quant_wgmma.max_rows(layer.quant_config.bits)


def release_unplanned_copies(layer: torch.nn.Module) -> None:
    """Drop the layer's wgmma copy of its codes when its plan does not run `QuantWgmma`."""
    if has_wgmma_copy(layer) and not any(isinstance(k, QuantWgmma) for k in layer.plan.kinds()):
        QuantWgmma().release(layer)


def _operands(layer: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if layer.input_perm is not None:  # act-order: columns sorted by group
        x = x.index_select(-1, layer.input_perm)
    return x.contiguous(), layer.qweight, layer.scales, layer.zeros


@dataclass(frozen=True)
class DequantMatmul(MatmulKind):
    """Dequantize the weight to the activation dtype, then the library's matmul."""

    name: ClassVar[str] = "dequantize + BLAS"

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, *,
        gated: bool = False, glu: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        bits, group = layer.quant_config.bits, layer.group_size
        return quant_matmul_ref(*_operands(layer, x), bits, group, bias)


@dataclass(frozen=True)
class TritonDequantMatmul(MatmulKind):
    """`DequantMatmul` with the dequantization as one Triton pass (the same values, rounded
    alike): for large batches, where the library's tensor-core GEMM outruns the quantized
    GEMM by more than the pass costs."""

    name: ClassVar[str] = "Triton dequantize + BLAS"

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, *,
        gated: bool = False, glu: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        x, qweight, scales, zeros = _operands(layer, x)
        w_t = dequantize_weight_triton(qweight, scales, zeros, layer.quant_config.bits,
                                       layer.group_size, x.dtype)  # fmt: skip
        y = x @ w_t
        return y if bias is None else y + bias


@dataclass(frozen=True)
class QuantTritonGemm(MatmulKind):
    """The Triton GEMM dequantizing inside its K loop
    (`asyncengine_kernels.quant_linear.quant_gemm`)."""

    config: QuantGemmConfig
    name: ClassVar[str] = "quantized Triton GEMM"

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, *,
        gated: bool = False, glu: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        bits, group = layer.quant_config.bits, layer.group_size
        # K splits count their finished tiles in the GEMV's counters (fresh ones where the
        # tiles outnumber them).
        return quant_gemm(*_operands(layer, x), bits, group, bias, self.config,
                          layer.gemv_counters)  # fmt: skip

    def describe(self) -> str:
        return f"{self.name} {self.config}"


@dataclass(frozen=True)
class QuantTritonGemv(MatmulKind):
    """The Triton GEMV with dequantization fused (`asyncengine_kernels.quant_linear.quant_gemv`),
    all of a program's tiles loaded at once, which can also form a SiLU-and-mul input as it
    loads x: the down projection of a decode step then runs no activation kernel before it."""

    config: QuantAtOnceGemvConfig
    name: ClassVar[str] = "quantized Triton GEMV"
    max_rows: ClassVar[int | None] = QUANT_GEMV_MAX_ROWS
    fusable_inputs: ClassVar[frozenset[InputTransform]] = frozenset(
        {InputTransform.SILU_AND_MUL}
    )

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, *,
        gated: bool = False, glu: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        bits, group = layer.quant_config.bits, layer.group_size
        if gated and layer.input_perm is not None:
            # Act-order gathers the input's columns: they are gathered from the activation.
            x, gated = silu_and_mul(x), False
        if not gated:
            return quant_gemv(*_operands(layer, x), bits, group, bias, self.config,
                              layer.gemv_counters)  # fmt: skip
        return quant_gemv(x.contiguous(), layer.qweight, layer.scales, layer.zeros, bits, group,
                          bias, self.config, layer.gemv_counters, gated=True)  # fmt: skip

    def describe(self) -> str:
        return f"{self.name} {self.config}"


@dataclass(frozen=True)
class QuantWgmma(MatmulKind):
    """The int4/int8 matmul on Hopper's tensor cores (`asyncengine_kernels.quant_wgmma`), the
    codes repacked at load into wgmma's register-operand layout (`wgmma_words`;
    `wgmma_has_zero`: whether any zero point is off the symmetric one). Its split-K arrival
    counters are the GEMV's."""

    name: ClassVar[str] = "wgmma"
    max_rows: ClassVar[int | None] = quant_wgmma.MAX_ROWS

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if not has_wgmma_copy(layer):  # a plan read from the cache after a release
            pack_wgmma_copy(layer)

    def release(self, layer: torch.nn.Module) -> None:
        layer.wgmma_words = None

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, *,
        gated: bool = False, glu: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        x, _, scales, zeros = _operands(layer, x)
        return quant_wgmma.quant_wgmma_matmul(
            x, layer.wgmma_words, scales, zeros, layer.group_size, bias,
            counters=layer.gemv_counters, bits=layer.quant_config.bits,
            has_zero=layer.wgmma_has_zero,
        )  # fmt: skip


def wgmma_serves(layer: torch.nn.Module) -> bool:
    """Whether `QuantWgmma` can serve `layer` (int4/int8 codes, bf16 or fp16, an sm_90 GPU,
    groups of 32, 64 or whole 128-feature iterations, its shapes)."""
    bits = layer.quant_config.bits
    k, n = layer.qweight.shape[0] * (32 // bits), layer.qweight.shape[1]  # this rank's shard
    return quant_wgmma.serves_weight(layer.qweight.device, layer.scales.dtype, n, k, bits,
                                    layer.group_size)  # fmt: skip


def pack_wgmma_copy(layer: torch.nn.Module) -> None:
    """Give `layer` the codes packed for `QuantWgmma`, and whether it must read zero points."""
    bits = layer.quant_config.bits
    layer.wgmma_words = quant_wgmma.pack_quant_wgmma(layer.qweight, bits)
    layer.wgmma_has_zero = quant_wgmma.reads_zeros(layer.zeros, bits)
