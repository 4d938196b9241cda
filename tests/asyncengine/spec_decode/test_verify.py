"""Sampled requests keep the target's distribution through the verify step: many samples of
the first three tokens from a tiny model, with and without speculation, against the exact
joint probabilities computed by HF transformers on the same weights (chi-square)."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.request import Request
from tests.asyncengine.spec_decode.test_rejection_sampler import chi2_pvalue

PROMPT = [17, 250, 31, 99, 4, 310]
TOP_K = 3
N = 900


class RandomCandidates:
    """Drafts drawn uniformly from a few likely tokens: some kept, some rejected."""

    def __init__(self, candidates: Sequence[int]) -> None:
        self.candidates = list(candidates)
        self.rng = np.random.default_rng(0)

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        return [self.rng.choice(self.candidates, k).tolist() for k in num_drafts]


@pytest.fixture(scope="module")
def exact(tiny_llama_dir: Path) -> dict[tuple[int, int, int], float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)

    def next_probs(ctx: list[int]) -> dict[int, float]:
        with torch.inference_mode():
            logits = model(torch.tensor([ctx])).logits[0, -1]
        top = logits.topk(TOP_K)
        return dict(zip(top.indices.tolist(), top.values.softmax(0).tolist(), strict=True))

    joint: dict[tuple[int, int, int], float] = {}
    for t1, p1 in next_probs(PROMPT).items():
        for t2, p2 in next_probs([*PROMPT, t1]).items():
            for t3, p3 in next_probs([*PROMPT, t1, t2]).items():
                joint[t1, t2, t3] = p1 * p2 * p3
    return joint


@pytest.mark.parametrize("speculate", [False, True])
def test_sampled_tokens_follow_the_target(
    tiny_llama_dir: Path, exact: dict[tuple[int, int, int], float], speculate: bool
) -> None:
    # A draft budget that keeps k = 2 for a batch of 128.
    config = {"method": "ngram", "num_speculative_tokens": 2, "max_draft_tokens_per_step": 512}
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", seed=3, max_num_seqs=128,
              speculative_config=config if speculate else None)  # fmt: skip
    decoder = llm.llm_engine.spec_decoder
    if speculate:
        tokens = sorted({t for key in exact for t in key})
        decoder.proposer = RandomCandidates(tokens)
    params = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=4, ignore_eos=True)
    outs = llm.generate([PROMPT] * N, params, use_tqdm=False)
    counts = Counter(tuple(o.outputs[0].token_ids[:3]) for o in outs)
    assert set(counts) <= set(exact), "a sequence outside the target's support was drawn"
    keys = list(exact)
    p = chi2_pvalue(
        torch.tensor([counts[k] for k in keys], dtype=torch.float64),
        torch.tensor([exact[k] for k in keys], dtype=torch.float64),
    )
    assert p > 1e-3
    if speculate:
        m = decoder.metrics
        # Both kept and rejected drafts at both positions decided the samples.
        assert m.num_drafts >= N // 2
        assert 0 < m.accepted_per_pos[1] < m.accepted_per_pos[0] < m.num_drafts


def test_exact_table_sums_to_one(exact: dict[tuple[int, int, int], float]) -> None:
    assert sum(exact.values()) == pytest.approx(1.0)
    assert len(exact) == TOP_K**3
    assert all(len(set(k)) >= 1 for k in itertools.islice(exact, 3))
