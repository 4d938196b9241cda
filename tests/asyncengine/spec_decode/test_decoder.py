"""Speculative decoding in the engine: greedy output equals HF and the non-speculative engine
token for token under every scheduling path, with drafts both kept and rejected; the rejected
drafts' slots are rolled back; penalties, stops, logprobs and n > 1 stay correct."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.sampling_params import RequestOutputKind
from asyncengine.spec_decode import NgramProposer, SpecDecodingMetrics
from asyncengine.spec_decode.replay import ReplayProposer
from tests.asyncengine.engine_helpers import TINY_POOL, assert_pool_clean, hf_greedy

VOCAB = 452
MAX_TOKENS = 24
# A draft cap that lets batches of several requests speculate (the default stops at three).
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "max_draft_tokens_per_step": 64}


def prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 37, 16, 70, 2)]
    # A prompt that repeats itself gives the n-gram proposer something to find.
    out.append(out[1][:9] * 4)
    return out


def spec_llm(model_dir: Path, speculative_config: dict | None = None, **engine_args) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cpu",
               speculative_config=speculative_config or NGRAM, **engine_args)  # fmt: skip


def generate(llm: LLM, ps: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def shared_spec(tiny_llama_dir: Path) -> LLM:
    return spec_llm(tiny_llama_dir)


@pytest.fixture
def spec(shared_spec: LLM) -> LLM:
    """The shared speculating engine with the n-gram proposer and fresh counters."""
    decoder = shared_spec.llm_engine.spec_decoder
    decoder.proposer = NgramProposer(1, 3)
    decoder.metrics = SpecDecodingMetrics(4)
    return shared_spec


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> dict[tuple[int, ...], list[int]]:
    ps = prompts()
    outs = hf_greedy(tiny_llama_dir, ps, MAX_TOKENS)
    return {tuple(p): o for p, o in zip(ps, outs, strict=True)}


CASES = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 19},  # drafts cut to the budget, mixed with prefill
    "preempt_recompute": {**TINY_POOL, "preemption_mode": "recompute"},
    "preempt_swap": {**TINY_POOL, "preemption_mode": "swap"},
    "async_few_seqs": {"async_scheduling": True, "max_num_seqs": 2},
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_replay_equals_hf(tiny_llama_dir: Path, reference: dict, case: str) -> None:
    llm = spec_llm(tiny_llama_dir, **CASES[case])
    spec = llm.llm_engine.spec_decoder
    spec.proposer = ReplayProposer(reference, acceptance=0.7, vocab_size=VOCAB, seed=1)
    ps = prompts()
    assert generate(llm, ps, GREEDY) == [reference[tuple(p)] for p in ps]
    m = spec.metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens  # kept and rejected drafts both
    assert_pool_clean(llm)


def test_ngram_greedy_equals_hf(spec: LLM, reference: dict) -> None:
    llm = spec
    ps = prompts()
    assert generate(llm, ps, GREEDY) == [reference[tuple(p)] for p in ps]
    assert llm.llm_engine.spec_decoder.metrics.num_drafts > 0
    assert_pool_clean(llm)


def test_rejected_slots_are_rolled_back(spec: LLM, reference: dict) -> None:
    llm = spec
    engine = llm.llm_engine
    engine.spec_decoder.proposer = ReplayProposer(reference, 0.5, VOCAB, seed=2)
    for i, p in enumerate(prompts()):
        engine.add_request(str(i), p, GREEDY)
    verified = 0
    while engine.has_unfinished_requests():
        before = engine.spec_decoder.metrics.num_drafts
        engine.step()
        engine.check_integrity()
        verified += engine.spec_decoder.metrics.num_drafts - before
        for req in engine.scheduler.running:
            # Computed: everything but the newest token; blocks: no more than its slot needs.
            assert req.num_computed_tokens == req.num_tokens - 1
            assert len(req.block_table) <= engine.pool.blocks_needed(req.num_tokens)
    assert verified > 0
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_shared_step_with_and_without_drafts(spec: LLM, reference: dict) -> None:
    llm = spec
    ps = prompts()
    # Only half the prompts have a replay: the others never draft, in the same steps.
    half = {k: v for i, (k, v) in enumerate(reference.items()) if i % 2}
    llm.llm_engine.spec_decoder.proposer = ReplayProposer(half, 1.0, VOCAB)
    assert generate(llm, ps, GREEDY) == [reference[tuple(p)] for p in ps]
    m = llm.llm_engine.spec_decoder.metrics
    assert m.num_accepted_tokens == m.num_draft_tokens > 0


def test_drafts_that_keep_failing_stop_being_proposed(spec: LLM, reference: dict) -> None:
    llm = spec
    decoder = llm.llm_engine.spec_decoder
    decoder.proposer = ReplayProposer(reference, 0.0, VOCAB)
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    ps = prompts()[:1]
    out = generate(llm, ps, params)
    assert out[0][:MAX_TOKENS] == reference[tuple(ps[0])]
    assert decoder.metrics.num_accepted_tokens == 0
    # 79 decode steps, but after each failing streak the pause doubles (4, 8, 16, ...).
    assert decoder.metrics.num_drafts < 20


class FailingFirst:
    """Wrong drafts for the first `failures` proposals, then the reference's tokens."""

    def __init__(self, reference: dict, failures: int) -> None:
        self.wrong = ReplayProposer(reference, 0.0, VOCAB)
        self.right = ReplayProposer(reference, 1.0, VOCAB)
        self.failures = failures

    def propose(self, requests: list, num_drafts: list[int]) -> list[list[int]]:
        self.failures -= 1
        return (self.wrong if self.failures >= 0 else self.right).propose(requests, num_drafts)


def test_a_pause_ends_under_asynchronous_scheduling(tiny_llama_dir: Path, reference: dict) -> None:
    """A paused request's steps overlap (its token is in flight when the next is scheduled);
    the pause must still count them down, and the request speculate again after it."""
    llm = spec_llm(tiny_llama_dir, async_scheduling=True)
    decoder = llm.llm_engine.spec_decoder
    decoder.proposer = FailingFirst(reference, failures=3)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ps = prompts()[1:2]
    assert generate(llm, ps, params) == [reference[tuple(ps[0])]]
    assert decoder.proposer.failures < 0  # it paused after the failures, then proposed again
    assert decoder.metrics.num_accepted_tokens > 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, frequency_penalty=0.5,
                       presence_penalty=0.3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=10),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, logprobs=3, ignore_eos=True),
    ],
    ids=["repetition", "frequency_presence", "min_tokens", "max_tokens", "logprobs"],
)
def test_params_equal_without_speculation(base: LLM, spec: LLM, params: SamplingParams) -> None:
    ps = prompts()
    want = base.generate(ps, params, use_tqdm=False)
    llm = spec
    got = llm.generate(ps, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        if params.logprobs is not None:
            for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
                assert lw.keys() == lg.keys()
                for tok, lp in lw.items():
                    assert lg[tok] == pytest.approx(lp, abs=1e-4)
    assert llm.llm_engine.spec_decoder.metrics.num_drafts > 0
    assert_pool_clean(llm)


def test_stops_inside_an_accepted_run(spec: LLM, reference: dict) -> None:
    ps = prompts()
    ref = reference[tuple(ps[5])]
    # Stop on the 6th reference token: drafts past it are accepted but must be dropped.
    for params in (
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[ref[5]]),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[ref[5]],
                       include_stop_str_in_output=True),
    ):
        llm = spec
        llm.llm_engine.spec_decoder.proposer = ReplayProposer(reference, 1.0, VOCAB)
        out = llm.generate([ps[5]], params, use_tqdm=False)[0].outputs[0]
        cut = ref.index(ref[5])
        assert out.token_ids == ref[: cut + 1]
        assert out.finish_reason == "stop" and out.stop_reason == ref[5]
        assert_pool_clean(llm)


def test_stop_string_with_speculation(base: LLM, spec: LLM) -> None:
    ps = prompts()
    text = base.generate([ps[5]], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop], ignore_eos=True)
    want = base.generate([ps[5]], params, use_tqdm=False)[0].outputs[0]
    got = spec.generate([ps[5]], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")


def test_text_of_verify_steps_equals_plain_decoding(
    tiny_llama_dir: Path, base: LLM, reference: dict
) -> None:
    """Under asynchronous scheduling (a verify step resolved before the next is scheduled)
    the text of verify steps, streamed or whole, equals plain decoding's, also where a
    stopping token or the length limit ends the request inside an accepted run."""
    ps = prompts()
    ref = reference[tuple(ps[5])]
    # A stopping token with text of its own, whose text must stay out of the output.
    tok = base.llm_engine.tokenizer

    def visible(t: int) -> bool:
        text = tok.decode([t])
        return bool(text.strip()) and "\ufffd" not in text

    stop = next(t for i, t in enumerate(ref) if i >= 3 and t not in ref[:i] and visible(t))
    delta = RequestOutputKind.DELTA
    cases = [
        GREEDY,
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=delta),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, output_kind=delta),
    ]
    spec = spec_llm(tiny_llama_dir, async_scheduling=True)
    spec.llm_engine.spec_decoder.proposer = ReplayProposer(reference, 1.0, VOCAB)
    for params in cases:
        texts = {}
        for name, llm in (("base", base), ("spec", spec)):
            engine = llm.llm_engine
            engine.add_request(name, None, params, prompt_token_ids=ps[5])
            pieces, final = [], None
            while engine.has_unfinished_requests():
                for out in engine.step():
                    pieces.append(out.outputs[0].text)
                    final = out
            assert final is not None and final.finished
            whole = "".join(pieces) if params.output_kind == delta else final.outputs[0].text
            texts[name] = (whole, final.outputs[0].finish_reason)
        assert texts["spec"] == texts["base"] and texts["base"][0]
    assert spec.llm_engine.spec_decoder.metrics.num_drafts > 0
    assert_pool_clean(spec)
    spec.llm_engine.shutdown()


def test_parallel_sampling_greedy(spec: LLM, reference: dict) -> None:
    ps = prompts()
    llm = spec
    llm.llm_engine.spec_decoder.proposer = ReplayProposer(reference, 0.7, VOCAB, seed=5)
    params = SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for p, out in zip(ps, llm.generate(ps, params, use_tqdm=False), strict=True):
        assert [c.token_ids for c in out.outputs] == [reference[tuple(p)]] * 3
    assert_pool_clean(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_replay_equals_hf_on_the_gpu(tiny_llama_dir: Path, reference: dict) -> None:
    """Float32 on the GPU with CUDA graphs: every verify step without a prompt chunk in it
    replays a decode graph (batch expansion), and the output still equals HF token for
    token."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cuda", speculative_config=NGRAM)
    engine = llm.llm_engine
    runner = engine.runner
    spec = engine.spec_decoder
    spec.proposer = ReplayProposer(reference, acceptance=0.7, vocab_size=VOCAB, seed=1)
    graphs = runner.graphs
    assert graphs is not None
    verify_steps: list[bool] = []  # per verify step: did a decode graph take it?
    prepare = runner.prepare_inputs

    def watched(sched, prev=None):
        inputs = prepare(sched, prev)
        chunks = sched.scheduled
        if any(c.num_spec_tokens for c in chunks) and all(
            c.num_new_tokens == 1 + c.num_spec_tokens for c in chunks
        ):
            verify_steps.append(graphs.can_run(inputs))
        return inputs

    runner.prepare_inputs = watched
    ps = prompts()
    assert generate(llm, ps, GREEDY) == [reference[tuple(p)] for p in ps]
    m = spec.metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens
    assert verify_steps and all(verify_steps)
    assert_pool_clean(llm)
