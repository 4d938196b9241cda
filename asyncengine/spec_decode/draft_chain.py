"""The draft model's one-token steps of a proposal as one CUDA graph.

After the catch-up forward gives each request its first draft, a proposal runs up to k - 1
one-token steps of the draft, each fed the draft the step before made. Replayed a graph a
step, every step costs the host a layout, a staging copy, a graph launch, an LM head and an
argmax, which for a draft of a few hundred MB is likely more than the device spends on the
step (a 160M draft's proposal of four forwards took 2.07 ms on the H200, its weights about
0.07 ms to read). A chain graph captures m steps
together: each step forms its positions, context lengths and cache slots on the device from
the proposal's first positions and draft counts, runs the draft, its LM head and the argmax,
and feeds the next step. The host stages one small image (first positions, counts, block
tables), copies the first drafts in on the device and replays once.

A request with fewer drafts than the chain's length keeps its last position past its count
and writes no cache slot (its extra drafts are dropped, as `DraftModelProposer` drops them);
padding rows have no context and write nothing. Chains are captured per padded batch of up
to `STAGE_MAX_ROWS` rows, chain length (1 to k - 1), decode plan (planned for the chain's
longest final context: a plan serves any shorter context) and form: greedy, or sampling.

A proposal with requests that sample their drafts (`draft_sampling`) replays the sampling
form: each step also forms q, the draft's distribution under each row's temperature and
top-k / top-p / min-p, draws the row's draft from it by the exponential race and keeps q for
verification; greedy rows in it keep the argmax. The race's noise is drawn before the
replay, a step at a time in the order the step-by-step path draws it, a seeded request's
from its proposal's own generator: its drafts are the step-by-step path's, run to run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from asyncengine.cuda_graphs import (
    STAGE_MAX_ROWS,
    aligned_offsets,
    capture_callable,
    capture_sizes,
)
from asyncengine.host_staging import PinnedStaging
from asyncengine.request import Request
from asyncengine.sampler import host_to_device
from asyncengine.spec_decode.draft_sampling import DraftSampling, samples_drafts
from asyncengine.spec_decode.rejection_sampler import filtered_probs
from asyncengine_kernels.paged_attention import DecodePlan, decode_plan, decode_plans
from models.forward_context import AttentionMetadata, set_forward_context

logger = logging.getLogger(__name__)

# The host image's element type of each device field's.
_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
                 torch.bool: np.bool_}  # fmt: skip


class DraftChains:
    """Chain graphs of the draft's one-token steps for batches of up to `max_num_seqs`
    requests (at most `STAGE_MAX_ROWS`) and chains of 1 to `max_steps` steps."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        max_num_seqs: int,
        max_steps: int,
        max_blocks: int,
        block_size: int,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.max_steps = max_steps
        self.sizes = [s for s in capture_sizes(max_num_seqs) if s <= STAGE_MAX_ROWS]
        n = self.sizes[-1] if self.sizes else 0
        self.num_kv_heads: int = model.attention_layers()[0].num_kv_heads  # type: ignore[operator]
        i64, i32 = torch.int64, torch.int32

        def zeros(*shape: int, dtype: torch.dtype = i64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        # What the steps run on (the model reads them through the forward context).
        self.input_ids, self.positions = zeros(n), zeros(n)
        self.slot_mapping = torch.full((n,), -1, dtype=i64, device=device)
        self.seq_lens = zeros(n, dtype=i32)
        self.query_start_loc = torch.arange(n + 1, dtype=i32, device=device)
        # The proposal's inputs, staged in one copy (`_fields`): each row's position of its
        # last known token (the first chain step's is one on), its draft count (0: padding),
        # whether it samples its drafts and its sampling parameters (temperature 1, no
        # filters where it does not), its block table; its first draft is copied in on the
        # device.
        fields = self._fields(n, max_blocks)
        offsets, self.image_bytes = aligned_offsets(
            {name: count * dtype.itemsize for name, dtype, count in fields}
        )  # fmt: skip
        self.static = torch.zeros(self.image_bytes, dtype=torch.uint8, device=device)
        self._image = np.zeros(self.image_bytes, dtype=np.uint8)
        # Each field on the device and in the host image it is staged from, made once.
        views: dict[str, torch.Tensor] = {}
        self._host: dict[str, np.ndarray] = {}
        for name, dtype, count in fields:
            at, end = offsets[name], offsets[name] + count * dtype.itemsize
            views[name] = self.static[at:end].view(dtype)
            self._host[name] = self._image[at:end].view(_NUMPY_DTYPES[dtype])
        self._host["block_tables"] = self._host["block_tables"].reshape(n, max_blocks)
        self.base, self.counts, self.sampled = views["base"], views["counts"], views["sampled"]
        self.temperature, self.top_k = views["temperature"], views["top_k"]
        self.top_p, self.min_p = views["top_p"], views["min_p"]
        self.block_tables = views["block_tables"].view(n, max_blocks)
        self.first_ids = zeros(n)
        self.drafts = zeros(n, max_steps + 1)  # column s: draft s (0: the first, copied in)
        vocab = self.vocab_size = model.config.vocab_size  # type: ignore[union-attr]
        # The sampling form's race noise (drawn before a replay) and the q it kept, a step
        # each (column s of `probs`: draft s's q; column 0 is the catch-up's, kept apart).
        self.noise = torch.ones((max_steps, n, vocab), dtype=torch.float32, device=device)
        self.probs = torch.zeros((n, max_steps + 1, vocab), dtype=torch.float32, device=device)
        self.graphs: dict[tuple[int, int, DecodePlan, bool], torch.cuda.CUDAGraph] = {}
        self.staging = PinnedStaging(device, turns=2)
        self.replays = 0

    @staticmethod
    def _fields(n: int, max_blocks: int) -> list[tuple[str, torch.dtype, int]]:
        i64, i32, f32 = torch.int64, torch.int32, torch.float32
        return [("base", i64, n), ("counts", i64, n), ("sampled", torch.bool, n),
                ("temperature", f32, n), ("top_k", i32, n), ("top_p", f32, n),
                ("min_p", f32, n), ("block_tables", i32, n * max_blocks)]  # fmt: skip

    def _meta(self, b: int, plan: DecodePlan) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b], max_query_len=1,
            decode_only=True, decode_plan=plan,
        )  # fmt: skip

    def body(self, b: int, steps: int, plan: DecodePlan, sampling: bool = False
             ) -> Callable[[], None]:  # fmt: skip
        """The chain of `steps` one-token steps over the first b rows, as a callable that
        runs it (eagerly, or under capture); `sampling`: the form whose rows that sample
        draw their drafts from q (`filtered_probs`, the race against `noise`)."""
        bs = self.block_size

        def run() -> None:
            base, counts = self.base[:b], self.counts[:b]
            last = (counts - 1).clamp(min=0)  # a row's last draft step (padding: 0)
            ids = self.first_ids[:b]
            for s in range(1, steps + 1):
                pos = base + last.clamp(max=s)
                self.positions[:b].copy_(pos)
                block = self.block_tables[:b].gather(1, (pos // bs).unsqueeze(1)).squeeze(1)
                slot = torch.where(counts > s, block.to(torch.int64) * bs + pos % bs, -1)
                self.slot_mapping[:b].copy_(slot)
                self.seq_lens[:b].copy_(torch.where(counts > 0, pos + 1, 0))
                self.input_ids[:b].copy_(ids)
                # Metadata of its own a step: off the GPU a step derives what its layers
                # share from it once (`AttentionMetadata.cpu_step_index`).
                with set_forward_context(self._meta(b, plan)):
                    hidden = self.model(self.input_ids[:b], self.positions[:b])
                logits = self.model.compute_logits(hidden)  # type: ignore[operator]
                ids = logits.argmax(dim=-1)
                if sampling:
                    q = filtered_probs(logits.to(torch.float32), self.temperature[:b],
                                       self.top_k[:b], self.top_p[:b], self.min_p[:b])  # fmt: skip
                    self.probs[:b, s].copy_(q)
                    raced = (q / self.noise[s - 1, :b]).argmax(dim=-1)
                    ids = torch.where(self.sampled[:b], raced, ids)
                self.drafts[:b, s].copy_(ids)

        return run

    @torch.inference_mode()
    def capture(self, pool: tuple | None = None) -> tuple | None:
        """Capture every chain (with no row counted: nothing written, no context read);
        returns the memory pool they share."""
        t0 = time.monotonic()
        todo = [(b, m, plan, sampling) for b in reversed(self.sizes)
                for m in range(self.max_steps, 0, -1)
                for plan in decode_plans(b, self.num_kv_heads, self.device)
                for sampling in (False, True)]  # fmt: skip
        for key in tqdm(todo, desc="Capturing draft chain CUDA graphs", unit="graph"):
            graph, _ = capture_callable(self.body(*key), self.device, pool)
            pool = graph.pool() if pool is None else pool
            self.graphs[key] = graph
        logger.info("captured %d draft chain CUDA graphs in %.1fs", len(self.graphs),
                    time.monotonic() - t0)  # fmt: skip
        return pool

    def run(self, reqs: Sequence[Request], counts: Sequence[int], first: torch.Tensor,
            sampling: DraftSampling | None = None) -> torch.Tensor | None:  # fmt: skip
        """[len(reqs), max(counts)] draft ids on the device (row i valid up to counts[i]):
        `first` (the catch-up's drafts) then the chain's; None where no chain was captured
        for this batch (its size, its chain length, its plan or a table too wide). With
        `sampling` (the proposal's, whose draft 0 it drew), the rows that sample draw from
        q, and q of drafts 1 on lands in `sampling.probs`."""
        b, steps = len(reqs), max(counts) - 1
        tables = [r.block_table for r in reqs]
        if steps < 1 or steps > self.max_steps or max(len(t) for t in tables) > self.max_blocks:
            return None
        padded = next((s for s in self.sizes if s >= b), None)
        if padded is None:
            return None
        base = [r.num_tokens - 1 for r in reqs]
        longest = max(p + c for p, c in zip(base, counts, strict=True))
        plan = decode_plan(padded, self.num_kv_heads, self.device, longest)
        graph = self.graphs.get((padded, steps, plan, sampling is not None))
        if graph is None:
            return None
        self._stage(reqs, counts, base, tables, sampling is not None)
        self.first_ids[:b].copy_(first)
        self.drafts[:b, 0].copy_(first)
        if sampling is not None:
            self._draw_noise(sampling, counts, steps)
        graph.replay()
        self.replays += 1
        if sampling is not None:
            # Slots follow the rows that sample, in order.
            rows = [i for i, slot in enumerate(sampling.slot) if slot is not None]
            kept = self.probs[:, 1 : steps + 1].index_select(
                0, host_to_device(rows, torch.int64, self.device)
            )  # fmt: skip
            sampling.probs[:, 1 : steps + 1].copy_(kept)
        return self.drafts[:b, : steps + 1]

    def _stage(self, reqs: Sequence[Request], counts: Sequence[int], base: list[int],
               tables: list[list[int]], sampling: bool) -> None:  # fmt: skip
        """The proposal's rows into the static image (padding rows: zeros), one copy."""
        host, b = self._host, len(reqs)
        self._image.fill(0)
        host["base"][:b] = base
        host["counts"][:b] = counts
        host["temperature"][:] = 1.0
        host["top_p"][:] = 1.0
        if sampling:
            for i, r in enumerate(reqs):
                if samples_drafts(r):
                    p = r.params
                    host["sampled"][i] = True
                    host["temperature"][i] = p.temperature
                    host["top_k"][i] = p.top_k if 0 < p.top_k < self.vocab_size else 0
                    host["top_p"][i], host["min_p"][i] = p.top_p, p.min_p
        for i, t in enumerate(tables):
            host["block_tables"][i, : len(t)] = t
        self.staging.to_device(self._image, self.static)

    def _draw_noise(self, sampling: DraftSampling, counts: Sequence[int], steps: int) -> None:
        """The race noise of steps 1..`steps`: unseeded rows from the default generator; a
        seeded row from its proposal's generator, a vocabulary's worth a step while it has
        drafts to make, as the step-by-step path draws it (`DraftSampling.pick`)."""
        noise = self.noise[:steps]
        noise.exponential_()
        for i, slot in enumerate(sampling.slot):
            gen = None if slot is None else sampling.generators[slot]
            if gen is None:
                continue
            for s in range(1, min(steps, counts[i] - 1) + 1):
                noise[s - 1, i].exponential_(generator=gen)

    def release(self) -> None:
        self.graphs = {}
        self.staging.release()
