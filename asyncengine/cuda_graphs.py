"""CUDA graphs for decode-only steps: captured once per padded batch size, replayed with
static input buffers. Prefill and mixed steps run eagerly.

A decode step of B requests is padded up to the nearest captured size; padding rows write
to slot -1 (skipped) and have a context length of 0 (attention returns zeros for them).
Grids inside the graph depend only on the padded size and on the step's `DecodePlan`
(split-KV segments, rotary fused or not), which the model runner decides for the padded
size: each size gets one graph per plan it can have (`decode_plans`), and one capture serves
every step of that size and plan whatever the context lengths.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm.auto import tqdm

from kernels.paged_attention import DecodePlan, decode_plans
from models.forward_context import AttentionMetadata, set_forward_context

if TYPE_CHECKING:
    from asyncengine.model_runner import StepInputs

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, *range(16, 257, 16), *range(288, 513, 32)]
    return [s for s in sizes if s <= max_num_seqs] or [1]


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        max_num_seqs: int,
        max_blocks: int,
        *,
        fuse_rotary: bool = True,
    ) -> None:
        self.model = model
        self.device = device
        self.fuse_rotary = fuse_rotary  # as the runner plans (`decode_plan`'s argument)
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
        # Keyed by (padded size, the decode plan its attention was captured with).
        self.graphs: dict[tuple[int, DecodePlan], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, DecodePlan], torch.Tensor] = {}

    def graph_size(self, num_seqs: int, table_width: int) -> int | None:
        """The padded size a decode step of `num_seqs` sequences replays at, or None when no
        graph fits it (it runs eagerly)."""
        if num_seqs > self.sizes[-1] or table_width > self.max_blocks:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def variants(self, b: int) -> list[tuple[int, DecodePlan]]:
        """The graphs size b needs: one per plan a step of that size can have."""
        plans = decode_plans(b, self.num_kv_heads, self.device, fuse_rotary=self.fuse_rotary)
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
    def capture(self) -> None:
        t0 = time.monotonic()
        pool = None
        # Largest first, so smaller graphs reuse the memory pool of the largest.
        todo = [key for b in sorted(self.sizes, reverse=True) for key in self.variants(b)]
        for b, plan in tqdm(todo, desc="Capturing CUDA graphs", unit="graph"):
            with set_forward_context(self._meta(b, plan)):
                # Warm-up compiles every kernel variant before capture.
                self.model(self.input_ids[:b], self.positions[:b])
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(self.input_ids[:b], self.positions[:b])
            pool = graph.pool() if pool is None else pool
            self.graphs[b, plan], self.outputs[b, plan] = graph, out
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d decode CUDA graphs in %.1fs", len(self.graphs), time.monotonic() - t0
        )

    def can_run(self, inputs: StepInputs) -> bool:
        meta = inputs.meta
        b, width = meta.block_tables.shape
        return meta.decode_only and self.graph_size(b, width) is not None

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Replay the graph of the step's padded size and plan (the runner planned the step
        for that size: `graph_size`)."""
        meta = inputs.meta
        b, width = meta.block_tables.shape
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
        return self.outputs[key][:b]
