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
                max_tokens=24, max_batch=8, enforce_eager=False, repeats=1,
                graph_head_layers=0, prelaunch=False)  # fmt: skip
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
    assert "verdict_to_fire_ms" not in record


def test_host_mode_with_prelaunch_times_the_path_to_the_armed_graph(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`host --prelaunch`: every verify step bets on the next (a host-side gate off the GPU),
    and the record gives the host's path from a verdict to the armed graph's inputs."""
    bench.run_host(_args(max_tokens=32, prelaunch=True))
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()
               if line.startswith("{")]  # fmt: skip
    (record,) = [r for r in records if r["bench"] == "spec_verify_host"]
    assert 0 < record["prelaunch_fired"] <= record["steps"]
    assert 0 < record["verdict_to_fire_ms"] < 1e3


def test_launch_gaps_measure_the_device_waiting_on_graph_launches() -> None:
    """Two launches: the first graph's kernel starts 30 us after its 100-us call ended, the
    device idle 180 us before it; the second's starts before its call returns, the device
    busy until then."""
    events = [
        ("gpu", "verify", 0.0, 50.0),
        ("cpu", "cudaGraphLaunch", 100.0, 200.0),
        ("gpu", "gemv", 230.0, 900.0),
        ("cpu", "cudaGraphLaunch", 880.0, 960.0),
        ("gpu", "norm", 905.0, 950.0),
        ("cpu", "cudaLaunchKernel", 1000.0, 1010.0),  # not a graph launch
    ]
    gaps = bench.launch_gaps(events)
    assert gaps["launches"] == 2
    assert gaps["launch_call_us"] == 90.0  # median of 100 and 80
    assert gaps["first_kernel_after_call_start_us"] == (130.0 + 25.0) / 2
    assert gaps["first_kernel_after_call_end_us"] == (30.0 - 55.0) / 2
    assert gaps["device_idle_before_us"] == (180.0 + 5.0) / 2
    assert bench.launch_gaps([("gpu", "k", 0.0, 1.0)]) == {"launches": 0}


def test_brief_gpu_mode_times_only_the_swept_draft_counts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gpu --brief` (an A/B of settings in a short device call) times the one-token step, the
    verify steps of the sweep's draft counts and the sweep: no synchronous engine, profiles
    or host split; one speculating engine per --graph-head-layers value against one set of
    references. Off the GPU it runs on the CPU engine, which it must leave exact."""
    from asyncengine.model_runner import ModelRunner

    # The bench sets the runner's switch per engine: it goes back after the test.
    monkeypatch.setattr(ModelRunner, "graph_head_layers", ModelRunner.graph_head_layers)
    bench.run_gpu(_args(brief=True, batches=[1], sweep=[(4, 0.7)], vocab=None,
                        graph_head_layers=[0, 1], max_tokens=16, prompt_len=16,
                        repeats=2, prelaunch=[0, 1]))  # fmt: skip
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()
               if line.startswith("{")]  # fmt: skip
    steps = [r for r in records if r["bench"] == "spec_verify_step"]
    assert [(r["k"], r["graph_head_layers"]) for r in steps] == [(0, 0), (4, 0), (4, 1)]
    assert not any(r.get("sync") for r in steps)
    assert {r["bench"] for r in records} == {"spec_verify_step", "spec_matmul_plans",
                                            "spec_latency", "spec_throughput",
                                            "spec_prelaunch_unavailable"}  # fmt: skip
    # Off the GPU no stream can wait on host memory: said once per engine, never timed as on.
    unavailable = [r for r in records if r["bench"] == "spec_prelaunch_unavailable"]
    assert [r["graph_head_layers"] for r in unavailable] == [0, 1]
    latency = [r for r in records if r["bench"] == "spec_latency"]
    assert [r["graph_head_layers"] for r in latency] == [0, 1]
    assert not any(r["prelaunch"] for r in latency)
    for r in latency:
        assert r["k"] == 4 and r["replay_converged"] and r["verify_steps"] > 0
        # The converged run and its two repeats, which replay the same drafts.
        assert len(r["ms_per_token_runs"]) == 3
        assert r["ms_per_token"] == sorted(r["ms_per_token_runs"])[1]
    # The second engine ran on the first one's matmul plans.
    assert [r["plans_of_first_engine"] for r in latency] == [False, True]
    plans = [r["matmul_plans"] for r in records if r["bench"] == "spec_matmul_plans"]
    assert len(plans) == 2 and plans[0] == plans[1]
    load = [r for r in records if r["bench"] == "spec_throughput"]
    assert [r["graph_head_layers"] for r in load] == [0, 1]
    assert all(r["equal_to_plain"] for r in load)
