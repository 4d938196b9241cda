"""The draft model's one-token steps of a greedy proposal as one CUDA graph.

After the catch-up forward gives each request its first draft, a proposal runs up to k - 1
one-token steps of the draft, each fed the argmax of the step before. Replayed a graph a
step, every step costs the host a layout, a staging copy, a graph launch, an LM head and an
argmax, which for a draft of a few hundred MB is more than the device spends on the step
(about 0.4 against 0.3 ms on the H200 for a 160M draft). A chain graph captures m steps
together: each step forms its positions, context lengths and cache slots on the device from
the proposal's first positions and draft counts, runs the draft, its LM head and the argmax,
and feeds the next step. The host stages one small image (first positions, counts, block
tables), copies the first drafts in on the device and replays once.

A request with fewer drafts than the chain's length keeps its last position past its count
and writes no cache slot (its extra drafts are dropped, as `DraftModelProposer` drops them);
padding rows have no context and write nothing. Chains are captured per padded batch of up
to `STAGE_MAX_ROWS` rows, chain length (1 to k - 1) and decode plan, planned for the
chain's longest final context (a plan serves any shorter context). Requests that sample
their drafts keep the step-by-step path, whose noise comes from each request's generator.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from asyncengine.cuda_graphs import STAGE_MAX_ROWS, capture_sizes
from asyncengine.host_staging import PinnedStaging
from asyncengine.request import Request
from asyncengine_kernels.paged_attention import DecodePlan, decode_plan, decode_plans
from models.forward_context import AttentionMetadata, set_forward_context

logger = logging.getLogger(__name__)


def capture_chain(body: Callable[[], None], device: torch.device, pool: tuple | None) -> object:
    """`body` run once eagerly (compiling its kernels), then captured as a CUDA graph in
    `pool` (None: a new one); returns the graph (`replay()`, `pool()`)."""
    body()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        body()
    return graph


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
        # The proposal's inputs, staged in one copy: each row's position of its first chain
        # step's token less one (the request's last known token), its draft count (0:
        # padding), its block table; and its first draft, copied in on the device.
        self.image_bytes = 8 * n + 8 * n + 4 * n * max_blocks
        self.static = torch.zeros(self.image_bytes, dtype=torch.uint8, device=device)
        self.base = self.static[: 8 * n].view(i64)
        self.counts = self.static[8 * n : 16 * n].view(i64)
        self.block_tables = self.static[16 * n :].view(i32).view(n, max_blocks)
        self.first_ids = zeros(n)
        self.drafts = zeros(n, max_steps + 1)  # column s: draft s (0: the first, copied in)
        self.graphs: dict[tuple[int, int, DecodePlan], object] = {}
        self.staging = PinnedStaging(device, turns=2)
        self._image = np.zeros(self.image_bytes, dtype=np.uint8)
        self.replays = 0

    def _meta(self, b: int, plan: DecodePlan) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b], max_query_len=1,
            decode_only=True, decode_plan=plan,
        )  # fmt: skip

    def body(self, b: int, steps: int, plan: DecodePlan) -> Callable[[], None]:
        """The chain of `steps` one-token steps over the first b rows, as a callable that
        runs it (eagerly, or under capture)."""
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
                ids = self.model.compute_logits(hidden).argmax(dim=-1)  # type: ignore[operator]
                self.drafts[:b, s].copy_(ids)

        return run

    @torch.inference_mode()
    def capture(self, pool: tuple | None = None) -> tuple | None:
        """Capture every chain (with no row counted: nothing written, no context read);
        returns the memory pool they share."""
        t0 = time.monotonic()
        todo = [(b, m, plan) for b in reversed(self.sizes) for m in range(self.max_steps, 0, -1)
                for plan in decode_plans(b, self.num_kv_heads, self.device)]  # fmt: skip
        for b, m, plan in tqdm(todo, desc="Capturing draft chain CUDA graphs", unit="graph"):
            graph = capture_chain(self.body(b, m, plan), self.device, pool)
            pool = graph.pool() if pool is None else pool  # type: ignore[attr-defined]
            self.graphs[b, m, plan] = graph
        logger.info("captured %d draft chain CUDA graphs in %.1fs", len(self.graphs),
                    time.monotonic() - t0)  # fmt: skip
        return pool

    def run(self, reqs: Sequence[Request], counts: Sequence[int],
            first: torch.Tensor) -> torch.Tensor | None:  # fmt: skip
        """[len(reqs), max(counts)] draft ids on the device (row i valid up to counts[i]):
        `first` (the catch-up's drafts) then the chain's; None where no chain was captured
        for this batch (its size, its chain length, its plan or a table too wide)."""
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
        graph = self.graphs.get((padded, steps, plan))
        if graph is None:
            return None
        n = len(self.base)
        image = self._image
        image.fill(0)
        image[: 8 * n].view(np.int64)[:b] = base
        image[8 * n : 16 * n].view(np.int64)[:b] = counts
        table = image[16 * n :].view(np.int32).reshape(n, self.max_blocks)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        self.staging.to_device(image, self.static)
        self.first_ids[:b].copy_(first)
        self.drafts[:b, 0].copy_(first)
        graph.replay()  # type: ignore[attr-defined]
        self.replays += 1
        return self.drafts[:b, : steps + 1]

    def release(self) -> None:
        self.graphs = {}
        self.staging.release()
