"""Jump-forward on a schema-heavy workload: the steps it saves, the latency it wins, and
whether the outputs equal step-by-step decoding.

Every request asks the embedded SmolLM2 (or `--model`) for a record of a schema whose keys,
punctuation and most values are fixed by the grammar (enums, booleans, bounded integers,
short strings), so much of each output is forced. The same greedy requests run step by step
and with jump-forward (the forced tokens verified as drafts), in one engine, alternating:
one at a time (latency) and all at once (a batch). Reported: model steps, wall time, the
forced drafts proposed and kept, and whether every output's token ids equal the step-by-step
ones.

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


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, jump: bool,
        batched: bool) -> dict[str, Any]:  # fmt: skip
    """The prompts one at a time (or all at once when `batched`): token ids, seconds per
    request (or for the batch), model steps, forced drafts proposed and kept."""
    engine = llm.llm_engine
    decoder = engine.spec_decoder
    assert decoder is not None
    decoder.jump_forward = jump
    forced = decoder.forced_metrics
    steps0, drafted0, kept0 = (engine.step_timing["steps"], forced.num_draft_tokens,
                               forced.num_accepted_tokens)
    groups = [prompts] if batched else [[p] for p in prompts]
    ids, secs = [], []
    for group in groups:
        t0 = time.perf_counter()
        outs = llm.generate(group, params, use_tqdm=False)
        secs.append(time.perf_counter() - t0)
        for out in outs:
            comp = out.outputs[0]
            json.loads(comp.text)  # the grammar guarantees it parses
            ids.append(comp.token_ids)
    return {"ids": ids, "secs": secs, "steps": engine.step_timing["steps"] - steps0,
            "drafted": forced.num_draft_tokens - drafted0,
            "kept": forced.num_accepted_tokens - kept0}


def compare(plain: list[dict[str, Any]], jumped: list[dict[str, Any]], key: str
            ) -> dict[str, Any]:  # fmt: skip
    """One mode's figures over its rounds (the last round's counts; median times)."""
    p, j = plain[-1], jumped[-1]
    ms_plain = 1e3 * statistics.median(s for r in plain for s in r["secs"])
    ms_jump = 1e3 * statistics.median(s for r in jumped for s in r["secs"])
    return {
        f"{key}_steps_step_by_step": p["steps"], f"{key}_steps_jump_forward": j["steps"],
        f"{key}_steps_saved_fraction": round(1 - j["steps"] / p["steps"], 3),
        f"{key}_forced_drafts": j["drafted"], f"{key}_forced_drafts_kept": j["kept"],
        f"{key}_ms_step_by_step": round(ms_plain, 1),
        f"{key}_ms_jump_forward": round(ms_jump, 1),
        f"{key}_latency_ratio": round(ms_plain / ms_jump, 3),
        f"{key}_outputs_equal": all(r["ids"] == p["ids"] for r in plain + jumped),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-requests", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2, help="alternating passes of each mode")
    args = ap.parse_args()

    llm = LLM(args.model, device=args.device, structured_outputs_jump_forward=True)
    prompts = [llm.llm_engine.apply_chat_template(
        [{"role": "user", "content": f"Describe {c} as a JSON record."}])
        for c in (COUNTRIES * 4)[: args.num_requests]]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=256, structured_outputs=(
        StructuredOutputsParams(json=SCHEMA)))
    run(llm, prompts[:2], params, False, False)  # compile the grammar, warm the kernels
    record: dict[str, Any] = {"bench": "jump_forward", "device": args.device,
                              "requests": len(prompts)}
    for batched, key in ((False, "single"), (True, "batch")):
        results: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for jump in (False, True):
                results[jump].append(run(llm, prompts, params, jump, batched))
        record.update(compare(results[False], results[True], key))
        if not batched:
            record["approx_output_tokens_per_request"] = round(statistics.mean(
                len(ids) for ids in results[False][-1]["ids"]), 1)
    emit(record)


if __name__ == "__main__":
    main()
