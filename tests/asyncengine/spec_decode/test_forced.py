"""Constrained requests under speculation, on a tiny random Llama in float32 (CPU): exact
jump-forward (grammar-forced tokens verified as drafts) and n-gram drafts give the same
greedy tokens as step-by-step decoding on nested objects, arrays and enums, alone and
batched, in fewer model steps; no draft the grammar forbids is ever verified; n > 1,
sampling, logprobs, asynchronous scheduling and abort stay correct."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.llm_engine import LLMEngine
from asyncengine.request import Request
from asyncengine.spec_decode.forced import forced_drafts
from asyncengine.spec_decode.verify import VerifyStep
from asyncengine.structured_outputs import StructuredOutputsParams
from tests.asyncengine.engine_helpers import assert_pool_clean

SCHEMAS: list[dict[str, Any]] = [
    {  # a nested object with an enum and a bounded integer
        "type": "object",
        "properties": {
            "kind": {"enum": ["alpha", "beta", "gamma"]},
            "size": {"type": "integer", "minimum": 0, "maximum": 99},
            "owner": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 6},
                               "admin": {"type": "boolean"}},
                "required": ["name", "admin"], "additionalProperties": False,
            },
        },
        "required": ["kind", "size", "owner"], "additionalProperties": False,
    },
    {  # an array of enums and a boolean
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                       "minItems": 1, "maxItems": 3},
            "done": {"type": "boolean"},
        },
        "required": ["colors", "done"], "additionalProperties": False,
    },
    {  # an array of objects at the top
        "type": "array", "minItems": 1, "maxItems": 2,
        "items": {"type": "object",
                  "properties": {"id": {"type": "integer", "maximum": 9},
                                 "state": {"enum": ["open", "closed"]}},
                  "required": ["id", "state"], "additionalProperties": False},
    },
]  # fmt: skip
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "max_draft_tokens_per_step": 64}  # fmt: skip


def params(schema: dict[str, Any], compact: bool = True, **kw: Any) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 64)
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=compact)
    return SamplingParams(structured_outputs=so, **kw)


def make_llm(model_dir: Path, **kw: Any) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cpu", seed=0, **kw)


@pytest.fixture(scope="module")
def base(tiny_llama_dir: Path) -> LLM:
    return make_llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def jump(tiny_llama_dir: Path) -> LLM:
    return make_llm(tiny_llama_dir, structured_outputs_jump_forward=True)


@pytest.fixture(scope="module")
def prompts(base: LLM) -> list[list[int]]:
    texts = ["Describe a record as JSON.", "Which colors? Answer in JSON.", "List items."]
    return [base.llm_engine.apply_chat_template([{"role": "user", "content": t}])
            for t in texts]  # fmt: skip


class VerifiedDrafts:
    """Records the drafts every scheduled step verifies and checks each against the
    request's grammar at that moment."""

    def __init__(self, engine: LLMEngine) -> None:
        self.num_drafts = 0
        schedule = engine.scheduler.schedule

        def checked() -> Any:
            out = schedule()
            for s in out.scheduled:
                drafts = s.request.spec_token_ids[: s.num_spec_tokens]
                if drafts and s.request.grammar is not None:
                    assert s.request.grammar.num_allowed(drafts) == len(drafts), drafts
                    self.num_drafts += len(drafts)
            return out

        engine.scheduler.schedule = checked  # type: ignore[method-assign]


def generate(llm: LLM, ps: Sequence[list[int]], sp: Sequence[SamplingParams]
             ) -> tuple[list[Any], int]:  # fmt: skip
    """Outputs and the model steps they took."""
    steps = llm.llm_engine.step_timing["steps"]
    outs = llm.generate(list(ps), list(sp), use_tqdm=False)
    return outs, llm.llm_engine.step_timing["steps"] - steps


def token_ids(outs: list[Any]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def check_valid(outs: list[Any], schemas: Sequence[dict[str, Any]]) -> None:
    for out, schema in zip(outs, schemas, strict=True):
        for comp in out.outputs:
            if comp.finish_reason == "stop":  # a length cut leaves the JSON unfinished
                jsonschema.validate(json.loads(comp.text), schema)


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "any_whitespace"])
def test_jump_forward_equals_step_by_step(base: LLM, jump: LLM, prompts: list[list[int]],
                                          compact: bool) -> None:  # fmt: skip
    """Each schema alone, then all in one batch: the same token ids, fewer model steps, and
    forced drafts both kept and rejected (the tiny model splits text its own way)."""
    sp = [params(s, compact) for s in SCHEMAS]
    metrics = jump.llm_engine.spec_decoder.forced_metrics
    drafted, kept = metrics.num_draft_tokens, metrics.num_accepted_tokens
    watch = VerifiedDrafts(jump.llm_engine)
    want, plain_steps, got, jump_steps = [], 0, [], 0
    for p, s in zip(prompts, sp, strict=True):
        outs, n = generate(base, [p], [s])
        want += outs
        plain_steps += n
        outs, n = generate(jump, [p], [s])
        got += outs
        jump_steps += n
    assert token_ids(got) == token_ids(want)
    assert jump_steps < plain_steps
    check_valid(got, SCHEMAS)
    batched, _ = generate(jump, prompts, sp)
    assert token_ids(batched) == token_ids(want)
    assert metrics.num_accepted_tokens > kept
    assert 0 < watch.num_drafts == metrics.num_draft_tokens - drafted
    assert_pool_clean(jump)


def test_forced_drafts_skip_the_batch_fade_out(tiny_llama_dir: Path, base: LLM,
                                               prompts: list[list[int]]) -> None:  # fmt: skip
    """With n-gram speculation configured and its batch cap reached, constrained requests
    still get forced drafts; every greedy output equals step-by-step decoding."""
    llm = make_llm(tiny_llama_dir, structured_outputs_jump_forward=True,
                   speculative_config={**NGRAM, "max_draft_tokens_per_step": 2})  # fmt: skip
    engine = llm.llm_engine
    assert engine.spec_decoder.config.num_drafts_for_batch(3) == 0
    schedule = engine.scheduler.schedule
    drafts_at_three: list[int] = []

    def watched() -> Any:
        out = schedule()
        if len(engine.scheduler.running) == 3:
            drafts_at_three.append(sum(s.num_spec_tokens for s in out.scheduled))
        return out

    sp = [params(s) for s in SCHEMAS]
    # The grammars are compiled (and cached) by a first run, so that the watched run admits
    # the three requests together: compiled in threads, they can otherwise arrive so far
    # apart on a 2-core machine that three never run at once.
    generate(llm, prompts, sp)
    engine.scheduler.schedule = watched  # type: ignore[method-assign]
    outs, _ = generate(llm, prompts, sp)
    assert token_ids(outs) == token_ids(generate(base, prompts, sp)[0])
    assert sum(drafts_at_three) > 0
    assert engine.spec_decoder.forced_metrics.num_accepted_tokens > 0


def test_ngram_drafts_for_constrained_requests(tiny_llama_dir: Path, base: LLM,
                                               prompts: list[list[int]]) -> None:  # fmt: skip
    """n-gram speculation serves constrained requests (drafts cut where the grammar says
    no), without and with jump-forward: greedy output equals step-by-step decoding."""
    sp = [params(s, max_tokens=48) for s in SCHEMAS] + [params(SCHEMAS[0], False)]
    ps = prompts + prompts[:1]
    want = token_ids(generate(base, ps, sp)[0])
    for jf in (False, True):
        llm = make_llm(tiny_llama_dir, speculative_config=NGRAM,
                       structured_outputs_jump_forward=jf)  # fmt: skip
        watch = VerifiedDrafts(llm.llm_engine)
        outs, _ = generate(llm, ps, sp)
        assert token_ids(outs) == want
        assert llm.llm_engine.spec_decoder.metrics.num_draft_tokens > 0
        assert watch.num_drafts > 0
        assert_pool_clean(llm)


class _Forbidden:
    """Drafts the token the grammar forbids most surely next: the stop token, before the
    JSON is complete, then a run that is allowed."""

    def __init__(self, stop_id: int) -> None:
        self.stop_id = stop_id
        self.proposed = 0  # calls
        self.num_tokens = 0  # drafts proposed

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]
                ) -> list[list[int]]:  # fmt: skip
        out = []
        for req, k in zip(requests, num_drafts, strict=True):
            allowed = forced_drafts(req, k)
            self.proposed += 1
            out.append([self.stop_id, *allowed][:k] if self.proposed % 2 else
                       [*allowed, *[self.stop_id] * k][:k])  # fmt: skip
            self.num_tokens += len(out[-1])
        return out


def test_forbidden_drafts_are_cut_and_never_verified(tiny_llama_dir: Path, base: LLM,
                                                     prompts: list[list[int]]) -> None:  # fmt: skip
    """A proposer that drafts forbidden tokens: they are cut before the verify step (only the
    allowed prefix is verified), and the output equals step-by-step decoding."""
    llm = make_llm(tiny_llama_dir, speculative_config=NGRAM)
    engine = llm.llm_engine
    stop = min(engine.eos_token_ids)
    proposer = _Forbidden(stop)
    engine.spec_decoder.proposer = proposer
    watch = VerifiedDrafts(engine)
    sp = [params(s) for s in SCHEMAS]
    outs, _ = generate(llm, prompts, sp)
    assert token_ids(outs) == token_ids(generate(base, prompts, sp)[0])
    assert 0 < watch.num_drafts < proposer.num_tokens
    check_valid(outs, SCHEMAS)


def test_n_logprobs_sampling_and_async(tiny_llama_dir: Path, base: LLM, jump: LLM,
                                       prompts: list[list[int]]) -> None:  # fmt: skip
    """n > 1 greedy samples all equal step-by-step; logprobs equal step-by-step's; sampled
    outputs validate; asynchronous scheduling gives the synchronous tokens."""
    sp = [params(SCHEMAS[0], n=2), params(SCHEMAS[1], logprobs=2),
          params(SCHEMAS[2], temperature=1.0, seed=5, n=2, max_tokens=96)]  # fmt: skip
    want, _ = generate(base, prompts, sp)
    got, _ = generate(jump, prompts, sp)
    assert token_ids(got)[:2] == token_ids(want)[:2]
    for a, b in zip(got[1].outputs[0].logprobs, want[1].outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    check_valid(got[2:], SCHEMAS[2:])
    async_llm = make_llm(tiny_llama_dir, structured_outputs_jump_forward=True,
                         async_scheduling=True)  # fmt: skip
    outs, _ = generate(async_llm, prompts[:2], sp[:2])
    assert token_ids(outs) == token_ids(want)[:2]
    assert async_llm.llm_engine.spec_decoder.forced_metrics.num_accepted_tokens > 0
    assert_pool_clean(async_llm)
    assert_pool_clean(jump)


def test_abort_while_forced_drafts_are_verified(tiny_llama_dir: Path,
                                                prompts: list[list[int]]) -> None:  # fmt: skip
    """With asynchronous scheduling a verify step stays in flight between two calls of
    `step`: aborting its request then frees everything; the request beside it finishes."""
    llm = make_llm(tiny_llama_dir, structured_outputs_jump_forward=True, async_scheduling=True)
    engine = llm.llm_engine
    engine.add_request("a", prompts[0], params(SCHEMAS[0], n=2))
    engine.add_request("b", prompts[1], params(SCHEMAS[1]))
    # b may finish before a's forced drafts are in flight (how soon depends on the tokens,
    # and the CPU plans are timed), so outputs count from the first step.
    done = {}
    for _ in range(200):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        step = engine._inflight
        if isinstance(step, VerifyStep) and any(
            r.request_id == "a" and k for r, k in zip(step.requests, step.num_spec, strict=True)
        ):
            break
    else:
        pytest.fail("request a never verified forced drafts")
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(done) == ["b"]
    assert_pool_clean(llm)
