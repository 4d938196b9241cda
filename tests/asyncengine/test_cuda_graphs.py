"""CUDA graphs: which graphs a padded decode size needs and which one a step replays; the
padded shape of a prefill step, and that attention over its padded static buffers gives the
step's own rows unchanged (the capture and replay themselves run in the GPU engine tests)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from asyncengine.cuda_graphs import (
    PREFILL_SEQ_SIZES,
    PREFILL_TOKEN_SIZES,
    STAGE_MAX_ROWS,
    DecodeGraphs,
    PrefillGraphs,
    capture_sizes,
    static_fields,
)
from asyncengine_kernels.paged_attention import DecodePlan, paged_attention_triton
from models.forward_context import AttentionMetadata
from tests.asyncengine_kernels.kernel_cases import make_paged_batch


class _OneKVHeadModel(nn.Module):
    def attention_layers(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(num_kv_heads=1)]


def _graphs(fuse_rotary: bool = True, verify_rows: int = 0) -> DecodeGraphs:
    # On the CPU the split heuristic sees one multiprocessor: only one sequence with one KV
    # head splits (4 segments, 2 for short contexts).
    return DecodeGraphs(
        _OneKVHeadModel(), torch.device("cpu"), max_num_seqs=4, max_blocks=8,
        fuse_rotary=fuse_rotary, verify_rows=verify_rows,
    )  # fmt: skip


def test_a_split_kv_size_gets_a_graph_per_plan() -> None:
    graphs = _graphs()
    assert graphs.variants(1) == [(1, DecodePlan(4, True)), (1, DecodePlan(2, True))]
    assert graphs.variants(2) == [(2, DecodePlan(1, False))]  # no split: one graph
    unfused = _graphs(fuse_rotary=False)
    assert unfused.variants(1) == [(1, DecodePlan(4, False)), (1, DecodePlan(2, False))]


def test_verify_sizes_also_get_the_unfused_plans() -> None:
    """Batch-expanded verify steps never fuse rotary: the sizes they pad to (1 and 2 for
    up to 2 rows; 4 for 3) get those plans too, larger sizes do not."""
    graphs = _graphs(verify_rows=3)
    assert graphs.verify_rows == 4
    assert graphs.variants(1) == [(1, DecodePlan(4, True)), (1, DecodePlan(2, True)),
                                  (1, DecodePlan(4, False)), (1, DecodePlan(2, False))]
    assert graphs.variants(4) == [(4, DecodePlan(1, False))]
    assert _graphs(verify_rows=2).verify_rows == 2


def test_steps_replay_at_the_padded_size_when_a_graph_fits() -> None:
    graphs = _graphs()
    assert [graphs.graph_size(b, 8) for b in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert graphs.graph_size(5, 8) is None  # more sequences than the largest graph
    assert graphs.graph_size(2, 9) is None  # a block table wider than the captured one


def test_capture_sizes_stop_at_max_num_seqs() -> None:
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]  # a full batch never runs eagerly
    assert capture_sizes(1) == [1]
    large = capture_sizes(1024)
    assert large[-1] == 1024 and 512 in large and large == sorted(set(large))
    assert capture_sizes(600)[-2:] == [576, 600]
    assert capture_sizes(10_000)[-1] == 2048


def test_prefill_steps_replay_at_padded_tokens_and_sequences() -> None:
    graphs = PrefillGraphs(_OneKVHeadModel(), torch.device("cpu"), max_blocks=8)
    assert graphs.graph_shape(64, 3, 8) == (64, 4)  # exact tokens: no padding sequence
    assert graphs.graph_shape(63, 3, 8) == (64, 4)  # 1 padding token: a 4th sequence
    assert graphs.graph_shape(65, 4, 8) == (128, 8)
    assert graphs.graph_shape(1000, 1, 8) == (1024, 2)
    assert graphs.graph_shape(1025, 1, 8) is None  # more tokens than the largest graph
    assert graphs.graph_shape(100, 16, 8) is None  # no room for the padding sequence
    assert graphs.graph_shape(64, 16, 8) == (64, 16)
    assert graphs.graph_shape(100, 2, 9) is None  # a block table wider than the captured one
    # A padded step never has as many tokens as sequences (attention would read it as decode).
    assert min(PREFILL_TOKEN_SIZES) > max(PREFILL_SEQ_SIZES)


@pytest.mark.parametrize("q_lens,seq_lens", [([1, 30, 5, 1], [40, 30, 20, 9]), ([64], [100])])
def test_prefill_padding_leaves_the_step_rows_unchanged(
    q_lens: list[int], seq_lens: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage a step into the static buffers and run attention over the padded (t, b) shape
    without the host's max_query_len hint, as the graph does: the step's rows equal the
    unpadded step's, padding rows are zeros and write nowhere."""
    pa = importlib.import_module("asyncengine_kernels.paged_attention")
    monkeypatch.setattr(pa, "PREFILL_TILE_MIN_QUERY_LEN", 8)  # the prefill launch runs too
    small = {"BLOCK_M": 32, "TILE": 16}
    batch = make_paged_batch(q_lens, seq_lens, 8, 2, head_dim=32, seed=3)
    n, width = batch.q.shape[0], batch.block_tables.shape[1]
    graphs = PrefillGraphs(_OneKVHeadModel(), torch.device("cpu"), max_blocks=width)
    t, b = graphs.graph_shape(n, len(q_lens), width)  # type: ignore[misc]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens, block_tables=batch.block_tables,
    )  # fmt: skip
    step = SimpleNamespace(input_ids=torch.arange(n), positions=torch.arange(n), meta=meta)
    graphs.stage(step, t, b)  # type: ignore[arg-type]
    padded = graphs.meta(t, b)
    assert torch.equal(padded.slot_mapping[n:], torch.full((t - n,), -1))
    q = torch.cat([batch.q, torch.randn(t - n, *batch.q.shape[1:])])
    want = paged_attention_triton(*batch.args(), large_tiles=small)
    got = paged_attention_triton(
        q, batch.k_cache, batch.v_cache, padded.block_tables, padded.query_start_loc,
        padded.seq_lens, batch.scale, large_tiles=small,
    )  # fmt: skip
    torch.testing.assert_close(got[:n], want, atol=1e-6, rtol=0)
    assert torch.equal(got[n:], torch.zeros_like(got[n:]))


def test_static_inputs_share_one_buffer_with_the_tables_last() -> None:
    """Every field on a 16-byte boundary (5 rows: 40-byte fields), the block tables last, so
    a step of few rows reaches all it reads in the buffer's head."""
    offsets, size = static_fields(5, 3)
    assert list(offsets) == ["input_ids", "positions", "slot_mapping", "seq_lens", "block_tables"]
    assert all(at % 16 == 0 for at in offsets.values())
    assert offsets["positions"] == 48 and offsets["block_tables"] == 3 * 48 + 32
    assert size == offsets["block_tables"] + 64  # 60 bytes of tables, rounded up
    graphs = _graphs()
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables"):
        tensor = getattr(graphs, name)
        assert tensor.data_ptr() == graphs.static.data_ptr() + graphs.offsets[name]
    assert graphs.slot_mapping.tolist() == [-1] * 4


def test_a_staged_image_lands_as_the_copy_path_would_leave_the_rows() -> None:
    graphs = _graphs()
    for key in graphs.variants(4):
        graphs.graphs[key] = None  # type: ignore[assignment]
    plan = graphs.variants(4)[0][1]
    padded = graphs.stageable(3, 2, plan)
    assert padded == 4
    graphs._image(4)[0].fill(0xFF)  # stale bytes everywhere
    tables = np.array([[3, 4], [5, 0], [6, 7]], dtype=np.int64)
    image = graphs.stage_image(4, np.array([11, 12, 13]), np.array([7, 8, 9]),
                               np.array([50, 81, 97]), np.array([8, 9, 10]), tables)  # fmt: skip
    assert image.size == graphs.image_bytes(4)
    graphs.static[: image.size].copy_(torch.from_numpy(image))
    assert graphs.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert graphs.positions[:4].tolist() == [7, 8, 9, 0]
    assert graphs.slot_mapping[:4].tolist() == [50, 81, 97, -1]
    assert graphs.seq_lens[:4].tolist() == [8, 9, 10, 0]
    assert graphs.block_tables.tolist() == [[3, 4] + [0] * 6, [5, 0] + [0] * 6,
                                            [6, 7] + [0] * 6, [0] * 8]  # fmt: skip
    ids, _, slots, qsl, lens, table, rows = graphs.staged_views(3)
    assert slots.tolist() == [50, 81, 97] and lens.tolist() == [8, 9, 10]
    assert ids.data_ptr() == graphs.input_ids.data_ptr() and qsl.tolist() == [0, 1, 2, 3]
    assert rows.tolist() == [0, 1, 2] and table.shape == (3, 8)
    assert graphs.staged_views(3)[0] is ids  # made once per row count


def test_rows_of_one_request_share_its_table_in_a_staged_image() -> None:
    """Tables given a row each, as `decode_rows` gives them (a verify step's rows share
    their request's list), land as the padded array would: a reused image keeps nothing of
    the step before."""
    graphs = _graphs()
    first, second = [3, 4, 9], [5]
    graphs.stage_image(4, [1, 2, 3, 4], [0] * 4, [0] * 4, [1] * 4, [first] * 4)
    image = graphs.stage_image(4, [11, 12, 13], [7, 8, 9], [50, 51, 81], [8, 9, 10],
                               [first, first, second])  # fmt: skip
    graphs.static[: image.size].copy_(torch.from_numpy(image))
    assert graphs.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert graphs.slot_mapping[:4].tolist() == [50, 51, 81, -1]
    assert graphs.block_tables[:4, :3].tolist() == [first, first, [5, 0, 0], [0, 0, 0]]
    assert graphs.block_tables[:, 3:].abs().sum().item() == 0


def test_only_small_captured_steps_are_staged() -> None:
    graphs = DecodeGraphs(_OneKVHeadModel(), torch.device("cpu"), max_num_seqs=64, max_blocks=8)
    plan = graphs.variants(32)[0][1]
    assert graphs.stageable(2, 8, graphs.variants(2)[0][1]) is None  # no graph captured
    for b in (2, 32):
        for key in graphs.variants(b):
            graphs.graphs[key] = None  # type: ignore[assignment]
    assert graphs.stageable(2, 8, graphs.variants(2)[0][1]) == 2
    assert STAGE_MAX_ROWS < 32 and graphs.stageable(20, 8, plan) is None  # too many rows
    assert graphs.stageable(2, 9, plan) is None  # a table wider than the captured one


class _LayeredModel(_OneKVHeadModel):
    """A model that can run as a head and a tail (`forward_head` / `forward_tail`)."""

    num_layers = 4

    def forward_head(self, *args: object) -> None: ...

    def forward_tail(self, *args: object) -> None: ...


@pytest.mark.parametrize("head_layers", [0, 2])
def test_small_graphs_split_after_the_head_layers(
    head_layers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Graphs of up to `STAGE_MAX_ROWS` padded rows (the steps the host waits for) are
    captured as a head and a tail, larger ones whole; 0 head layers, or a model that cannot
    run in two parts, keeps every graph whole."""
    import asyncengine.cuda_graphs as cuda_graphs

    captured: dict[int, int] = {}  # rows -> head layers (0: whole)

    def whole(model, meta, ids, positions, pool):  # type: ignore[no-untyped-def]
        captured[len(ids)] = 0
        return SimpleNamespace(pool=lambda: "pool"), torch.zeros(len(ids))

    def split(model, meta, ids, positions, pool, head):  # type: ignore[no-untyped-def]
        captured[len(ids)] = head
        return SimpleNamespace(pool=lambda: "pool"), torch.zeros(len(ids))

    monkeypatch.setattr(cuda_graphs, "capture_forward", whole)
    monkeypatch.setattr(cuda_graphs, "capture_split_forward", split)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    graphs = DecodeGraphs(_LayeredModel(), torch.device("cpu"), max_num_seqs=32, max_blocks=8,
                          head_layers=head_layers)  # fmt: skip
    assert graphs.capture() == "pool"
    assert set(captured) == set(graphs.sizes) and max(graphs.sizes) > STAGE_MAX_ROWS
    for rows, head in captured.items():
        assert head == (head_layers if rows <= STAGE_MAX_ROWS else 0), (rows, head)
    # No tail left, or no way to split: whole graphs.
    cpu = torch.device("cpu")
    assert DecodeGraphs(_LayeredModel(), cpu, 4, 8, head_layers=4).head_layers == 0
    assert DecodeGraphs(_OneKVHeadModel(), cpu, 4, 8, head_layers=2).head_layers == 0


def test_warm_up_passes_run_side_by_side_each_with_its_own_metadata() -> None:
    """Each pass runs once, in a pool thread, seeing its own metadata in the forward context
    (per thread): what lets a capture's kernels compile together before the captures."""
    import threading

    from asyncengine.cuda_graphs import warm_up_forwards
    from models.forward_context import get_attention_metadata

    seen: list[tuple[int, str, int]] = []
    barrier = threading.Barrier(3, timeout=10)  # all three passes in flight at once

    class Recording(nn.Module):
        def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            meta = get_attention_metadata()
            barrier.wait()
            seen.append((len(ids), threading.current_thread().name, meta.seq_lens.numel()))
            return ids

    passes = []
    for b in (1, 2, 4):
        meta = AttentionMetadata(
            slot_mapping=torch.full((b,), -1), query_start_loc=torch.arange(b + 1),
            seq_lens=torch.zeros(b), block_tables=torch.zeros((b, 2)),
        )  # fmt: skip
        ids = torch.zeros(b, dtype=torch.int64)
        passes.append((meta, ids, ids))
    warm_up_forwards(Recording(), passes, threads=3)
    assert sorted((rows, lens) for rows, _, lens in seen) == [(1, 1), (2, 2), (4, 4)]
    assert all(name.startswith("warm-up") for _, name, _ in seen)
    seen.clear()
    warm_up_forwards(Recording(), passes[:1], threads=3)  # one pass: the capture runs it
    assert seen == []


def test_prefill_warm_up_passes_have_query_starts_of_their_own() -> None:
    """Each shape's warm-up pass sees the capture's inputs (all t tokens in sequence 0, no
    keys, no slots) through query starts no other pass or capture rewrites."""
    graphs = PrefillGraphs(_OneKVHeadModel(), torch.device("cpu"), max_blocks=4)
    shapes = [(64, 2), (128, 4), (1024, 16)]
    passes = graphs.warm_up_passes(shapes)
    for (t, b), (meta, ids, positions) in zip(shapes, passes, strict=True):
        assert meta.query_start_loc.tolist() == [0] + [t] * b
        assert meta.query_start_loc.data_ptr() != graphs.query_start_loc.data_ptr()
        assert len(ids) == len(positions) == t and meta.seq_lens.shape == (b,)
        assert meta.slot_mapping.shape == (t,) and meta.max_query_len is None
    assert len({m.query_start_loc.data_ptr() for m, _, _ in passes}) == len(shapes)
