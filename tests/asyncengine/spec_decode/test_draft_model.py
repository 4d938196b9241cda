"""The draft-model proposer in the engine: greedy output equals the non-speculative engine's
token for token under every scheduling path (swap preemption included), a draft identical to
the target has every draft accepted (so its K/V in the shared blocks is never stale), sampled
requests draft by sampling (accepting more than argmax drafts would, seeded ones alike run
to run), a prefix-cache hit brings the draft's K/V only where the draft ran over the blocks,
the pool and the swap space are sized for both models' K/V, and a draft of another
vocabulary, a larger one or a missing one is refused at start."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.request import Request
from asyncengine.spec_decode.draft_model import EXPAND_MAX_TOKENS
from tests.asyncengine.engine_helpers import TINY_POOL, assert_pool_clean
from tests.asyncengine.spec_decode.test_decoder import GREEDY, VOCAB, generate, prompts

FIELD = r"speculative_config\.model"


def draft_config(model_dir: Path, k: int = 3, **extra: object) -> dict:
    # A draft cap that lets a batch of several requests speculate.
    return {"model": str(model_dir), "num_speculative_tokens": k,
            "max_draft_tokens_per_step": 64, **extra}  # fmt: skip


def draft_llm(target: Path, config: dict, **engine_args: object) -> LLM:
    engine_args = {"dtype": "float32", "device": "cpu", **engine_args}
    return LLM(str(target), speculative_config=config, **engine_args)


def shared_prefix_prompts() -> list[list[int]]:
    """Prompts over one 40-token prefix: later ones hit the prefix cache."""
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, VOCAB, (40,), generator=gen).tolist()
    return [prefix + torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 9, 1)]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_without_speculation(base: LLM, pair: tuple[Path, Path], k: int) -> None:
    target, draft = pair
    ps = prompts()
    llm = draft_llm(target, draft_config(draft, k))
    assert generate(llm, ps, GREEDY) == generate(base, ps, GREEDY)
    m = llm.llm_engine.spec_decoder.metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens  # kept and rejected drafts both
    assert_pool_clean(llm)


def test_stops_and_max_tokens_equal_without_speculation(base: LLM, pair: tuple[Path, Path]) -> None:
    ps = prompts()
    ref = generate(base, ps, GREEDY)
    params = [
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ref[1][6]]),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ref[2][10]]),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=12),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ref[5][3]]),
    ]
    llm = draft_llm(pair[0], draft_config(pair[1], 4))
    want = base.generate(ps, params, use_tqdm=False)
    got = llm.generate(ps, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        w0, g0 = w.outputs[0], g.outputs[0]
        assert (g0.token_ids, g0.finish_reason, g0.stop_reason) == (
            w0.token_ids, w0.finish_reason, w0.stop_reason,
        )  # fmt: skip
    assert {"stop", "length"} <= {w.outputs[0].finish_reason for w in want}
    assert llm.llm_engine.spec_decoder.metrics.num_drafts > 0
    assert_pool_clean(llm)


# Scheduling paths; a draft equal to the target must have every draft accepted on each.
CASES = {
    "default": {},
    # Drafts cut to the budget; the draft catches up over a long prompt in several forwards.
    "chunked": {"max_num_batched_tokens": 19},
    "preempt_recompute": {**TINY_POOL, "preemption_mode": "recompute"},
    # Swapped requests keep the draft's K/V (it goes to CPU and back with the target's).
    "preempt_swap": {**TINY_POOL, "preemption_mode": "swap"},
    "async_preempt_swap": {
        "async_scheduling": True,
        **TINY_POOL,
        "preemption_mode": "swap",
    },
    "async_few_seqs": {"async_scheduling": True, "max_num_seqs": 2},
    "no_prefix_caching": {"enable_prefix_caching": False},
}


@pytest.mark.parametrize("case", list(CASES))
def test_draft_equal_to_target_accepts_every_draft(
    base: LLM, pair: tuple[Path, Path], case: str
) -> None:
    target = pair[0]
    llm = draft_llm(target, draft_config(target, 3), **CASES[case])
    engine = llm.llm_engine
    # Tokens of the draft's K/V each prefix-cache hit brought (every draft kept below: it
    # was the draft's for exactly those tokens).
    draft_hits: list[int] = []
    count = engine.pool.num_draft_cached_tokens

    def counting(blocks: list[int]) -> int:
        draft_hits.append(count(blocks))
        return draft_hits[-1]

    engine.pool.num_draft_cached_tokens = counting  # type: ignore[method-assign]
    # The second batch finds the first one's prefix in the cache.
    for ps in (prompts() + shared_prefix_prompts()[:1], shared_prefix_prompts()[1:]):
        assert generate(llm, ps, GREEDY) == generate(base, ps, GREEDY)
    m = engine.spec_decoder.metrics
    assert m.num_draft_tokens > 0
    assert m.num_accepted_tokens == m.num_draft_tokens
    stats = engine.get_stats().spec_decode
    assert stats is not None and stats.acceptance_rate == 1.0
    assert stats.mean_acceptance_length > 2.0
    if case == "preempt_recompute":
        assert engine.scheduler.num_preemptions > 0
    if case.endswith("swap"):
        assert engine.scheduler.num_swaps_out > 0 and engine.scheduler.num_swaps_in > 0
    if case == "default":
        assert engine.pool.prefix_hits > 0
    assert (max(draft_hits, default=0) > 0) == (case != "no_prefix_caching")
    assert_pool_clean(llm)


@pytest.mark.parametrize("case", ["default", "preempt_swap"])
def test_parallel_sampling_greedy(base: LLM, pair: tuple[Path, Path], case: str) -> None:
    ps = prompts()
    params = SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in base.generate(ps, params, use_tqdm=False)]
    llm = draft_llm(pair[0], draft_config(pair[0], 3), **CASES[case])
    catch_ups, _ = record_catch_ups(llm)
    for w, out in zip(want, llm.generate(ps, params, use_tqdm=False), strict=True):
        assert [c.token_ids for c in out.outputs] == [w] * 3
    m = llm.llm_engine.spec_decoder.metrics
    assert m.num_accepted_tokens == m.num_draft_tokens > 0
    # Samples forked from a sequence that had drafted take its draft K/V of the prompt.
    assert any(index > 0 and runs[0][0] > 0 for (_, index), runs in catch_ups.items())
    if case == "preempt_swap":  # a group's shared blocks go out and back once, both halves
        assert llm.llm_engine.scheduler.num_swaps_in > 0
    assert_pool_clean(llm)


def test_draft_kv_is_rolled_back_with_the_target(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    llm = draft_llm(target, draft_config(draft, 4))
    engine = llm.llm_engine
    for i, p in enumerate(prompts()):
        engine.add_request(str(i), p, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
        for req in engine.scheduler.running:
            # Drafts past the kept tokens were rolled back: their slots are gone, and the
            # draft K/V counted as valid is of computed tokens only.
            assert len(req.block_table) <= engine.pool.blocks_needed(req.num_tokens)
            assert req.num_draft_computed_tokens <= req.num_computed_tokens
    assert engine.spec_decoder.metrics.num_drafts > 0
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


SAMPLED = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)


def test_sampled_drafts_accept_more_than_argmax_drafts(pair: tuple[Path, Path]) -> None:
    """The target as its own draft: drafts sampled from q = p are all kept, argmax drafts
    (point masses) only with probability p(argmax)."""
    target = pair[0]
    rates = {}
    for sample_drafts in (True, False):
        llm = draft_llm(target, draft_config(target, 3))
        llm.llm_engine.spec_decoder.proposer.sample_drafts = sample_drafts
        outs = llm.generate(prompts(), SAMPLED, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
        assert {o.outputs[0].finish_reason for o in outs} == {"length"}
        stats = llm.llm_engine.get_stats().spec_decode
        assert stats is not None and stats.num_draft_tokens > 0
        rates[sample_drafts] = stats.acceptance_rate
        assert_pool_clean(llm)
    assert rates[True] == 1.0
    assert rates[False] < 0.9


def record_proposals(llm: LLM) -> list[tuple[str, list[int], list[int], torch.Tensor | None]]:
    """(request id, tokens, drafts, q) of every proposal the engine's draft model makes."""
    proposer = llm.llm_engine.spec_decoder.proposer
    seen: list[tuple[str, list[int], list[int], torch.Tensor | None]] = []
    propose = proposer.propose

    def recording(requests, num_drafts):  # type: ignore[no-untyped-def]
        out = propose(requests, num_drafts)
        seen.extend((r.request_id, list(r.all_token_ids), d, r.spec_draft_probs)
                    for r, d in zip(requests, out, strict=True) if d)  # fmt: skip
        return out

    proposer.propose = recording
    return seen


def test_seeded_sampled_drafts_repeat_run_to_run(base: LLM, pair: tuple[Path, Path]) -> None:
    """A smaller draft, seeded sampled requests next to greedy ones: two engines of other
    seeds propose the same drafts and emit the same tokens; q is kept, [drafts, vocab]
    float32, for the sampled requests only; greedy output equals the non-speculative
    engine's."""
    target, draft = pair
    ps = prompts()
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=24, ignore_eos=True)
        if i % 2 else GREEDY
        for i in range(len(ps))
    ]  # fmt: skip
    runs = []
    for engine_seed in (0, 1):
        llm = draft_llm(target, draft_config(draft, 4), seed=engine_seed)
        # Pauses by the measured cost of a step would make which steps verify, and so what
        # the seeded streams draw, depend on timing: leave the cost at its start.
        llm.llm_engine.spec_decoder.observe_step = lambda *_, **__: None
        seen = record_proposals(llm)
        outs = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
        m = llm.llm_engine.spec_decoder.metrics
        assert 0 < m.num_accepted_tokens < m.num_draft_tokens
        assert_pool_clean(llm)
        runs.append((outs, [(tokens, drafts) for _, tokens, drafts, _ in seen]))
        for rid, _, drafts, q in seen:
            if params[int(rid.rsplit("-", 1)[1])].is_greedy:  # LLM ids: offline-<i>
                assert q is None
            else:
                assert q is not None and q.dtype == torch.float32
                assert q.shape == (len(drafts), VOCAB)
                # Each draft was drawn from its row of q.
                assert bool((q.gather(1, torch.tensor(drafts).unsqueeze(1)) > 0).all())
                torch.testing.assert_close(q.sum(dim=1), torch.ones(len(drafts)))
    assert runs[0] == runs[1]
    assert any(q is not None for *_, q in seen) and any(q is None for *_, q in seen)
    want = generate(base, ps, GREEDY)
    for i, (w, got) in enumerate(zip(want, runs[0][0], strict=True)):
        if params[i].is_greedy:
            assert got == w


@pytest.mark.parametrize("case", ["default", "chunked", "preempt_recompute", "preempt_swap"])
def test_drafts_are_the_draft_models_own_greedy_continuation(
    pair: tuple[Path, Path], case: str
) -> None:
    """Every proposal equals HF's greedy continuation of the request's tokens by the draft
    model: the draft K/V kept in the blocks across steps, rollbacks and preemptions is what
    a fresh pass would compute (stale K/V of rejected drafts would change the drafts)."""
    from transformers import AutoModelForCausalLM

    target, draft = pair
    llm = draft_llm(target, draft_config(draft, 4), **CASES[case])
    proposer = llm.llm_engine.spec_decoder.proposer
    seen: list[tuple[list[int], list[int]]] = []
    propose = proposer.propose

    def recording(requests, num_drafts):  # type: ignore[no-untyped-def]
        out = propose(requests, num_drafts)
        seen.extend((list(r.all_token_ids), d) for r, d in zip(requests, out, strict=True) if d)
        return out

    proposer.propose = recording
    generate(llm, prompts(), GREEDY)
    m = llm.llm_engine.spec_decoder.metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens
    if case == "preempt_swap":
        assert llm.llm_engine.scheduler.num_swaps_in > 0
    hf = AutoModelForCausalLM.from_pretrained(str(draft), dtype=torch.float32)
    with torch.inference_mode():
        for tokens, drafts in seen:
            want = list(tokens)
            for _ in drafts:  # plain argmax steps: EOS is a token like any other here
                want.append(int(hf(torch.tensor([want])).logits[0, -1].argmax()))
            assert drafts == want[len(tokens) :]


# ------------------------------------------------------- the draft through the prefix cache
Seq = tuple[str, int]  # (request id, sample index)


def record_catch_ups(llm: LLM) -> tuple[dict[Seq, list[tuple[int, int]]], dict[Seq, Request]]:
    """(start, length) of every forward the draft model runs over a sequence's known tokens
    (its drafting steps feed the previous drafts, not these), by (request id, index); and
    the sequences themselves."""
    proposer = llm.llm_engine.spec_decoder.proposer
    seen: dict[Seq, list[tuple[int, int]]] = {}
    reqs: dict[Seq, Request] = {}
    forward = proposer._forward

    def recording(batch, starts, lens, *, host_ids=None, device_ids=None):  # type: ignore[no-untyped-def]
        if host_ids is not None:
            for r, s, n in zip(batch, starts, lens, strict=True):
                seen.setdefault((r.request_id, r.index), []).append((s, n))
                reqs[r.request_id, r.index] = r
        return forward(batch, starts, lens, host_ids=host_ids, device_ids=device_ids)

    proposer._forward = recording
    return seen, reqs


def run_one(llm: LLM, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    """One request through the engine alone; its output tokens."""
    engine = llm.llm_engine
    engine.add_request(rid, prompt, params)
    done = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done = out
        engine.check_integrity()
    assert done is not None and done.request_id == rid
    return list(done.outputs[0].token_ids)


def covered(runs: list[tuple[int, int]]) -> list[int]:
    return [pos for s, n in runs for pos in range(s, s + n)]


def assert_drafts_are_the_drafts_own(draft: Path, seen: list) -> None:  # type: ignore[type-arg]
    """Each proposal is the draft model's greedy continuation of the request's tokens (HF):
    draft K/V taken from the prefix cache that was not the draft's for exactly those tokens
    would change the drafts."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(draft), dtype=torch.float32)
    with torch.inference_mode():
        for _, tokens, drafts, _ in seen:
            want = list(tokens)
            for _ in drafts:
                want.append(int(hf(torch.tensor([want])).logits[0, -1].argmax()))
            assert drafts == want[len(tokens) :]


def test_a_prefix_hit_takes_the_drafts_kv_with_it(base: LLM, pair: tuple[Path, Path]) -> None:
    """Requests sharing a 40-token prefix one after another: the later ones run the draft
    only over what follows the two cached blocks, each position once; their drafts are still
    the draft model's own and greedy output equals the engine without speculation."""
    target, draft = pair
    llm = draft_llm(target, draft_config(draft, 4))
    catch_ups, reqs = record_catch_ups(llm)
    proposals = record_proposals(llm)
    ps = shared_prefix_prompts()
    got = [run_one(llm, str(i), p) for i, p in enumerate(ps)]
    assert got == generate(base, ps, GREEDY)
    assert covered(catch_ups["0", 0])[0] == 0
    for rid in ("1", "2"):
        assert reqs[rid, 0].metrics.num_cached_prompt_tokens == 32
        # The uncached tail only (prompt, then the tokens as they come), each position once.
        positions = covered(catch_ups[rid, 0])
        assert positions == list(range(32, 32 + len(positions)))
        assert positions[-1] >= len(ps[int(rid)])
    m = llm.llm_engine.spec_decoder.metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens
    assert {rid for rid, *_ in proposals} == {"0", "1", "2"}
    assert_drafts_are_the_drafts_own(draft, proposals)
    assert_pool_clean(llm)


def test_blocks_cached_by_a_request_that_never_drafted_are_not_trusted(
    base: LLM, pair: tuple[Path, Path]
) -> None:
    """A one-token request never drafts: its prompt blocks serve the next request's target
    but not its draft, which runs over the whole prompt; those blocks then hold the draft's
    K/V, and the request after takes it."""
    target, draft = pair
    llm = draft_llm(target, draft_config(draft, 4))
    catch_ups, reqs = record_catch_ups(llm)
    proposals = record_proposals(llm)
    first, second, third = shared_prefix_prompts()
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    assert run_one(llm, "plain", first, one) == generate(base, [first], one)[0]
    assert ("plain", 0) not in catch_ups and not any(llm.llm_engine.pool.draft_cached)
    assert run_one(llm, "after-plain", second) == generate(base, [second], GREEDY)[0]
    assert reqs["after-plain", 0].metrics.num_cached_prompt_tokens == 32
    assert covered(catch_ups["after-plain", 0])[0] == 0
    assert run_one(llm, "after-draft", third) == generate(base, [third], GREEDY)[0]
    assert covered(catch_ups["after-draft", 0])[0] == 32
    assert_drafts_are_the_drafts_own(draft, proposals)
    assert_pool_clean(llm)


def test_blocks_cached_before_the_draft_ran_are_not_trusted(
    base: LLM, pair: tuple[Path, Path]
) -> None:
    """A prompt computed in chunks has its first blocks cached before its first proposal
    runs the draft over them: a request admitted then shares them without the draft's K/V."""
    target, draft = pair
    llm = draft_llm(target, draft_config(draft, 4), max_num_batched_tokens=20)
    engine = llm.llm_engine
    catch_ups, _ = record_catch_ups(llm)
    proposals = record_proposals(llm)
    first, second, _ = shared_prefix_prompts()
    engine.add_request("a", first, GREEDY)
    outs = engine.step() + engine.step()  # 40 of its 43 prompt tokens: two blocks cached
    engine.add_request("b", second, GREEDY)
    outs += engine.step()  # a's last 3 prompt tokens, b's 17 past the hit
    b = engine.scheduler.requests["b"]
    assert b.metrics.num_cached_prompt_tokens == 32 and b.num_computed_tokens == len(second)
    assert b.num_draft_computed_tokens == 0
    assert not catch_ups  # nothing drafted yet
    while engine.has_unfinished_requests():
        outs += engine.step()
        engine.check_integrity()
    final = {o.request_id: list(o.outputs[0].token_ids) for o in outs if o.finished}
    assert [final["a"], final["b"]] == generate(base, [first, second], GREEDY)
    assert covered(catch_ups["b", 0])[0] == 0
    assert_drafts_are_the_drafts_own(draft, proposals)
    assert_pool_clean(llm)


def test_swap_preemption_keeps_the_draft_kv(base: LLM, pair: tuple[Path, Path]) -> None:
    """A smaller draft under swap preemption: requests go to CPU and back, greedy output
    equals the non-speculative engine's, a swapped request keeps its draft count (its draft
    K/V came back with its blocks) and its next drafts, which start from that K/V, equal the
    draft model's own greedy continuation of its tokens."""
    from transformers import AutoModelForCausalLM

    target, draft = pair
    llm = draft_llm(target, draft_config(draft, 4), **TINY_POOL, preemption_mode="swap")
    engine = llm.llm_engine
    swap = engine.scheduler.swap_space
    proposer = engine.spec_decoder.proposer
    at_swap_out: dict[int, int] = {}
    back: dict[int, int] = {}  # swapped in, not proposed for since: count at swap-in
    checked: list[tuple[int, list[int], list[int]]] = []  # (count, tokens, drafts)
    swap_out, swap_in, propose = swap.swap_out, swap.swap_in, proposer.propose

    def swapping_out(pool, reqs):  # type: ignore[no-untyped-def]
        pairs = swap_out(pool, reqs)
        if pairs is not None:
            at_swap_out.update((id(r), r.num_draft_computed_tokens) for r in reqs)
        return pairs

    def swapping_in(pool, reqs):  # type: ignore[no-untyped-def]
        for r in reqs:
            assert r.num_draft_computed_tokens == at_swap_out.pop(id(r))
            back[id(r)] = r.num_draft_computed_tokens
        return swap_in(pool, reqs)

    def proposing(requests, num_drafts):  # type: ignore[no-untyped-def]
        counts = [r.num_draft_computed_tokens for r in requests]
        out = propose(requests, num_drafts)
        for r, n, drafts in zip(requests, counts, out, strict=True):
            if id(r) in back:
                assert n == back.pop(id(r))  # no recompute from position 0
                if drafts and n:
                    checked.append((n, list(r.all_token_ids), drafts))
        return out

    swap.swap_out, swap.swap_in, proposer.propose = swapping_out, swapping_in, proposing
    ps = prompts()
    assert generate(llm, ps, GREEDY) == generate(base, ps, GREEDY)
    sched = engine.scheduler
    assert sched.num_swaps_out > 0 and sched.num_swaps_in > 0
    assert sched.num_preemptions == sched.num_swaps_out  # no fallback to recompute
    assert checked, "no swapped-in request drafted from kept draft K/V"
    hf = AutoModelForCausalLM.from_pretrained(str(draft), dtype=torch.float32)
    with torch.inference_mode():
        for _, tokens, drafts in checked:
            want = list(tokens)
            for _ in drafts:
                want.append(int(hf(torch.tensor([want])).logits[0, -1].argmax()))
            assert drafts == want[len(tokens) :]
    assert_pool_clean(llm)


def test_positions_past_the_draft_limit_get_no_drafts(
    base: LLM, pair: tuple[Path, Path], tmp_path: Path
) -> None:
    short = tmp_path / "short-draft"
    short.mkdir()
    for f in pair[1].iterdir():
        (short / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 48
    (short / "config.json").write_text(json.dumps(cfg))
    ps = prompts()
    llm = draft_llm(pair[0], draft_config(short, 3))
    assert generate(llm, ps, GREEDY) == generate(base, ps, GREEDY)
    # The short prompts draft until position 47; the 70-token prompt never drafts.
    assert llm.llm_engine.spec_decoder.metrics.num_drafts > 0
    assert_pool_clean(llm)


def test_pool_holds_both_models_kv(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    gib = 1 / 64
    plain = LLM(str(target), dtype="float32", device="cpu", cpu_kv_cache_gib=gib)
    llm = draft_llm(target, draft_config(draft), cpu_kv_cache_gib=gib)

    def kv_bytes_per_block(model_dir: Path) -> int:
        c = json.loads((model_dir / "config.json").read_text())
        head_dim = c["hidden_size"] // c["num_attention_heads"]
        return 2 * c["num_hidden_layers"] * 16 * c["num_key_value_heads"] * head_dim * 4

    per_block = kv_bytes_per_block(target) + kv_bytes_per_block(draft)
    assert plain.llm_engine.pool.num_blocks == int(gib * 2**30) // kv_bytes_per_block(target)
    assert llm.llm_engine.pool.num_blocks == int(gib * 2**30) // per_block
    assert llm.llm_engine.runner.block_bytes() == per_block
    # The draft's cache spans the same blocks as the target's.
    runner = llm.llm_engine.runner
    assert runner.draft_kv_cache.num_blocks == runner.kv_cache.num_blocks
    # The swap space too: its blocks are counted at both models' bytes, as the pool's are.
    swapping = draft_llm(target, draft_config(draft), cpu_kv_cache_gib=gib,
                         preemption_mode="swap", swap_space=gib / 4)  # fmt: skip
    runner = swapping.llm_engine.runner
    num_cpu = int(gib / 4 * 2**30) // per_block
    assert swapping.llm_engine.scheduler.swap_space.num_blocks == num_cpu
    assert runner.cpu_cache.num_blocks == runner.draft_cpu_cache.num_blocks == num_cpu
    shape = list(runner.draft_kv_cache.data.shape)
    shape[2] = num_cpu  # [layers, K/V, blocks, block size, heads, head dim]
    assert list(runner.draft_cpu_cache.data.shape) == shape


# ------------------------------------------------------------------ refusals
def _write_config(path: Path, base_dir: Path, **changes: object) -> Path:
    path.mkdir()
    cfg = json.loads((base_dir / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_other_vocab_size_is_refused(pair: tuple[Path, Path], tmp_path: Path) -> None:
    other = _write_config(tmp_path / "other-vocab", pair[1], vocab_size=VOCAB + 8)
    with pytest.raises(ValueError, match=FIELD + r".*vocabulary of 460 tokens"):
        draft_llm(pair[0], draft_config(other) | {"load_format": "dummy"})


def test_other_tokenizer_is_refused(pair: tuple[Path, Path], tmp_path: Path) -> None:
    other = tmp_path / "other-tokenizer"
    other.mkdir()
    for f in pair[1].iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    # Same size, two ids swapped: another vocabulary all the same.
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=FIELD + r" has another tokenizer"):
        draft_llm(pair[0], draft_config(other))


def test_larger_draft_is_refused(pair: tuple[Path, Path], tmp_path: Path) -> None:
    big = _write_config(tmp_path / "big", pair[1], num_hidden_layers=4)
    with pytest.raises(ValueError, match=FIELD + r" is larger than the target"):
        draft_llm(pair[0], draft_config(big) | {"load_format": "dummy"})


def test_missing_draft_is_refused(pair: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=FIELD + r" .*does not exist"):
        draft_llm(pair[0], draft_config(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=FIELD + r" .*no config.json"):
        draft_llm(pair[0], draft_config(empty))


class EagerReplay:
    """Stands in for a captured CUDA graph off the GPU: a replay runs the forward eagerly over
    the graph's static inputs into its output buffer, and is recorded."""

    def __init__(self, model: torch.nn.Module, meta: object, ids: torch.Tensor,
                 positions: torch.Tensor, log: list) -> None:  # fmt: skip
        from models.forward_context import set_forward_context

        self.model, self.meta, self.ids, self.positions, self.log = model, meta, ids, positions, log
        with set_forward_context(meta):
            self.out = model(ids, positions)

    def replay(self) -> None:
        from models.forward_context import set_forward_context

        meta = self.meta
        rows = len(self.ids)
        real = int((meta.slot_mapping >= 0).sum())  # type: ignore[attr-defined]
        tables = meta.block_tables[:real].tolist()  # type: ignore[attr-defined]
        # Rows of one request share its block table: a batch-expanded catch-up.
        expanded = len({tuple(t) for t in tables}) < real
        self.log.append((rows, real, meta.decode_plan, expanded))  # type: ignore[attr-defined]
        # A fresh copy of the metadata: off the GPU a step keeps what its layers derive from
        # it (`cpu_step_index`), which a replay over new inputs must not reuse.
        with set_forward_context(dataclasses.replace(meta, cpu_step_index=None)):  # type: ignore[type-var]
            self.out.copy_(self.model(self.ids, self.positions))

    def pool(self) -> None:
        return None


def eager_graphs(proposer: object, monkeypatch: pytest.MonkeyPatch, max_num_seqs: int) -> list:
    """Give the proposer real `DecodeGraphs` (static buffers, staging, planning) whose graphs
    replay eagerly on the CPU; returns the log of the decode graphs' replays (padded rows,
    real rows, plan, whether batch-expanded)."""
    import asyncengine.cuda_graphs as cuda_graphs

    log: list = []

    def capture(model, meta, ids, positions, pool):  # type: ignore[no-untyped-def]
        replay = EagerReplay(model, meta, ids, positions, log)
        return replay, replay.out

    monkeypatch.setattr(cuda_graphs, "capture_forward", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    proposer.capture_graphs(max_num_seqs, 64, expanded_rows=8)  # type: ignore[attr-defined]
    log.clear()  # capture's own passes
    return log


def test_draft_steps_go_through_the_graphs(
    base: LLM, pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With graphs captured, each of the draft's one-token steps replays one, planned for
    the padded size it replays at; so do the short catch-ups after verify steps, one row a
    token with rotary unfused. Only catch-ups over a prompt, or past the largest graph, run
    eagerly; greedy output is unchanged."""
    from asyncengine_kernels.paged_attention import decode_plans

    target, draft = pair
    llm = draft_llm(target, draft_config(draft, 4))
    proposer = llm.llm_engine.spec_decoder.proposer
    replays = eager_graphs(proposer, monkeypatch, llm.llm_engine.scheduler.max_num_seqs)
    graphs = proposer.graphs
    eager: list[tuple[int, int]] = []  # (longest, rows) of forwards run eagerly
    forward = proposer._forward

    def recording(reqs, starts, lens, **ids):  # type: ignore[no-untyped-def]
        before = len(replays)
        out = forward(reqs, starts, lens, **ids)
        if len(replays) == before:
            eager.append((max(lens), sum(lens)))
        return out

    proposer._forward = recording
    import asyncengine.spec_decode.draft_model as draft_model

    staged: list[int] = []
    stage = draft_model.stage_decode_rows

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        inputs = stage(*args, **kwargs)
        if inputs is not None:
            staged.append(inputs.staged_rows)
        return inputs

    monkeypatch.setattr(draft_model, "stage_decode_rows", counting)
    ps = prompts()
    assert generate(llm, ps, GREEDY) == generate(base, ps, GREEDY)
    assert replays, "no draft step replayed a graph"
    assert staged, "no draft step was staged into the graphs' inputs"
    kv_heads = proposer.num_kv_heads
    for padded, real, plan, expanded in replays:
        assert padded == graphs.graph_size(real, 0)
        unfused = decode_plans(padded, kv_heads, proposer.device, fuse_rotary=False)
        assert plan in (unfused if expanded else decode_plans(padded, kv_heads, proposer.device))
    assert any(expanded for *_, expanded in replays), "no catch-up replayed a graph"
    # Eager: a prompt to catch up on, or more rows than the largest graph.
    largest = graphs.sizes[-1]
    assert all(n > EXPAND_MAX_TOKENS or rows > largest for n, rows in eager), eager
    assert_pool_clean(llm)
    llm.shutdown()
    assert proposer.graphs is None
# ------------------------------------------------------------------ on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_gpu_greedy_equals_without_speculation(
    pair: tuple[Path, Path], enforce_eager: bool
) -> None:
    """On the GPU (Triton kernels, asynchronous scheduling, CUDA graphs for the target's steps
    and the draft's one-token steps, or every step eager; split-KV decode plans): a smaller
    draft keeps greedy output equal, and the target as its own draft has every draft
    accepted, also with preemption."""
    target, draft = pair
    ps = prompts() + shared_prefix_prompts()
    common = dict(dtype="float32", device="cuda", enforce_eager=enforce_eager)
    # Sized pools: engines that each took 90% of the GPU could not live side by side.
    base = LLM(str(target), num_kv_blocks=64, **common)
    want = generate(base, ps, GREEDY)
    base.shutdown()
    small = draft_llm(target, draft_config(draft, 4), num_kv_blocks=64, **common)
    assert generate(small, ps, GREEDY) == want
    m = small.llm_engine.spec_decoder.metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens
    graphs = small.llm_engine.spec_decoder.proposer.graphs
    assert (graphs is None) == enforce_eager
    assert enforce_eager or graphs.replays > 0  # the draft's one-token steps replayed
    assert_pool_clean(small)
    small.shutdown()
    same = draft_llm(target, draft_config(target, 3), **TINY_POOL, **common)
    assert generate(same, ps, GREEDY) == want
    m = same.llm_engine.spec_decoder.metrics
    assert m.num_accepted_tokens == m.num_draft_tokens > 0
    assert same.llm_engine.scheduler.num_preemptions > 0
    assert_pool_clean(same)
    same.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_swap_preemption_keeps_every_draft(pair: tuple[Path, Path]) -> None:
    """On the GPU (asynchronous scheduling, pinned swap space, CUDA graphs): the target as
    its own draft under swap preemption has every draft accepted, so the draft's K/V came
    back from the CPU intact, and greedy output equals the non-speculative engine's."""
    target = pair[0]
    ps = prompts() + shared_prefix_prompts()
    common = dict(dtype="float32", device="cuda", **TINY_POOL, preemption_mode="swap")
    base = LLM(str(target), **common)
    want = generate(base, ps, GREEDY)
    base.shutdown()
    same = draft_llm(target, draft_config(target, 3), **common)
    assert generate(same, ps, GREEDY) == want
    m = same.llm_engine.spec_decoder.metrics
    assert m.num_accepted_tokens == m.num_draft_tokens > 0
    sched = same.llm_engine.scheduler
    assert sched.num_swaps_out > 0 and sched.num_swaps_in > 0
    assert_pool_clean(same)
    same.shutdown()
