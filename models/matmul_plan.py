"""The matmul plan of a linear layer: which kernel computes y = x W^T (+ b), and what it fuses.

Each linear layer (and the LM head) holds one frozen `MatmulPlan`. The model only declares,
when it builds a layer, what the layer's input is (`InputTransform`: plain, RMSNorm of
x + residual, or a [gate, up] pair that needs SiLU-and-mul) and whether its output is a
[gate; up] pair (`glu_output`). The layer starts with `MatmulPlan.default`, the BLAS call for
every batch with the input's transform run as a kernel of its own; `models.linear_tuning`
times the alternatives at start-up and hands each layer a new plan (`set_plan`).

A plan is a short list of `PlanEntry`s, each serving batches up to `max_rows` rows (the last
serves any); the row count of the step picks the entry, and nothing else about the input is
looked at. An entry names:
- `kind`, a `MatmulKind` object: `Blas` (F.linear), `TritonGemv` (batch 1; its config's
  type says tiled or whole-row), `TritonSkinnyGemm` (2-16 rows, each weight tile read once for
  all of them), `CpuPacked` (oneDNN with a prepacked weight, small CPU batches),
  `CpuGemm` (`asyncengine_kernels.cpu_gemm`'s panel-packed kernel, small CPU batches);
- `input`, the transform this entry applies to the layer's input, and `fuse_input`, whether
  the kernel does it in its prologue rather than a kernel of its own before it. A layer
  declared with a [gate, up] input may have `input=NONE` where its producer's entry applies
  SiLU-and-mul in its epilogue: the tuner gives both layers matching entries;
- `epilogue`: SiLU-and-mul of the [gate; up] product inside the kernel, or none.

Adding a weight format (GPTQ/AWQ int4 GEMM/GEMV, FP8 scaled_mm): subclass `MatmulKind`. Its
`process_weights_after_loading(layer)` builds the tensors it reads (quantized copies, scales,
a repacked layout) and keeps them on the layer, `release` drops them, `apply` runs its
kernel, and its class attributes say which rows, input transforms and epilogues it takes;
`PlanEntry` checks a plan against them. The tuner (or the loader, for a format that the
checkpoint dictates) hands layers plans holding the new kind; `models/llama.py`, which only
declares inputs and outputs, does not change.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F

from asyncengine_kernels.activation import silu_and_mul
from asyncengine_kernels.cpu_gemm import (
    gemm_linear,
    gemm_linear_gated,
    gemm_linear_normed,
    pack_gemm_weight,
)
from asyncengine_kernels.cpu_linear import pack_weight, packed_linear
from asyncengine_kernels.gemv import GemvConfig, gemv_triton, rms_norm_gemv
from asyncengine_kernels.skinny_gemm import (
    SKINNY_MAX_ROWS,
    SkinnyConfig,
    skinny_counters,
    skinny_gemm,
)

__all__ = [
    "Blas",
    "CpuGemm",
    "CpuPacked",
    "Epilogue",
    "InputTransform",
    "MatmulKind",
    "MatmulPlan",
    "PlanEntry",
    "PlannedMatmul",
    "TritonGemv",
    "TritonSkinnyGemm",
]


class InputTransform(enum.Enum):
    """What must be done to a layer's input before the product."""

    NONE = "none"
    RMS_NORM = "rms_norm"  # rms_norm(x + residual): the layer runs through forward_normed
    SILU_AND_MUL = "silu_and_mul"  # x is [gate, up]; the operand is silu(gate) * up


class Epilogue(enum.Enum):
    """What the kernel does to its product before storing it."""

    NONE = "none"
    SILU_AND_MUL = "silu_and_mul"  # the weight is [gate; up]; the output is silu(gate) * up


class Norm(Protocol):
    """The RMSNorm in front of a normed layer (`models.layers.RMSNorm`)."""

    weight: torch.Tensor
    eps: float

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


class MatmulKind:
    """One way to compute x W^T (+ b) for a layer that has a dense `weight` [N, K].

    Kinds are frozen dataclasses (plans compare and print them); whatever a kind stores
    beside the layer's parameters lives on the layer, made by `process_weights_after_loading`.
    """

    name: ClassVar[str]
    # The most rows the kernel takes (None: any).
    max_rows: ClassVar[int | None] = None
    # Input transforms and epilogues the kernel can apply itself.
    fusable_inputs: ClassVar[frozenset[InputTransform]] = frozenset()
    fusable_epilogues: ClassVar[frozenset[Epilogue]] = frozenset()

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Build what `apply` reads beside `layer.weight` (called when a plan holding this
        kind is given to a layer whose plan did not hold it)."""

    def release(self, layer: torch.nn.Module) -> None:
        """Drop what `process_weights_after_loading` built (the layer's plan no longer
        holds this kind)."""

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, *,
        gated: bool = False, glu: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """x [M, K] (gated: [M, 2K] holding [gate, up], fused SiLU-and-mul) -> [M, N] (glu:
        [M, N / 2], fused SiLU-and-mul of the [gate; up] product)."""
        raise NotImplementedError

    def apply_normed(
        self, layer: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
        norm: Norm, bias: torch.Tensor | None, *, glu: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The product with rms_norm(x + residual) formed in the kernel; returns it and the
        new residual. Only kinds with RMS_NORM in `fusable_inputs`."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class Blas(MatmulKind):
    """The library's matmul (cuBLAS, or the CPU BLAS): every batch size."""

    name: ClassVar[str] = "BLAS"

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, *,
        gated: bool = False, glu: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        return F.linear(x, layer.weight, bias)


@dataclass(frozen=True)
class TritonGemv(MatmulKind):
    """The batch-1 Triton GEMV (`asyncengine_kernels.gemv`), tiled or whole-row as its config's
    type (`TiledGemvConfig`, `WholeRowGemvConfig`) says."""

    config: GemvConfig
    name: ClassVar[str] = "Triton GEMV"
    max_rows: ClassVar[int | None] = 1
    fusable_inputs: ClassVar[frozenset[InputTransform]] = frozenset(
        {InputTransform.RMS_NORM, InputTransform.SILU_AND_MUL}
    )
    fusable_epilogues: ClassVar[frozenset[Epilogue]] = frozenset({Epilogue.SILU_AND_MUL})

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, *,
        gated: bool = False, glu: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        return gemv_triton(x, layer.weight, bias, self.config, gated=gated, glu=glu)

    def apply_normed(
        self, layer: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
        norm: Norm, bias: torch.Tensor | None, *, glu: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        w = layer.weight
        return rms_norm_gemv(x, residual, norm.weight, norm.eps, w, bias, self.config, glu=glu)

    def describe(self) -> str:
        return f"{self.name} {self.config}"


@dataclass(frozen=True)
class TritonSkinnyGemm(MatmulKind):
    """The few-row Triton matmul (`asyncengine_kernels.skinny_gemm`): up to 16 rows, each weight
    tile read once for all of them. Its split-K arrival counters live on the layer as
    `skinny_counters`."""

    config: SkinnyConfig
    name: ClassVar[str] = "Triton skinny GEMM"
    max_rows: ClassVar[int | None] = SKINNY_MAX_ROWS
    # The norm runs as a kernel of its own before it: a prologue forming it lost to that
    # in every start-up plan (docs/performance.md, 2026-12-06).
    fusable_inputs: ClassVar[frozenset[InputTransform]] = frozenset({InputTransform.SILU_AND_MUL})
    fusable_epilogues: ClassVar[frozenset[Epilogue]] = frozenset({Epilogue.SILU_AND_MUL})

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # Allocated here, outside any CUDA graph capture; every config of the layer shares it.
        if getattr(layer, "skinny_counters", None) is None:
            layer.skinny_counters = skinny_counters(layer.weight.shape[0], layer.weight.device)

    def release(self, layer: torch.nn.Module) -> None:
        layer.skinny_counters = None

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, *,
        gated: bool = False, glu: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        counters = getattr(layer, "skinny_counters", None)
        return skinny_gemm(x, layer.weight, bias, self.config, counters, gated=gated, glu=glu)

    def describe(self) -> str:
        return f"{self.name} {self.config}"


@dataclass(frozen=True)
class CpuPacked(MatmulKind):
    """oneDNN with a prepacked float32 weight (`asyncengine_kernels.cpu_linear`), kept on the layer
    as
    `packed_weight` beside the dense one."""

    name: ClassVar[str] = "oneDNN-packed"

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.packed_weight = pack_weight(layer.weight)

    def release(self, layer: torch.nn.Module) -> None:
        layer.packed_weight = None

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, *,
        gated: bool = False, glu: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        return packed_linear(x, layer.packed_weight, bias)


@dataclass(frozen=True)
class CpuGemm(MatmulKind):
    """The small-batch float32 kernel that reads the weight once (`asyncengine_kernels.cpu_gemm`),
    on a panel-packed copy kept on the layer as `gemm_weight` beside the dense one. It forms a
    RMSNorm or SiLU-and-mul input itself, in the same call."""

    name: ClassVar[str] = "CPU GEMM"
    fusable_inputs: ClassVar[frozenset[InputTransform]] = frozenset(
        {InputTransform.RMS_NORM, InputTransform.SILU_AND_MUL}
    )

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.gemm_weight = pack_gemm_weight(layer.weight)

    def release(self, layer: torch.nn.Module) -> None:
        layer.gemm_weight = None

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, *,
        gated: bool = False, glu: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        n = layer.weight.shape[0]
        if gated:
            return gemm_linear_gated(x, layer.gemm_weight, n, bias)
        return gemm_linear(x, layer.gemm_weight, n, bias)

    def apply_normed(
        self, layer: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
        norm: Norm, bias: torch.Tensor | None, *, glu: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return gemm_linear_normed(x, residual, norm.weight, norm.eps, layer.gemm_weight,
                                  layer.weight.shape[0], bias)  # fmt: skip


@dataclass(frozen=True)
class PlanEntry:
    """How a layer multiplies batches of up to `max_rows` rows (None: any)."""

    kind: MatmulKind
    max_rows: int | None = None
    input: InputTransform = InputTransform.NONE
    fuse_input: bool = False  # the kernel applies `input` in its prologue
    epilogue: Epilogue = Epilogue.NONE
    # Derived from the fields above: SiLU-and-mul as its own kernel first; in the kernel's
    # prologue; in its epilogue.
    activate_first: bool = field(init=False, repr=False, compare=False)
    gated: bool = field(init=False, repr=False, compare=False)
    glu: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        kind = self.kind
        if kind.max_rows is not None and (self.max_rows is None or self.max_rows > kind.max_rows):
            raise ValueError(f"{kind.describe()} takes at most {kind.max_rows} rows")
        if self.fuse_input and self.input not in kind.fusable_inputs:
            raise ValueError(f"{kind.describe()} cannot apply {self.input.value} itself")
        if self.epilogue is not Epilogue.NONE and self.epilogue not in kind.fusable_epilogues:
            raise ValueError(f"{kind.describe()} has no {self.epilogue.value} epilogue")
        # Read on every call: worked out once (the layers run on the step's host path).
        gated = self.input is InputTransform.SILU_AND_MUL
        object.__setattr__(self, "activate_first", gated and not self.fuse_input)
        object.__setattr__(self, "gated", gated and self.fuse_input)
        object.__setattr__(self, "glu", self.epilogue is Epilogue.SILU_AND_MUL)

    def describe(self) -> str:
        what = self.kind.describe()
        if self.input is not InputTransform.NONE:
            where = "in its prologue" if self.fuse_input else "before it"
            what += f", {self.input.value} {where}"
        if self.epilogue is not Epilogue.NONE:
            what += f", {self.epilogue.value} in its epilogue"
        return what


@dataclass(frozen=True)
class MatmulPlan:
    """A layer's entries, by `max_rows` ascending; the last serves any number of rows."""

    entries: tuple[PlanEntry, ...]

    def __post_init__(self) -> None:
        bounds = [e.max_rows for e in self.entries]
        if not bounds or bounds[-1] is not None:
            raise ValueError("a matmul plan needs a last entry that serves any number of rows")
        limited = bounds[:-1]
        if None in limited or limited != sorted(set(limited)):  # type: ignore[type-var]
            raise ValueError(f"plan entries must have increasing max_rows, got {bounds}")

    @classmethod
    def default(cls, input: InputTransform = InputTransform.NONE) -> MatmulPlan:
        """The BLAS call for every batch, the input's transform a kernel of its own."""
        return cls((PlanEntry(Blas(), input=input),))

    def entry_for(self, rows: int) -> PlanEntry:
        for entry in self.entries:
            if entry.max_rows is None or rows <= entry.max_rows:
                return entry
        raise AssertionError("unreachable: the last entry serves any number of rows")

    def kinds(self) -> set[MatmulKind]:
        return {e.kind for e in self.entries}

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:  # fmt: skip
        """The layer's product for an input that is plain or a [gate, up] pair."""
        entry = self.entry_for(x.shape[0])
        if entry.input is InputTransform.RMS_NORM:
            raise ValueError("a layer with a normed input runs through apply_normed")
        if entry.activate_first:
            x = silu_and_mul(x)
        return entry.kind.apply(layer, x, bias, gated=entry.gated, glu=entry.glu)

    def apply_normed(
        self, layer: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
        norm: Norm, bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The product for rms_norm(x + residual) (rms_norm(x) without a residual); returns
        it and the new residual (x + residual, or x)."""
        entry = self.entry_for(x.shape[0])
        if entry.input is not InputTransform.RMS_NORM:
            raise ValueError(f"this plan expects a {entry.input.value} input, not a normed one")
        if entry.fuse_input:
            return entry.kind.apply_normed(layer, x, residual, norm, bias, glu=entry.glu)
        if residual is None:
            h, residual = norm(x), x
        else:
            h, residual = norm(x, residual)
        return entry.kind.apply(layer, h, bias, glu=entry.glu), residual

    def describe(self) -> str:
        """One line: each entry with the rows it serves."""
        parts, low = [], 1
        for e in self.entries:
            rows = f"{low}+ rows" if e.max_rows is None else (
                f"{low} row" if e.max_rows == low else f"{low}-{e.max_rows} rows"
            )  # fmt: skip
            parts.append(f"{rows}: {e.describe()}")
            low = (e.max_rows or 0) + 1
        return "; ".join(parts)


class PlannedMatmul:
    """Mixin for a module with a dense `weight` that multiplies through a `MatmulPlan`.

    The module declares `input_transform` and `glu_output` when it is built; `plan` starts as
    the default plan for that input."""

    plan: MatmulPlan
    input_transform: InputTransform = InputTransform.NONE
    glu_output: bool = False

    def init_plan(self, input_transform: InputTransform, glu_output: bool) -> None:
        self.input_transform, self.glu_output = input_transform, glu_output
        self.plan = MatmulPlan.default(input_transform)

    def set_plan(self, plan: MatmulPlan) -> None:
        """Take `plan` after checking it against what this layer's input and output are;
        kinds it no longer holds release what they stored on the layer, and kinds new to it
        build theirs (`process_weights_after_loading`)."""
        for entry in plan.entries:
            # A [gate, up] input may arrive already activated by its producer's epilogue.
            allowed = {self.input_transform}
            if self.input_transform is InputTransform.SILU_AND_MUL:
                allowed.add(InputTransform.NONE)
            if entry.input not in allowed:
                raise ValueError(
                    f"plan entry takes a {entry.input.value} input; the layer's input is "
                    f"{self.input_transform.value}"
                )
            if entry.epilogue is Epilogue.SILU_AND_MUL and not self.glu_output:
                raise ValueError("a SiLU-and-mul epilogue needs a [gate; up] output layer")
        old = self.plan.kinds()
        for kind in old - plan.kinds():
            kind.release(self)  # type: ignore[arg-type]
        # A kind the old plan held keeps what it built: tuning sets many plans in turn, and
        # repacking a held weight each time would only cost.
        for kind in plan.kinds() - old:
            kind.process_weights_after_loading(self)  # type: ignore[arg-type]
        self.plan = plan
