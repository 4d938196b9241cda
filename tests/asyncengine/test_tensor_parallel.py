"""Tensor parallelism: sharded layers against their unsharded reference (one process), and
the engine at TP=2/4 on CPU with gloo, greedy output equal to TP=1 token for token."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import models.layers as layers
from asyncengine import LLM, SamplingParams
from asyncengine.distributed import TensorParallelWorkerError
from asyncengine.llm_engine import StepError
from asyncengine.model_runner import ModelRunner
from asyncengine.tp_runner import TensorParallelModelRunner, check_tp_compatible
from models.config import ModelConfig
from models.loader import iterate_safetensors, load_model
from models.parallel import get_tp_size, set_tensor_parallel
from tests.asyncengine.engine_helpers import TINY_POOL, assert_pool_clean, hf_greedy

MAX_TOKENS = 24
LENGTHS = [5, 37, 16, 70, 1, 23]
VOCAB = 452


@contextmanager
def as_rank(rank: int, size: int) -> Iterator[None]:
    """Build layers as `rank` of `size` (the TP state is read at construction)."""
    set_tensor_parallel(rank, size)
    try:
        yield
    finally:
        set_tensor_parallel(0, 1)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    # Ranks share two cores; a second intra-op thread in rank 0 would only contend.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------- sharded layers
@pytest.mark.parametrize("tp", [2, 4])
def test_column_parallel_shards_concatenate_to_full(tp: int) -> None:
    torch.manual_seed(0)
    w, b, x = torch.randn(24, 16), torch.randn(24), torch.randn(5, 16)
    outs = []
    for r in range(tp):
        with as_rank(r, tp):
            layer = layers.ColumnParallelLinear(16, 24, bias=True)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        outs.append(layer(x))
    torch.testing.assert_close(torch.cat(outs, dim=-1), F.linear(x, w, b))


@pytest.mark.parametrize("tp", [2, 4])
def test_merged_column_shards_hold_gate_and_up_halves(tp: int) -> None:
    torch.manual_seed(0)
    gate, up, x = torch.randn(32, 8), torch.randn(32, 8), torch.randn(3, 8)
    gates, ups = [], []
    for r in range(tp):
        with as_rank(r, tp):
            layer = layers.MergedColumnParallelLinear(8, [32, 32])
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        g, u = layer(x).chunk(2, dim=-1)
        gates.append(g)
        ups.append(u)
    torch.testing.assert_close(torch.cat(gates, -1), x @ gate.T)
    torch.testing.assert_close(torch.cat(ups, -1), x @ up.T)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_shards_split_query_heads_and_replicate_scarce_kv_heads(tp: int) -> None:
    torch.manual_seed(0)
    hd, heads, kv_heads, hidden = 4, 4, 2, 8
    q = torch.randn(heads * hd, hidden)
    k, v = torch.randn(kv_heads * hd, hidden), torch.randn(kv_heads * hd, hidden)
    x = torch.randn(3, hidden)
    qs = []
    for r in range(tp):
        with as_rank(r, tp):
            layer = layers.QKVParallelLinear(hidden, hd, heads, kv_heads, bias=False)
        for shard_id, tensor in (("q", q), ("k", k), ("v", v)):
            layer.weight.weight_loader(layer.weight, tensor, shard_id)
        assert layer.num_heads == heads // tp
        assert layer.num_kv_heads == max(kv_heads // tp, 1)
        q_r, k_r, v_r = layer(x).split(
            [layer.num_heads * hd, layer.num_kv_heads * hd, layer.num_kv_heads * hd], dim=-1
        )
        qs.append(q_r)
        # With more ranks than KV heads, ranks 2i and 2i+1 both hold KV head i.
        group = r * kv_heads // tp
        rows = slice(group * layer.num_kv_heads * hd, (group + 1) * layer.num_kv_heads * hd)
        torch.testing.assert_close(k_r, x @ k[rows].T)
        torch.testing.assert_close(v_r, x @ v[rows].T)
    torch.testing.assert_close(torch.cat(qs, -1), x @ q.T)


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_partial_sums_add_up_to_full(tp: int) -> None:
    torch.manual_seed(0)
    w, b, x = torch.randn(12, 32), torch.randn(12), torch.randn(5, 32)
    total = torch.zeros(5, 12)
    for r in range(tp):
        with as_rank(r, tp):
            layer = layers.RowParallelLinear(32, 12, bias=True)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        cols = slice(r * 32 // tp, (r + 1) * 32 // tp)
        total += F.linear(x[:, cols], layer.weight)  # what each rank feeds the all-reduce
        torch.testing.assert_close(layer.bias, b)  # added once, after the reduction
    torch.testing.assert_close(total + b, F.linear(x, w, b))


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_embedding_and_lm_head_cover_an_uneven_vocab(
    tp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each rank's output stands alone: the test adds / concatenates them itself.
    monkeypatch.setattr(layers, "all_reduce", lambda t: t)
    monkeypatch.setattr(layers, "all_gather_last_dim", lambda t: t)
    torch.manual_seed(0)
    vocab, dim = 451, 8  # not a multiple of tp: the last shard is padded
    table, hidden = torch.randn(vocab, dim), torch.randn(4, dim)
    ids = torch.tensor([0, 112, 113, 225, 226, 338, 339, 450])
    embedded, logits = torch.zeros(len(ids), dim), []
    for r in range(tp):
        with as_rank(r, tp):
            emb = layers.VocabParallelEmbedding(vocab, dim)
            head = layers.ParallelLMHead(vocab, dim)
        emb.weight.weight_loader(emb.weight, table)
        head.weight.weight_loader(head.weight, table)
        embedded += emb(ids)
        logits.append(head.compute_logits(hidden))
    torch.testing.assert_close(embedded, table[ids])
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], hidden @ table.T)


def test_loader_gives_each_rank_its_slice_with_replicated_kv(tiny_llama_dir: Path) -> None:
    """TP=4 over 4 query / 2 KV heads: every rank loads the checkpoint and keeps its part."""
    cfg = ModelConfig.from_dir(tiny_llama_dir)
    full = dict(iterate_safetensors(tiny_llama_dir, progress=False))
    p = "model.layers.1."
    hd = cfg.head_dim
    for r in range(4):
        with as_rank(r, 4):
            model = load_model(tiny_llama_dir, cfg, dtype=torch.float32, device=torch.device("cpu"))
        layer = model.model.layers[1]
        q, k, v = layer.self_attn.qkv_proj.weight.split([hd, hd, hd])
        torch.testing.assert_close(q, full[p + "self_attn.q_proj.weight"][r * hd : (r + 1) * hd])
        kv_rows = slice((r // 2) * hd, (r // 2 + 1) * hd)
        torch.testing.assert_close(k, full[p + "self_attn.k_proj.weight"][kv_rows])
        torch.testing.assert_close(v, full[p + "self_attn.v_proj.weight"][kv_rows])
        o_cols = slice(r * hd, (r + 1) * hd)
        torch.testing.assert_close(
            layer.self_attn.o_proj.weight, full[p + "self_attn.o_proj.weight"][:, o_cols]
        )
        m = cfg.intermediate_size // 4
        gate, up = layer.mlp.gate_up_proj.weight.split([m, m])
        torch.testing.assert_close(gate, full[p + "mlp.gate_proj.weight"][r * m : (r + 1) * m])
        torch.testing.assert_close(up, full[p + "mlp.up_proj.weight"][r * m : (r + 1) * m])
        torch.testing.assert_close(
            layer.mlp.down_proj.weight, full[p + "mlp.down_proj.weight"][:, r * m : (r + 1) * m]
        )


def test_incompatible_sizes_are_refused_before_any_process_starts(tiny_llama_dir: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_llama_dir)
    check_tp_compatible(cfg, 4)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        check_tp_compatible(cfg, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size=8 does not divide"):
        LLM(str(tiny_llama_dir), device="cpu", tensor_parallel_size=8)
    assert get_tp_size() == 1


# ------------------------------------------------------------------- the engine
def make_prompts(lengths: list[int] = LENGTHS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def make_llm(model_dir: Path, **engine_args: Any) -> LLM:
    engine_args.setdefault("num_kv_blocks", 64)
    return LLM(str(model_dir), dtype="float32", device="cpu", **engine_args)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts = make_prompts()
    return prompts, generate(make_llm(tiny_llama_dir), prompts)


CASES = {
    # prefill chunks mixed with decodes
    "tp2_chunked": dict(tensor_parallel_size=2, max_num_batched_tokens=19),
    # preemption by swap: block moves travel with the step
    "tp2_preempt_swap": dict(tensor_parallel_size=2, **TINY_POOL, preemption_mode="swap"),
    # 2 KV heads over 4 ranks: each KV head lives on two ranks
    "tp4_replicated_kv": dict(tensor_parallel_size=4),
    # step N+1 launched before step N's ids reach the host: rank 0 broadcasts the filled ids
    "tp2_async_chunked": dict(
        tensor_parallel_size=2, async_scheduling=True, max_num_batched_tokens=19
    ),
    "tp2_async_preempt_swap": dict(
        tensor_parallel_size=2, async_scheduling=True, **TINY_POOL, preemption_mode="swap"
    ),
    # a draft model (the target itself: its drafts are all kept) whole on rank 0, its K/V in
    # rank 0's blocks only, swapped with them
    "tp2_draft_model_preempt_swap": dict(
        tensor_parallel_size=2, **TINY_POOL, preemption_mode="swap", draft=2
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp_greedy_equals_tp1(
    tiny_llama_dir: Path, reference: tuple[list[list[int]], list[list[int]]], case: str
) -> None:
    prompts, expected = reference
    args = dict(CASES[case])
    draft_k = args.pop("draft", 0)
    if draft_k:
        args["speculative_config"] = {"model": str(tiny_llama_dir),
                                      "num_speculative_tokens": draft_k}  # fmt: skip
    llm = make_llm(tiny_llama_dir, **args)
    try:
        engine = llm.llm_engine
        assert isinstance(engine.runner, TensorParallelModelRunner)
        assert get_tp_size() == CASES[case]["tensor_parallel_size"]
        assert engine.async_scheduling == CASES[case].get("async_scheduling", False)
        overlapped = 0
        prepare = engine.runner.prepare_inputs

        def counting_prepare(sched: Any, prev: Any = None) -> Any:
            nonlocal overlapped
            overlapped += prev is not None
            return prepare(sched, prev)

        engine.runner.prepare_inputs = counting_prepare  # type: ignore[method-assign]
        assert generate(llm, prompts) == expected
        # Asynchronous steps really launched on top of an in-flight one.
        assert (overlapped > 0) == engine.async_scheduling
        if case.endswith("preempt_swap"):
            assert engine.scheduler.num_swaps_out > 0 and engine.scheduler.num_swaps_in > 0
        if draft_k:
            metrics = engine.spec_decoder.metrics
            assert metrics.num_drafts > 0
            assert metrics.num_accepted_tokens >= 0.9 * metrics.num_draft_tokens  # its own
            assert engine.runner.draft_kv_cache is not None
        assert_pool_clean(llm)
        pids = engine.runner.workers.pids
    finally:
        llm.llm_engine.shutdown()
    assert get_tp_size() == 1
    for pid in pids:  # every worker has exited and been reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_set_up_calls_run_on_every_rank(tiny_llama_dir: Path) -> None:
    """A set-up call runs the named runner method on every rank (arguments pickled, floats
    as they are) and gives rank 0 each rank's result."""
    llm = make_llm(tiny_llama_dir, tensor_parallel_size=2)
    try:
        runner = llm.llm_engine.runner
        assert isinstance(runner, TensorParallelModelRunner)
        assert runner._call_all("block_bytes") == [runner.block_bytes()] * 2
        gib = 0.0123456789  # on the CPU the count follows the swap-pool size exactly
        own = ModelRunner.profile_num_blocks(runner, 0.5, 64, gib)
        assert own == int(gib * 2**30) // runner.block_bytes()
        assert runner.profile_num_blocks(0.5, 64, gib) == own
        assert generate(llm, make_prompts([9, 4], seed=3))  # the workers still serve steps
    finally:
        llm.llm_engine.shutdown()
    assert get_tp_size() == 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_dead_worker_fails_the_step_with_a_clear_error(
    tiny_llama_dir: Path, async_scheduling: bool
) -> None:
    llm = make_llm(tiny_llama_dir, tensor_parallel_size=2, async_scheduling=async_scheduling)
    try:
        prompts = make_prompts([9, 4], seed=3)
        assert len(generate(llm, prompts)) == 2
        os.kill(llm.llm_engine.runner.workers.pids[0], signal.SIGKILL)
        with pytest.raises(StepError) as err:
            generate(llm, prompts)
        assert isinstance(err.value.cause, TensorParallelWorkerError)
        assert "worker rank 1" in str(err.value.cause) and "SIGKILL" in str(err.value.cause)
        # The engine stays failed (no hang) and its requests were aborted.
        with pytest.raises(StepError, match="SIGKILL"):
            generate(llm, prompts)
        assert not llm.llm_engine.has_unfinished_requests()
    finally:
        llm.llm_engine.shutdown()
    assert get_tp_size() == 1


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_gpu_tp2_over_nccl_equals_hf(tiny_llama_dir: Path, enforce_eager: bool) -> None:
    """NCCL, rank r on cuda:r; decode steps replay graphs captured on both ranks."""
    prompts = make_prompts()
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        device="cuda",
        tensor_parallel_size=2,
        **TINY_POOL,
        max_num_batched_tokens=19,
        preemption_mode="swap",
        enforce_eager=enforce_eager,
        max_num_seqs=8,
    )
    try:
        assert generate(llm, prompts) == hf_greedy(tiny_llama_dir, prompts, MAX_TOKENS)
        engine = llm.llm_engine
        assert engine.scheduler.num_swaps_out > 0
        if not enforce_eager:
            assert engine.runner.graphs is not None and engine.runner.graphs.graphs
        assert_pool_clean(llm)
    finally:
        llm.llm_engine.shutdown()


def test_tp_parallel_samples_copy_their_blocks_on_every_rank(
    tiny_llama_dir: Path, reference: tuple[list[list[int]], list[list[int]]]
) -> None:
    """n > 1: copy-on-write of the shared prompt blocks (and swaps of whole groups) travel
    with the step to every rank; each greedy sample equals TP=1."""
    prompts, expected = reference
    llm = make_llm(tiny_llama_dir, tensor_parallel_size=2, num_kv_blocks=20,
                   schedule_conservativeness=0, preemption_mode="swap")
    try:
        params = SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [[list(c.token_ids) for c in o.outputs] for o in outs] == [[e] * 3
                                                                         for e in expected]
        assert llm.llm_engine.scheduler.num_preemptions > 0
        assert_pool_clean(llm)
    finally:
        llm.llm_engine.shutdown()
    assert get_tp_size() == 1


def test_tp_workers_build_the_fp8_kv_cache_too(tiny_llama_dir: Path) -> None:
    """kv_cache_dtype reaches every rank: the workers' blocks are e4m3 as rank 0's, and a TP=2
    run with swaps equals the TP=1 run over the same FP8 cache."""
    prompts = make_prompts()
    expected = generate(make_llm(tiny_llama_dir, kv_cache_dtype="fp8"), prompts)
    llm = make_llm(tiny_llama_dir, tensor_parallel_size=2, kv_cache_dtype="fp8",
                   **TINY_POOL, preemption_mode="swap")  # fmt: skip
    try:
        runner = llm.llm_engine.runner
        assert isinstance(runner, TensorParallelModelRunner)
        assert runner.kv_cache_dtype == torch.float8_e4m3fn
        cfg = llm.llm_engine.model_config
        # K and V, every layer, 16 tokens, this rank's one KV head, one byte per element.
        e4m3_bytes = 2 * cfg.num_hidden_layers * 16 * 1 * cfg.head_dim
        assert runner._call_all("block_bytes") == [e4m3_bytes] * 2
        assert generate(llm, prompts) == expected
        assert llm.llm_engine.scheduler.num_swaps_out > 0
    finally:
        llm.llm_engine.shutdown()


def test_tp_ranks_calibrate_their_own_kv_heads_from_the_same_ids(tiny_llama_dir: Path) -> None:
    """FP8 KV scales calibrated at start-up: every rank runs the pass over rank 0's ids and
    calibrates its own KV heads; the ranks' scales side by side are TP=1's, and two TP=2
    engines agree on scales and greedy tokens."""
    prompts = make_prompts()
    single = make_llm(tiny_llama_dir, kv_cache_dtype="fp8").llm_engine.calibrated_kv_scales
    assert single is not None
    runs = []
    for _ in range(2):
        llm = make_llm(tiny_llama_dir, tensor_parallel_size=2, kv_cache_dtype="fp8")
        try:
            engine = llm.llm_engine
            scales = engine.calibrated_kv_scales
            assert scales is not None
            # Rank 0's layers hold the first of the two KV heads.
            for attn, (k, v) in zip(engine.runner.model.attention_layers(), scales, strict=True):
                assert torch.equal(attn.k_scale, k[:1]) and torch.equal(attn.v_scale, v[:1])
            runs.append((scales, generate(llm, prompts)))
        finally:
            llm.llm_engine.shutdown()
    assert get_tp_size() == 1
    (first, tokens), (second, tokens_again) = runs
    assert tokens == tokens_again
    for (k, v), (k2, v2), (k1, v1) in zip(first, second, single, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)
        # The sharded layers sum their partial products in another order: float32 rounding.
        torch.testing.assert_close(k, k1, rtol=1e-5, atol=0)
        torch.testing.assert_close(v, v1, rtol=1e-5, atol=0)
