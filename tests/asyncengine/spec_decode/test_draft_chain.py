"""The draft model's greedy one-token steps as one chain (`spec_decode.draft_chain`): off
the GPU its graphs replay eagerly (`EagerChain`), so the chain's device-side positions, slots
and argmax feeding are what runs; the drafts must be the step-by-step path's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncengine import LLM, SamplingParams
from tests.asyncengine.engine_helpers import assert_pool_clean
from tests.asyncengine.spec_decode.test_decoder import GREEDY, generate, prompts
from tests.asyncengine.spec_decode.test_draft_model import draft_config, draft_llm, eager_graphs


def _run(target: Path, draft: Path, k: int, chains: bool, monkeypatch: pytest.MonkeyPatch,
         ps: list[list[int]], params: SamplingParams) -> tuple[list, LLM]:  # fmt: skip
    llm = draft_llm(target, draft_config(draft, k))
    proposer = llm.llm_engine.spec_decoder.proposer
    eager_graphs(proposer, monkeypatch, llm.llm_engine.scheduler.max_num_seqs,
                 chain_steps=k - 1 if chains else 0)  # fmt: skip
    assert (proposer.chains is not None) == chains
    return generate(llm, ps, params), llm


def _chained_as_stepwise(target: Path, draft: Path, k: int, monkeypatch: pytest.MonkeyPatch,
                         ps: list[list[int]], params: object) -> list:  # fmt: skip
    """The same requests with chains off and on: the same output (returned) and the same
    drafts proposed and accepted, position by position (a fingerprint of every draft); the
    chains replayed; both pools clean."""
    stepwise, llm_steps = _run(target, draft, k, False, monkeypatch, ps, params)  # type: ignore[arg-type]
    chained, llm_chain = _run(target, draft, k, True, monkeypatch, ps, params)  # type: ignore[arg-type]
    assert stepwise == chained
    m_steps = llm_steps.llm_engine.spec_decoder.metrics
    m_chain = llm_chain.llm_engine.spec_decoder.metrics
    assert m_chain.num_draft_tokens == m_steps.num_draft_tokens > 0
    assert m_chain.num_accepted_tokens == m_steps.num_accepted_tokens
    assert m_chain.accepted_per_pos == m_steps.accepted_per_pos
    assert llm_chain.llm_engine.spec_decoder.proposer.chains.replays > 0
    for llm in (llm_steps, llm_chain):
        assert_pool_clean(llm)
        llm.shutdown()
    return chained


@pytest.mark.parametrize("k", [2, 4])
def test_chained_drafts_are_the_step_by_step_drafts(
    base: LLM, pair: tuple[Path, Path], k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same requests, same engine settings, chains on and off: greedy output equal to the
    target alone, and the same drafts proposed and accepted (the acceptance counts are a
    fingerprint of every draft); the chains replayed, some requests with fewer drafts than
    the chain's length (near max_tokens)."""
    target, draft = pair
    ps = prompts()
    want = generate(base, ps, GREEDY)
    assert _chained_as_stepwise(target, draft, k, monkeypatch, ps, GREEDY) == want


def test_seeded_sampled_drafts_are_the_step_by_step_drafts(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests that sample their drafts, seeded: the sampling chain draws each seeded row's
    race noise from its proposal's generator in the step-by-step order and keeps q, so the
    drafts, their acceptance (min(1, p/q)) and the sampled output are the step-by-step
    path's exactly; a greedy request in the batch keeps its argmax drafts."""
    target, draft = pair
    ps = prompts()
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=3 + i, max_tokens=12,
                             ignore_eos=True) for i in range(len(ps) - 1)]  # fmt: skip
    params = [*seeded, GREEDY]
    _chained_as_stepwise(target, draft, 3, monkeypatch, ps, params)


def test_unseeded_sampling_chains_and_unfit_batches(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unseeded requests that sample go through the sampling chain and leave the pool
    clean; a chain longer than captured, or a batch past the largest chain, is refused
    (the proposal then runs step by step)."""
    target, draft = pair
    free = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    out, llm = _run(target, draft, 3, True, monkeypatch, prompts()[:2], free)
    assert all(len(o) == 12 for o in out)
    chains = llm.llm_engine.spec_decoder.proposer.chains
    assert chains.replays > 0
    replays = chains.replays
    stand_in = type("Req", (), {"block_table": [0], "num_tokens": 5})()
    first = torch.zeros(1, dtype=torch.int64)
    assert chains.run([stand_in], [chains.max_steps + 2], first) is None  # too long a chain
    many = [stand_in] * (chains.sizes[-1] + 1)
    assert chains.run(many, [2] * len(many), torch.zeros(len(many), dtype=torch.int64)) is None
    assert chains.replays == replays
    assert_pool_clean(llm)
    llm.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_chains_draft_as_the_steps_do(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the GPU, chains captured as CUDA graphs (`ModelRunner.draft_chains`): the same
    drafts as step by step (float32: the same acceptance, position by position), greedy
    output equal, and the target as its own draft has every chained draft accepted."""
    from asyncengine.model_runner import ModelRunner

    target, draft = pair
    ps = prompts()
    common = dict(dtype="float32", device="cuda", num_kv_blocks=64)
    runs = {}
    for chains in (False, True):
        monkeypatch.setattr(ModelRunner, "draft_chains", chains)
        llm = draft_llm(target, draft_config(draft, 4), **common)
        proposer = llm.llm_engine.spec_decoder.proposer
        assert (proposer.chains is not None) == chains
        m = llm.llm_engine.spec_decoder.metrics
        out = generate(llm, ps, GREEDY)
        runs[chains] = (out, m.num_draft_tokens, m.num_accepted_tokens, list(m.accepted_per_pos))
        assert not chains or proposer.chains.replays > 0
        assert_pool_clean(llm)
        llm.shutdown()
    assert runs[True] == runs[False]
    monkeypatch.setattr(ModelRunner, "draft_chains", True)
    same = draft_llm(target, draft_config(target, 3), **common)
    assert generate(same, ps, GREEDY) == runs[True][0]
    m = same.llm_engine.spec_decoder.metrics
    assert m.num_accepted_tokens == m.num_draft_tokens > 0
    assert same.llm_engine.spec_decoder.proposer.chains.replays > 0
    assert_pool_clean(same)
    same.shutdown()
