"""CUDA graphs for decode steps and for small prefill and mixed steps, captured once per
padded shape and replayed with static input buffers.

Decode: a step of B requests is padded up to the nearest captured size; padding rows write
to slot -1 (skipped) and have a context length of 0 (attention returns zeros for them).
Grids inside the graph depend only on the padded size and on the step's `DecodePlan`
(split-KV segments, rotary fused or not), which the model runner decides for the padded
size: each size gets one graph per plan it can have (`decode_plans`), and one capture serves
every step of that size and plan whatever the context lengths.

Prefill and mixed steps of up to `PREFILL_TOKEN_SIZES[-1]` tokens and `PREFILL_SEQ_SIZES[-1]`
sequences: eager, such a step is as long as the host takes to launch its few hundred kernels
(a 512-token prompt on a 7B model: about 30 ms of launches for 10 ms of GPU work). They
replay at (tokens, sequences) padded up to captured sizes. The padding tokens form one extra
sequence with no keys (seq_len 0, slot -1: attention gives it zeros and writes nothing);
padding sequences after it hold no tokens. Attention is captured without the host's
`max_query_len` hint, so both its short-query and prefill launches run and each takes the
sequences it serves, whatever the lengths. Larger steps keep the GPU busy for longer than
their launches take and run eagerly.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from asyncengine_kernels.paged_attention import DecodePlan, decode_plans
from models.forward_context import AttentionMetadata, set_forward_context

if TYPE_CHECKING:
    from asyncengine.model_runner import StepInputs

logger = logging.getLogger(__name__)
T = TypeVar("T")


# Padded decode batch sizes: fine steps where a step is short and padding costs the most,
# coarser ones above. Large pools (FP8 KV) run 512-1,024 sequences at once, and an eager step
# that large is paced by the host's launches (W2 FP8 at 1,024 sequences: 43 s of a 68 s run).
_CAPTURE_SIZES = (1, 2, 4, 8, *range(16, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
                  *range(1152, 2049, 128))  # fmt: skip


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes captured as graphs: every size up to `max_num_seqs` (capped at
    2,048), and `max_num_seqs` itself, so that a full batch never runs eagerly."""
    top = min(max_num_seqs, _CAPTURE_SIZES[-1])
    sizes = [s for s in _CAPTURE_SIZES if s <= top]
    if not sizes or sizes[-1] != top:
        sizes.append(top)
    return sizes


def capture_callable(
    fn: Callable[[], T], device: torch.device, pool: tuple | None
) -> tuple[torch.cuda.CUDAGraph, T]:
    """`fn` over static buffers captured as a graph in `pool` (None: a new one); returns the
    graph and what the capture returned (its output buffers). An eager call first compiles
    every kernel variant the capture will launch."""
    fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def capture_forward(
    model: nn.Module,
    meta: AttentionMetadata,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    pool: tuple | None,
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """One forward pass over static buffers captured as a graph (`capture_callable`)."""
    with set_forward_context(meta):
        return capture_callable(lambda: model(input_ids, positions), input_ids.device, pool)


# Threads that run the decode graphs' warm-up passes side by side (`warm_up_forwards`), and
# the largest padded size among them: bigger batches' passes run one at a time in the
# captures, so that side-by-side passes never hold more than a few small batches'
# activations beyond what the memory profile left.
WARM_UP_THREADS = min(8, os.cpu_count() or 1)
WARM_UP_MAX_ROWS = 256


def warm_up_forwards(
    model: nn.Module,
    passes: Sequence[tuple[AttentionMetadata, torch.Tensor, torch.Tensor]],
    threads: int = WARM_UP_THREADS,
) -> None:
    """Run each forward (metadata, input ids, positions) once, from a pool of threads: a
    graph's capture starts with an eager pass that compiles the kernel variants its size
    and plan launch, and run one after another those compiles were most of a cold start's
    captures (15 s for W1's 23 decode graphs). Side by side they compile together, as the
    start-up tuner's do (Triton releases the GIL while it compiles); each capture's own pass
    then finds them built. The forward context is per thread; on a GPU every pass runs on
    the caller's stream, one after another as launched, and what they return is dropped.
    The passes must write nothing (no cache slots) and read only their own inputs."""
    if threads < 2 or len(passes) < 2:
        return
    device = passes[0][1].device
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def run(p: tuple[AttentionMetadata, torch.Tensor, torch.Tensor]) -> None:
        meta, ids, positions = p
        with (torch.inference_mode(), set_forward_context(meta),
              torch.cuda.stream(stream) if stream is not None else nullcontext()):  # fmt: skip
            model(ids, positions)

    with ThreadPoolExecutor(min(threads, len(passes)), thread_name_prefix="warm-up") as pool:
        list(pool.map(run, passes))
    if stream is not None:
        torch.cuda.synchronize(device)
        # What the passes held side by side goes back: the captures that follow allocate
        # one pass at a time.
        torch.cuda.empty_cache()


class SplitGraph:
    """A decode forward captured as two graphs replayed back to back: the first
    `head_layers` layers, then the rest. A graph's first kernel is seen to start near the end
    of its launch call, which for a 7B forward takes the host about as long as a layer runs;
    a step the host waited for (a verify step, a draft's step) would then start on the
    head's short launch while the long one is submitted. `head_outputs` keeps the hidden
    state the tail reads from being handed to another capture."""

    def __init__(self, head: torch.cuda.CUDAGraph, tail: torch.cuda.CUDAGraph,
                 head_outputs: tuple[torch.Tensor, ...]) -> None:  # fmt: skip
        self.head, self.tail, self.head_outputs = head, tail, head_outputs

    def replay(self) -> None:
        self.head.replay()
        self.tail.replay()

    def pool(self) -> tuple:
        return self.head.pool()


def can_split(model: nn.Module, head_layers: int) -> bool:
    """Whether `model` runs as a head of `head_layers` layers and a tail of at least one
    (`forward_head` / `forward_tail`, as `models.llama` offers)."""
    layers = getattr(model, "num_layers", 0)
    return 0 < head_layers < layers and hasattr(model, "forward_head")


def capture_split_forward(
    model: nn.Module,
    meta: AttentionMetadata,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    pool: tuple | None,
    head_layers: int,
) -> tuple[SplitGraph, torch.Tensor]:
    """`capture_forward` in two graphs (`SplitGraph`) in one memory pool: the tail's input is
    the head's output, kept alive while the tail is captured so no allocation reuses it."""
    with set_forward_context(meta):
        model(input_ids, positions)
        torch.cuda.synchronize(input_ids.device)
        head = torch.cuda.CUDAGraph()
        with torch.cuda.graph(head, pool=pool):
            hidden, residual = model.forward_head(input_ids, positions, head_layers)  # type: ignore[operator]
        tail = torch.cuda.CUDAGraph()
        with torch.cuda.graph(tail, pool=head.pool()):
            out = model.forward_tail(positions, hidden, residual, head_layers)  # type: ignore[operator]
    return SplitGraph(head, tail, (hidden, residual)), out


# Decode steps of up to this many padded rows (a batch-1 stream, a verify step) are staged
# whole: the host writes their inputs in the static buffer's layout and one copy lands them,
# where otherwise seven copy and fill launches would, each some microseconds of host time
# that a verify step (resolved before the next is prepared) waits out with the device idle.
STAGE_MAX_ROWS = 16
STAGE_MAX_BYTES = 1 << 18


def static_fields(num_rows: int, max_blocks: int) -> tuple[dict[str, int], int]:
    """Byte offsets of the decode graphs' static inputs in their one buffer (each on a
    16-byte boundary, the block tables last so a small step's rows end early), and its size."""
    return aligned_offsets({"input_ids": 8 * num_rows, "positions": 8 * num_rows,
                            "slot_mapping": 8 * num_rows, "seq_lens": 4 * num_rows,
                            "block_tables": 4 * num_rows * max_blocks})  # fmt: skip


def aligned_offsets(sizes: dict[str, int]) -> tuple[dict[str, int], int]:
    """Byte offsets of fields of these sizes laid one after another in one buffer, each on a
    16-byte boundary, and the buffer's size."""
    offsets, at = {}, 0
    for name, size in sizes.items():
        offsets[name] = at
        at += -(-size // 16) * 16
    return offsets, at


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        max_num_seqs: int,
        max_blocks: int,
        *,
        fuse_rotary: bool = True,
        verify_rows: int = 0,
        label: str = "decode",
        head_layers: int = 0,
    ) -> None:
        self.model = model
        # Graphs of up to `STAGE_MAX_ROWS` padded rows split after this many layers
        # (`SplitGraph`); 0, or a model that cannot split: every graph whole.
        self.head_layers = head_layers if can_split(model, head_layers) else 0
        self.label = label  # whose graphs, in the progress bar and the log
        self.device = device
        self.fuse_rotary = fuse_rotary  # as the runner plans (`decode_plan`'s argument)
        self.sizes = capture_sizes(max_num_seqs)
        # Speculative decoding: the sizes a verify step of up to `verify_rows` rows pads to
        # also get the plans without fused rotary, which batch-expanded verify steps run.
        self.verify_rows = 0
        if verify_rows:
            self.verify_rows = self.sizes[min(bisect.bisect_left(self.sizes, verify_rows),
                                              len(self.sizes) - 1)]  # fmt: skip
        n = self.sizes[-1]
        self.max_blocks = max_blocks
        # The static inputs are fields of one buffer (`static_fields`), so a small step can
        # reach them all in one copy of the buffer's head (`stage_image`).
        self.offsets, size = static_fields(n, max_blocks)
        self.static = torch.zeros(size, dtype=torch.uint8, device=device)

        def field(name: str, dtype: torch.dtype, count: int) -> torch.Tensor:
            at = self.offsets[name]
            return self.static[at : at + count * dtype.itemsize].view(dtype)

        self.input_ids = field("input_ids", torch.int64, n)
        self.positions = field("positions", torch.int64, n)
        self.slot_mapping = field("slot_mapping", torch.int64, n)
        self.slot_mapping.fill_(-1)
        self.seq_lens = field("seq_lens", torch.int32, n)
        self.block_tables = field("block_tables", torch.int32, n * max_blocks).view(n, max_blocks)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.row_ids = torch.arange(n, dtype=torch.int64, device=device)
        self._staged_views: dict[int, tuple[torch.Tensor, ...]] = {}
        # Per padded size, the host image a staged step is written into and its fields' views
        # (`stage_image`), made once: the copy to the device reads it before the call returns.
        self._images: dict[int, tuple[np.ndarray, ...]] = {}
        self.num_kv_heads: int = model.attention_layers()[0].num_kv_heads  # type: ignore[operator]
        # Keyed by (padded size, the decode plan its attention was captured with).
        self.graphs: dict[tuple[int, DecodePlan], torch.cuda.CUDAGraph | SplitGraph] = {}
        self.outputs: dict[tuple[int, DecodePlan], torch.Tensor] = {}
        self.replays = 0  # steps run through a graph

    def graph_size(self, num_seqs: int, table_width: int) -> int | None:
        """The padded size a decode step of `num_seqs` sequences replays at, or None when no
        graph fits it (it runs eagerly)."""
        if num_seqs > self.sizes[-1] or table_width > self.max_blocks:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def variants(self, b: int) -> list[tuple[int, DecodePlan]]:
        """The graphs size b needs: one per plan a step of that size can have."""
        plans = decode_plans(b, self.num_kv_heads, self.device, fuse_rotary=self.fuse_rotary)
        if b <= self.verify_rows:
            unfused = decode_plans(b, self.num_kv_heads, self.device, fuse_rotary=False)
            plans = tuple(dict.fromkeys(plans + unfused))
        return [(b, plan) for plan in plans]

    def _meta(self, b: int, plan: DecodePlan) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            max_query_len=1,
            decode_only=True,
            decode_plan=plan,
        )

    @torch.inference_mode()
    def capture(self) -> tuple | None:
        """Capture every decode graph; returns their memory pool, which the prefill graphs
        share (one step's graph runs at a time, and its output is copied out before the
        next replay is enqueued)."""
        t0 = time.monotonic()
        pool = None
        # Largest first, so smaller graphs reuse the memory pool of the largest.
        todo = [key for b in sorted(self.sizes, reverse=True) for key in self.variants(b)]
        if self.device.type == "cuda":  # static inputs as captured: no slot, no context
            warm_up_forwards(self.model, [
                (self._meta(b, plan), self.input_ids[:b], self.positions[:b])
                for b, plan in todo if b <= WARM_UP_MAX_ROWS
            ])  # fmt: skip
        for b, plan in tqdm(todo, desc=f"Capturing {self.label} CUDA graphs", unit="graph"):
            args = (self.model, self._meta(b, plan), self.input_ids[:b], self.positions[:b], pool)
            if self.head_layers and b <= STAGE_MAX_ROWS:
                graph, out = capture_split_forward(*args, self.head_layers)
            else:
                graph, out = capture_forward(*args)
            pool = graph.pool() if pool is None else pool
            self.graphs[b, plan], self.outputs[b, plan] = graph, out
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d %s CUDA graphs in %.1fs", len(self.graphs), self.label,
            time.monotonic() - t0,
        )
        return pool

    def can_run(self, inputs: StepInputs) -> bool:
        meta = inputs.meta
        if not meta.decode_only:
            return False
        b, width = meta.block_tables.shape
        padded = self.graph_size(b, width)
        # A verify step past `verify_rows` may want a plan no graph was captured with.
        return padded is not None and (padded, meta.decode_plan) in self.graphs

    def stageable(self, num_seqs: int, table_width: int, plan: DecodePlan) -> int | None:
        """The padded size a decode step of `num_seqs` sequences replays at, where the step is
        small enough to be staged whole (`stage_image`), else None."""
        padded = self.graph_size(num_seqs, table_width)
        if padded is None or padded > STAGE_MAX_ROWS or (padded, plan) not in self.graphs:
            return None
        if self.image_bytes(padded) > STAGE_MAX_BYTES:
            return None
        return padded

    def image_bytes(self, padded: int) -> int:
        """Bytes of the static buffer's head that a step of `padded` rows reads."""
        return self.offsets["block_tables"] + padded * self.max_blocks * 4

    def _image(self, padded: int) -> tuple[np.ndarray, ...]:
        """The host image of a staged step of `padded` rows and views of its fields (input
        ids, positions, slots, context lengths, [padded, max_blocks] block tables)."""
        cached = self._images.get(padded)
        if cached is None:
            image = np.zeros(self.image_bytes(padded), dtype=np.uint8)
            o, n = self.offsets, self.sizes[-1]

            def field(name: str, dtype: type, count: int) -> np.ndarray:
                return image[o[name] : o[name] + count * np.dtype(dtype).itemsize].view(dtype)

            tables = field("block_tables", np.int32, padded * self.max_blocks)
            cached = (image, field("input_ids", np.int64, n), field("positions", np.int64, n),
                      field("slot_mapping", np.int64, n), field("seq_lens", np.int32, n),
                      tables.reshape(padded, self.max_blocks))  # fmt: skip
            self._images[padded] = cached
        return cached

    def stage_image(
        self, padded: int, input_ids: Sequence[int], positions: Sequence[int],
        slots: Sequence[int], seq_lens: Sequence[int], tables: np.ndarray | Sequence[Sequence[int]],
    ) -> np.ndarray:  # fmt: skip
        """A step of `len(input_ids)` rows as the static buffer's head lays it out
        (`image_bytes(padded)` bytes), for one copy to the device before the next call
        rewrites it. Everything else is zero (token 0 at position 0 in padding rows, table
        columns past each row's own), and padding rows write to slot -1 and have no context.
        Rows past `padded` are never read by its graph. `tables`: the rows' block tables, as
        one padded array or one sequence a row (rows of a request may share one object)."""
        image, ids, pos, slot, lens, table = self._image(padded)
        b = len(input_ids)
        image.fill(0)
        ids[:b] = input_ids
        pos[:b] = positions
        slot[:b] = slots
        slot[b:padded] = -1
        lens[:b] = seq_lens
        if isinstance(tables, np.ndarray):
            table[:b, : tables.shape[1]] = tables
            return image
        # Consecutive rows with the same table (a verify step's rows) are written at once.
        r = 0
        while r < b:
            row = tables[r]
            end = r + 1
            while end < b and tables[end] is row:
                end += 1
            table[r:end, : len(row)] = row
            r = end
        return image

    def staged_views(self, b: int) -> tuple[torch.Tensor, ...]:
        """The static inputs' first b rows (input ids, positions, slots, query starts,
        context lengths, block tables, row ids), made once per b."""
        views = self._staged_views.get(b)
        if views is None:
            views = (self.input_ids[:b], self.positions[:b], self.slot_mapping[:b],
                     self.query_start_loc[: b + 1], self.seq_lens[:b], self.block_tables[:b],
                     self.row_ids[:b])  # fmt: skip
            self._staged_views[b] = views
        return views

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Replay the graph of the step's padded size and plan (the runner planned the step
        for that size: `graph_size`). A staged step's inputs are already in place."""
        meta = inputs.meta
        b, width = meta.block_tables.shape
        if inputs.staged_rows:
            key = (inputs.staged_rows, meta.decode_plan)
            if not inputs.prelaunched:  # else enqueued already, and counted
                self.graphs[key].replay()  # type: ignore[index]
                self.replays += 1
            return self.outputs[key][:b]  # type: ignore[index]
        padded = self.graph_size(b, width)
        assert padded is not None and meta.decode_plan is not None
        self.input_ids[:b].copy_(inputs.input_ids)
        self.positions[:b].copy_(inputs.positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.block_tables[:b, :width].copy_(meta.block_tables)
        if padded > b:
            self.slot_mapping[b:padded].fill_(-1)
            self.seq_lens[b:padded].fill_(0)
        key = (padded, meta.decode_plan)
        self.graphs[key].replay()
        self.replays += 1
        return self.outputs[key][:b]


# Captured prefill shapes: tokens per step and sequences per step (one of them the padding).
# Every token size exceeds every sequence size: attention reads a step with as many tokens as
# sequences as a decode step.
PREFILL_TOKEN_SIZES = (64, 128, 256, 512, 1024)
PREFILL_SEQ_SIZES = (2, 4, 8, 16)


class PrefillGraphs:
    """Graphs of prefill and mixed steps at (tokens, sequences) padded up to captured sizes."""

    def __init__(self, model: nn.Module, device: torch.device, max_blocks: int) -> None:
        self.model = model
        self.device = device
        self.max_blocks = max_blocks
        t, b = PREFILL_TOKEN_SIZES[-1], PREFILL_SEQ_SIZES[-1]
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(b + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((b, max_blocks), dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.replays = 0  # steps run through a graph

    def graph_shape(
        self, num_tokens: int, num_seqs: int, table_width: int
    ) -> tuple[int, int] | None:
        """(tokens, sequences) a step replays at, or None when no graph fits it. A step
        padded with tokens needs one more sequence to hold them."""
        if table_width > self.max_blocks or num_tokens > PREFILL_TOKEN_SIZES[-1]:
            return None
        t = PREFILL_TOKEN_SIZES[bisect.bisect_left(PREFILL_TOKEN_SIZES, num_tokens)]
        need = num_seqs + (t > num_tokens)
        if need > PREFILL_SEQ_SIZES[-1]:
            return None
        return t, PREFILL_SEQ_SIZES[bisect.bisect_left(PREFILL_SEQ_SIZES, need)]

    def meta(self, t: int, b: int) -> AttentionMetadata:
        """The static buffers as the metadata of a (t, b) step. No `max_query_len` hint: the
        captured attention serves any split of the t tokens among the b sequences."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:t],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
        )

    @torch.inference_mode()
    def capture(self, pool: tuple | None = None) -> None:
        t0 = time.monotonic()
        todo = [(t, b) for t in reversed(PREFILL_TOKEN_SIZES) for b in reversed(PREFILL_SEQ_SIZES)]
        # Capture inputs: every token in sequence 0, no keys, no cache writes.
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        if self.device.type == "cuda":  # prefill passes hold more: half as many at once
            warm_up_forwards(self.model, self.warm_up_passes(todo),
                             threads=max(WARM_UP_THREADS // 2, 1))  # fmt: skip
        for t, b in tqdm(todo, desc="Capturing prefill CUDA graphs", unit="graph"):
            self.query_start_loc.fill_(t)
            self.query_start_loc[0] = 0
            graph, out = capture_forward(
                self.model, self.meta(t, b), self.input_ids[:t], self.positions[:t], pool
            )
            pool = graph.pool() if pool is None else pool
            self.graphs[t, b], self.outputs[t, b] = graph, out
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d prefill CUDA graphs in %.1fs", len(self.graphs), time.monotonic() - t0
        )

    def warm_up_passes(
        self, shapes: Sequence[tuple[int, int]]
    ) -> list[tuple[AttentionMetadata, torch.Tensor, torch.Tensor]]:
        """The forwards that compile what the captures of `shapes` launch
        (`warm_up_forwards`): the capture inputs (every token in sequence 0, no keys, no
        cache writes), each with query starts of its own, since the captures rewrite the
        shared ones shape by shape."""
        passes = []
        for t, b in shapes:
            starts = torch.full((b + 1,), t, dtype=torch.int32, device=self.device)
            starts[0] = 0
            meta = dataclasses.replace(self.meta(t, b), query_start_loc=starts)
            passes.append((meta, self.input_ids[:t], self.positions[:t]))
        return passes

    def shape_of(self, inputs: StepInputs) -> tuple[int, int] | None:
        """The padded shape a step replays at; None for decode steps and steps too large."""
        meta = inputs.meta
        if meta.decode_only:
            return None
        b, width = meta.block_tables.shape
        return self.graph_shape(inputs.input_ids.shape[0], b, width)

    def can_run(self, inputs: StepInputs) -> bool:
        return self.shape_of(inputs) is not None

    def stage(self, inputs: StepInputs, t: int, b: int) -> None:
        """Copy the step into the static buffers, padded to (t, b)."""
        meta = inputs.meta
        n = inputs.input_ids.shape[0]
        seqs, width = meta.block_tables.shape
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.input_ids[n:t].zero_()
        self.positions[n:t].zero_()
        self.slot_mapping[n:t].fill_(-1)
        self.query_start_loc[: seqs + 1].copy_(meta.query_start_loc)
        self.query_start_loc[seqs + 1 : b + 1].fill_(t)  # the padding sequence ends at t
        self.seq_lens[:seqs].copy_(meta.seq_lens)
        self.seq_lens[seqs:b].zero_()
        self.block_tables[:seqs, :width].copy_(meta.block_tables)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Replay the graph of the step's padded shape (`shape_of` is not None)."""
        shape = self.shape_of(inputs)
        assert shape is not None
        self.stage(inputs, *shape)
        self.graphs[shape].replay()
        self.replays += 1
        return self.outputs[shape][: inputs.input_ids.shape[0]]
