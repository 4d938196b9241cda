"""Structured outputs through the engine, on the embedded SmolLM2 (CPU): every output of a
set of schemas parses and validates (greedy and sampled), choice / regex / grammar hold, and
constraints live with unconstrained requests, n > 1, chunked prefill, preemption, abort and
jump-forward (exact: the same tokens as step by step)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from asyncengine.config import EngineArgs
from asyncengine.errors import InvalidRequestError
from asyncengine.llm import LLM
from asyncengine.llm_engine import LLMEngine
from asyncengine.sampling_params import SamplingParams
from asyncengine.structured_outputs import StructuredOutputsParams

SCHEMAS: list[dict[str, Any]] = [
    {  # nested object, enum, integer range, required fields
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12},
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False,
            },
        },
        "required": ["name", "age", "role", "address"], "additionalProperties": False,
    },
    {  # arrays of numbers and booleans
        "type": "object",
        "properties": {
            "scores": {"type": "array", "items": {"type": "integer", "maximum": 100},
                       "minItems": 1, "maxItems": 3},
            "passed": {"type": "boolean"},
        },
        "required": ["scores", "passed"], "additionalProperties": False,
    },
    {  # an array of objects at the top, optional field
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object",
                  "properties": {"id": {"type": "integer"},
                                 "tag": {"type": "string", "maxLength": 8}},
                  "required": ["id"], "additionalProperties": False},
    },
]

PROMPTS = [
    "Describe a user of a website as JSON.",
    "Give the scores of a student as JSON.",
    "List a few items with ids as JSON.",
]


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> LLM:
    return _reference(default_model_dir)


def chat_ids(llm: LLM, text: str) -> list[int]:
    return llm.llm_engine.apply_chat_template([{"role": "user", "content": text}])


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[Any]:
    ids = [chat_ids(llm, p) for p in prompts]
    return llm.generate(ids, params, use_tqdm=False)


def constrained(schema: dict[str, Any], **kw: Any) -> SamplingParams:
    kw.setdefault("max_tokens", 100)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), **kw)


def assert_valid(schema: dict[str, Any], completion: Any) -> Any:
    assert completion.finish_reason == "stop", completion.text
    value = json.loads(completion.text)
    jsonschema.validate(value, schema)
    return value


def test_schemas_validate_greedy_and_sampled(llm: LLM) -> None:
    """Every output parses and validates, greedy and sampled (top-k/p, penalties)."""
    greedy = [constrained(s, temperature=0.0) for s in SCHEMAS]
    sampled = [constrained(s, temperature=1.0, top_p=0.95, top_k=50, seed=7 + i,
                           repetition_penalty=1.1, presence_penalty=0.2, n=1 + (i == 0))
               for i, s in enumerate(SCHEMAS)]
    outs = run(llm, PROMPTS + PROMPTS, greedy + sampled)
    for i, out in enumerate(outs):
        for comp in out.outputs:
            assert_valid(SCHEMAS[i % len(SCHEMAS)], comp)


def test_logprobs_are_of_allowed_tokens(llm: LLM) -> None:
    """With logprobs, the sampled token is an allowed one and its logprob is finite."""
    (out,) = run(llm, PROMPTS[:1], [constrained(SCHEMAS[0], temperature=0.0, logprobs=2)])
    comp = out.outputs[0]
    assert_valid(SCHEMAS[0], comp)
    assert len(comp.logprobs) == len(comp.token_ids)
    for tok, entry in zip(comp.token_ids, comp.logprobs, strict=True):
        assert entry[tok] > float("-inf")


def test_choice_regex_grammar_and_json_object(llm: LLM) -> None:
    params = [
        SamplingParams(temperature=0.0, max_tokens=8,
                       structured_outputs=StructuredOutputsParams(choice=["Paris", "Rome"])),
        SamplingParams(temperature=0.8, seed=3, max_tokens=20,
                       structured_outputs=StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8}, \d{4}")),
        SamplingParams(temperature=0.8, seed=4, max_tokens=20,
                       structured_outputs=StructuredOutputsParams(
                           grammar='root ::= "yes" | "no" | "maybe " [0-9]')),
        SamplingParams(temperature=0.0, max_tokens=120,
                       structured_outputs=StructuredOutputsParams(json_object=True)),
    ]
    outs = run(llm, ["What is the capital of France?", "Name a city and a year.",
                     "Answer yes or no.", "Return a JSON object with a name and an age."], params)
    texts = [o.outputs[0].text for o in outs]
    assert texts[0] == "Paris"
    assert re.fullmatch(r"[A-Z][a-z]{2,8}, \d{4}", texts[1])
    assert re.fullmatch(r"yes|no|maybe [0-9]", texts[2])
    assert outs[3].outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(texts[3]), dict)


def test_unconstrained_requests_in_the_same_steps_are_unchanged(llm: LLM) -> None:
    """A constrained request batched with free ones changes none of their outputs."""
    free = SamplingParams(temperature=0.0, max_tokens=16)
    alone = run(llm, PROMPTS[:2], [free] * 2)
    mixed = run(llm, PROMPTS[:2] * 2, [free] * 2 + [constrained(s, temperature=0.0)
                                                  for s in SCHEMAS[:2]])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == \
        [o.outputs[0].token_ids for o in alone]
    for s, o in zip(SCHEMAS, mixed[2:], strict=False):
        assert_valid(s, o.outputs[0])


def small_engine(model_dir: Path, **kw: Any) -> LLMEngine:
    args = dict(model=str(model_dir), device="cpu", dtype="float32", max_model_len=512,
                num_kv_blocks=256, seed=0)
    return LLMEngine(EngineArgs(**{**args, **kw}))


@functools.cache
def _reference(model_dir: Path) -> LLM:
    return LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=512,
               num_kv_blocks=256, seed=0)


def llm_outputs(model_dir: Path, convs: list[list[dict[str, str]]],
                schema: dict[str, Any]) -> list[Any]:
    """Unhindered greedy outputs (a roomy pool, whole prompts) to compare with."""
    llm = _reference(model_dir)
    return llm.chat(convs, constrained(schema, temperature=0.0, max_tokens=40), use_tqdm=False)


def drain(engine: LLMEngine) -> dict[str, Any]:
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        assert not engine.take_rejected()
    return done


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_chunked_prefill_keep_the_grammar(default_model_dir: Path,
                                                         mode: str) -> None:
    """A pool too small for the batch preempts constrained requests (recompute or swap) and
    small token budgets chunk their prompts: greedy outputs equal an unhindered run."""
    tight = small_engine(default_model_dir, num_kv_blocks=6, schedule_conservativeness=0,
                         block_size=16, max_num_batched_tokens=32, preemption_mode=mode)
    prompts = [[{"role": "user", "content": PROMPTS[i]}] for i in (1, 1)]
    for i, msgs in enumerate(prompts):
        tight.add_request(f"r{i}", tight.apply_chat_template(msgs),
                          constrained(SCHEMAS[1], temperature=0.0, max_tokens=40))
    got = drain(tight)
    assert tight.scheduler.num_preemptions > 0
    want = llm_outputs(default_model_dir, prompts, SCHEMAS[1])
    for i, out in enumerate(want):
        assert got[f"r{i}"].outputs[0].token_ids == out.outputs[0].token_ids
        assert_valid(SCHEMAS[1], got[f"r{i}"].outputs[0])
    tight.check_integrity()
    assert tight.pool.num_free_blocks == tight.pool.num_blocks


def test_jump_forward_equals_step_by_step_greedy(llm: LLM, default_model_dir: Path) -> None:
    """Forced tokens verified as drafts: the same token ids as step by step, in fewer model
    steps, on every schema at once."""
    jump = LLM(str(default_model_dir), device="cpu", dtype="float32", max_model_len=512,
               num_kv_blocks=256, seed=0, structured_outputs_jump_forward=True)  # fmt: skip
    results = {}
    for engine in (llm, jump):
        steps = engine.llm_engine.step_timing["steps"]
        outs = run(engine, PROMPTS, [constrained(s, temperature=0.0) for s in SCHEMAS])
        results[engine is jump] = ([o.outputs[0].token_ids for o in outs],
                                   engine.llm_engine.step_timing["steps"] - steps)
    (plain, plain_steps), (jumped, jump_steps) = results[False], results[True]
    assert jumped == plain
    assert jump.llm_engine.spec_decoder.forced_metrics.num_accepted_tokens > 0
    assert jump_steps < plain_steps


def test_invalid_constraints_are_refused_naming_the_field(llm: LLM) -> None:
    engine = llm.llm_engine
    ids = chat_ids(llm, "hi")
    cases = [
        (StructuredOutputsParams(json={"type": "nope"}), "structured_outputs.json"),
        (StructuredOutputsParams(regex="a("), "structured_outputs.regex"),
        (StructuredOutputsParams(grammar="root ::= undefined_rule"),
         "structured_outputs.grammar"),
        (StructuredOutputsParams(json={"type": "object", "not": {}}), "structured_outputs.json"),
    ]
    for so, field in cases:
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request("bad", ids, SamplingParams(structured_outputs=so))
        assert err.value.field == field
    assert not engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(json={}, regex="a")
    assert err.value.field == "structured_outputs.regex"


def test_compile_timeout_refuses_only_that_request(default_model_dir: Path) -> None:
    """A grammar that compiles past the limit is refused after `add_request`; the request
    beside it finishes normally."""
    eng = small_engine(default_model_dir, structured_outputs_compile_timeout=1e-9)
    ids = eng.apply_chat_template([{"role": "user", "content": "hi"}])
    eng.add_request("slow", ids, constrained(SCHEMAS[0]))
    eng.add_request("free", ids, SamplingParams(temperature=0.0, max_tokens=4))
    rejected, done = [], {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
        rejected += eng.take_rejected()
    assert [r[0] for r in rejected] == ["slow"]
    assert "longer than" in str(rejected[0][2])
    assert rejected[0][2].field == "structured_outputs.json"
    assert list(done) == ["free"]


def test_abort_while_compiling_and_while_running(default_model_dir: Path) -> None:
    eng = small_engine(default_model_dir)
    ids = eng.apply_chat_template([{"role": "user", "content": "hi"}])
    eng.add_request("a", ids, constrained(SCHEMAS[1]))  # first compile: it waits
    waiting = len(eng.structured.waiting)
    with pytest.raises(InvalidRequestError):  # its id is taken while it waits too
        eng.add_request("a", ids, SamplingParams())
    eng.abort_request("a")
    assert not eng.has_unfinished_requests() and waiting == 1
    eng.add_request("b", ids, constrained(SCHEMAS[1]))
    while not eng.scheduler.requests:
        eng.step()
    eng.step()
    eng.abort_request("b")
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_integrity()
    assert eng.pool.num_free_blocks == eng.pool.num_blocks


def test_asynchronous_scheduling_overlaps_and_matches(default_model_dir: Path) -> None:
    """With asynchronous scheduling, constrained steps still overlap (the mask takes the
    token in flight from the step that sampled it) and outputs equal the synchronous ones,
    alongside an unconstrained request."""
    eng = small_engine(default_model_dir, async_scheduling=True)
    convs = [[{"role": "user", "content": PROMPTS[1]}], [{"role": "user", "content": "Hi!"}]]
    eng.add_request("json", eng.apply_chat_template(convs[0]),
                    constrained(SCHEMAS[1], temperature=0.0, max_tokens=40))
    eng.add_request("free", eng.apply_chat_template(convs[1]),
                    SamplingParams(temperature=0.0, max_tokens=12))
    overlapped = 0
    done: dict[str, Any] = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
        overlapped += eng._inflight is not None
    assert overlapped > 5
    want = llm_outputs(default_model_dir, convs[:1], SCHEMAS[1])[0].outputs[0]
    assert done["json"].outputs[0].token_ids == want.token_ids
    assert_valid(SCHEMAS[1], done["json"].outputs[0])
    free = _reference(default_model_dir).chat(
        convs[1:], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert done["free"].outputs[0].token_ids == free[0].outputs[0].token_ids


@pytest.mark.gpu
def test_gpu_cuda_graphs_and_async_scheduling(default_model_dir: Path) -> None:
    """On the GPU (CUDA graphs, asynchronous scheduling): greedy and sampled outputs
    validate, and greedy ones repeat exactly."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    gpu = LLM(str(default_model_dir), device="cuda", dtype="float32", max_model_len=512, seed=0)
    assert gpu.llm_engine.async_scheduling and gpu.llm_engine.runner.graphs is not None
    greedy = [constrained(s, temperature=0.0) for s in SCHEMAS]
    sampled = [constrained(s, temperature=1.0, seed=i, n=2) for i, s in enumerate(SCHEMAS)]
    outs = run(gpu, PROMPTS + PROMPTS, greedy + sampled)
    for i, out in enumerate(outs):
        for comp in out.outputs:
            assert_valid(SCHEMAS[i % 3], comp)
    again = run(gpu, PROMPTS, greedy)
    assert [o.outputs[0].text for o in outs[:3]] == [o.outputs[0].text for o in again]
