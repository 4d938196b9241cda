"""Prompt logprobs equal HF's log-softmax on the same weights (float32, CPU), through chunked
prefill, a prefix-cache hit beside them, preemption, parallel sampling and every output kind;
and a step where nobody asks for them does no extra work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncengine import LLM, RequestOutputKind, SamplingParams
from asyncengine.errors import InvalidRequestError
from asyncengine.outputs import Logprob, PromptLogprobs
from asyncengine.prompt_logprobs import chunk_rows, score_rows
from tests.asyncengine.engine_helpers import assert_pool_clean
from tests.asyncengine.test_llm_engine import make_prompts

VOCAB = 452
K = 3


def hf_log_softmax(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, HF's float32 log-softmax over the vocabulary at every position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.inference_mode():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1)
                for p in prompts]  # fmt: skip


def assert_matches_hf(prompt: list[int], got: PromptLogprobs, ref: torch.Tensor, k: int) -> None:
    assert len(got) == len(prompt) and got[0] is None
    for pos in range(1, len(prompt)):
        entry, row, tok = got[pos], ref[pos - 1], prompt[pos]
        assert entry is not None and tok in entry
        first = next(iter(entry))
        assert first == tok  # the prompt's own token leads, as vLLM lists it
        assert entry[tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)
        assert entry[tok].rank == int((row >= row[tok]).sum())
        top = torch.topk(row, k)
        others = {t: lp for t, lp in entry.items() if t != tok or lp.rank == 1}
        assert len(entry) in (k, k + 1)
        for rank, (lp_ref, t) in enumerate(zip(top.values.tolist(), top.indices.tolist(),
                                               strict=True), start=1):  # fmt: skip
            if t == tok:
                continue
            assert others[t].rank == rank
            assert others[t].logprob == pytest.approx(lp_ref, abs=1e-4)


CASES = {
    "one_step": {},
    "chunked": {"max_num_batched_tokens": 7},  # prompts scored across many chunks
    "async_chunked": {"max_num_batched_tokens": 7, "async_scheduling": True},
    "preempt_recompute": {"num_kv_blocks": 10, "schedule_conservativeness": 0,
                          "preemption_mode": "recompute", "max_num_batched_tokens": 16},
}


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_logprobs_equal_hf(tiny_llama_dir: Path, case: str) -> None:
    prompts = make_prompts(VOCAB, [37, 2, 16, 60, 1, 23], seed=3)
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", **CASES[case])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=K)
    outs = llm.generate(prompts, params, use_tqdm=False)
    refs = hf_log_softmax(tiny_llama_dir, prompts)
    for prompt, out, ref in zip(prompts, outs, refs, strict=True):
        assert out.prompt_logprobs is not None
        assert_matches_hf(prompt, out.prompt_logprobs, ref, K)
    assert_pool_clean(llm)


def test_prefix_cache_hit_does_not_skip_scored_tokens(tiny_llama_dir: Path) -> None:
    """A request scoring its prompt computes every position even when its prefix is cached;
    one that does not ask still takes the hit."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_num_batched_tokens=11)
    prompt = make_prompts(VOCAB, [50], seed=4)[0]
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([prompt], plain, use_tqdm=False)
    scored = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([prompt], scored, use_tqdm=False)[0]
    assert out.metrics is not None and out.metrics.num_cached_prompt_tokens == 0
    ref = hf_log_softmax(tiny_llama_dir, [prompt])[0]
    assert_matches_hf(prompt, out.prompt_logprobs or [], ref, 0)
    again = llm.generate([prompt], plain, use_tqdm=False)[0]
    assert again.metrics is not None and again.metrics.num_cached_prompt_tokens == 48
    assert again.prompt_logprobs is None
    assert_pool_clean(llm)


def test_delta_outputs_carry_them_once_and_parallel_samples_share_them(
    tiny_llama_dir: Path,
) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_num_batched_tokens=8)
    engine = llm.llm_engine
    prompt = make_prompts(VOCAB, [20], seed=6)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True,
                            prompt_logprobs=1, output_kind=RequestOutputKind.DELTA)
    engine.add_request("d", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    carrying = [o for o in outs if o.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is outs[0]
    assert_matches_hf(prompt, carrying[0].prompt_logprobs or [],
                      hf_log_softmax(tiny_llama_dir, [prompt])[0], 1)
    assert_pool_clean(llm)


def test_decoded_tokens_and_default_model(default_model_dir: Path) -> None:
    """On the embedded model (tokenizer included): the text of each token is filled in."""
    llm = LLM(dtype="float32", device="cpu")
    tok = llm.get_tokenizer()
    prompt = "The capital of France is Paris."
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    ids = out.prompt_token_ids
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(ids) and lps[0] is None
    for tid, entry in zip(ids[1:], lps[1:], strict=True):
        assert entry is not None
        assert entry[tid].decoded_token == tok.decode([tid])
        assert all(isinstance(v, Logprob) and v.decoded_token is not None for v in entry.values())
    ref = hf_log_softmax(default_model_dir, [ids])[0]
    assert_matches_hf(ids, lps, ref, 2)


def test_limits() -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(prompt_logprobs=21)
    assert err.value.field == "prompt_logprobs"
    with pytest.raises(InvalidRequestError):
        SamplingParams(prompt_logprobs=-1)
    SamplingParams(prompt_logprobs=20)


def test_scoring_in_small_chunks_equals_one_chunk() -> None:
    """The chunking of the LM head changes nothing; chunk sizes bound the logits held."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 8, generator=gen)
    hidden = torch.randn(13, 8, generator=gen)
    targets = torch.randint(0, 50, (13,), generator=gen)

    def head(h: torch.Tensor) -> torch.Tensor:
        assert h.shape[0] <= 4 or h.shape[0] == 13
        return h @ weight.T

    small = score_rows(head, hidden, targets, 5, rows=4)
    whole = score_rows(head, hidden, targets, 5, rows=13)
    assert torch.equal(small.ranks, whole.ranks) and torch.equal(small.top_ids, whole.top_ids)
    # The matmul may round differently by batch size; nothing else differs.
    torch.testing.assert_close(small.logprobs, whole.logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(small.top_logprobs, whole.top_logprobs, rtol=0, atol=1e-5)
    assert chunk_rows(49152) * 49152 <= 1 << 24


def test_normal_steps_do_no_prompt_work(tiny_llama_dir: Path, monkeypatch) -> None:
    """Without prompt_logprobs no step plans or scores a prompt row."""
    from asyncengine import model_runner

    def fail(*args, **kwargs):
        raise AssertionError("scored prompt rows nobody asked for")

    monkeypatch.setattr(model_runner, "score_rows", fail)
    monkeypatch.setattr(model_runner.PromptLogprobPlan, "add", fail)
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_num_batched_tokens=9)
    outs = llm.generate(make_prompts(VOCAB, [30, 5]),
                        SamplingParams(temperature=0, max_tokens=3, logprobs=2),
                        use_tqdm=False)  # fmt: skip
    assert all(o.prompt_logprobs is None for o in outs)


def test_tensor_parallel_ranks_score_the_same_rows(tiny_llama_dir: Path) -> None:
    """TP=2 (gloo): the workers join each chunk's vocab-parallel gather, rank 0 scores; equal
    to HF, chunked prefill and decodes in the same steps."""
    prompts = make_prompts(VOCAB, [37, 9, 60], seed=8)
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", tensor_parallel_size=2,
              num_kv_blocks=64, max_num_batched_tokens=19)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=K)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out, ref in zip(prompts, outs, hf_log_softmax(tiny_llama_dir, prompts),
                                    strict=True):  # fmt: skip
            assert_matches_hf(prompt, out.prompt_logprobs or [], ref, K)
        assert_pool_clean(llm)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_gpu_prompt_logprobs_equal_hf(tiny_llama_dir: Path, enforce_eager: bool) -> None:
    """On the GPU (CUDA graphs for small prefills and decodes, asynchronous scheduling,
    chunked prefill): float32 prompt logprobs equal HF's on the CPU."""
    prompts = make_prompts(VOCAB, [37, 2, 16, 300, 1, 23], seed=3)
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cuda",
              max_num_batched_tokens=64, enforce_eager=enforce_eager)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=K)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out, ref in zip(prompts, outs, hf_log_softmax(tiny_llama_dir, prompts),
                                strict=True):  # fmt: skip
        assert_matches_hf(prompt, out.prompt_logprobs or [], ref, K)
    assert_pool_clean(llm)
