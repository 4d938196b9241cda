"""Decode CUDA graphs: which graphs a padded size needs and which one a step replays (the
capture and replay themselves run in the GPU engine tests)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from asyncengine.cuda_graphs import DecodeGraphs, capture_sizes
from kernels.paged_attention import SHORT_CONTEXT_KEYS


class _OneKVHeadModel(nn.Module):
    def attention_layers(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(num_kv_heads=1)]


def _graphs() -> DecodeGraphs:
    # On the CPU the split heuristic sees one multiprocessor: only one sequence with one KV
    # head splits (4 segments, 2 for short contexts).
    return DecodeGraphs(_OneKVHeadModel(), torch.device("cpu"), max_num_seqs=4, max_blocks=8)


def test_a_split_kv_size_gets_a_graph_per_split_count() -> None:
    graphs = _graphs()
    assert graphs.variants(1) == {(1, 4): None, (1, 2): SHORT_CONTEXT_KEYS}
    assert graphs.variants(2) == {(2, 1): None}  # no split: one graph whatever the context


def test_a_step_replays_the_graph_of_its_longest_context() -> None:
    graphs = _graphs()
    assert graphs.key(1, SHORT_CONTEXT_KEYS) == (1, 2)
    assert graphs.key(1, SHORT_CONTEXT_KEYS + 1) == (1, 4)
    assert graphs.key(1, None) == (1, 4)  # unknown counts as long
    assert graphs.key(4, 10) == (4, 1)


def test_capture_sizes_stop_at_max_num_seqs() -> None:
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16]
