"""Jump-forward on a schema-heavy workload: the tokens it saves and the latency it wins.

Every request asks the embedded SmolLM2 (or `--model`) for a record of a schema whose keys,
punctuation and most values are fixed by the grammar (enums, booleans, bounded integers,
short strings), so much of each output is forced. The same greedy requests run one at a time
step by step and with jump-forward, in one engine, alternating. Reported: model steps and
wall time per request, the tokens appended without a step, and whether the JSON of each
output equals the step-by-step one (the forced tokens may be split into token ids
differently, so the texts are compared as parsed JSON).

    python scripts/bench_jump_forward.py            # CPU, embedded model
    python scripts/bench_jump_forward.py --device cuda --model DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncengine import LLM, SamplingParams
from asyncengine.structured_outputs import StructuredOutputsParams
from scripts.bench_common import emit

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "country": {"type": "string", "maxLength": 24},
        "continent": {"enum": ["Africa", "Asia", "Europe", "North America", "Oceania",
                               "South America"]},
        "landlocked": {"type": "boolean"},
        "official_languages": {"type": "integer", "minimum": 1, "maximum": 20},
        "driving_side": {"enum": ["left", "right"]},
        "currency_is_euro": {"type": "boolean"},
        "population_band": {"enum": ["under 1 million", "1 to 10 million",
                                     "10 to 100 million", "over 100 million"]},
        "has_coastline_on_the_atlantic_ocean": {"type": "boolean"},
        "member_of_the_european_union": {"type": "boolean"},
    },
    "required": ["country", "continent", "landlocked", "official_languages", "driving_side",
                 "currency_is_euro", "population_band", "has_coastline_on_the_atlantic_ocean",
                 "member_of_the_european_union"],
    "additionalProperties": False,
}
COUNTRIES = ["France", "Japan", "Brazil", "Kenya", "Canada", "Australia", "Switzerland",
             "India", "Mexico", "Norway", "Egypt", "Chile"]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, jump: bool
        ) -> tuple[list[Any], list[float], int, int]:  # fmt: skip
    """Each prompt alone (latency): parsed outputs, seconds each, steps, jumped tokens."""
    engine = llm.llm_engine
    engine.structured.jump_forward = jump
    engine.structured.num_jump_forward_tokens = 0
    steps0 = engine.step_timing["steps"]
    parsed, secs = [], []
    for prompt in prompts:
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        secs.append(time.perf_counter() - t0)
        parsed.append(json.loads(out.text))
    return (parsed, secs, engine.step_timing["steps"] - steps0,
            engine.structured.num_jump_forward_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-requests", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2, help="alternating passes of each mode")
    args = ap.parse_args()

    llm = LLM(args.model, device=args.device)
    tok = llm.get_tokenizer()
    prompts = [llm.llm_engine.apply_chat_template(
        [{"role": "user", "content": f"Describe {c} as a JSON record."}])
        for c in (COUNTRIES * 4)[: args.num_requests]]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=256, structured_outputs=(
        StructuredOutputsParams(json=SCHEMA)))
    run(llm, prompts[:2], params, False)  # compile the grammar, warm the kernels
    results: dict[bool, list[tuple[Any, ...]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for jump in (False, True):
            results[jump].append(run(llm, prompts, params, jump))
    plain, jumped = results[False][-1], results[True][-1]
    tokens = [len(tok.encode(json.dumps(p))) for p in plain[0]]
    record = {
        "bench": "jump_forward", "device": args.device, "requests": len(prompts),
        "steps_step_by_step": plain[2], "steps_jump_forward": jumped[2],
        "tokens_jumped": jumped[3],
        "steps_saved_fraction": round(1 - jumped[2] / plain[2], 3),
        "ms_per_request_step_by_step": round(
            1e3 * statistics.median(s for r in results[False] for s in r[1]), 1),
        "ms_per_request_jump_forward": round(
            1e3 * statistics.median(s for r in results[True] for s in r[1]), 1),
        "approx_output_tokens_per_request": round(statistics.mean(tokens), 1),
        "json_equal": plain[0] == jumped[0],
    }
    record["latency_ratio"] = round(record["ms_per_request_step_by_step"]
                                    / record["ms_per_request_jump_forward"], 3)
    emit(record)


if __name__ == "__main__":
    main()
