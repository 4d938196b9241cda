"""Runs one scheduled step on the device: flattens the batch, moves KV blocks, runs the
model and the sampler. It owns the KV cache tensors (GPU pool and CPU swap pool; with a draft
model, the draft's half of each, moved with the target's).

The flattened step is `input_ids[T]`, `positions[T]`, `slot_mapping[T]` (-1 = padding),
`query_start_loc[B+1]`, `seq_lens[B]` and `block_tables[B, max_blocks]`, packed into one
buffer by `asyncengine.step_buffer`; logits are computed only for requests whose chunk
reaches their last known token. A decode-only step's `DecodePlan` (split-KV count, rotary
fused or not) is decided here, once, and carried in the attention metadata.

`launch()` enqueues a step and returns at once with an `InflightStep`; its sampled ids reach
the host when `result()` is called. With asynchronous scheduling the engine launches step
N+1 before resolving step N: a request whose token from step N is still on the device gets
it as input straight from step N's sampled-id tensor, so the GPU never waits for the host.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from asyncengine.cuda_graphs import STAGE_MAX_ROWS
from asyncengine.host_staging import PinnedStaging
from asyncengine.kv_calibration import KVScales, calibrate_kv_scales, set_kv_scales
from asyncengine.prelaunch import CudaStreamGate, GateUnavailable, GraphPrelaunch
from asyncengine.prompt_logprobs import (
    PromptLogprobPlan,
    ScoredRows,
    chunk_rows,
    lm_head_chunks,
    score_rows,
    wants_prompt_logprobs,
)
from asyncengine.request import Request
from asyncengine.sampler import Sampler, SamplerOutput, SamplingMetadata, host_to_device
from asyncengine.scheduler import SchedulerOutput
from asyncengine.step_buffer import StepHeader, pack, unpack
from asyncengine.structured_outputs.masks import GrammarMasker
from asyncengine_kernels.kv_cache_write import as_bytes
from asyncengine_kernels.paged_attention import DecodePlan, decode_plan
from models.config import ModelConfig
from models.forward_context import AttentionMetadata, set_forward_context
from models.linear_tuning import describe_matmul_plans, tune_cpu_linears, tune_gpu_linears

if TYPE_CHECKING:
    from asyncengine.cuda_graphs import DecodeGraphs, PrefillGraphs
    from asyncengine.spec_decode.verify import SpecVerdict

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_requests: list[Request]
    header: StepHeader
    buffer: torch.Tensor  # the packed step on the device; the tensors above are views of it
    prompt_rows: torch.Tensor  # rows scored for prompt logprobs, and their target tokens
    prompt_targets: torch.Tensor
    prompt_plan: PromptLogprobPlan | None = None  # rank 0's host side of those rows
    prompt_hidden: torch.Tensor | None = None  # their hidden states, set by `run_model`
    # The padded rows of a decode step staged straight into the decode graphs' static
    # inputs (`DecodeGraphs.stage_image`; the tensors above are views of them); 0: not.
    staged_rows: int = 0
    # Its graph was enqueued before the step was known and has been given it
    # (`prelaunch.GraphPrelaunch.fire`): `DecodeGraphs.run` must not replay it again.
    prelaunched: bool = False


def token_layout(
    block_tables: Sequence[Sequence[int]], starts: np.ndarray, lens: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Where a step's tokens sit: `lens[r]` tokens of sequence r from position `starts[r]`.
    Returns query_start_loc, seq_lens, the block tables padded to the widest, each token's
    sequence, its position and its cache slot."""
    b = len(lens)
    qsl = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(lens, out=qsl[1:])
    tables = np.zeros((b, max(len(t) for t in block_tables)), dtype=np.int64)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = table
    # Token i of sequence r sits at position starts[r] + (i - qsl[r]).
    owner = np.repeat(np.arange(b), lens)
    positions = np.arange(int(qsl[-1]), dtype=np.int64) - qsl[owner] + starts[owner]
    slots = tables[owner, positions // block_size] * block_size + positions % block_size
    return qsl, starts + lens, tables, owner, positions, slots


def one_row_per_token(
    tables: np.ndarray, owner: np.ndarray, positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A step's tokens (as `token_layout` placed them) as decode rows, one a token (batch
    expansion): row i attends to its sequence up to and with its own position. Returns
    query_start_loc, the query lengths (all 1), seq_lens and the rows' block tables. Every
    row's K/V must be in the cache before any row attends: no fused rotary/write."""
    t = len(positions)
    return np.arange(t + 1, dtype=np.int64), np.ones(t, np.int64), positions + 1, tables[owner]


def decode_rows(
    block_tables: Sequence[Sequence[int]], starts: Sequence[int], lens: Sequence[int],
    block_size: int,
) -> tuple[list[int], list[int], list[int], list[Sequence[int]]]:  # fmt: skip
    """`token_layout` and `one_row_per_token` in plain Python, for a step of a few tokens: each
    token of sequence r (`lens[r]` from position `starts[r]`) as a decode row. Returns the
    rows' positions, cache slots, context lengths (up to and with the row's own token) and
    block tables (the sequence's own object, shared by its rows). At a few rows numpy's cost
    per call is most of the layout's, on the path from a verify step's verdict to the next
    step."""
    positions: list[int] = []
    slots: list[int] = []
    tables: list[Sequence[int]] = []
    for table, start, n in zip(block_tables, starts, lens, strict=True):
        for pos in range(start, start + n):
            positions.append(pos)
            block, offset = divmod(pos, block_size)
            slots.append(table[block] * block_size + offset)
            tables.append(table)
    return positions, slots, [p + 1 for p in positions], tables


def staged_step_inputs(
    graphs: DecodeGraphs, staging: PinnedStaging, padded: int, header: StepHeader,
    input_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
    seq_lens: Sequence[int], tables: np.ndarray | Sequence[Sequence[int]],
    sampling: list[Request], prelaunch: GraphPrelaunch | None = None,
) -> StepInputs:  # fmt: skip
    """A small decode step (every row's logits wanted, no fills) written straight into the
    decode graphs' static inputs with one copy (`DecodeGraphs.stageable` gave `padded`): the
    step's tensors are views of them, and `DecodeGraphs.run` only replays. Where `prelaunch`
    holds this graph already enqueued, the image goes to it instead and nothing is replayed."""
    b = len(input_ids)
    image = graphs.stage_image(padded, input_ids, positions, slots, seq_lens, tables)
    prelaunched = prelaunch is not None and prelaunch.takes(padded, header.decode_plan)
    if prelaunched:
        prelaunch.fire(image)  # type: ignore[union-attr]
    else:
        if prelaunch is not None:
            prelaunch.release()  # it reads the same static inputs: it goes first
        staging.to_device(image, graphs.static[: image.size])
    ids, pos, slot_view, qsl, lens, table_view, rows = graphs.staged_views(b)
    meta = AttentionMetadata(
        slot_mapping=slot_view, query_start_loc=qsl, seq_lens=lens, block_tables=table_view,
        max_query_len=1, decode_only=True, max_seq_len=header.max_seq_len,
        decode_plan=header.decode_plan,
    )  # fmt: skip
    return StepInputs(
        input_ids=ids, positions=pos, meta=meta, logits_indices=rows,
        sampling_requests=sampling, header=header, buffer=graphs.static,
        prompt_rows=rows[:0], prompt_targets=rows[:0], staged_rows=padded,
        prelaunched=prelaunched,
    )  # fmt: skip


def stage_decode_rows(
    graphs: DecodeGraphs, staging: PinnedStaging, block_size: int,
    block_tables: Sequence[Sequence[int]], starts: Sequence[int], lens: Sequence[int],
    input_ids: Sequence[int], plan_for: Callable[[int, int, int, bool], DecodePlan],
    sampling: list[Request], num_logits: int, moves: tuple[int, int, int] = (0, 0, 0),
    prelaunch: GraphPrelaunch | None = None,
) -> StepInputs | None:  # fmt: skip
    """A decode-only step of a few tokens (`lens[r]` of sequence r from `starts[r]`) laid
    out as one decode row a token (`decode_rows`) and staged whole into the graphs' inputs;
    None where no captured graph takes it whole. `plan_for(rows, table width, longest
    context, expanded)` plans its attention (expanded: some sequence has several rows, which
    attend to each other's K/V); `moves` are the step's block-move counts (swap out, swap
    in, copy) for its header. A graph `prelaunch` holds takes the step where it has room
    for its rows and the plan of that many rows with unfused rotary is its own: fewer
    drafts than the last step then pad further, and a step without drafts runs in the
    verify graph (slower than in its own, much faster than the lost bet's forward and its
    own after it)."""
    positions, slots, seq_lens, row_tables = decode_rows(block_tables, starts, lens,
                                                         block_size)  # fmt: skip
    t = len(positions)
    w, max_len = max(len(table) for table in block_tables), max(seq_lens)
    expanded = t > len(block_tables)
    plan = plan_for(t, w, max_len, expanded)
    padded = graphs.stageable(t, w, plan)
    armed = prelaunch.armed if prelaunch is not None else None
    if armed is not None and armed != (padded, plan) and t <= armed[0]:
        rows, armed_plan = armed
        if (plan_for(rows, w, max_len, True) == armed_plan
                and graphs.stageable(rows, w, armed_plan) == rows):  # fmt: skip
            plan, padded = armed_plan, rows
    if padded is None:
        return None
    header = StepHeader(
        num_tokens=t, num_seqs=t, table_width=w, num_logits=num_logits, max_query_len=1,
        max_seq_len=max_len, decode_segments=plan.segments, fuse_rotary=plan.fuse_rotary,
        num_swap_out=moves[0], num_swap_in=moves[1], num_copy=moves[2],
    )  # fmt: skip
    return staged_step_inputs(graphs, staging, padded, header, input_ids, positions, slots,
                              seq_lens, row_tables, sampling, prelaunch)  # fmt: skip


def step_inputs(
    header: StepHeader,
    buffer: torch.Tensor,
    parts: dict[str, torch.Tensor],
    sampling_requests: list[Request],
) -> StepInputs:
    """The step from its packed device buffer and the buffer's fields (`step_buffer.unpack`)."""
    b, w = header.num_seqs, header.table_width
    meta = AttentionMetadata(
        slot_mapping=parts["slot_mapping"],
        query_start_loc=parts["query_start_loc"],
        seq_lens=parts["seq_lens"],
        block_tables=parts["block_tables"].view(b, w),
        max_query_len=header.max_query_len,
        decode_only=header.decode_plan is not None,
        max_seq_len=header.max_seq_len,
        decode_plan=header.decode_plan,
    )
    return StepInputs(
        input_ids=parts["input_ids"],
        positions=parts["positions"],
        meta=meta,
        logits_indices=parts["logits_indices"],
        sampling_requests=sampling_requests,
        header=header,
        buffer=buffer,
        prompt_rows=parts["prompt_rows"],
        prompt_targets=parts["prompt_targets"],
    )


@dataclass
class StepResult:
    """Per sampled request (in `sampling_requests` order): the token and optional logprobs."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    # Prompt logprobs scored by the step (host tensors) and the rows' plan, when any.
    prompt_logprobs: tuple[ScoredRows, PromptLogprobPlan] | None = None
    # A verify step (speculative decoding): a request's kept tokens are consecutive entries
    # above, and its verdict (`spec_decode.verify.SpecVerdict`) says how many drafts it kept.
    spec: list[SpecVerdict] | None = None


class InflightStep:
    """A launched step. Sampled ids stay on the device (for the next step's inputs) and are
    copied to pinned host memory behind an event; `result()` waits for that copy only."""

    def __init__(
        self,
        requests: list[Request],
        token_ids: torch.Tensor | None,
        logprobs: tuple[torch.Tensor, torch.Tensor] | None,
        scheduled: list[Request],
        prompt_logprobs: tuple[ScoredRows, PromptLogprobPlan] | None = None,
    ) -> None:
        self.requests = requests
        self.scheduled = scheduled
        self.token_ids = token_ids
        self.rows = {id(r): i for i, r in enumerate(requests)}
        self._host_ids = token_ids
        self._host_logprobs = logprobs
        self._prompt_logprobs = prompt_logprobs
        self._done: torch.cuda.Event | None = None
        self._result: StepResult | None = None
        # Wraps the wait in `result()`: tensor parallelism turns a failed collective of this
        # step into an error naming the dead worker there.
        self.guard: Callable[[], AbstractContextManager[object]] = nullcontext
        on_gpu = token_ids is not None and token_ids.is_cuda
        if prompt_logprobs is not None and prompt_logprobs[0].logprobs.is_cuda:
            on_gpu = True
            scored, plan = prompt_logprobs
            self._prompt_logprobs = (scored.to("cpu", non_blocking=True), plan)
        if on_gpu:
            if token_ids is not None:
                self._host_ids = token_ids.to("cpu", non_blocking=True)
            if logprobs is not None:
                ids, lps = logprobs
                self._host_logprobs = (
                    ids.to("cpu", non_blocking=True),
                    lps.to("cpu", non_blocking=True),
                )
            self._done = torch.cuda.Event()
            self._done.record()

    def wait(self) -> None:
        """Until the step's copies to the host have landed."""
        if self._done is not None:
            with self.guard():
                self._done.synchronize()

    def result(self) -> StepResult:
        if self._result is not None:
            return self._result
        self.wait()
        if self._host_ids is None:
            self._result = StepResult([], [], None, self._prompt_logprobs)
            return self._result
        token_ids = self._host_ids.tolist()
        logprobs = None
        if self._host_logprobs is not None:
            logprobs = _logprob_dicts(*self._host_logprobs, self.requests)
        self._result = StepResult(self.requests, token_ids, logprobs, self._prompt_logprobs)
        return self._result


def _logprob_dicts(
    ids_t: torch.Tensor, lps_t: torch.Tensor, reqs: list[Request]
) -> list[dict[int, float]]:
    ids, lps = ids_t.tolist(), lps_t.tolist()
    result = []
    for req, row_ids, row_lps in zip(reqs, ids, lps, strict=True):
        n = req.params.logprobs
        if n is None:
            result.append({})
            continue
        entry = {row_ids[0]: row_lps[0]}
        for tok, lp in zip(row_ids[1 : n + 1], row_lps[1 : n + 1], strict=True):
            if lp != float("-inf"):  # a token a grammar forbids is no alternative
                entry.setdefault(tok, lp)
        result.append(entry)
    return result


_NONE = np.empty(0, np.int64)  # a step's prompt-logprob rows when nobody asks for them


def _in_flight(
    reqs: Sequence[Request], prev: InflightStep | None
) -> tuple[list[bool], torch.Tensor] | None:
    """Which of `reqs` have their last output token in `prev` (launched, not yet resolved),
    and those ids on the device (row order; 0 where none): what penalties and the min_tokens
    ban take from the device instead of waiting for `prev`."""
    if prev is None or prev.token_ids is None:
        return None
    rows = [prev.rows.get(id(r), -1) if r.num_pending_tokens else -1 for r in reqs]
    if all(row < 0 for row in rows):
        return None
    index = host_to_device([max(row, 0) for row in rows], torch.int64, prev.token_ids.device)
    return [row >= 0 for row in rows], prev.token_ids.index_select(0, index)


def _plain_greedy(req: Request) -> bool:
    p = req.params
    return p.is_greedy and p.logprobs is None and not req.sampling_needs_history


class KVCache:
    """Per-layer K and V tensors laid out [num_blocks, block_size, num_kv_heads, head_dim], in
    the model dtype or in e4m3 (`kv_cache_dtype="fp8"`: 1 byte per element, the scales live
    on the attention layers)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        pin_memory: bool = False,
    ) -> None:
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        # One allocation: cheap to size and to zero. Zeroed so unwritten slots never hold NaN.
        self.data = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        self.num_blocks = num_blocks

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, 0], self.data[i, 1]


def copy_blocks(src: KVCache, dst: KVCache, pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks (all layers, K and V) from src[i] to dst[j] for (i, j) in pairs."""
    if not pairs:
        return
    if src.data.dtype != dst.data.dtype:
        raise ValueError(f"cannot copy {src.data.dtype} KV blocks into a {dst.data.dtype} cache")
    src_ids = torch.tensor([p[0] for p in pairs], device=src.data.device)
    dst_ids = torch.tensor([p[1] for p in pairs], device=dst.data.device)
    moved = as_bytes(src.data).index_select(2, src_ids)
    # To the GPU the copy may run behind the queue; to the CPU it must have landed before the
    # CPU-side index_copy_ reads it, so that direction blocks.
    moved = moved.to(dst.data.device, non_blocking=dst.data.device.type == "cuda")
    as_bytes(dst.data).index_copy_(2, dst_ids, moved)


class ModelRunner:
    # The decode plan fuses rotary into attention wherever decode splits KV; False keeps the
    # separate rotary kernel everywhere (the GPU tests compare the two paths).
    fuse_decode_rotary = True
    # Small decode steps go straight into the decode graphs' static inputs
    # (`DecodeGraphs.stage_image`); tensor-parallel ranks need the packed buffer instead.
    stage_small_steps = True
    # Decode graphs of up to `STAGE_MAX_ROWS` padded rows (and the draft model's) split after
    # this many layers (`cuda_graphs.SplitGraph`: a step the host waited for starts on a
    # short launch); 0 keeps every graph whole. On the H100 (2026-12-06) two head layers
    # were within call-to-call noise for verify steps, 2 % slower for a draft's proposals at
    # batch 1 and 1 % faster at 8; the benchmarks set it (`--graph-head-layers`) to compare
    # on the H200.
    graph_head_layers = 0
    # Enqueue the next verify step's graph behind a gate before the verdict it waits for
    # (`asyncengine.prelaunch`), where the engine bets that the next step is alike. On the
    # H100 (2026-12-07, one engine, same call) a k = 4 verify step took 5.697 ms with it
    # against 5.752, and latency at acceptance 0.7 was 2.096 ms per token against 2.136;
    # the benchmarks switch it (`--prelaunch 0 1`).
    prelaunch_verify = True

    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        eos_token_ids: set[int],
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.cfg = model_config
        self.device = device
        self.dtype = dtype
        # The KV cache's element type: the model dtype, or e4m3 (`EngineArgs.kv_cache_dtype`).
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()
        self.grammar_masker = GrammarMasker(model_config.vocab_size, device)
        self.kv_cache: KVCache | None = None
        self.cpu_cache: KVCache | None = None
        # A draft model's K/V (speculative decoding) lives in the same blocks: its own cache
        # of the same block count, sized by `(num_layers, num_kv_heads, head_dim)`.
        self.draft_kv_layout: tuple[int, int, int] | None = None
        self.draft_kv_cache: KVCache | None = None
        # Its half of the CPU swap pool: a swapped block takes the draft's K/V along.
        self.draft_cpu_cache: KVCache | None = None
        attn = model.attention_layers()  # type: ignore[operator]
        self.num_kv_heads = attn[0].num_kv_heads
        self.head_dim = attn[0].head_dim
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.last_step_decode_only = False
        # Two pinned staging buffers used in turn: step N+1 is prepared while step N's copy
        # may still be queued behind step N-1.
        self.staging = PinnedStaging(device, turns=2)
        self._linears_tuned = False  # GPU plans are made once: before the memory profile
        self.prelaunch: GraphPrelaunch | None = None
        # The graph the last step replayed, where it was a staged verify step: what
        # `prelaunch_next` enqueues again.
        self._last_verify_graph: tuple[int, DecodePlan] | None = None

    # ------------------------------------------------------------ KV memory
    def block_bytes(self) -> int:
        """Bytes of one KV block: the target's K/V and, with a draft model, the draft's."""
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        layers = self.cfg.num_hidden_layers
        size = 2 * layers * self.block_size * self.num_kv_heads * self.head_dim * elem
        if self.draft_kv_layout is not None:
            draft_layers, draft_heads, draft_dim = self.draft_kv_layout
            draft_elem = torch.empty((), dtype=self.dtype).element_size()
            size += 2 * draft_layers * self.block_size * draft_heads * draft_dim * draft_elem
        return size

    @torch.inference_mode()
    def profile_num_blocks(
        self, gpu_memory_utilization: float, max_num_batched_tokens: int, cpu_cache_gib: float
    ) -> int:
        """How many KV blocks fit after weights and the peak activations of a full step."""
        if self.device.type != "cuda":
            return max(int(cpu_cache_gib * 2**30) // self.block_bytes(), 1)
        # The plans decide which repacked copies of quantized weights stay on the device, so
        # the weights' memory is known only after tuning.
        self._tune_gpu_linears()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run(max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        _, total = torch.cuda.mem_get_info(self.device)
        # Headroom for CUDA graphs, the sampler's vocab-sized buffers and allocator slack.
        reserve = 512 * 2**20
        available = int(total * gpu_memory_utilization) - peak - reserve
        num_blocks = available // self.block_bytes()
        if num_blocks < 1:
            raise RuntimeError(
                f"no memory left for the KV cache: peak use {peak / 2**30:.1f} GiB of "
                f"{total / 2**30:.1f} GiB at gpu_memory_utilization={gpu_memory_utilization}"
            )
        return num_blocks

    def _profile_run(self, num_tokens: int) -> None:
        """A forward pass over `num_tokens` tokens with no cache writes, to measure memory."""
        num_tokens = max(num_tokens, 1)
        dummy_k = torch.zeros(
            (1, self.block_size, self.num_kv_heads, self.head_dim),
            dtype=self.kv_cache_dtype,
            device=self.device,
        )
        for layer in self.model.attention_layers():  # type: ignore[operator]
            layer.k_cache, layer.v_cache = dummy_k, dummy_k
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([0], dtype=torch.int32, device=self.device),
            block_tables=torch.zeros((1, 1), dtype=torch.int32, device=self.device),
            max_query_len=num_tokens,
        )
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        with set_forward_context(meta):
            hidden = self.model(ids, ids)
        self.model.compute_logits(hidden[-min(num_tokens, 256) :])  # type: ignore[operator]

    def calibrate_kv_scales(self, token_ids: list[int]) -> KVScales:
        """Set every layer's FP8 KV scales, per KV head of this rank, from one pass over
        `token_ids` (`asyncengine.kv_calibration`); returns them on the host. The pass writes
        a scratch cache of its own: the KV pool and the prefix cache never see it."""
        scales = calibrate_kv_scales(
            self.model, token_ids, dtype=self.dtype, device=self.device,
            block_size=self.block_size,
        )  # fmt: skip
        set_kv_scales(self.model, scales)
        return [(k.cpu(), v.cpu()) for k, v in scales]

    def allocate_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        layers = self.cfg.num_hidden_layers
        args = (self.block_size, self.num_kv_heads, self.head_dim, self.kv_cache_dtype)
        self.kv_cache = KVCache(layers, num_blocks, *args, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):  # type: ignore[operator]
            attn.k_cache, attn.v_cache = self.kv_cache.layer(i)
        if self.draft_kv_layout is not None:
            # In the model dtype even under an FP8 target cache: the draft has no KV scales.
            self.draft_kv_cache = KVCache(
                self.draft_kv_layout[0], num_blocks, self.block_size,
                *self.draft_kv_layout[1:], self.dtype, device=self.device,
            )  # fmt: skip
        if num_cpu_blocks:
            pin = self.device.type == "cuda"
            cpu = torch.device("cpu")
            self.cpu_cache = KVCache(layers, num_cpu_blocks, *args, device=cpu, pin_memory=pin)
            if self.draft_kv_layout is not None:
                self.draft_cpu_cache = KVCache(
                    self.draft_kv_layout[0], num_cpu_blocks, self.block_size,
                    *self.draft_kv_layout[1:], self.dtype, device=cpu, pin_memory=pin,
                )  # fmt: skip

    def prepare_for_serving(
        self, *, enforce_eager: bool, max_num_seqs: int, max_blocks_per_seq: int,
        verify_rows: int = 0,
    ) -> None:  # fmt: skip
        """Set-up after the KV cache exists: the linear layers' plans (on the GPU already made
        by the memory profile, unless the pool was sized by hand) and CUDA graphs for decode
        and small prefill steps on the GPU (and, with speculative decoding, for verify steps
        of up to `verify_rows` rows)."""
        self.set_prelaunch(False)  # its graph is about to go
        self.graphs = None
        self.prefill_graphs = None
        if self.device.type == "cuda":
            self._tune_gpu_linears()
        else:
            for (n, k), per_rows in tune_cpu_linears(self.model).items():
                names = " / ".join(next(iter(per_rows.values())))
                at_rows = "; ".join(
                    f"{rows} rows " + " / ".join(f"{us:.0f}" for us in times.values())
                    for rows, times in per_rows.items()
                )  # fmt: skip
                logger.info("CPU linear %dx%d, us per layer (%s): %s", n, k, names, at_rows)
            for line in describe_matmul_plans(self.model):
                logger.info("matmul plan %s", line)
        if self.device.type == "cuda" and not enforce_eager:
            from asyncengine.cuda_graphs import DecodeGraphs, PrefillGraphs

            self.graphs = DecodeGraphs(
                self.model, self.device, max_num_seqs, max_blocks_per_seq,
                fuse_rotary=self.fuse_decode_rotary, verify_rows=verify_rows,
                head_layers=self.graph_head_layers,
            )  # fmt: skip
            pool = self.graphs.capture()
            self.prefill_graphs = PrefillGraphs(self.model, self.device, max_blocks_per_seq)
            self.prefill_graphs.capture(pool)
            if self.prelaunch_verify and verify_rows:
                self.set_prelaunch(True)

    def set_prelaunch(self, on: bool) -> bool:
        """Turn the verify graphs' prelaunch on or off; whether it is on. On needs decode
        graphs and a driver that lets a stream wait on host memory."""
        self.release_prelaunch()
        self.prelaunch = None
        if on and self.graphs is not None and self.device.type == "cuda":
            try:
                self.prelaunch = GraphPrelaunch(self.graphs, CudaStreamGate(self.device))
            except GateUnavailable as e:
                logger.warning("verify steps are not prelaunched: %s", e)
        return self.prelaunch is not None

    def _tune_gpu_linears(self) -> None:
        """Plan every linear layer on the GPU, once (`tune_gpu_linears`)."""
        if self._linears_tuned:
            return
        tune_gpu_linears(self.model)
        for line in describe_matmul_plans(self.model):
            logger.info("matmul plan %s", line)
        self._linears_tuned = True

    def shutdown(self) -> None:
        """Let go of everything the runner holds on the device: CUDA graphs (and their memory
        pool), the KV pools, the staging buffers and the weights. No steps after this."""
        self.set_prelaunch(False)
        self.graphs = self.prefill_graphs = None
        self.kv_cache = self.cpu_cache = self.draft_kv_cache = self.draft_cpu_cache = None
        self.staging.release()
        model, self.model = self.model, None  # type: ignore[assignment]
        if model is not None:
            for attn in model.attention_layers():  # type: ignore[operator]
                attn.k_cache = attn.v_cache = None

    # --------------------------------------------------------------- a step
    def prepare_inputs(
        self, sched: SchedulerOutput, prev: InflightStep | None = None
    ) -> StepInputs:
        """Flatten the scheduled requests into the step's tensors (one host-to-device copy).

        A request whose last token is still in flight in `prev` takes it on the device.
        """
        small = self._small_decode_inputs(sched)
        if small is not None:
            return small
        # Nothing below takes a prelaunched graph, and it must run before this step's copies.
        self.release_prelaunch()
        scheduled = sched.scheduled
        b = len(scheduled)
        lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=b)
        starts = np.fromiter(
            (s.request.num_computed_tokens for s in scheduled), dtype=np.int64, count=b
        )
        qsl, seq_lens, tables, owner, positions, slots = token_layout(
            [s.request.block_table for s in scheduled], starts, lens, self.block_size
        )
        t, w = int(qsl[-1]), tables.shape[1]
        input_ids = np.empty(t, dtype=np.int64)
        sampling: list[Request] = []
        logits_idx: list[int] = []
        fill_dst: list[int] = []
        fill_src: list[int] = []
        prompt_plan: PromptLogprobPlan | None = None
        for i, s in enumerate(scheduled):
            req = s.request
            lo, n, start = int(qsl[i]), int(lens[i]), int(starts[i])
            if start >= len(req.all_token_ids):  # sampled by `prev`, id not on the host yet
                if prev is None or n != 1 or id(req) not in prev.rows:
                    raise RuntimeError(f"request {req.request_id} has no token to compute")
                input_ids[lo] = 0
                fill_dst.append(lo)
                fill_src.append(prev.rows[id(req)])
            elif s.num_spec_tokens:  # the last known token, then the drafts to verify
                input_ids[lo : lo + n] = req.all_token_ids[start:] + req.spec_token_ids[
                    : s.num_spec_tokens
                ]
            elif n == 1:
                input_ids[lo] = req.all_token_ids[start]
            else:
                input_ids[lo : lo + n] = req.all_token_ids[start : start + n]
            if s.needs_logits:
                logits_idx.extend(range(lo + n - 1 - s.num_spec_tokens, lo + n))
                sampling.append(req)
            if req.params.prompt_logprobs is not None and wants_prompt_logprobs(req):
                prompt_plan = prompt_plan or PromptLogprobPlan()
                prompt_plan.add(req, lo, start, n)
        fuse_rotary = None
        if t > b and all(s.num_new_tokens == 1 + s.num_spec_tokens for s in scheduled):
            # A verify step with no prompt in it runs as a decode step of one row per token
            # (batch expansion): row j of a request attends to its context and the drafts
            # before it, so it replays the decode graphs and their attention kernel. Every
            # row's K/V must be in the cache before any row attends: no fused rotary/write.
            qsl, lens, seq_lens, tables = one_row_per_token(tables, owner, positions)
            b, fuse_rotary = t, False
        max_q, max_len = int(lens.max()), int(seq_lens.max())
        plan = self.decode_plan(b, w, max_len, fuse_rotary) if max_q == 1 else None
        header = StepHeader(
            num_tokens=t,
            num_seqs=b,
            table_width=w,
            num_logits=len(logits_idx),
            num_fills=len(fill_dst),
            max_query_len=max_q,
            max_seq_len=max_len,
            decode_segments=0 if plan is None else plan.segments,
            fuse_rotary=plan is not None and plan.fuse_rotary,
            num_swap_out=len(sched.blocks_to_swap_out),
            num_swap_in=len(sched.blocks_to_swap_in),
            num_copy=len(sched.blocks_to_copy),
            num_prompt_rows=len(prompt_plan.rows) if prompt_plan is not None else 0,
        )
        if (plan is not None and self.stage_small_steps and self.graphs is not None
                and not fill_dst and prompt_plan is None and len(logits_idx) == t):  # fmt: skip
            padded = self.graphs.stageable(b, w, plan)
            if padded is not None:
                return staged_step_inputs(self.graphs, self.staging, padded, header, input_ids,
                                          positions, slots, seq_lens, tables, sampling)  # fmt: skip
        arrays = {
            "input_ids": input_ids,
            "positions": positions,
            "slot_mapping": slots,
            "query_start_loc": qsl,
            "seq_lens": seq_lens,
            "block_tables": tables,
            "logits_indices": np.asarray(logits_idx, np.int64),
            "fills": np.asarray(fill_dst + fill_src, np.int64),
            "prompt_rows": np.asarray(prompt_plan.rows, np.int64) if prompt_plan else _NONE,
            "prompt_targets": np.asarray(prompt_plan.targets, np.int64) if prompt_plan else _NONE,
        }
        buffer = self.staging.to_device(pack(header, arrays))
        parts = unpack(header, buffer)
        if fill_dst:
            assert prev is not None and prev.token_ids is not None
            fills, nf = parts["fills"], len(fill_dst)
            parts["input_ids"][fills[:nf]] = prev.token_ids[fills[nf:]]
        inputs = step_inputs(header, buffer, parts, sampling)
        inputs.prompt_plan = prompt_plan
        return inputs

    def _small_decode_inputs(self, sched: SchedulerOutput) -> StepInputs | None:
        """A decode-only step of a few rows whose tokens are all on the host and all sampled
        (a batch-1 stream resolved before the next step, a verify step), laid out in plain
        Python (`decode_rows`) and staged straight into the decode graphs' inputs; None for
        any other step, which `prepare_inputs` lays out in numpy. A verify step runs as a
        decode step of one row per token, as there."""
        graphs = self.graphs
        scheduled = sched.scheduled
        if graphs is None or not self.stage_small_steps:
            return None
        t = 0
        for s in scheduled:
            req = s.request
            t += s.num_new_tokens
            # Its last known token and its drafts, every row sampled, nothing in flight.
            if (t > STAGE_MAX_ROWS or not s.needs_logits
                    or s.num_new_tokens != 1 + s.num_spec_tokens
                    or req.num_computed_tokens != len(req.all_token_ids) - 1
                    or (req.params.prompt_logprobs is not None
                        and wants_prompt_logprobs(req))):  # fmt: skip
                return None
        reqs = [s.request for s in scheduled]
        ids: list[int] = []
        for s, req in zip(scheduled, reqs, strict=True):
            ids.append(req.all_token_ids[-1])
            ids += req.spec_token_ids[: s.num_spec_tokens]

        def plan_for(rows: int, width: int, longest: int, expanded: bool) -> DecodePlan:
            # Rows of one request attend to each other's K/V: no fused rotary and K/V write.
            return self.decode_plan(rows, width, longest, False if expanded else None)

        moves = (len(sched.blocks_to_swap_out), len(sched.blocks_to_swap_in),
                 len(sched.blocks_to_copy))  # fmt: skip
        return stage_decode_rows(
            graphs, self.staging, self.block_size, [r.block_table for r in reqs],
            [r.num_computed_tokens for r in reqs], [s.num_new_tokens for s in scheduled], ids,
            plan_for, reqs, t, moves, self.prelaunch,
        )  # fmt: skip

    def decode_plan(self, num_seqs: int, table_width: int, max_seq_len: int,
                    fuse_rotary: bool | None = None) -> DecodePlan:  # fmt: skip
        """The plan of a decode-only step, for the batch its kernels will see: a step that
        replays a CUDA graph runs at the graph's padded size. `fuse_rotary=False`: never
        fold rotary and the K/V write into attention (a batch-expanded verify step)."""
        if self.graphs is not None:
            num_seqs = self.graphs.graph_size(num_seqs, table_width) or num_seqs
        return decode_plan(
            num_seqs, self.num_kv_heads, self.device, max_seq_len,
            fuse_rotary=self.fuse_decode_rotary if fuse_rotary is None else fuse_rotary,
        )  # fmt: skip

    def apply_block_moves(self, sched: SchedulerOutput) -> None:
        """The step's swaps and copy-on-write copies, on the target's cache and on the
        draft's (a block holds both: whatever moves a block moves its draft K/V too)."""
        assert self.kv_cache is not None
        pools = [(self.kv_cache, self.cpu_cache)]
        if self.draft_kv_cache is not None:
            pools.append((self.draft_kv_cache, self.draft_cpu_cache))
        for gpu, cpu in pools:
            if sched.blocks_to_swap_out:
                assert cpu is not None
                copy_blocks(gpu, cpu, sched.blocks_to_swap_out)
            if sched.blocks_to_swap_in:
                assert cpu is not None
                copy_blocks(cpu, gpu, sched.blocks_to_swap_in)
            copy_blocks(gpu, gpu, sched.blocks_to_copy)

    def move_blocks(self, sched: SchedulerOutput) -> None:
        """The block moves of a step that runs no request (the scheduler swapped out every
        sequence it had room for none of): a swapped-out request's CPU copy must exist
        before its GPU blocks are given to another."""
        self.apply_block_moves(sched)

    def run_model(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states of the rows that need logits (and, in `inputs.prompt_hidden`, of
        the rows scored for prompt logprobs)."""
        if inputs.staged_rows:  # every row is sampled: no gather
            assert self.graphs is not None
            return self.graphs.run(inputs)
        if self.graphs is not None and self.graphs.can_run(inputs):
            hidden = self.graphs.run(inputs)
        elif self.prefill_graphs is not None and self.prefill_graphs.can_run(inputs):
            hidden = self.prefill_graphs.run(inputs)
        else:
            with set_forward_context(inputs.meta):
                hidden = self.model(inputs.input_ids, inputs.positions)
        if inputs.header.num_prompt_rows:
            inputs.prompt_hidden = hidden.index_select(0, inputs.prompt_rows)
        return hidden.index_select(0, inputs.logits_indices)

    def prompt_lm_head(self, inputs: StepInputs) -> None:
        """A tensor-parallel worker's share of scoring prompt rows: the LM head's gathers,
        chunk by chunk as rank 0 runs them (`score_prompt_rows`)."""
        assert inputs.prompt_hidden is not None
        rows = chunk_rows(self.cfg.vocab_size)
        for _ in lm_head_chunks(self.model.compute_logits, inputs.prompt_hidden, rows):  # type: ignore[arg-type]
            pass

    def score_prompt_rows(self, inputs: StepInputs) -> tuple[ScoredRows, PromptLogprobPlan]:
        """Prompt logprobs of the step's planned rows, on the device."""
        assert inputs.prompt_hidden is not None and inputs.prompt_plan is not None
        scored = score_rows(
            self.model.compute_logits,  # type: ignore[arg-type]
            inputs.prompt_hidden, inputs.prompt_targets, inputs.prompt_plan.max_k,
            chunk_rows(self.cfg.vocab_size),
        )  # fmt: skip
        return scored, inputs.prompt_plan

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, prev: InflightStep | None = None) -> InflightStep:
        """Enqueue the step on the device; nothing here waits for the device. A prelaunched
        graph that this step does not take runs on padding first (`release_prelaunch`)."""
        if sched.has_block_moves:
            self.release_prelaunch()  # the moves land before any graph reads the cache
        try:
            self.apply_block_moves(sched)
            inputs = self.prepare_inputs(sched, prev)
        finally:
            self.release_prelaunch()
        step = self.launch_prepared(inputs, sched, prev)
        verify = inputs.staged_rows and any(s.num_spec_tokens for s in sched.scheduled)
        plan = inputs.meta.decode_plan
        self._last_verify_graph = (inputs.staged_rows, plan) if verify and plan else None
        return step

    @torch.inference_mode()  # the engine calls it between steps; the copy is in place
    def prelaunch_next(self) -> bool:
        """Enqueue the last verify step's graph again, for the next step, behind the gate
        (the engine bets that step is alike: `SpecDecoder.next_step_verifies`). Never with a
        draft model, whose proposals run on the device before the next step."""
        key = self._last_verify_graph
        if self.prelaunch is None or key is None or self.draft_kv_cache is not None:
            return False
        try:
            self.prelaunch.arm(*key)
        except GateUnavailable as e:  # nothing was enqueued: steps go on without it
            logger.warning("verify steps are no longer prelaunched: %s", e)
            self.prelaunch = None
            return False
        return True

    def release_prelaunch(self) -> None:
        """Let a prelaunched graph run on padding (no slot written): before any other work
        is enqueued or waited for. Costs nothing when none is armed (every step calls it)."""
        if self.prelaunch is not None and self.prelaunch.armed is not None:
            with torch.inference_mode():  # the engine may call it between steps
                self.prelaunch.release()

    def launch_prepared(self, inputs: StepInputs, sched: SchedulerOutput,
                        prev: InflightStep | None = None) -> InflightStep:
        """Enqueue the model and the sampler on prepared inputs (block moves applied);
        `prev`, the step still in flight, has the tokens grammar masks start from."""
        self.last_step_decode_only = inputs.meta.decode_only
        reqs = inputs.sampling_requests
        scheduled = [s.request for s in sched.scheduled]
        hidden = self.run_model(inputs)
        # Before the sampling rows' LM head: tensor-parallel workers gather in this order.
        prompt = self.score_prompt_rows(inputs) if inputs.header.num_prompt_rows else None
        if not reqs:
            return InflightStep([], None, None, scheduled, prompt)
        logits = self.model.compute_logits(hidden)  # type: ignore[operator]
        # A verify step gives request i num_spec[i] + 1 consecutive rows.
        num_spec = [s.num_spec_tokens for s in sched.scheduled if s.needs_logits]
        verify = any(num_spec)
        # Structured outputs: forbidden tokens to -inf before any sampling transform.
        logits = self.grammar_masker.apply(logits, reqs, prev, num_spec if verify else None)
        if verify:
            from asyncengine.spec_decode.verify import launch_verify

            return launch_verify(
                self.sampler, logits, reqs, num_spec, scheduled,
                eos_token_ids=self.eos_token_ids, vocab_size=self.cfg.vocab_size,
                prompt_logprobs=prompt,
            )  # fmt: skip
        if all(_plain_greedy(r) for r in reqs):
            # Nothing to filter or penalize: skip building the sampler's per-row tensors.
            return InflightStep(reqs, logits.argmax(dim=-1), None, scheduled, prompt)
        meta = SamplingMetadata.build(
            [r.params for r in reqs],
            [r.prompt_token_ids for r in reqs],
            [r.output_token_ids for r in reqs],
            [r.generator for r in reqs],
            self.eos_token_ids,
            self.cfg.vocab_size,
            self.device,
            in_flight=_in_flight(reqs, prev),
        )
        out: SamplerOutput = self.sampler(logits, meta)
        logprobs = None
        if out.logprob_token_ids is not None and out.logprobs is not None:
            logprobs = (out.logprob_token_ids, out.logprobs)
        return InflightStep(reqs, out.sampled_token_ids, logprobs, scheduled, prompt)
