"""Start-up choice of each linear layer's matmul plan (`models.matmul_plan`), made by timing.

- GPU, batch 1: the Triton GEMV (`asyncengine_kernels.gemv`, tiled and whole-row configs) against
  cuBLAS, in a CUDA graph over the layers' own weights; for a layer whose input needs
  SiLU-and-mul or RMSNorm first, also with that transform fused into the GEMV; for the MLP,
  also with SiLU-and-mul in the gate/up GEMV's epilogue.
- GPU, 2-16 rows: at each of a ladder of row counts, the few-row Triton matmul
  (`asyncengine_kernels.skinny_gemm`, which reads each weight tile once for all rows) against
  cuBLAS, likewise with a SiLU-and-mul input fused or not, and the MLP timed as a pair.
- CPU, small batches: at each of a ladder of row counts, the panel-packed kernel
  (`asyncengine_kernels.cpu_gemm`) and a oneDNN-packed weight (`asyncengine_kernels.cpu_linear`)
  against the BLAS call; each row range takes the fastest.
- GPU, quantized layers (`models.quantization`): at each of a ladder of row counts, the
  kinds of the layer's format that its rule table names for those rows (its linear
  method's `tuning_kinds`, `models.quantization.method`: for integer weights at-once GEMVs
  (few rows), GEMM tiles and dequantize-then-cuBLAS; for FP8 the weight-only GEMVs, cuBLASLt's
  `_scaled_mm` and the Triton GEMM; every config with `ASYNCENGINE_TUNE_ALL_KINDS=1`),
  each timed with the layer's input transform where its plan entry would apply it; each
  row range takes the fastest that agrees with its reference, and a row count with one
  candidate is only checked.

`plan_*` return the plans per layer; `tune_*` hand each layer its plan. A layer keeps the
library unless the alternative is clearly faster, so a wrong guess costs nothing but the
tuning time.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import replace
from functools import partial
from typing import NamedTuple

import torch
from torch import nn
from tqdm.auto import tqdm

from asyncengine_kernels.activation import silu_and_mul
from asyncengine_kernels.cpu_gemm import gemm_available
from asyncengine_kernels.cpu_linear import cpu_packing_available
from asyncengine_kernels.gemv import (
    GemvChoice,
    GemvConfig,
    compile_only,
    graph_time_ms,
    tune_gemv,
)
from asyncengine_kernels.skinny_gemm import SKINNY_MAX_ROWS, SkinnyChoice, SkinnyConfig, tune_skinny
from models.layers import LinearBase, RMSNorm, RowParallelLinear
from models.matmul_plan import (
    Blas,
    CpuGemm,
    CpuPacked,
    Epilogue,
    InputTransform,
    MatmulKind,
    MatmulPlan,
    PlanEntry,
    PlannedMatmul,
    TritonGemv,
    TritonSkinnyGemm,
)
from models.plan_cache import PlanCache, device_identity, plan_key, source_digest
from models.quantization.kinds import (
    QUANT_GEMV_MAX_ROWS,
    agrees_with_reference,
    reference_of,
    reference_output,
    release_unplanned_copies,
)
from models.quantization.method import get_quant_method

logger = logging.getLogger(__name__)

# A small-batch CPU kind must beat BLAS by this factor: timings on a busy CPU are noisy. The
# oneDNN-packed weight needs a clear win. The CPU GEMM is kept unless clearly slower: it
# reads each weight once, so it is never far behind at decode sizes, and a near tie picked
# by noise otherwise splits a plan into patches that differ from run to run.
CPU_PACKED_MIN_GAIN = 0.9
CPU_GEMM_MIN_GAIN = 1.1
# Row counts at which CPU linears are timed; each serves the rows above the previous. Decode
# batches shrink from the number of running requests towards 1 as requests finish.
CPU_ROW_LADDER = (2, 8, 16, 32, 64)
# Layers whose packed copy would exceed this many bytes keep the BLAS call alone (the copy
# doubles the layer's memory).
CPU_PACKED_MAX_BYTES = 256 * 2**20
# The packed copies of all layers may take at most this share of the host memory available
# at start-up; a model too large for that keeps the BLAS calls (one log line says so).
CPU_PACKED_MAX_SHARE_OF_FREE = 0.5

# Threads that compile the quantized kinds' Triton kernels side by side before any is
# timed (`_compile_ahead`); 1 compiles each on its first run instead.
COMPILE_AHEAD_THREADS = min(16, os.cpu_count() or 1)
# The largest ladder step whose kinds compile in that pool (`_compile_ahead`): the steps
# above run dequantize + BLAS alone, whose kernel the 256-row step compiled.
COMPILE_AHEAD_MAX_ROWS = 256

Plans = dict[PlannedMatmul, MatmulPlan]
# What the 16-bit tuner's timings of one layer group at one row count give.
Tuned = GemvChoice | SkinnyChoice

# Row counts at which the few-row Triton matmul is timed against the library on the GPU;
# each serves the rows above the previous (a decode step of a few requests, or a speculative
# verify step of k + 1 rows per request).
SKINNY_ROW_LADDER = (2, 4, 8, 16)


class _GemvGroup(NamedTuple):
    """Layers tuned together: one weight shape, one input and output form."""

    n: int
    k: int
    has_bias: bool
    input_transform: InputTransform
    glu_output: bool


def _tuned_entry(
    declared: InputTransform, choice: GemvChoice | SkinnyChoice,
    kind: type[TritonGemv] | type[TritonSkinnyGemm], rows: int,
    entry_input: InputTransform | None = None, epilogue: Epilogue = Epilogue.NONE,
) -> PlanEntry:  # fmt: skip
    """The entry for batches up to `rows` rows from a tuner's `choice`: `kind` with the
    chosen config, or the BLAS call where it chose none; `entry_input`: the input it takes,
    if not the declared one."""
    entry_input = declared if entry_input is None else entry_input
    if choice.config is None:
        return PlanEntry(Blas(), rows, entry_input)
    made = kind(choice.config)  # type: ignore[arg-type]  # each kind with its tuner's config
    return PlanEntry(made, rows, entry_input, choice.fuses_input, epilogue)


def _same_entry(a: PlanEntry, b: PlanEntry) -> bool:
    return (a.kind, a.input, a.fuse_input, a.epilogue) == (b.kind, b.input, b.fuse_input,
                                                           b.epilogue)  # fmt: skip


def _plan_of(entries: Sequence[PlanEntry], rest: PlanEntry) -> MatmulPlan:
    """The plan of every tuner: `entries` by increasing rows, then `rest` (no row bound) for
    larger batches; neighbouring entries that run alike merge, and those at the end that
    run as `rest` does are left to it."""
    merged: list[PlanEntry] = []
    for entry in entries:
        if merged and _same_entry(merged[-1], entry):
            merged[-1] = replace(merged[-1], max_rows=entry.max_rows)
        else:
            merged.append(entry)
    while merged and _same_entry(merged[-1], rest):
        merged.pop()
    return MatmulPlan((*merged, rest))


def plan_decode_gemvs(
    model: nn.Module, configs: Sequence[GemvConfig] | None = None,
    skinny_configs: Sequence[SkinnyConfig] | None = None,
    ladder: Sequence[int] = SKINNY_ROW_LADDER,
) -> tuple[Plans, dict[tuple[int, int], dict[str, float]]]:  # fmt: skip
    """Time the Triton GEMV against the BLAS library once per layer group (CUDA, batch 1)
    over the layers of that group, and plan the faster one for batch 1; then, at each row
    count of `ladder`, the few-row Triton matmul (`asyncengine_kernels.skinny_gemm`) against the
    library, planning the faster for the rows above the previous count. Returns the plans per layer
    and the timings per weight shape (few-row ones named "<rows> rows: <form>"). `configs`,
    `skinny_configs`: the Triton configs to try (default: all,
    `asyncengine_kernels.gemv.gemv_candidates`,
    `asyncengine_kernels.skinny_gemm.SKINNY_CONFIGS`); an empty ladder times no few-row matmul.

    The MLP is then timed as a pair, at batch 1 and at each row count: SiLU-and-mul applied
    by the down projection to its [gate, up] input (either form above), against the gate/up
    matmul applying it in its epilogue and the down projection taking a plain input; the
    faster pair is planned for those rows."""
    return _plan_groups(_gemv_groups(model, "cuda"), configs, skinny_configs, ladder)


def _layer_groups(model: nn.Module, key: Callable[[nn.Module], Hashable | None]) -> dict:
    """The model's modules by `key` (None: not tuned), in model order: every tuner times a
    group's layers together, each step over all of their weights."""
    groups: dict[Hashable, list] = {}
    for module in model.modules():
        group = key(module)
        if group is not None:
            groups.setdefault(group, []).append(module)
    return groups


def _own_bias(m: LinearBase) -> bool:
    """Whether the layer adds its bias in its own matmul (a row-parallel layer adds it after
    the all-reduce)."""
    return m.bias is not None and not isinstance(m, RowParallelLinear)


def _gemv_groups(model: nn.Module, device_type: str) -> dict[_GemvGroup, list[LinearBase]]:
    """16-bit linear layers on `device_type` by weight shape and input and output form."""

    def key(m: nn.Module) -> _GemvGroup | None:
        if not isinstance(m, LinearBase) or m.quant_config is not None:
            return None
        if m.weight.device.type != device_type:
            return None
        return _GemvGroup(*m.weight.shape, _own_bias(m), m.input_transform, m.glu_output)

    return _layer_groups(model, key)


def _plan_groups(
    groups: dict[_GemvGroup, list[LinearBase]], configs: Sequence[GemvConfig] | None,
    skinny_configs: Sequence[SkinnyConfig] | None = None,
    ladder: Sequence[int] = SKINNY_ROW_LADDER,
) -> tuple[Plans, dict[tuple[int, int], dict[str, float]]]:  # fmt: skip
    if any(not 2 <= rows <= SKINNY_MAX_ROWS for rows in ladder) or list(ladder) != sorted(
        set(ladder)
    ):
        raise ValueError(f"the few-row ladder must rise within 2..{SKINNY_MAX_ROWS}: {ladder}")
    mlp = _mlp_pair(groups)
    calls = _tuning_calls(groups, mlp, configs, skinny_configs, ladder)
    _compile_tuning_calls(list(calls.values()), groups)
    tuned = {purpose: call() for purpose, call in calls.items()}
    timings: dict[tuple[int, int], dict[str, float]] = {}
    for key in groups:
        timings[(key.n, key.k)] = dict(tuned[key, 1].timings)
        for rows in ladder:
            timings[(key.n, key.k)].update(
                {f"{rows} rows: {name}": t for name, t in tuned[key, rows].timings.items()}
            )
    few_entries = {
        key: [_tuned_entry(key.input_transform, tuned[key, rows], TritonSkinnyGemm, rows)
              for rows in ladder]
        for key in groups
    }  # fmt: skip
    one_row = {key: _tuned_entry(key.input_transform, tuned[key, 1], TritonGemv, 1)
               for key in groups}  # fmt: skip
    if mlp is not None:
        _pair_mlp(mlp, ladder, tuned, one_row, few_entries, timings)
    plans: Plans = {}
    for key, layers in groups.items():
        library = PlanEntry(Blas(), input=key.input_transform)
        plans.update(dict.fromkeys(layers, _plan_of([one_row[key], *few_entries[key]], library)))
    return plans, timings


def _mlp_pair(groups: dict[_GemvGroup, list[LinearBase]]) -> tuple[_GemvGroup, _GemvGroup] | None:
    """The model's MLP as (gate/up group, down group), where it has one MLP shape; anything
    else keeps separate forms."""
    producers = [key for key in groups if key.glu_output]
    consumers = [key for key in groups if key.input_transform is InputTransform.SILU_AND_MUL]
    return (producers[0], consumers[0]) if len(producers) == 1 and len(consumers) == 1 else None


def _tuning_calls(
    groups: dict[_GemvGroup, list[LinearBase]], mlp: tuple[_GemvGroup, _GemvGroup] | None,
    configs: Sequence[GemvConfig] | None, skinny_configs: Sequence[SkinnyConfig] | None,
    ladder: Sequence[int],
) -> dict[tuple, Callable[[], Tuned]]:  # fmt: skip
    """Every timing the 16-bit planner makes, in the order it makes them, by purpose: per
    group, (key, 1) the GEMV and (key, rows) the few-row matmul at each row count of
    `ladder`, with the input's norm or SiLU-and-mul formed in the kernel where it can and as
    a kernel of its own before it; for the MLP pair, ("glu", rows) the gate/up matmul with
    SiLU-and-mul in its epilogue and ("plain input", rows) the down projection on an
    activated input, at 1 and at every row count."""
    calls: dict[tuple, Callable[[], Tuned]] = {}
    for key, layers in groups.items():
        weights = [m.weight for m in layers]
        biases = [m.bias for m in layers] if key.has_bias else None
        gated = key.input_transform is InputTransform.SILU_AND_MUL
        normed = key.input_transform is InputTransform.RMS_NORM
        calls[key, 1] = partial(tune_gemv, weights, biases, configs=configs, gated=gated,
                                normed=normed)  # fmt: skip
        for rows in ladder:
            calls[key, rows] = partial(tune_skinny, weights, biases, rows, gated=gated,
                                       configs=skinny_configs, normed=normed)  # fmt: skip
    if mlp is not None:
        prod, cons = mlp
        prod_weights = [m.weight for m in groups[prod]]
        cons_weights = [m.weight for m in groups[cons]]
        biases = [m.bias for m in groups[prod]] if prod.has_bias else None
        normed = prod.input_transform is InputTransform.RMS_NORM
        calls["glu", 1] = partial(tune_gemv, prod_weights, biases, normed=normed, glu=True,
                                  configs=configs)  # fmt: skip
        calls["plain input", 1] = partial(tune_gemv, cons_weights, configs=configs)
        for rows in ladder:
            calls["glu", rows] = partial(tune_skinny, prod_weights, biases, rows, glu=True,
                                         configs=skinny_configs, normed=normed)  # fmt: skip
            calls["plain input", rows] = partial(tune_skinny, cons_weights, None, rows,
                                                 configs=skinny_configs)  # fmt: skip
    return calls


def _compile_tuning_calls(
    calls: Sequence[Callable[[], Tuned]], groups: dict[_GemvGroup, list[LinearBase]]
) -> None:
    """On the GPU, run every tuning call once under `compile_only` from a pool of threads
    (each call's kernels compile side by side, as `_compile_ahead` does for the quantized
    kinds), so that the serial pass that times them compiles nothing."""
    layers = [m for members in groups.values() for m in members]
    if not layers or layers[0].weight.device.type != "cuda" or COMPILE_AHEAD_THREADS < 2:
        return

    def warm(call: Callable[[], Tuned]) -> None:
        # A call that fails here fails again in the serial pass, which reports it.
        with compile_only(), suppress(Exception):
            call()

    with (ThreadPoolExecutor(COMPILE_AHEAD_THREADS, thread_name_prefix="compile") as pool,
          tqdm(total=len(calls), desc="Compiling 16-bit matmuls", unit="step") as bar):
        for _ in pool.map(warm, calls):
            bar.update()
    torch.cuda.synchronize(layers[0].weight.device)


def _pair_mlp(
    mlp: tuple[_GemvGroup, _GemvGroup], ladder: Sequence[int], tuned: dict[tuple, Tuned],
    one_row: dict[_GemvGroup, PlanEntry], few_entries: dict[_GemvGroup, list[PlanEntry]],
    timings: dict[tuple[int, int], dict[str, float]],
) -> None:  # fmt: skip
    """Where the MLP's gate/up matmul with SiLU-and-mul in its epilogue and the down
    projection on a plain input (`_tuning_calls`' "glu" and "plain input") beat the separate
    forms already chosen, at batch 1 or at a row count of `ladder`, both layers' entries for
    those rows are replaced (in `one_row` and `few_entries`), so that the two always match."""
    prod, cons = mlp
    glu, plain = tuned["glu", 1], tuned["plain input", 1]
    timings[(prod.n, prod.k)].update({f"glu {name}": t for name, t in glu.timings.items()})
    timings[(cons.n, cons.k)].update(
        {f"plain input {name}": t for name, t in plain.timings.items()}
    )
    if glu.config is not None and glu.ms + plain.ms < tuned[prod, 1].ms + tuned[cons, 1].ms:
        one_row[prod] = _tuned_entry(prod.input_transform, glu, TritonGemv, 1,
                                     epilogue=Epilogue.SILU_AND_MUL)  # fmt: skip
        # The down projection's batch-1 input arrives activated by that epilogue.
        one_row[cons] = _tuned_entry(cons.input_transform, plain, TritonGemv, 1,
                                     entry_input=InputTransform.NONE)  # fmt: skip
    for i, rows in enumerate(ladder):
        few_glu, few_plain = tuned["glu", rows], tuned["plain input", rows]
        timings[(prod.n, prod.k)].update(
            {f"{rows} rows: glu {name}": t for name, t in few_glu.timings.items()}
        )
        timings[(cons.n, cons.k)].update(
            {f"{rows} rows: plain input {name}": t for name, t in few_plain.timings.items()}
        )
        separate = tuned[prod, rows].ms + tuned[cons, rows].ms
        if few_glu.config is not None and few_glu.ms + few_plain.ms < separate:
            few_entries[prod][i] = _tuned_entry(prod.input_transform, few_glu, TritonSkinnyGemm,
                                                rows, epilogue=Epilogue.SILU_AND_MUL)  # fmt: skip
            few_entries[cons][i] = _tuned_entry(cons.input_transform, few_plain,
                                                TritonSkinnyGemm, rows,
                                                entry_input=InputTransform.NONE)  # fmt: skip


# Row counts at which quantized layers are timed; each serves the rows above the previous.
QUANT_ROW_LADDER = (1, 2, 4, 8, 16, 64, 256, 1024)  # ends above QUANT_GEMV_MAX_ROWS


def plan_quantized_linears(
    model: nn.Module, ladder: Sequence[int] = QUANT_ROW_LADDER, reps: int = 5,
    device_type: str = "cuda", cache: PlanCache | None = None,
) -> tuple[Plans, dict[tuple[int, int], dict[int, dict[str, float]]]]:  # fmt: skip
    """Time the candidate kinds of each row count of `ladder` (the format's `tuning_kinds`:
    by default the few a rule table names) over the same-shape CUDA layers of the model (in a CUDA
    graph, as decode runs them), and plan the fastest per row range; a row count with one
    candidate is only checked against the reference. Returns the plans and, per weight
    shape, per row count timed, the milliseconds of each kind (none for a shape whose
    choices came from `cache`, which also keeps the new ones: `models.plan_cache`). Logs
    the tuning's total seconds."""
    if ladder[-1] <= QUANT_GEMV_MAX_ROWS:
        raise ValueError("the ladder must reach past the GEMV's rows: its top serves any batch")
    def key(m: nn.Module) -> tuple | None:
        if not isinstance(m, LinearBase) or m.quant_config is None:
            return None
        if m.qweight.device.type != device_type:
            return None
        return (m.out_features, m.in_features, m.quant_config, m.group_size, _own_bias(m),
                m.input_transform, m.input_perm is not None)  # fmt: skip

    groups: dict[tuple, list[LinearBase]] = _layer_groups(model, key)
    plans: Plans = {}
    timings: dict[tuple[int, int], dict[int, dict[str, float]]] = {}
    started, timed, checked = time.perf_counter(), 0, 0
    # Each group's candidates per step, and its plan from the cache where held; the other
    # groups' kernels all compile side by side before the first is timed.
    chosen = {}
    jobs: list[CompileJob] = []
    for group, layers in groups.items():
        has_bias, declared = group[4], group[5]
        first = layers[0]
        method = get_quant_method(first.quant_config)
        candidates = [method.tuning_kinds(first, rows) for rows in ladder]
        key = plan_key([
            *device_identity(first.qweight.device), source_digest(), *group,
            first.params_dtype, *ladder, *([kind.describe() for kind in c] for c in candidates),
        ])  # fmt: skip
        pairs = [(m, m.bias if has_bias else None) for m in layers]
        # A step whose candidates all failed planned one of the format's fallbacks (or the
        # reference): a cached plan may name those too.
        known = [[*kinds, *method.fallback_kinds(first, rows)]
                 for rows, kinds in zip(ladder, candidates, strict=True)]  # fmt: skip
        best = _cached_choice(cache, key, known, ladder, pairs, first, declared)
        chosen[group] = (method, candidates, key, pairs, best)
        if best is None:
            for i, (rows, kinds) in enumerate(zip(ladder, candidates, strict=True)):
                if rows <= COMPILE_AHEAD_MAX_ROWS:
                    low_rows = ladder[i - 1] + 1 if i else 1
                    jobs += [CompileJob(kind, pairs[0], rows, low_rows, declared)
                             for kind in kinds]  # fmt: skip
    _compile_ahead(jobs, device_type)
    bar = tqdm(total=len(groups) * len(ladder), desc="Tuning quantized matmuls",
               unit="step", disable=not groups)  # fmt: skip
    for group, layers in groups.items():
        n, k, declared = group[0], group[1], group[5]
        bar.set_postfix_str(f"{n}x{k}")
        first = layers[0]
        method, candidates, key, pairs, best = chosen[group]
        if best is not None:
            bar.update(len(ladder))
        else:
            best = []
            for i, (rows, kinds) in enumerate(zip(ladder, candidates, strict=True)):
                x, low_rows = _step_input(first, ladder, i)
                fastest, row_times = _fastest(kinds, x, pairs, reps, low_rows, declared)
                if fastest is None:
                    # Every candidate failed the agreement check (a kernel that fails on this
                    # GPU): the format's fallbacks, if any, take their place.
                    fallback = method.fallback_kinds(first, rows)
                    if fallback:
                        kinds = fallback
                        fastest, row_times = _fastest(kinds, x, pairs, reps, low_rows, declared)
                if len(kinds) > 1:
                    timed += len(row_times)
                    timings.setdefault((n, k), {})[rows] = row_times
                else:
                    checked += 1
                # No kind agreeing (a non-finite reference) leaves the reference planned.
                best.append(_named(kinds)[fastest] if fastest else reference_of(kinds[0]))
                bar.update()
            if cache is not None:
                cache.store(key, [kind.describe() for kind in best], about=f"{n}x{k} {group}")
        # A kind that can form the declared input itself (FP8's activation quantization with
        # RMSNorm or SiLU-and-mul, the at-once GEMV's SiLU-and-mul) does, saving a kernel.
        entries = [PlanEntry(kind, rows, declared, fuse_input=declared in kind.fusable_inputs)
                   for rows, kind in zip(ladder, best, strict=True)]  # fmt: skip
        # The ladder's top step serves any batch.
        rest = replace(entries.pop(), max_rows=None)
        plans.update(dict.fromkeys(layers, _plan_of(entries, rest)))
    bar.close()
    if groups:
        logger.info("quantized matmul plans for %d shapes in %.1f s: %d candidates timed, %d "
                    "ladder steps with one candidate checked only", len(groups),
                    time.perf_counter() - started, timed, checked)  # fmt: skip
    return plans, timings


def _fastest(
    kinds: Sequence[MatmulKind], x: torch.Tensor,
    pairs: list[tuple[LinearBase, torch.Tensor | None]], reps: int, low_rows: int,
    declared: InputTransform,
) -> tuple[str | None, dict[str, float]]:  # fmt: skip
    """The name of the fastest of `kinds` that agrees with the reference at a ladder step,
    and every agreeing kind's time (none timed where there is one kind: it is only checked);
    None where no kind agrees."""
    if len(kinds) == 1:
        agreeing = _agreeing_kinds(kinds, pairs, x, low_rows)
        return (agreeing[0].describe() if agreeing else None), {}
    row_times = _time_kinds(kinds, x, pairs, reps, low_rows, declared=declared)
    return (min(row_times, key=row_times.__getitem__) if row_times else None), row_times


def _named(kinds: Sequence[MatmulKind]) -> dict[str, MatmulKind]:
    """`kinds` by description, with the first one's reference, which a step plans when no
    candidate agrees with it."""
    fallback = reference_of(kinds[0])
    return {kind.describe(): kind for kind in (fallback, *kinds)}


def _step_input(first: LinearBase, ladder: Sequence[int], i: int) -> tuple[torch.Tensor, int]:
    """A random input of ladder step i's rows for `first`'s group, and the fewest rows that
    step serves (one more than the previous step's)."""
    x = torch.randn(ladder[i], first.in_features, device=first.qweight.device,
                    dtype=first.params_dtype)  # fmt: skip
    return x, ladder[i - 1] + 1 if i else 1


def _cached_choice(
    cache: PlanCache | None, key: str, candidates: Sequence[Sequence[MatmulKind]],
    ladder: Sequence[int], pairs: list[tuple[LinearBase, torch.Tensor | None]],
    first: LinearBase, declared: InputTransform,
) -> list[MatmulKind] | None:  # fmt: skip
    """The kinds `cache` holds for `key`, one per row count, if each is still a candidate
    (or fallback) there and agrees with the reference on every layer at that row count and
    the fewest rows it serves; else None (the caller times them)."""
    names = cache.load(key) if cache is not None else None
    if names is None or len(names) != len(ladder):
        return None
    best: list[MatmulKind] = []
    for i, (rows, kinds, name) in enumerate(zip(ladder, candidates, names, strict=True)):
        kind = _named(kinds).get(name)
        if kind is None:
            return None
        x, low_rows = _step_input(first, ladder, i)
        try:
            agrees = _agrees_over_range(kind, pairs, x, low_rows)
        except Exception:  # a kind this GPU can no longer run: time them all again
            agrees = False
        if not agrees:
            logger.warning("cached matmul plan %s disagrees with the reference at %d rows; "
                           "tuning again", name, rows)  # fmt: skip
            return None
        best.append(kind)
    logger.info("quantized %dx%d: matmul plan read from %s", first.out_features,
                first.in_features, cache.root if cache is not None else "")  # fmt: skip
    return best


def _agrees_over_range(
    kind: MatmulKind, pairs: list[tuple[LinearBase, torch.Tensor | None]], x: torch.Tensor,
    low_rows: int,
) -> bool:  # fmt: skip
    """Whether `kind` agrees with its reference on every layer of `pairs` (layer, bias), at
    x's rows and at `low_rows` (`_agreeing_kinds`)."""
    return bool(_agreeing_kinds([kind], pairs, x, low_rows))


def _range_inputs(x: torch.Tensor, low_rows: int) -> list[torch.Tensor]:
    """The inputs a kind serving rows low_rows..x's rows is checked on: x, and its first
    `low_rows` rows where that is fewer (a partial tile can fail where a full one does not)."""
    return [x] if low_rows >= x.shape[0] else [x, x[:low_rows]]


def _agreeing_kinds(
    kinds: Sequence[MatmulKind], pairs: list[tuple[LinearBase, torch.Tensor | None]],
    x: torch.Tensor, low_rows: int,
) -> list[MatmulKind]:  # fmt: skip
    """The kinds that agree with their reference (`agrees_with_reference`) on every layer of
    `pairs` (layer, bias), at x's rows and at `low_rows` (the fewest rows of the range they
    would serve: a partial tile there can fail where a full one does not). A kind that
    raises (a config this GPU cannot run) drops out with an info line, one that disagrees
    with a warning. Layer by layer, each reference output is computed once for all the kinds
    rather than once per kind: with some fifty kinds over 32 layers, a dequantize-then-
    matmul per kind and layer is a large share of a cold start's tuning."""
    dropped: set[MatmulKind] = set()
    for m, b in pairs:
        for xs in _range_inputs(x, low_rows):
            wants: dict[MatmulKind, torch.Tensor] = {}
            for kind in kinds:
                if kind in dropped:
                    continue
                try:
                    reference = reference_of(kind)
                    if reference not in wants:
                        wants[reference] = reference_output(reference, m, xs, b)
                    agrees = agrees_with_reference(kind, m, xs, b, wants[reference])
                except Exception as e:
                    logger.info("quantized %s cannot run at %d rows (%s: %s); not planned",
                                kind.describe(), xs.shape[0], type(e).__name__, e)  # fmt: skip
                    dropped.add(kind)
                    continue
                if not agrees:
                    logger.warning("quantized %s disagrees with the reference at %d rows; "
                                   "not planned", kind.describe(), xs.shape[0])  # fmt: skip
                    dropped.add(kind)
    return [kind for kind in kinds if kind not in dropped]


class CompileJob(NamedTuple):
    """A kind to run once before tuning, so that its kernels are compiled: on `pair` (a
    layer and its bias), at `rows` rows and at `low_rows` (the range a ladder step serves),
    on the input its layer declares."""

    kind: MatmulKind
    pair: tuple[LinearBase, torch.Tensor | None]
    rows: int
    low_rows: int
    declared: InputTransform


def _compile_ahead(jobs: Sequence[CompileJob], device_type: str) -> None:
    """Run each job's kind once, as the agreement check and the timing will, from a pool of
    threads, so that the Triton kernels of every shape and ladder step compile side by side
    before the first is timed: Triton releases the GIL while it compiles, and a cold start
    compiles each config about once per row bucket (Triton specializes a row count only on
    being 1 or a multiple of 16; the wgmma matmul per padded row count and K split). The
    kernels run on the caller's stream, one after another as launched; what they return is
    dropped, and a kind that fails here fails again in the serial pass, which skips it. On
    the GPU only: on the CPU the serial pass compiles."""
    if device_type != "cuda" or COMPILE_AHEAD_THREADS < 2 or len(jobs) < 2:
        return
    device = jobs[0].pair[0].qweight.device
    stream = torch.cuda.current_stream(device)

    def warm(job: CompileJob) -> None:
        layer, bias = job.pair
        try:
            with torch.cuda.stream(stream), torch.inference_mode():
                x = torch.randn(job.rows, layer.in_features, device=device,
                                dtype=layer.params_dtype)  # fmt: skip
                for xs in _range_inputs(x, job.low_rows) + _bucket_inputs(x, job.low_rows):
                    job.kind.apply(layer, xs, bias)
                _declared_input(x, job.declared)(job.kind, layer, bias)
        except Exception:  # the serial pass reports and skips it
            pass

    with (ThreadPoolExecutor(COMPILE_AHEAD_THREADS, thread_name_prefix="compile") as pool,
          tqdm(total=len(jobs), desc="Compiling quantized matmuls", unit="kind") as bar):
        for _ in pool.map(warm, jobs):
            bar.update()
    torch.cuda.synchronize(device)


def _bucket_inputs(x: torch.Tensor, low_rows: int) -> list[torch.Tensor]:
    """x's first rows at each power of two strictly between `low_rows` and x's rows: row
    counts a step serves that launch other kernel variants than its ends (Triton
    specializes a row count on being a multiple of 16, the wgmma matmul pads rows to a power
    of two), which decode graphs of those batch sizes would otherwise compile at capture."""
    rows, p = x.shape[0], 1 << low_rows.bit_length()
    out = []
    while p < rows:
        out.append(x[:p])
        p <<= 1
    return out


def _time_kinds(
    kinds: Sequence[MatmulKind], x: torch.Tensor,
    pairs: list[tuple[LinearBase, torch.Tensor | None]], reps: int,
    low_rows: int = 1, *, declared: InputTransform = InputTransform.NONE,
) -> dict[str, float]:  # fmt: skip
    """Milliseconds per layer of each kind over `pairs` (layer, bias) at input x; a kind
    counts only if it agrees with the reference over its row range (`_agreeing_kinds`).
    A layer whose input needs RMSNorm or SiLU-and-mul (`declared`) is timed with it: inside
    the kind where the kind forms it, else as its own kernel before, as the plan will run
    it."""
    times: dict[str, float] = {}
    timed_input = _declared_input(x, declared)
    for kind in _agreeing_kinds(kinds, pairs, x, low_rows):
        try:

            def call(m: LinearBase, b: torch.Tensor | None, kind: MatmulKind = kind
                     ) -> torch.Tensor:  # fmt: skip
                return timed_input(kind, m, b)

            with torch.inference_mode():
                times[kind.describe()] = graph_time_ms(call, pairs, reps)  # type: ignore[arg-type]
        except Exception as e:  # a config this GPU cannot run (resources): skip it
            logger.warning("quantized %s could not be timed at %d rows (%s: %s); not planned",
                           kind.describe(), x.shape[0], type(e).__name__, e)  # fmt: skip
            continue
    return times


def _declared_input(
    x: torch.Tensor, declared: InputTransform
) -> Callable[[MatmulKind, LinearBase, torch.Tensor | None], torch.Tensor]:
    """A call of a kind on the input a `declared` layer receives, formed where a plan
    holding that kind forms it: in the kind if it can (`MatmulKind.fusable_inputs`), else by
    a kernel of its own before it."""
    if declared is InputTransform.NONE:
        return lambda kind, m, b: kind.apply(m, x, b)
    if declared is InputTransform.SILU_AND_MUL:
        pair = torch.cat([x, x], dim=1)  # [gate, up]

        def gated(kind: MatmulKind, m: LinearBase, b: torch.Tensor | None) -> torch.Tensor:
            if declared in kind.fusable_inputs:
                return kind.apply(m, pair, b, gated=True)
            return kind.apply(m, silu_and_mul(pair), b)

        return gated
    norm = RMSNorm(x.shape[1], 1e-5).to(x.device, x.dtype)
    residual = torch.randn_like(x)

    def normed(kind: MatmulKind, m: LinearBase, b: torch.Tensor | None) -> torch.Tensor:
        if declared in kind.fusable_inputs:
            return kind.apply_normed(m, x, residual, norm, b)[0]
        return kind.apply(m, norm(x, residual)[0], b)

    return normed


def tune_gpu_linears(
    model: nn.Module, configs: Sequence[GemvConfig] | None = None
) -> dict[tuple[int, int], dict[str, float]]:
    """The GPU's start-up tuning of every linear layer: `plan_decode_gemvs` (16-bit layers)
    and `plan_quantized_linears` (quantized ones, on a row ladder up to 1024 rows); each
    layer takes its plan. Returns the 16-bit layers' timings."""
    plans, timings = plan_decode_gemvs(model, configs)
    quant_plans, quant_timings = plan_quantized_linears(model, cache=PlanCache.default())
    for (n, k), per_rows in quant_timings.items():
        for rows, row_times in per_rows.items():
            if row_times:
                fastest = min(row_times, key=row_times.__getitem__)
                logger.info("quantized %dx%d at %d rows: %s %.4f ms (of %d kinds timed)", n, k,
                            rows, fastest, row_times[fastest], len(row_times))  # fmt: skip
                # Every kind's time, for the rules that would spare start-up this tuning.
                ranked = sorted(row_times.items(), key=lambda t: t[1])
                logger.debug("quantized %dx%d at %d rows, all kinds (ms): %s", n, k, rows,
                             {kind: round(ms, 4) for kind, ms in ranked})  # fmt: skip
    plans.update(quant_plans)
    for layer, plan in plans.items():
        layer.set_plan(plan)
    for layer in quant_plans:
        release_unplanned_copies(layer)
    return timings


def describe_matmul_plans(model: nn.Module) -> list[str]:
    """One line per layer group (layers of one name, weight shape and plan): what each row
    count runs, as tuning left it."""
    lines: dict[tuple[str, tuple[int, ...], MatmulPlan], str] = {}
    for name, m in model.named_modules():
        if not isinstance(m, PlannedMatmul):
            continue
        role = name.rsplit(".", 1)[-1]
        quantized = getattr(m, "quant_config", None) is not None
        shape = (m.out_features, m.in_features) if quantized else tuple(m.weight.shape)
        key = (role, shape, m.plan)
        if key not in lines:
            lines[key] = f"{role} {shape[0]}x{shape[1]}: {m.plan.describe()}"
    return list(lines.values())


def cpu_kinds() -> list[MatmulKind]:
    """The small-batch CPU kinds this build can run, each timed against the BLAS call."""
    kinds: list[MatmulKind] = []
    if gemm_available():
        kinds.append(CpuGemm())
    if cpu_packing_available():
        kinds.append(CpuPacked())
    return kinds


def time_cpu_kinds(
    weights: Sequence[torch.Tensor], kinds: Sequence[MatmulKind], ladder: Sequence[int],
    declared: InputTransform = InputTransform.NONE, reps: int = 5,
) -> dict[int, dict[str, float]]:  # fmt: skip
    """Per row count of `ladder`, median microseconds per layer of each kind (by
    `describe()`) for a [rows, K] input, over `weights` (the layers of one shape) in turn:
    as a step runs them, each weight is read from memory, not from a cache that one layer
    alone would fit. A layer whose input needs RMSNorm or SiLU-and-mul (`declared`) is timed
    with it, formed where a plan would form it (`_declared_input`). The kinds alternate
    within each repetition, so a busy spell slows them alike; each runs on its own copies of
    what it builds from the weights, made once for the whole ladder."""
    holders: list[list[nn.Module]] = []
    for kind in kinds:
        holders.append([])
        for weight in weights:
            holder = nn.Module()
            holder.weight = weight  # type: ignore[assignment]
            kind.process_weights_after_loading(holder)
            holders[-1].append(holder)
    per_rows: dict[int, dict[str, float]] = {}
    for rows in ladder:
        x = torch.randn(rows, weights[0].shape[1], dtype=weights[0].dtype)
        timed_input = _declared_input(x, declared)

        def run(kind: MatmulKind, layers: list[nn.Module],
                timed_input: Callable = timed_input) -> None:  # fmt: skip
            for layer in layers:
                timed_input(kind, layer, None)

        calls = [(kind.describe(), functools.partial(run, kind, layers))
                 for kind, layers in zip(kinds, holders, strict=True)]  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name, _ in calls}
        with torch.inference_mode():
            for _, fn in calls:
                fn()
            for _ in range(reps):
                for name, fn in calls:
                    t0 = time.perf_counter()
                    fn()
                    times[name].append((time.perf_counter() - t0) / len(weights))
        per_rows[rows] = {name: 1e6 * sorted(t)[len(t) // 2] for name, t in times.items()}
    return per_rows


def plan_cpu_linears(
    model: nn.Module, ladder: Sequence[int] = CPU_ROW_LADDER
) -> tuple[Plans, dict[tuple[int, int], dict[int, dict[str, float]]]]:
    """On the CPU, time each float32 linear shape (over its layers; the LM head is one)
    at every row count of `ladder` with the BLAS call and each small-batch kind
    (`CpuGemm`, `CpuPacked`), each with the layer's input transform where it would run;
    each row range (up to the ladder's top) takes the fastest kind where it beats BLAS (by
    `CPU_PACKED_MIN_GAIN` or `CPU_GEMM_MIN_GAIN`), else BLAS, which also serves every batch
    above the ladder. Returns the plans per layer and, per shape, per row count, the
    microseconds of each path."""
    kinds = cpu_kinds()
    if not kinds:
        return {}, {}
    def key(m: nn.Module) -> tuple[int, int, InputTransform] | None:
        if not isinstance(m, PlannedMatmul) or getattr(m, "quant_config", None):
            return None
        weight = m.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None
        if weight.numel() * weight.element_size() > CPU_PACKED_MAX_BYTES:
            return None
        return (weight.shape[0], weight.shape[1], m.input_transform)

    groups: dict[tuple[int, int, InputTransform], list[nn.Module]] = _layer_groups(model, key)
    copy_bytes = sum(m.weight.numel() * m.weight.element_size() for g in groups.values() for m in g)
    free = _available_host_bytes()
    if free is not None and copy_bytes > CPU_PACKED_MAX_SHARE_OF_FREE * free:
        logger.info(
            "CPU linears keep BLAS: packed weight copies would take %.1f GiB of %.1f GiB "
            "available", copy_bytes / 2**30, free / 2**30,
        )  # fmt: skip
        return {}, {}
    timings: dict[tuple[int, int], dict[int, dict[str, float]]] = {}
    plans: Plans = {}
    for (n, k, declared), layers in groups.items():
        weights = [m.weight for m in layers]
        per_rows = time_cpu_kinds(weights, [Blas(), *kinds], ladder, declared)
        timings[(n, k)] = per_rows
        plans.update(dict.fromkeys(layers, _cpu_plan(per_rows, kinds, declared)))
    return plans, timings


def _available_host_bytes() -> int | None:
    """Host memory available now (None where psutil cannot tell)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # an unknown platform: no limit rather than no start-up
        return None


def _cpu_plan(
    per_rows: dict[int, dict[str, float]], kinds: Sequence[MatmulKind],
    declared: InputTransform,
) -> MatmulPlan:  # fmt: skip
    """Entries from the timings at each row count: the fastest of the kinds within their
    margin of BLAS (else BLAS) serves the rows above the previous count, and BLAS any
    larger batch (`_plan_of`)."""
    entries: list[PlanEntry] = []
    for rows, times in sorted(per_rows.items()):
        blas = times["BLAS"]
        within = [k for k in kinds if times[k.describe()] < blas * (
            CPU_GEMM_MIN_GAIN if isinstance(k, CpuGemm) else CPU_PACKED_MIN_GAIN
        )]  # fmt: skip
        fastest = min(within, key=lambda k: times[k.describe()], default=Blas())
        # A kind that forms the declared input itself (the CPU GEMM) does, saving ops.
        fuse = declared in fastest.fusable_inputs
        entries.append(PlanEntry(fastest, rows, declared, fuse_input=fuse))
    return _plan_of(entries, PlanEntry(Blas(), input=declared))


def tune_cpu_linears(model: nn.Module) -> dict[tuple[int, int], dict[int, dict[str, float]]]:
    """`plan_cpu_linears`, and each layer takes its plan; returns the timings."""
    plans, timings = plan_cpu_linears(model)
    for layer, plan in plans.items():
        layer.set_plan(plan)
    return timings
