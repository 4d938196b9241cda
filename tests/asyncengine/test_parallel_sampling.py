"""Parallel sampling (`SamplingParams.n > 1`) through the engine: the prompt's KV is computed
once and shared, each sample equals what a lone request would give (HF greedy; seed + i),
under chunking, preemption of both kinds and asynchronous scheduling, and the pool is clean
after."""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import pytest

from asyncengine import LLM, RequestOutputKind, SamplingParams
from asyncengine.errors import ErrorCode, InvalidRequestError
from asyncengine.llm_engine import LLMEngine
from tests.asyncengine.engine_helpers import assert_pool_clean, hf_greedy
from tests.asyncengine.test_llm_engine import CASES, make_prompts

VOCAB = 452
MAX_TOKENS = 24
N = 3
LENGTHS = [5, 37, 16, 70, 1, 23]


@cache
def _hf_greedy(model_dir: Path, prompts: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    return hf_greedy(model_dir, [list(p) for p in prompts], MAX_TOKENS)


def make_llm(model_dir: Path, **engine_args) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cpu", **engine_args)


def sampled(outs) -> list[list[list[int]]]:
    """Token ids per request, per sample in index order (and the indexes checked)."""
    result = []
    for out in outs:
        assert [c.index for c in out.outputs] == list(range(len(out.outputs)))
        result.append([c.token_ids for c in out.outputs])
    return result


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_samples_each_equal_hf(tiny_llama_dir: Path, case: str) -> None:
    prompts = make_prompts(VOCAB, LENGTHS)
    llm = make_llm(tiny_llama_dir, **CASES[case])
    params = SamplingParams(n=N, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    want = _hf_greedy(tiny_llama_dir, tuple(map(tuple, prompts)))
    assert sampled(outs) == [[w] * N for w in want]
    assert all(c.finish_reason == "length" for o in outs for c in o.outputs)
    sched = llm.llm_engine.scheduler
    if "preempt" in case:
        assert sched.num_preemptions > 0
    if case.endswith("swap"):
        assert sched.num_swaps_out > 0 and sched.num_swaps_in > 0
    assert_pool_clean(llm)


def seeded(n: int, seed: int, max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens,
                          ignore_eos=True, **kw)


def test_seeded_samples_differ_repeat_and_equal_lone_requests_with_seed_plus_i(
    tiny_llama_dir: Path,
) -> None:
    prompts = make_prompts(VOCAB, [21, 40], seed=3)
    llm = make_llm(tiny_llama_dir)
    first = sampled(llm.generate(prompts, seeded(4, 7), use_tqdm=False))
    for samples in first:
        assert len({tuple(s) for s in samples}) > 1, "the n samples are all the same"
    # Reproducible, prompt blocks cached this time or not.
    assert sampled(llm.generate(prompts, seeded(4, 7), use_tqdm=False)) == first
    assert sampled(make_llm(tiny_llama_dir).generate(prompts, seeded(4, 7),
                                                     use_tqdm=False)) == first
    # Sample i is what a lone request with seed + i draws (vLLM's convention).
    for p, samples in zip(prompts, first, strict=True):
        for i, s in enumerate(samples):
            lone = make_llm(tiny_llama_dir).generate([p], seeded(1, 7 + i), use_tqdm=False)
            assert lone[0].outputs[0].token_ids == s


@pytest.mark.parametrize("case", ["preempt_recompute", "preempt_swap", "async",
                                  "async_preempt_recompute", "async_preempt_swap", "chunked"])
def test_seeded_samples_unchanged_by_scheduling(tiny_llama_dir: Path, case: str) -> None:
    prompts = make_prompts(VOCAB, LENGTHS, seed=4)
    params = seeded(N, 11, max_tokens=MAX_TOKENS, logprobs=2)
    base = make_llm(tiny_llama_dir).generate(prompts, params, use_tqdm=False)
    llm = make_llm(tiny_llama_dir, **CASES[case])
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert sampled(outs) == sampled(base)
    for a, b in zip(outs, base, strict=True):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert ca.text == cb.text
            assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-3)
    if "preempt" in case:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_pool_clean(llm)


def test_prompt_is_prefilled_once_and_its_blocks_shared(tiny_llama_dir: Path) -> None:
    llm = make_llm(tiny_llama_dir, enable_prefix_caching=False, max_num_batched_tokens=512)
    engine = llm.llm_engine
    prompt = make_prompts(VOCAB, [70], seed=9)[0]
    engine.add_request("p", prompt, SamplingParams(n=4, temperature=0, max_tokens=5,
                                                   ignore_eos=True))
    engine.step()  # the prompt, once
    assert engine._prompt_meter.total == len(prompt)
    engine.step()  # three forks recompute the prompt's last token; the first decodes
    assert engine._prompt_meter.total == len(prompt) + 3
    seqs = engine.scheduler.get_sequences("p")
    assert len(seqs) == 4 and [s.index for s in seqs] == [0, 1, 2, 3]
    bs = engine.pool.block_size
    full = (len(prompt) - 1) // bs
    # Full prompt blocks shared by all four; the partial last one copied on first write.
    for s in seqs:
        assert s.block_table[:full] == seqs[0].block_table[:full]
    assert len({s.block_table[full] for s in seqs}) == 4
    assert all(engine.pool.ref_counts[b] == 4 for b in seqs[0].block_table[:full])
    assert engine.pool.num_used_blocks == full + 4
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_clean(llm)


def _long_context_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = 2048
    cfg_path.write_text(json.dumps(cfg))
    return dst


def peak_blocks(engine: LLMEngine) -> int:
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.pool.num_used_blocks)
    return peak


def test_n8_on_a_long_prompt_holds_the_prompt_once(tiny_llama_dir: Path,
                                                   tmp_path: Path) -> None:
    model = _long_context_model(tiny_llama_dir, tmp_path / "long")
    prompt = make_prompts(VOCAB, [1000], seed=2)[0]
    gen = 32
    args = dict(num_kv_blocks=1024, max_num_batched_tokens=2048, enable_prefix_caching=False)
    engine = make_llm(model, **args).llm_engine
    engine.add_request("n8", prompt, seeded(8, 1, max_tokens=gen))
    parallel = peak_blocks(engine)
    engine = make_llm(model, **args).llm_engine
    for i in range(8):
        engine.add_request(f"r{i}", prompt, seeded(1, 1 + i, max_tokens=gen))
    separate = peak_blocks(engine)
    bs = engine.pool.block_size
    prompt_blocks = -(-len(prompt) // bs)
    tail = -(-(len(prompt) + gen) // bs) - (len(prompt) - 1) // bs
    assert parallel <= prompt_blocks + 8 * tail
    assert separate >= 8 * prompt_blocks
    assert parallel * 4 < separate


@pytest.mark.parametrize("n", [0, -2, 1.5, "2", True])
def test_bad_n_is_refused_naming_the_field(tiny_llama_dir: Path, n: object) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(n=n)  # type: ignore[arg-type]
    assert err.value.field == "n" and err.value.code == ErrorCode.INVALID_REQUEST


def test_n_beyond_what_the_pool_can_hold_is_refused(tiny_llama_dir: Path) -> None:
    llm = make_llm(tiny_llama_dir, num_kv_blocks=14, schedule_conservativeness=0)
    engine = llm.llm_engine
    prompt = make_prompts(VOCAB, [40])[0]
    engine.add_request("ok", prompt, SamplingParams(n=5, max_tokens=8))  # 3 + 4 * 1 blocks
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("big", prompt, SamplingParams(n=13, max_tokens=8))
    assert err.value.field == "n" and err.value.code == ErrorCode.INVALID_REQUEST
    assert "big" not in engine.scheduler.requests
    engine.abort_request("ok")
    assert_pool_clean(llm)


def test_abort_ends_all_samples(tiny_llama_dir: Path) -> None:
    llm = make_llm(tiny_llama_dir)
    engine = llm.llm_engine
    engine.add_request("a", make_prompts(VOCAB, [30])[0], seeded(4, 0, max_tokens=50))
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.get_sequences("a")) == 4
    engine.abort_request("a")
    assert engine.get_num_unfinished_requests() == 0
    assert_pool_clean(llm)


def test_delta_outputs_carry_their_sample_index(tiny_llama_dir: Path) -> None:
    llm = make_llm(tiny_llama_dir)
    engine = llm.llm_engine
    prompt = make_prompts(VOCAB, [12], seed=6)[0]
    engine.add_request("d", prompt, seeded(3, 5, max_tokens=10, logprobs=1,
                                           output_kind=RequestOutputKind.DELTA))
    text: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    for out in outs:
        for c in out.outputs:
            text[c.index] = text.get(c.index, "") + c.text
            ids.setdefault(c.index, []).extend(c.token_ids)
            assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    full = llm.generate([prompt], seeded(3, 5, max_tokens=10), use_tqdm=False)[0]
    assert [c.token_ids for c in full.outputs] == [ids[i] for i in range(3)]
    assert [c.text for c in full.outputs] == [text[i] for i in range(3)]
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert_pool_clean(llm)
