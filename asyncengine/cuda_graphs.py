"""CUDA graphs for decode-only steps: captured once per padded batch size, replayed with
static input buffers. Prefill and mixed steps run eagerly.

A decode step of B requests is padded up to the nearest captured size; padding rows write
to slot -1 (skipped) and have a context length of 0 (attention returns zeros for them).
Grids inside the graph depend only on the padded size and, for sizes small enough for
split-KV attention, on whether the longest context is short (fewer segments pay there):
such sizes get one graph per split count, and one capture serves every step of that size
and class whatever the context lengths.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm.auto import tqdm

from kernels.paged_attention import SHORT_CONTEXT_KEYS, decode_split_segments
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
        self.num_kv_heads: int = model.attention_layers()[0].num_kv_heads  # type: ignore[operator]
        # Keyed by (padded size, split-KV segments of its attention).
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}

    def key(self, b: int, max_seq_len: int | None) -> tuple[int, int]:
        """The graph for a step of padded size b whose longest context is max_seq_len."""
        return b, decode_split_segments(b, self.num_kv_heads, self.device, max_seq_len)

    def variants(self, b: int) -> dict[tuple[int, int], int | None]:
        """The graphs size b needs, each with a context-length hint that selects it."""
        found: dict[tuple[int, int], int | None] = {}
        for hint in (None, SHORT_CONTEXT_KEYS):
            found.setdefault(self.key(b, hint), hint)
        return found

    def _meta(self, b: int, max_seq_len: int | None) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            max_query_len=1,
            decode_only=True,
            max_seq_len=max_seq_len,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.monotonic()
        pool = None
        # Largest first, so smaller graphs reuse the memory pool of the largest.
        todo = [(key, hint) for b in sorted(self.sizes, reverse=True)
                for key, hint in self.variants(b).items()]  # fmt: skip
        for (b, segments), hint in tqdm(todo, desc="Capturing CUDA graphs", unit="graph"):
            with set_forward_context(self._meta(b, hint)):
                # Warm-up compiles every kernel variant before capture.
                self.model(self.input_ids[:b], self.positions[:b])
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(self.input_ids[:b], self.positions[:b])
            pool = graph.pool() if pool is None else pool
            self.graphs[b, segments], self.outputs[b, segments] = graph, out
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
        key = self.key(padded, meta.max_seq_len)
        self.graphs[key].replay()
        return self.outputs[key][:b]
