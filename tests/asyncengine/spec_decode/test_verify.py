"""Sampled requests keep the target's distribution through the verify step: many samples of
the first three tokens from a tiny model, without speculation, with drafts from the target's
top-k, with another draft model's drafts sampled from its own q, with the target as its own
draft (q = p: every draft kept) and with its argmax drafts, against the exact joint
probabilities computed by HF transformers on the same weights (chi-square)."""

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
from tests.asyncengine.engine_helpers import save_hf
from tests.asyncengine.spec_decode.test_rejection_sampler import chi2_pvalue

PROMPT = [17, 250, 31, 99, 4, 310]
TOP_K = 3
N = 900


class TopKCandidates:
    """Each draft drawn uniformly from the target's own top-k at that point (the context
    extended by the drafts before it): about a third of the drafts at each position are kept,
    so kept and rejected drafts at both positions decide many samples. The drafts are drawn
    apart from the engine's sampling, so any proposer must leave the distribution exact."""

    def __init__(self, top_k: dict[tuple[int, ...], list[int]]) -> None:
        self.top_k = top_k
        self.rng = np.random.default_rng(0)

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        out = []
        for req, k in zip(requests, num_drafts, strict=True):
            ctx, drafts = tuple(req.all_token_ids), []
            for _ in range(k):
                choices = self.top_k.get(ctx)
                if choices is None:
                    break
                drafts.append(int(self.rng.choice(choices)))
                ctx = (*ctx, drafts[-1])
            out.append(drafts)
        return out


@pytest.fixture(scope="module")
def target_top_k(tiny_llama_dir: Path) -> dict[tuple[int, ...], dict[int, float]]:
    """The target's top-k tokens and their renormalized probabilities after the prompt and
    after each of its top-k continuations of one and two tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)

    def next_probs(ctx: tuple[int, ...]) -> dict[int, float]:
        with torch.inference_mode():
            logits = model(torch.tensor([ctx])).logits[0, -1]
        top = logits.topk(TOP_K)
        return dict(zip(top.indices.tolist(), top.values.softmax(0).tolist(), strict=True))

    table = {}
    frontier = [tuple(PROMPT)]
    for _ in range(3):
        nxt = []
        for ctx in frontier:
            table[ctx] = next_probs(ctx)
            nxt += [(*ctx, t) for t in table[ctx]]
        frontier = nxt
    return table


@pytest.fixture(scope="module")
def exact(target_top_k: dict[tuple[int, ...], dict[int, float]]
          ) -> dict[tuple[int, int, int], float]:  # fmt: skip
    p0 = tuple(PROMPT)
    joint: dict[tuple[int, int, int], float] = {}
    for t1, p1 in target_top_k[p0].items():
        for t2, p2 in target_top_k[(*p0, t1)].items():
            for t3, p3 in target_top_k[(*p0, t1, t2)].items():
                joint[t1, t2, t3] = p1 * p2 * p3
    return joint


@pytest.fixture(scope="module")
def damped_draft(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target with its second layer's outputs halved: q near p but not equal (a draft
    of the target's own size, which a draft may be)."""
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if ".layers.1." in name and ("o_proj" in name or "down_proj" in name):
                p.mul_(0.5)
    return save_hf(draft, tiny_llama_dir, tmp_path_factory.mktemp("damped") / "draft")


PROPOSERS = ["none", "top_k", "draft_model", "draft_model_same", "draft_model_argmax"]


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_sampled_tokens_follow_the_target(
    tiny_llama_dir: Path,
    damped_draft: Path,
    exact: dict[tuple[int, int, int], float],
    target_top_k: dict[tuple[int, ...], dict[int, float]],
    proposer: str,
) -> None:
    # A draft budget that keeps k = 2 for a batch of 128.
    config = {"method": "ngram", "num_speculative_tokens": 2, "max_draft_tokens_per_step": 512}
    if proposer.startswith("draft_model"):
        # Drafts sampled from another draft's q; or the target as its own draft, its
        # drafts sampled from q = p, or its argmax drafts (point masses).
        draft = damped_draft if proposer == "draft_model" else tiny_llama_dir
        config = {"model": str(draft), "num_speculative_tokens": 2,
                  "max_draft_tokens_per_step": 512}  # fmt: skip
    speculate = proposer != "none"
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", seed=3, max_num_seqs=128,
              speculative_config=config if speculate else None)  # fmt: skip
    decoder = llm.llm_engine.spec_decoder
    if proposer == "top_k":
        decoder.proposer = TopKCandidates({c: list(p) for c, p in target_top_k.items()})
    if proposer == "draft_model_argmax":
        decoder.proposer.sample_drafts = False
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
        assert m.num_drafts >= N // 2
        if proposer == "draft_model_same":
            assert m.num_accepted_tokens == m.num_draft_tokens
        else:  # both kept and rejected drafts at both positions decided the samples
            assert 0 < m.accepted_per_pos[1] < m.accepted_per_pos[0] < m.num_drafts


def test_exact_table_sums_to_one(exact: dict[tuple[int, int, int], float]) -> None:
    assert sum(exact.values()) == pytest.approx(1.0)
    assert len(exact) == TOP_K**3
    assert all(len(set(k)) >= 1 for k in itertools.islice(exact, 3))
