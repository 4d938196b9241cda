"""`bench_spec_decode host`: off the GPU its decode graphs replay eagerly, so a speculating
engine runs the staged small-step path a GPU runs; what it times must be that path, with
the same tokens as the engine without graphs."""

from __future__ import annotations

import argparse
import json

import pytest

from asyncengine import SamplingParams
from scripts import bench_spec_decode as bench


def _args(**over: object) -> argparse.Namespace:
    base = dict(model=None, shape="tiny", load_format="auto", device="cpu", prompt_len=24,
                max_tokens=24, max_batch=8, enforce_eager=False, repeats=1)  # fmt: skip
    return argparse.Namespace(**{**base, **over})


def test_eager_graphs_run_the_staged_path_with_the_same_tokens() -> None:
    args = _args()
    bench._default_model(args)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = bench._engine(args, 4)
    prompts = bench._prompts(2, 24, plain.llm_engine.model_config.vocab_size)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.llm_engine.shutdown()
    llm = bench._engine(args, 4)
    bench._eager_graphs(llm)
    runner = llm.llm_engine.runner
    staged: list[int] = []
    small = runner._small_decode_inputs

    def recording(sched):  # type: ignore[no-untyped-def]
        inputs = small(sched)
        if inputs is not None:
            staged.append(inputs.staged_rows)
        return inputs

    runner._small_decode_inputs = recording
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert staged and runner.graphs.replays >= len(staged)
    assert llm.llm_engine.spec_decoder.metrics.num_drafts > 0  # verify steps ran
    llm.llm_engine.shutdown()


def test_host_mode_reports_every_part(capsys: pytest.CaptureFixture[str]) -> None:
    bench.run_host(_args(max_tokens=16))
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()
               if line.startswith("{")]  # fmt: skip
    (record,) = [r for r in records if r["bench"] == "spec_verify_host"]
    assert record["steps"] > 0
    for part in ("propose", "schedule", "prepare_inputs", "run_model", "resolve"):
        assert record[f"{part}_ms"] >= 0
    assert record["prepare_inputs_ms"] > 0 and record["run_model_ms"] > 0
