"""The model runner's step inputs, its decode plan, its device-side token hand-over and its
block moves."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.cuda_graphs import DecodeGraphs
from asyncengine.llm_engine import LLMEngine
from asyncengine.model_runner import (
    InflightStep,
    KVCache,
    copy_blocks,
    decode_rows,
    one_row_per_token,
    token_layout,
)
from asyncengine.request import Request
from asyncengine.scheduler import ScheduledRequest, SchedulerOutput
from asyncengine_kernels.paged_attention import DecodePlan


def _engine(model_dir: Path) -> LLMEngine:
    return LLM(str(model_dir), dtype="float32", device="cpu").llm_engine


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, None, prompt, SamplingParams(max_tokens=4), max_tokens=4)


def test_step_parts_start_on_16_byte_boundaries(tiny_llama_dir: Path) -> None:
    """Odd token counts must not leave positions or slots misaligned (a second kernel
    variant per alignment would be compiled mid-serving)."""
    engine = _engine(tiny_llama_dir)
    reqs = [_request("a", [5, 6, 7]), _request("b", [8, 9])]  # 5 tokens: odd
    sched = SchedulerOutput()
    for r in reqs:
        assert engine.pool.allocate_slots(r, r.num_tokens) is not None
        sched.scheduled.append(ScheduledRequest(r, r.num_tokens))
    inputs = engine.runner.prepare_inputs(sched)
    meta = inputs.meta
    assert inputs.input_ids.tolist() == [5, 6, 7, 8, 9]
    assert inputs.positions.tolist() == [0, 1, 2, 0, 1]
    assert meta.query_start_loc.tolist() == [0, 3, 5] and meta.seq_lens.tolist() == [3, 2]
    assert inputs.logits_indices.tolist() == [2, 4]
    for t in (inputs.positions, meta.slot_mapping, inputs.logits_indices, inputs.input_ids):
        assert t.data_ptr() % 16 == 0
    for t in (meta.query_start_loc, meta.seq_lens, meta.block_tables):
        assert t.dtype == torch.int32 and t.data_ptr() % 16 == 0
    assert not meta.decode_only and meta.decode_plan is None  # a prefill step has no plan
    assert inputs.header.num_tokens == 5 and inputs.header.num_seqs == 2
    for r in reqs:
        engine.pool.free(r)


def _verifying(engine: LLMEngine, drafts: list[int]) -> Request:
    """A request of 4 known tokens (3 computed) about to verify `drafts`, its slots taken."""
    spec = _request("s", [5, 6, 7, 8])
    assert engine.pool.allocate_slots(spec, 6) is not None
    spec.num_computed_tokens = 3
    spec.spec_token_ids = drafts
    return spec


def _decode_step(engine: LLMEngine, lens: list[int]) -> SchedulerOutput:
    sched = SchedulerOutput()
    for i, n in enumerate(lens):
        req = _request(str(i), list(range(3, 3 + n)))
        assert engine.pool.allocate_slots(req, n) is not None
        req.num_computed_tokens = n - 1
        sched.scheduled.append(ScheduledRequest(req, 1))
    return sched


def test_a_decode_step_carries_the_plan_for_the_size_its_kernels_see(
    tiny_llama_dir: Path,
) -> None:
    """The plan is decided once, here, for the batch the kernels run: the step's own size
    eagerly, the padded size when a CUDA graph will replay it."""
    engine = _engine(tiny_llama_dir)
    runner = engine.runner
    # On the CPU the heuristic sees one multiprocessor: one sequence of one KV head splits.
    runner.num_kv_heads = 1
    sched = _decode_step(engine, [9])
    meta = runner.prepare_inputs(sched).meta
    assert meta.decode_only and meta.max_seq_len == 9
    assert meta.decode_plan == DecodePlan(2, fuse_rotary=True)  # a short context: 2 segments
    assert runner.prepare_inputs(sched).header.decode_plan == meta.decode_plan
    runner.graphs = SimpleNamespace(graph_size=lambda b, width: 2,  # padded to 2 sequences
                                    stageable=lambda b, width, plan: None)  # fmt: skip
    assert runner.prepare_inputs(sched).meta.decode_plan == DecodePlan(1, fuse_rotary=False)


def test_a_verify_step_runs_as_a_decode_step_of_one_row_per_token(
    tiny_llama_dir: Path,
) -> None:
    """Batch expansion: a request verifying 2 drafts becomes 3 decode rows over its block
    table, row j seeing the context and the drafts before it; a plain decode request beside
    it keeps its one row. No fused rotary: every row's K/V is written before any attends."""
    engine = _engine(tiny_llama_dir)
    runner = engine.runner
    runner.num_kv_heads = 1  # one CPU "multiprocessor": short contexts would split and fuse
    spec = _verifying(engine, [21, 22])
    plain = _request("p", list(range(3, 12)))
    assert engine.pool.allocate_slots(plain, 9) is not None
    plain.num_computed_tokens = 8
    sched = SchedulerOutput(scheduled=[ScheduledRequest(spec, 3, num_spec_tokens=2),
                                       ScheduledRequest(plain, 1)])  # fmt: skip
    inputs = runner.prepare_inputs(sched)
    meta = inputs.meta
    assert inputs.input_ids.tolist() == [8, 21, 22, 11]
    assert inputs.positions.tolist() == [3, 4, 5, 8]
    assert meta.decode_only and meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.seq_lens.tolist() == [4, 5, 6, 9]
    table = spec.block_table
    assert meta.block_tables[:3, : len(table)].tolist() == [table] * 3
    assert meta.decode_plan is not None and not meta.decode_plan.fuse_rotary
    assert inputs.logits_indices.tolist() == [0, 1, 2, 3]
    assert inputs.header.num_seqs == 4 and inputs.header.max_query_len == 1
    for r in (spec, plain):
        engine.pool.free(r)


def test_a_small_decode_step_is_staged_whole_into_the_graphs_inputs(
    tiny_llama_dir: Path,
) -> None:
    """A verify step of 3 rows (padded to a graph of 4) is written straight into the decode
    graphs' static inputs in one copy: the same rows as the packed path gives, the padding
    row writing nowhere and seeing no context, every row sampled."""
    engine = _engine(tiny_llama_dir)
    runner = engine.runner
    runner.num_kv_heads = 1
    spec = _verifying(engine, [21, 22])
    sched = SchedulerOutput(scheduled=[ScheduledRequest(spec, 3, num_spec_tokens=2)])
    graphs = DecodeGraphs(runner.model, torch.device("cpu"), max_num_seqs=8, max_blocks=8,
                          verify_rows=4)  # fmt: skip
    for key in graphs.variants(4):  # as if captured: the staged step replays one of them
        graphs.graphs[key] = None  # type: ignore[assignment]
    runner.graphs = graphs
    staged = runner.prepare_inputs(sched)
    runner.stage_small_steps = False
    packed = runner.prepare_inputs(sched)
    assert staged.staged_rows == 4 and packed.staged_rows == 0
    assert staged.header == packed.header  # one header, whichever way the step travels
    assert staged.input_ids.tolist() == packed.input_ids.tolist() == [8, 21, 22]
    assert staged.positions.tolist() == packed.positions.tolist() == [3, 4, 5]
    sm, pm = staged.meta, packed.meta
    assert sm.slot_mapping.tolist() == pm.slot_mapping.tolist()
    assert sm.seq_lens.tolist() == pm.seq_lens.tolist() == [4, 5, 6]
    width = pm.block_tables.shape[1]
    assert sm.block_tables[:, :width].tolist() == pm.block_tables.tolist()
    assert not sm.block_tables[:, width:].any()
    assert sm.decode_plan == pm.decode_plan and sm.max_seq_len == pm.max_seq_len == 6
    assert staged.logits_indices.tolist() == packed.logits_indices.tolist() == [0, 1, 2]
    # The padding row: token 0 at position 0, no slot, no context.
    assert graphs.input_ids[3] == 0 and graphs.positions[3] == 0
    assert graphs.slot_mapping[3] == -1 and graphs.seq_lens[3] == 0
    engine.pool.free(spec)


def test_decode_rows_lay_a_step_out_as_numpy_does() -> None:
    """The plain-Python layout of a few-token step gives the rows `token_layout` and
    `one_row_per_token` give: positions, slots across block boundaries, context lengths and
    each row's table."""
    rng = random.Random(0)
    for _ in range(50):
        b = rng.randint(1, 4)
        starts = [rng.randint(0, 40) for _ in range(b)]
        lens = [rng.randint(1, 5) for _ in range(b)]
        tables = [rng.sample(range(100), (s + n + 3) // 4 + rng.randint(0, 2))
                  for s, n in zip(starts, lens, strict=True)]  # fmt: skip
        _, _, padded, owner, positions, slots = token_layout(
            tables, np.asarray(starts, np.int64), np.asarray(lens, np.int64), 4
        )  # fmt: skip
        _, _, seq_lens, row_tables = one_row_per_token(padded, owner, positions)
        got = decode_rows(tables, starts, lens, 4)
        assert got[0] == positions.tolist() and got[1] == slots.tolist()
        assert got[2] == seq_lens.tolist()
        assert [list(t) + [0] * (padded.shape[1] - len(t)) for t in got[3]] == row_tables.tolist()
        assert all(t is tables[owner[i]] for i, t in enumerate(got[3]))


def test_a_mixed_small_step_is_staged_as_the_packed_path_lays_it_out(
    tiny_llama_dir: Path,
) -> None:
    """A verify step beside a plain decode request (tables of two widths) takes the
    plain-Python layout and lands as the numpy layout's packed buffer does; a step with a
    token still in flight does not take it."""
    engine = _engine(tiny_llama_dir)
    runner = engine.runner
    runner.num_kv_heads = 1
    spec = _verifying(engine, [21, 22, 23])
    plain = _request("p", list(range(3, 12)))
    assert engine.pool.allocate_slots(plain, 9) is not None
    plain.num_computed_tokens = 8
    sched = SchedulerOutput(scheduled=[ScheduledRequest(spec, 3, num_spec_tokens=2),
                                       ScheduledRequest(plain, 1)])  # fmt: skip
    graphs = DecodeGraphs(runner.model, torch.device("cpu"), max_num_seqs=8, max_blocks=8,
                          verify_rows=4)  # fmt: skip
    for key in graphs.variants(4):
        graphs.graphs[key] = None  # type: ignore[assignment]
    runner.graphs = graphs
    small = runner._small_decode_inputs(sched)
    assert small is not None and small.staged_rows == 4
    got = {
        "ids": small.input_ids.tolist(),
        "pos": small.positions.tolist(),
        "slots": small.meta.slot_mapping.tolist(),
        "lens": small.meta.seq_lens.tolist(),
    }
    runner.stage_small_steps = False
    packed = runner.prepare_inputs(sched)
    assert small.header == packed.header
    assert got == {
        "ids": [8, 21, 22, 11],
        "pos": [3, 4, 5, 8],
        "slots": packed.meta.slot_mapping.tolist(),
        "lens": [4, 5, 6, 9],
    }
    width = packed.meta.block_tables.shape[1]
    assert graphs.block_tables[:4, :width].tolist() == packed.meta.block_tables.tolist()
    assert small.sampling_requests == [spec, plain]
    runner.stage_small_steps = True
    plain.num_pending_tokens = 1  # its token is in flight: the numpy layout fills it in
    plain.num_computed_tokens = 9
    assert engine.pool.allocate_slots(plain, 1) is not None
    assert runner._small_decode_inputs(sched) is None
    for r in (spec, plain):
        engine.pool.free(r)


def test_pending_token_is_taken_from_the_previous_step(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    req = _request("a", [5, 6, 7])
    assert engine.pool.allocate_slots(req, 4) is not None
    req.num_computed_tokens = 3
    req.num_pending_tokens = 1  # sampled by a step whose ids are still on the device
    prev = InflightStep([_request("x", [1]), req], torch.tensor([11, 42]), None, [req])
    sched = SchedulerOutput(scheduled=[ScheduledRequest(req, 1)])
    inputs = engine.runner.prepare_inputs(sched, prev)
    assert inputs.input_ids.tolist() == [42] and inputs.positions.tolist() == [3]
    assert inputs.sampling_requests == [req]
    engine.pool.free(req)


def test_copy_blocks_round_trip_between_caches() -> None:
    gpu_like = KVCache(2, 6, 4, 2, 8, torch.float32, torch.device("cpu"))
    cpu = KVCache(2, 3, 4, 2, 8, torch.float32, torch.device("cpu"))
    gpu_like.data.normal_()
    original = gpu_like.data.clone()
    copy_blocks(gpu_like, cpu, [(4, 0), (1, 2)])
    gpu_like.data.zero_()
    copy_blocks(cpu, gpu_like, [(0, 4), (2, 1)])
    assert torch.equal(gpu_like.data[:, :, [1, 4]], original[:, :, [1, 4]])
    assert not gpu_like.data[:, :, [0, 2, 3, 5]].any()


def test_swaps_move_the_draft_kv_with_the_target_kv(tiny_llama_dir: Path) -> None:
    """With a draft model a swapped block takes both halves along: out to the CPU pool and
    back into other GPU blocks, bit for bit, and nothing else is touched."""
    spec = {"model": str(tiny_llama_dir), "num_speculative_tokens": 2}
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=8,
              preemption_mode="swap", speculative_config=spec)  # fmt: skip
    runner = llm.llm_engine.runner
    pools = [(runner.kv_cache, runner.cpu_cache), (runner.draft_kv_cache, runner.draft_cpu_cache)]
    for gpu, cpu in pools:
        assert gpu is not None and cpu is not None and cpu.data.device.type == "cpu"
        gpu.data.normal_()
    original = [gpu.data.clone() for gpu, _ in pools]
    runner.apply_block_moves(SchedulerOutput(blocks_to_swap_out=[(5, 0), (2, 3)]))
    for (gpu, cpu), before in zip(pools, original, strict=True):
        assert torch.equal(cpu.data[:, :, [0, 3]], before[:, :, [5, 2]])
        assert not cpu.data[:, :, [1, 2]].any()
        gpu.data.zero_()
    runner.apply_block_moves(SchedulerOutput(blocks_to_swap_in=[(0, 1), (3, 6)]))
    for (gpu, _), before in zip(pools, original, strict=True):
        assert torch.equal(gpu.data[:, :, [1, 6]], before[:, :, [5, 2]])
        assert not gpu.data[:, :, [0, 2, 3, 4, 5, 7]].any()
    llm.shutdown()
    assert runner.draft_cpu_cache is None and runner.cpu_cache is None
