"""FP8 (e4m3) linear layers: their parameters, the repacking once loaded, and their
matmul-plan kinds.

While loading, an FP8 layer holds `weight` float8_e4m3fn [N, K] (its shard), `weight_scale`
float32 [N, 1] (one per output channel: a per-tensor checkpoint scale arrives expanded to
every row by `models.quantization.formats`, which is exact, so fused q/k/v and gate/up shards
with different scales need no requantization) and, for static activations, `input_scale`
float32 (one per layer: the fused projections share their input and take the largest of
their checkpoint scales, so none of them clips). Column-parallel shards take their rows of
both; row-parallel shards replicate the channel scales. `process_fp8_linear` then keeps
`qweight` [N, K] e4m3 and `scales` [N] float32 (`asyncengine_kernels.fp8_linear`'s layout) and plans
the layer.

Kinds: `Fp8DequantMatmul` (the torch reference: the CPU path and the oracle, W8A8 or weight-
only), `Fp8ScaledMM` (cuBLASLt) and `Fp8TritonGemm` (W8A8: the activation quantized per
token, or with the static scale, by `asyncengine_kernels.fp8_linear.quantize_rows`, which also forms
an RMSNorm or SiLU-and-mul input in the same pass), `Fp8Gemv` (weight-only, 1-16 rows; it
forms a SiLU-and-mul input itself) and `Fp8WholeRowGemv` (one row on `asyncengine_kernels.gemv`'s
persistent form, which forms either input once per program). `tuning_kinds` names those the
start-up tuner times: the few a rule table names per row range (`FP8_TUNING_RULES`), or
every config with `ASYNCENGINE_TUNE_ALL_KINDS=1`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from asyncengine_kernels import envs
from asyncengine_kernels.fp8_linear import (
    FP8_DTYPE,
    FP8_GEMV_MAX_ROWS,
    FP8_GEMV_MIN_BLOCK_N,
    FP8_WHOLE_ROW_CONFIGS,
    Fp8GemmConfig,
    Fp8GemvConfig,
    fp8_gemm,
    fp8_gemm_candidates,
    fp8_gemv,
    fp8_gemv_candidates,
    fp8_linear_ref,
    fp8_scaled_mm,
    quantize_rows,
    scaled_mm_fits,
)
from asyncengine_kernels.gemv import (
    WholeRowGemvConfig,
    gemv_triton,
    rms_norm_gemv,
    whole_row_max_k,
)
from asyncengine_kernels.gemv_split_k import gemv_counters
from models.matmul_plan import InputTransform, MatmulKind, MatmulPlan, Norm, PlanEntry
from models.quantization.config import Fp8QuantConfig
from models.weight_loaders import set_weight_loader

# The first CUDA compute capability with FP8 tensor cores (Ada; Hopper is 9.0).
FP8_MIN_CAPABILITY = (8, 9)


def create_fp8_weights(layer: nn.Module, qc: Fp8QuantConfig) -> None:
    """Give `layer` (in_features, out_features: its shard) the FP8 parameters."""
    k, n = layer.in_features, layer.out_features
    layer.weight = nn.Parameter(torch.empty(n, k, dtype=FP8_DTYPE), requires_grad=False)
    layer.weight_scale = nn.Parameter(torch.empty(n, 1, dtype=torch.float32), requires_grad=False)
    for p in (layer.weight, layer.weight_scale):
        set_weight_loader(p, layer.weight_loader)
        # A channel's scale covers its whole row: a row-parallel shard takes all of them.
        p.row_replicated = p is layer.weight_scale  # type: ignore[attr-defined]
    if qc.activation == "static":
        layer.input_scale = nn.Parameter(torch.zeros((), dtype=torch.float32),
                                         requires_grad=False)  # fmt: skip
        set_weight_loader(layer.input_scale, load_input_scale)
    else:
        layer.input_scale = None
    layer.group_size, layer.input_perm = k, None


def load_input_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """A static activation scale: one value; the shards of a fused projection keep the
    largest (they quantize one input)."""
    if loaded.numel() != 1:
        raise ValueError(f"input_scale has shape {tuple(loaded.shape)}; the format needs one "
                         "value per layer")  # fmt: skip
    value = loaded.reshape(()).to(param.device, torch.float32)
    if getattr(param, "loaded", False):
        value = torch.maximum(value, param.data)
    param.data.copy_(value)
    param.loaded = True  # type: ignore[attr-defined]


def process_fp8_linear(layer: nn.Module) -> None:
    """Keep the loaded weight and scales in the kernels' layout and plan the layer."""
    layer.register_buffer("qweight", layer.weight.data, False)
    layer.register_buffer("scales", layer.weight_scale.data.reshape(-1).contiguous(), False)
    layer.weight = None
    del layer.weight_scale
    # The one-row GEMV's split-K arrival counters: allocated once, outside any graph capture.
    layer.register_buffer("gemv_counters", gemv_counters(
        1, layer.qweight.shape[0], layer.qweight.device, FP8_GEMV_MIN_BLOCK_N), False)
    layer.set_plan(default_fp8_plan(layer))


def default_fp8_plan(layer: nn.Module) -> MatmulPlan:
    """The CPU: the W8A8 reference. A GPU before tuning: the GEMV for a few rows, then
    cuBLASLt (or the Triton GEMM where cuBLASLt's alignment rules are not met)."""
    declared = layer.input_transform
    if not layer.qweight.is_cuda:
        return MatmulPlan((PlanEntry(Fp8DequantMatmul(), input=declared),))
    gemm: MatmulKind = (Fp8ScaledMM() if scaled_mm_fits(layer.out_features, layer.in_features)
                        else Fp8TritonGemm(Fp8GemmConfig()))  # fmt: skip
    return MatmulPlan((
        fp8_entry(Fp8Gemv(Fp8GemvConfig()), 1, declared),
        fp8_entry(Fp8Gemv(Fp8GemvConfig(16, 256)), FP8_GEMV_MAX_ROWS, declared),
        fp8_entry(gemm, None, declared),
    ))  # fmt: skip


def fp8_entry(kind: MatmulKind, max_rows: int | None, declared: InputTransform) -> PlanEntry:
    """A plan entry for `kind` that forms the declared input itself where the kind can."""
    return PlanEntry(kind, max_rows, declared, fuse_input=declared in kind.fusable_inputs)


def check_fp8_device(device: torch.device) -> None:
    """Refuse a CUDA device without FP8 tensor cores before anything is allocated."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"fp8 weights need a GPU with FP8 tensor cores (compute capability 8.9 or newer); "
            f"{name} has {capability[0]}.{capability[1]}"
        )


def use_weight_only_reference(model: nn.Module) -> None:
    """Plan every FP8 layer of `model` on the weight-only (W8A16) reference: the numbers of
    the GEMV, which serves 1-16 rows on a GPU (the CPU's default is the W8A8 reference)."""
    for m in model.modules():
        if isinstance(getattr(m, "quant_config", None), Fp8QuantConfig):
            entry = PlanEntry(Fp8DequantMatmul(quantize_input=False), input=m.input_transform)
            m.set_plan(MatmulPlan((entry,)))


def tuning_kinds(layer: nn.Module, rows: int) -> list[MatmulKind]:
    """The kinds the start-up tuner times for `layer` at `rows` rows: those the rule table
    names (`rule_fp8_kinds`), or with `ASYNCENGINE_TUNE_ALL_KINDS` every one
    (`all_fp8_kinds`)."""
    return all_fp8_kinds(layer, rows) if envs.tune_all_kinds() else rule_fp8_kinds(layer, rows)


def all_fp8_kinds(layer: nn.Module, rows: int) -> list[MatmulKind]:
    """Every kind and launch config that can serve `layer` at `rows` rows; the reference
    first."""
    kinds: list[MatmulKind] = [Fp8DequantMatmul(), Fp8ScaledMM()]
    kinds += [Fp8TritonGemm(c) for c in fp8_gemm_candidates()]
    if rows == 1:
        # The whole-row GEMV forms a normed or gated input once per program (a few per
        # multiprocessor), where the row fits in its registers.
        kinds += [Fp8WholeRowGemv(c) for c in FP8_WHOLE_ROW_CONFIGS
                  if layer.in_features <= whole_row_max_k(c)]  # fmt: skip
    if rows <= FP8_GEMV_MAX_ROWS:
        kinds += [Fp8Gemv(c) for c in fp8_gemv_candidates(rows)]
    return kinds


@dataclass(frozen=True)
class Fp8Rule:
    """The kinds timed for FP8 weights at a ladder step of up to `max_rows` rows (None:
    any): whole-row GEMV configs (one row, where the row fits), weight-only GEMV configs,
    Triton GEMM tiles, and whether `_scaled_mm` is one (where its alignment rules are not
    met, the Triton GEMM tile `FP8_GEMM_IN_PLACE_OF_SCALED_MM` instead)."""

    max_rows: int | None
    whole_row: tuple[WholeRowGemvConfig, ...] = ()
    gemvs: tuple[Fp8GemvConfig, ...] = ()
    gemms: tuple[Fp8GemmConfig, ...] = ()
    scaled_mm: bool = False


_GEMM_16, _GEMM_64 = Fp8GemmConfig(16, 64, 128, 4, 4), Fp8GemmConfig(64, 64, 128, 4, 4)
_WHOLE_ROW = WholeRowGemvConfig(2, 4, 3, programs_per_sm=8, pairs=True)
FP8_GEMM_IN_PLACE_OF_SCALED_MM = _GEMM_64
# What won a Llama-2-7B shape at those rows in the plans of a full-sweep FP8 start on the
# H200 (docs/quantization.md, "Start-up tuning by rules"): the whole-row pairs GEMV (norm
# fused) for q/k/v, o and gate/up at one row, the float32 GEMV for down; the small and the
# 64-row Triton GEMM tiles (W8A8, the norm or activation fused into the quantization) and
# the GEMV for o at 2-16 rows, `_scaled_mm` for down from 9 rows and everywhere past 64.
FP8_TUNING_RULES: tuple[Fp8Rule, ...] = (
    Fp8Rule(1, whole_row=(_WHOLE_ROW,), gemvs=(Fp8GemvConfig(8, 1024, num_stages=3),)),
    Fp8Rule(8, gemvs=(Fp8GemvConfig(32, 256),), gemms=(_GEMM_16, _GEMM_64)),
    Fp8Rule(16, gemvs=(Fp8GemvConfig(32, 256),), gemms=(_GEMM_16, _GEMM_64), scaled_mm=True),
    Fp8Rule(64, gemms=(_GEMM_64,), scaled_mm=True),
    Fp8Rule(None, scaled_mm=True),
)


def fp8_rule(rows: int) -> Fp8Rule:
    """The rule of `FP8_TUNING_RULES` for a ladder step of `rows` rows."""
    return next(r for r in FP8_TUNING_RULES if r.max_rows is None or rows <= r.max_rows)


def rule_fp8_kinds(layer: nn.Module, rows: int) -> list[MatmulKind]:
    """The kinds `FP8_TUNING_RULES` names for `layer` at `rows` rows: whole-row configs only
    where the row fits, `_scaled_mm` only where its alignment rules are met."""
    rule = fp8_rule(rows)
    kinds: list[MatmulKind] = []
    if rows == 1:
        kinds += [Fp8WholeRowGemv(c) for c in rule.whole_row
                  if layer.in_features <= whole_row_max_k(c)]  # fmt: skip
    if rows <= FP8_GEMV_MAX_ROWS:
        kinds += [Fp8Gemv(c) for c in rule.gemvs]
    gemms = list(rule.gemms)
    if rule.scaled_mm and scaled_mm_fits(layer.out_features, layer.in_features):
        kinds.append(Fp8ScaledMM())
    elif rule.scaled_mm and FP8_GEMM_IN_PLACE_OF_SCALED_MM not in gemms:
        gemms.append(FP8_GEMM_IN_PLACE_OF_SCALED_MM)
    kinds += [Fp8TritonGemm(c) for c in gemms]
    return kinds


@dataclass(frozen=True)
class Fp8DequantMatmul(MatmulKind):
    """Dequantize the weight to float32 and multiply in float32; `quantize_input`: first
    round the activation to e4m3 as the W8A8 kinds do (W8A8), else use it as is (W8A16)."""

    quantize_input: bool = True
    name: ClassVar[str] = "fp8 dequantize + float32 matmul"

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, *,
        gated: bool = False, glu: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        return fp8_linear_ref(x, layer.qweight, layer.scales, bias,
                              quantize_input=self.quantize_input,
                              input_scale=layer.input_scale)  # fmt: skip

    def describe(self) -> str:
        return f"{self.name} ({'W8A8' if self.quantize_input else 'W8A16'})"


class _W8A8(MatmulKind):
    """A GEMM on e4m3 activations: `quantize_rows` forms and quantizes the input (RMSNorm or
    SiLU-and-mul included when the plan fuses them), then `_gemm` multiplies."""

    fusable_inputs: ClassVar[frozenset[InputTransform]] = frozenset(
        {InputTransform.RMS_NORM, InputTransform.SILU_AND_MUL}
    )
    reference: ClassVar[MatmulKind] = Fp8DequantMatmul(quantize_input=True)

    def _gemm(self, layer: nn.Module, xq: torch.Tensor, xs: torch.Tensor,
              bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        raise NotImplementedError

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, *,
        gated: bool = False, glu: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        xq, xs, _ = quantize_rows(x.contiguous(), layer.input_scale, gated=gated)
        return self._gemm(layer, xq, xs, bias, x.dtype)

    def apply_normed(
        self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, norm: Norm,
        bias: torch.Tensor | None, *, glu: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        xq, xs, new_residual = quantize_rows(
            x.contiguous(), layer.input_scale, norm=(norm.weight, norm.eps), residual=residual
        )
        y = self._gemm(layer, xq, xs, bias, x.dtype)
        return y, new_residual if new_residual is not None else x


@dataclass(frozen=True)
class Fp8ScaledMM(_W8A8):
    """torch's `_scaled_mm` (cuBLASLt) with row-wise scales in its epilogue."""

    name: ClassVar[str] = "fp8 _scaled_mm"

    def _gemm(self, layer: nn.Module, xq: torch.Tensor, xs: torch.Tensor,
              bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        return fp8_scaled_mm(xq, xs, layer.qweight, layer.scales, bias, dtype)


@dataclass(frozen=True)
class Fp8TritonGemm(_W8A8):
    """The Triton `tl.dot` GEMM on both e4m3 operands
    (`asyncengine_kernels.fp8_linear.fp8_gemm`)."""

    config: Fp8GemmConfig
    name: ClassVar[str] = "fp8 Triton GEMM"

    def _gemm(self, layer: nn.Module, xq: torch.Tensor, xs: torch.Tensor,
              bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        return fp8_gemm(xq, xs, layer.qweight, layer.scales, bias, dtype, self.config)

    def describe(self) -> str:
        return f"{self.name} {self.config}"


@dataclass(frozen=True)
class Fp8Gemv(MatmulKind):
    """The weight-only GEMV (`asyncengine_kernels.fp8_linear.fp8_gemv`) for 1-16 rows."""

    config: Fp8GemvConfig
    name: ClassVar[str] = "fp8 Triton GEMV (W8A16)"
    max_rows: ClassVar[int | None] = FP8_GEMV_MAX_ROWS
    # SiLU-and-mul is elementwise: each program forms its K range of the input itself.
    fusable_inputs: ClassVar[frozenset[InputTransform]] = frozenset(
        {InputTransform.SILU_AND_MUL}
    )
    reference: ClassVar[MatmulKind] = Fp8DequantMatmul(quantize_input=False)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, *,
        gated: bool = False, glu: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        return fp8_gemv(x.contiguous(), layer.qweight, layer.scales, bias, self.config,
                        gated=gated, counters=layer.gemv_counters)  # fmt: skip

    def describe(self) -> str:
        return f"{self.name} {self.config}"


@dataclass(frozen=True)
class Fp8WholeRowGemv(MatmulKind):
    """One row (weight-only, W8A16) on `asyncengine_kernels.gemv`'s persistent whole-row GEMV: a few
    programs per multiprocessor each form the input once, its RMSNorm or SiLU-and-mul
    included, and stream whole e4m3 rows against it, the row scales applied in the epilogue.
    A fused norm then costs once per program, not once per row block."""

    config: WholeRowGemvConfig
    name: ClassVar[str] = "fp8 Triton whole-row GEMV (W8A16)"
    max_rows: ClassVar[int | None] = 1
    fusable_inputs: ClassVar[frozenset[InputTransform]] = frozenset(
        {InputTransform.SILU_AND_MUL, InputTransform.RMS_NORM}
    )
    reference: ClassVar[MatmulKind] = Fp8DequantMatmul(quantize_input=False)

    def __post_init__(self) -> None:
        # Dataclasses do not check field types: a tiled config is refused here, as a plan is
        # built, rather than by each call (the tiled form takes no weight scales).
        if not isinstance(self.config, WholeRowGemvConfig):
            raise ValueError(f"{self.name} takes a whole-row config, got {self.config}")

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, *,
        gated: bool = False, glu: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        return gemv_triton(x.contiguous(), layer.qweight, bias, self.config, gated=gated,
                           scale=layer.scales)  # fmt: skip

    def apply_normed(
        self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, norm: Norm,
        bias: torch.Tensor | None, *, glu: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return rms_norm_gemv(x.contiguous(), residual, norm.weight, norm.eps, layer.qweight,
                             bias, self.config, scale=layer.scales)  # fmt: skip

    def describe(self) -> str:
        return f"{self.name} {self.config}"
