"""Greedy engine output equals HF transformers token for token, under every scheduling path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.errors import (
    DuplicateRequestIdError,
    ErrorCode,
    InvalidRequestError,
    PromptTooLongError,
)
from asyncengine.scheduler import SchedulerOutput
from tests.asyncengine.engine_helpers import TINY_POOL, assert_pool_clean, hf_greedy

MAX_TOKENS = 24
LENGTHS = [5, 37, 16, 70, 1, 23]


def make_prompts(vocab: int, lengths: list[int] = LENGTHS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def run(model_dir: Path, prompts: list[list[int]], **engine_args) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(model_dir), dtype="float32", device="cpu", **engine_args)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    return llm, [o.outputs[0].token_ids for o in outs]


CASES = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 19},  # prefill chunks mixed with decodes
    "preempt_recompute": {**TINY_POOL, "preemption_mode": "recompute"},
    "preempt_swap": {**TINY_POOL, "preemption_mode": "swap"},
    "few_seqs": {"max_num_seqs": 2},
    # Step N+1 launched before step N is resolved (the CUDA default; the CPU's is one at a
    # time), through chunking and both kinds of preemption.
    "async": {"async_scheduling": True},
    "async_chunked": {"async_scheduling": True, "max_num_batched_tokens": 19},
    "async_preempt_recompute": {"async_scheduling": True, **TINY_POOL,
                                "preemption_mode": "recompute"},
    "async_preempt_swap": {"async_scheduling": True, **TINY_POOL, "preemption_mode": "swap"},
}


@pytest.mark.parametrize("model_fixture", ["tiny_mha_dir", "tiny_llama_dir"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_hf(request: pytest.FixtureRequest, model_fixture: str, case: str) -> None:
    model_dir = request.getfixturevalue(model_fixture)
    vocab = 452
    prompts = make_prompts(vocab)
    llm, ours = run(model_dir, prompts, **CASES[case])
    assert ours == hf_greedy(model_dir, prompts, MAX_TOKENS)
    if "preempt" in case or "swap" in case:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    if case.endswith("swap"):
        assert llm.llm_engine.scheduler.num_swaps_out > 0
        assert llm.llm_engine.scheduler.num_swaps_in > 0
    assert_pool_clean(llm)


def test_shared_prefix_hits_cache(tiny_llama_dir: Path) -> None:
    prefix = make_prompts(452, [48], seed=7)[0]
    suffixes = make_prompts(452, [3, 9, 20, 1], seed=8)
    prompts = [prefix + s for s in suffixes]
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    ours = [o.outputs[0].token_ids for o in first + rest]
    assert ours == hf_greedy(tiny_llama_dir, prompts, MAX_TOKENS)
    pool = llm.llm_engine.pool
    # The 3 later requests each reuse the 3 full blocks of the shared 48-token prefix.
    assert pool.prefix_hits == 3 * 48
    assert sum(o.metrics.num_cached_prompt_tokens for o in rest) == 3 * 48
    assert_pool_clean(llm)


def test_default_model_greedy_equals_hf(default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    texts = [
        "The capital of France is",
        "Once upon a time, there was a",
        "def add(a, b):\n    return",
        "1, 2, 3, 4,",
    ]
    prompts = [tok.encode(t) for t in texts]
    llm, ours = run(default_model_dir, prompts, max_num_batched_tokens=12)
    assert ours == hf_greedy(default_model_dir, prompts, MAX_TOKENS)
    assert_pool_clean(llm)


def test_default_model_chat_knows_paris() -> None:
    llm = LLM(dtype="float32", device="cpu")
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=30),
        use_tqdm=False,
    )
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"
    assert_pool_clean(llm)


def test_stop_strings_and_tokens(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu")
    prompt = make_prompts(452, [12], seed=3)[0]
    base = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    # Stop on the 5th generated token id.
    stop_tok = base.token_ids[4]
    first = base.token_ids.index(stop_tok)
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_tok]),
        use_tqdm=False,
    )[0]
    assert out.outputs[0].token_ids == base.token_ids[: first + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop_tok)
    # Stop on a piece of the text: output is trimmed before it.
    text = base.text
    needle = text[len(text) // 2 : len(text) // 2 + 3]
    if needle.strip():
        out = llm.generate(
            [prompt],
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[needle]),
            use_tqdm=False,
        )[0].outputs[0]
        assert out.text == text[: text.index(needle)]
        assert (out.finish_reason, out.stop_reason) == ("stop", needle)
    assert_pool_clean(llm)


def test_rejects_requests_that_can_never_fit(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=64, num_kv_blocks=3)
    engine = llm.llm_engine
    with pytest.raises(PromptTooLongError, match="exceeds max_model_len") as info:
        engine.add_request("a", list(range(3, 60)), SamplingParams(max_tokens=10))
    assert info.value.field == "max_tokens"
    with pytest.raises(PromptTooLongError, match="needs 4 KV blocks but the pool has only 3"):
        engine.add_request("b", list(range(3, 40)), SamplingParams(max_tokens=20))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary") as info:
        engine.add_request("c", [1, 10**6], SamplingParams())
    assert (info.value.code, info.value.field) == (ErrorCode.INVALID_REQUEST, "prompt_token_ids")
    with pytest.raises(ValueError, match="empty"):  # the typed errors are still ValueErrors
        engine.add_request("d", [], SamplingParams())
    engine.add_request("e", [5, 6], SamplingParams())
    with pytest.raises(DuplicateRequestIdError, match="already in flight"):
        engine.add_request("e", [5, 6], SamplingParams())
    engine.abort_request("e")
    assert not engine.has_unfinished_requests()
    # LLM: one refused prompt refuses the batch and leaves none of it queued.
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[5, 6], [1, 10**6]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


def test_request_rate_starts_at_the_second_token(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", async_scheduling=False)
    engine = llm.llm_engine
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # prefill: the first token
    [first] = engine.get_stats().requests
    assert first.generated_tokens == 1 and first.tokens_per_s is None
    engine.step()
    [second] = engine.get_stats().requests
    m = engine.scheduler.requests["r"].metrics
    assert second.generated_tokens == 2 and second.tokens_per_s is not None
    # One token after the first, over at least the time between the two.
    assert 0 < second.tokens_per_s <= 1 / (m.last_token_time - m.first_token_time)
    engine.abort_request("r")


def test_output_kinds_and_logprobs(tiny_llama_dir: Path) -> None:
    from asyncengine import RequestOutputKind

    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu")
    engine = llm.llm_engine
    prompt = make_prompts(452, [10], seed=5)[0]
    engine.add_request(
        "d",
        prompt,
        SamplingParams(
            temperature=0,
            max_tokens=8,
            ignore_eos=True,
            logprobs=3,
            output_kind=RequestOutputKind.DELTA,
        ),
    )
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert len(deltas) == 8 and all(len(d.outputs[0].token_ids) == 1 for d in deltas)
    ids = [d.outputs[0].token_ids[0] for d in deltas]
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"
    for d in deltas:
        lp = d.outputs[0].logprobs[0]
        tok = d.outputs[0].token_ids[0]
        assert tok in lp and 3 <= len(lp) <= 4
        assert lp[tok] == pytest.approx(max(lp.values()))  # greedy picks the top logprob
    full = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert full.token_ids == ids
    assert full.text == "".join(d.outputs[0].text for d in deltas)


def test_a_step_that_runs_nothing_still_moves_its_blocks(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Preemption can swap out every running sequence and schedule none: that step's
    swap-outs must still be copied, or the requests come back to garbage K/V."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=8,
              preemption_mode="swap")  # fmt: skip
    engine = llm.llm_engine
    runner = engine.runner
    assert runner.kv_cache is not None and runner.cpu_cache is not None
    runner.kv_cache.data.normal_()
    before = runner.kv_cache.data.clone()
    moves_only = SchedulerOutput(blocks_to_swap_out=[(5, 0), (2, 3)])
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: moves_only)
    assert engine.step() == []
    assert engine.step_timing["steps"] == 0  # nothing was launched
    assert torch.equal(runner.cpu_cache.data[:, :, [0, 3]], before[:, :, [5, 2]])
    llm.shutdown()


# ------------------------------------------------------- room kept for growth
def test_room_kept_for_growth_is_in_the_stats_and_spares_preemption(tiny_llama_dir: Path) -> None:
    """A pool that holds the prompts but not every output: with room kept for growth the
    engine runs fewer requests at once and preempts none; the outputs are the same."""
    prompts = make_prompts(452)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens: dict[float, dict[str, list[int]]] = {}
    preemptions = {}
    for conservativeness in (1.0, 0.0):
        llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=14,
                  schedule_conservativeness=conservativeness)
        engine = llm.llm_engine
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        done = {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        stats = engine.get_stats()
        if conservativeness:
            assert stats.kv_blocks_reserved > 0
            assert stats.num_waiting > 0  # held back while blocks are free
        else:
            assert stats.kv_blocks_reserved == 0
        while engine.has_unfinished_requests():
            done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        tokens[conservativeness] = done
        preemptions[conservativeness] = engine.scheduler.num_preemptions
        assert_pool_clean(llm)
    assert preemptions[1.0] == 0 and preemptions[0.0] > 0
    assert len(tokens[1.0]) == len(prompts) and tokens[1.0] == tokens[0.0]
    assert all(len(ids) == MAX_TOKENS for ids in tokens[1.0].values())


def test_bad_schedule_conservativeness_is_refused_by_name() -> None:
    from asyncengine.config import EngineArgs

    with pytest.raises(ValueError, match="schedule_conservativeness must be >= 0"):
        EngineArgs(schedule_conservativeness=-1.0)
