"""The cost of structured outputs (`bench_throughput.py --structured-outputs json`).

One engine, one call: the workload unconstrained, then every request constrained to a JSON
schema whose long string field keeps each request going for the whole `output_len`, then
unconstrained again (so drift shows). Dummy weights of the workload's shape, with the
embedded SmolLM2's tokenizer (the grammar needs a real vocabulary; the model's vocabulary
is widened to the tokenizer's 49,152 for both runs). Reported: output tok/s of each and
their ratio, the host time spent filling and applying masks per step, the compile time cold
and cached, and the TTFT of a first request with a never-seen schema beside a free one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.bench_common import SHAPES, emit

# Every request writes this object; `body` cannot end within the workload's output length.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "title": {"type": "string", "maxLength": 64},
        "tags": {"type": "array", "items": {"enum": ["news", "sport", "tech"]}, "maxItems": 3},
        "body": {"type": "string", "minLength": 8192},
    },
    "required": ["id", "title", "tags", "body"],
    "additionalProperties": False,
}
TOKENIZER_VOCAB = 49152


def model_dir(shape: str) -> Path:
    """The dummy config of `shape` with the tokenizer's vocabulary size."""
    path = Path(tempfile.gettempdir()) / f"asyncengine-dummy-{shape}-v{TOKENIZER_VOCAB}"
    path.mkdir(exist_ok=True)
    config = dict(SHAPES[shape], vocab_size=TOKENIZER_VOCAB)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def constrained(params: Any, schema: dict[str, Any]) -> Any:
    from asyncengine.structured_outputs import StructuredOutputsParams

    return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=schema))


def time_to_first_token(engine: Any, prompt: list[int], params: Any, rid: str) -> float:
    """Seconds from `add_request` to the request's first token, on an idle engine."""
    one = dataclasses.replace(params, max_tokens=1)
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, one)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def run(w: dict, args: argparse.Namespace) -> None:
    from asyncengine import EngineArgs
    from asyncengine.llm_engine import LLMEngine
    from models.default_model import default_model_dir
    from scripts.bench_throughput import make_prompts, sampling_params, timed_run, warm_up

    engine_args = EngineArgs(
        model=str(model_dir(w["shape"])), tokenizer=args.tokenizer or str(default_model_dir()),
        load_format="dummy", max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
        async_scheduling=False if args.sync else None,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
        device=args.device, dtype="bfloat16" if args.device != "cpu" else "float32",
    )  # fmt: skip
    engine = LLMEngine(engine_args)
    free = sampling_params(w["output_len"], 1, args.seed)
    json_params = constrained(free, SCHEMA)
    compiler = engine.structured.compiler
    t0 = time.perf_counter()
    compiler.compile(json_params.structured_outputs)
    cold_s = time.perf_counter() - t0  # includes the vocabulary's one-time analysis
    t0 = time.perf_counter()
    compiler.compile(json_params.structured_outputs)
    cached_s = time.perf_counter() - t0
    warm_up(engine, w, free)
    warm_up(engine, w, json_params)

    records = {}
    for label, params in (("free", free), ("json", json_params), ("free_again", free)):
        masks = engine.runner.grammar_masker.stats
        before = dataclasses.replace(masks)
        record = timed_run(engine, w, params, args, f"{label}-")
        steps = max(masks.steps - before.steps, 1)
        record.update({
            "structured_outputs": label if label == "json" else None,
            "masked_steps": masks.steps - before.steps,
            "mask_fill_ms_per_step": round(1000 * (masks.fill_s - before.fill_s) / steps, 3),
            "mask_apply_ms_per_step": round(1000 * (masks.apply_s - before.apply_s) / steps, 3),
            "masked_rows_per_step": round((masks.rows - before.rows) / steps, 1),
            "vocab_size": TOKENIZER_VOCAB,
        })  # fmt: skip
        records[label] = record
        emit(record)

    vocab = SHAPES[w["shape"]]["vocab_size"]
    prompt = make_prompts(dict(w, num_requests=1), vocab, seed=123)[0]
    ttft_free = time_to_first_token(engine, prompt, free, "ttft-free")
    fresh = dict(SCHEMA, properties=dict(SCHEMA["properties"], fresh={"type": "boolean"}))
    ttft_new = time_to_first_token(engine, prompt, constrained(free, fresh), "ttft-new")
    ttft_cached = time_to_first_token(engine, prompt, constrained(free, fresh), "ttft-cached")
    free_tok_s = (records["free"]["output_tok_s"] + records["free_again"]["output_tok_s"]) / 2
    stats = compiler.stats
    emit({
        "workload": args.workload, "system": "asyncengine", "summary": "structured_outputs",
        "free_output_tok_s": round(free_tok_s, 1),
        "json_output_tok_s": records["json"]["output_tok_s"],
        "json_vs_free": round(records["json"]["output_tok_s"] / free_tok_s, 4),
        "mask_fill_ms_per_step": records["json"]["mask_fill_ms_per_step"],
        "mask_apply_ms_per_step": records["json"]["mask_apply_ms_per_step"],
        "compile_cold_s": round(cold_s, 4), "compile_cached_s": round(cached_s, 6),
        "tokenizer_info_s": round(stats.tokenizer_info_s, 4),
        "compile_max_s": round(stats.compile_s_max, 4),
        "ttft_free_s": round(ttft_free, 4), "ttft_new_schema_s": round(ttft_new, 4),
        "ttft_cached_schema_s": round(ttft_cached, 4),
        "async_scheduling": engine.async_scheduling,
    })  # fmt: skip
