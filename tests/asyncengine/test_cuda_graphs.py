"""Decode CUDA graphs: which graphs a padded size needs and which one a step replays (the
capture and replay themselves run in the GPU engine tests)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from asyncengine.cuda_graphs import DecodeGraphs, capture_sizes
from kernels.paged_attention import DecodePlan


class _OneKVHeadModel(nn.Module):
    def attention_layers(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(num_kv_heads=1)]


def _graphs(fuse_rotary: bool = True) -> DecodeGraphs:
    # On the CPU the split heuristic sees one multiprocessor: only one sequence with one KV
    # head splits (4 segments, 2 for short contexts).
    return DecodeGraphs(
        _OneKVHeadModel(), torch.device("cpu"), max_num_seqs=4, max_blocks=8,
        fuse_rotary=fuse_rotary,
    )  # fmt: skip


def test_a_split_kv_size_gets_a_graph_per_plan() -> None:
    graphs = _graphs()
    assert graphs.variants(1) == [(1, DecodePlan(4, True)), (1, DecodePlan(2, True))]
    assert graphs.variants(2) == [(2, DecodePlan(1, False))]  # no split: one graph
    unfused = _graphs(fuse_rotary=False)
    assert unfused.variants(1) == [(1, DecodePlan(4, False)), (1, DecodePlan(2, False))]


def test_steps_replay_at_the_padded_size_when_a_graph_fits() -> None:
    graphs = _graphs()
    assert [graphs.graph_size(b, 8) for b in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert graphs.graph_size(5, 8) is None  # more sequences than the largest graph
    assert graphs.graph_size(2, 9) is None  # a block table wider than the captured one


def test_capture_sizes_stop_at_max_num_seqs() -> None:
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16]
