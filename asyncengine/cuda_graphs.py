"""CUDA graphs for decode-only steps: captured once per padded batch size, replayed with
static input buffers. Prefill and mixed steps run eagerly.

A decode step of B requests is padded up to the nearest captured size; padding rows write
to slot -1 (skipped) and have a context length of 0 (attention returns zeros for them).
Grids inside the graph depend only on the padded size, so one capture serves every step of
that size whatever the context lengths.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm.auto import tqdm

from models.forward_context import AttentionMetadata, set_forward_context

if TYPE_CHECKING:
    from asyncengine.model_runner import StepInputs

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, *range(16, 257, 16), *range(288, 513, 32)]
    return [s for s in sizes if s <= max_num_seqs] or [1]


class DecodeGraphs:
    def __init__(
        self, model: nn.Module, device: torch.device, max_num_seqs: int, max_blocks: int
    ) -> None:
        self.model = model
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.max_blocks = max_blocks
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            max_query_len=1,
            decode_only=True,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.monotonic()
        pool = None
        # Largest first, so smaller graphs reuse the memory pool of the largest.
        for b in tqdm(sorted(self.sizes, reverse=True), desc="Capturing CUDA graphs", unit="graph"):
            meta = self._meta(b)
            with set_forward_context(meta):
                # Warm-up compiles every kernel variant before capture.
                self.model(self.input_ids[:b], self.positions[:b])
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(self.input_ids[:b], self.positions[:b])
            pool = graph.pool() if pool is None else pool
            self.graphs[b], self.outputs[b] = graph, out
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d decode CUDA graphs in %.1fs", len(self.graphs), time.monotonic() - t0
        )

    def can_run(self, inputs: StepInputs) -> bool:
        meta = inputs.meta
        b = meta.seq_lens.shape[0]
        return (
            meta.decode_only
            and b <= self.sizes[-1]
            and meta.block_tables.shape[1] <= self.max_blocks
        )

    def run(self, inputs: StepInputs) -> torch.Tensor:
        meta = inputs.meta
        b = meta.seq_lens.shape[0]
        padded = self.sizes[bisect.bisect_left(self.sizes, b)]
        self.input_ids[:b].copy_(inputs.input_ids)
        self.positions[:b].copy_(inputs.positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(meta.block_tables)
        if padded > b:
            self.slot_mapping[b:padded].fill_(-1)
            self.seq_lens[b:padded].fill_(0)
        self.graphs[padded].replay()
        return self.outputs[padded][:b]
