"""bench_serving's request draws (fixed and log-uniform lengths), its floor per rate, the
long-mixed workload's flags and the chunked-prefill sweep's command and table."""

from __future__ import annotations

import math
import random
import sys

import pytest

from scripts import bench_serving
from scripts.bench_common import SHAPES, param_count, request_floor_seconds
from scripts.bench_serving import (
    BenchRequest,
    FloorModel,
    RequestResult,
    arrival_times,
    log_uniform_int,
    make_requests,
    parse_args,
    parse_range,
    serving_floor,
    summarize,
    sweep_command,
    sweep_table,
)


def lengths(requests: list[BenchRequest]) -> list[tuple[int, int]]:
    return [(len(r.prompt_token_ids), r.output_len) for r in requests]


def test_parse_range() -> None:
    assert parse_range("32,8192") == (32, 8192)
    assert parse_range(None) is None
    for bad in ("0,8", "9,8"):
        with pytest.raises(ValueError):
            parse_range(bad)


def test_log_uniform_stays_in_bounds_and_reaches_both_ends() -> None:
    rng = random.Random(0)
    draws = [log_uniform_int(rng, 3, 6) for _ in range(2000)]
    assert set(draws) == {3, 4, 5, 6}
    assert all(7 <= log_uniform_int(rng, 7, 7) <= 7 for _ in range(10))


def test_log_uniform_puts_as_many_draws_in_each_doubling() -> None:
    # [32, 8191] is 8 whole doublings; a uniform draw would put half in the last one.
    rng = random.Random(1)
    n = 16000
    counts = [0] * 8
    for _ in range(n):
        x = log_uniform_int(rng, 32, 8191)
        assert 32 <= x <= 8191
        counts[int(math.log2(x)) - 5] += 1
    for c in counts:
        assert abs(c / n - 1 / 8) < 0.015


def test_mixed_lengths_are_reproducible_from_the_seed() -> None:
    kw = dict(input_range=(32, 8192), output_range=(32, 1024))
    a = make_requests(64, 0, 0, 0.0, 1000, seed=5, content_seed=0, **kw)
    b = make_requests(64, 0, 0, 0.0, 1000, seed=5, content_seed=0, **kw)
    fresh = make_requests(64, 0, 0, 0.0, 1000, seed=5, content_seed=1, **kw)
    other = make_requests(64, 0, 0, 0.0, 1000, seed=6, content_seed=0, **kw)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert lengths(a) == lengths(b) == lengths(fresh) != lengths(other)
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in fresh]
    assert all(32 <= p <= 8192 and 32 <= o <= 1024 for p, o in lengths(a))
    assert all(100 <= t < 1000 for r in a for t in r.prompt_token_ids)


def test_fixed_lengths_stay_the_default() -> None:
    reqs = make_requests(50, 100, 20, 0.5, 1000, seed=0)
    assert all(50 <= p <= 150 and 10 <= o <= 30 for p, o in lengths(reqs))
    exact = make_requests(5, 64, 16, 0.0, 1000, seed=0, output_range=(8, 9))
    assert all(p == 64 and o in (8, 9) for p, o in lengths(exact))


def test_floor_is_the_work_or_the_last_arrival_whichever_is_later() -> None:
    model = FloorModel("llama3.1-8b", 256, 2 * param_count("llama3.1-8b"))
    reqs = make_requests(8, 0, 0, 0.0, 1000, seed=0, input_range=(32, 8192),
                         output_range=(32, 1024))
    at_once = serving_floor(model, reqs, arrival_times(8, math.inf, 0))
    assert at_once["total_s"] == at_once["work_s"] >= at_once["arrival_bound_s"]
    late = [0.0] * 7 + [100.0]
    spread = serving_floor(model, reqs, late)
    p, o = lengths(reqs)[-1]
    assert spread["arrival_bound_s"] == pytest.approx(
        100.0 + request_floor_seconds("llama3.1-8b", p, o, model.weight_bytes))
    assert spread["total_s"] == spread["arrival_bound_s"]


def test_summary_reports_percentiles_throughput_and_fraction_of_floor() -> None:
    reqs = [BenchRequest([1] * 10, 3), BenchRequest([1] * 30, 2)]
    results = [RequestResult(ok=True, ttft=0.1, itls=[0.01, 0.02], e2e=0.2, output_tokens=3),
               RequestResult(ok=True, ttft=0.3, itls=[0.03], e2e=0.4, output_tokens=2)]
    model = FloorModel("tiny", 256, 2 * param_count("tiny"))
    rec = summarize("s", 2.0, results, 2.0, {}, reqs, [0.0, 0.5], model)
    assert rec["ttft_p50_ms"] == pytest.approx(100.0)
    assert rec["ttft_p90_ms"] == pytest.approx(300.0)
    assert rec["output_tokens_per_s"] == pytest.approx(5 / 2.0)
    assert rec["total_tokens_per_s"] == pytest.approx(45 / 2.0)
    floor = serving_floor(model, reqs, [0.0, 0.5])
    assert rec["fraction_of_floor"] == pytest.approx(floor["total_s"] / 2.0, abs=1e-4)
    # A failed request leaves the floor out: it was computed for the whole set.
    results[1] = RequestResult(ok=False, error="boom")
    partial = summarize("s", 2.0, results, 2.0, {}, reqs, [0.0, 0.5], model)
    assert "fraction_of_floor" not in partial and partial["failed"] == 1


def test_long_mixed_workload_fits_its_model_and_yields_to_explicit_flags() -> None:
    ns = parse_args(["--workload", "long-mixed", "--rates", "inf"])
    assert ns.rates == "inf" and ns.shape == "llama3.1-8b" and ns.api == "openai"
    lo_in, hi_in = parse_range(ns.input_len_range)
    lo_out, hi_out = parse_range(ns.output_len_range)
    assert (lo_in, hi_in, lo_out, hi_out) == (32, 8192, 32, 1024)
    assert hi_in + hi_out <= ns.max_model_len <= SHAPES[ns.shape]["max_position_embeddings"]
    plain = parse_args([])
    assert plain.workload is None and plain.input_len_range is None and plain.seed == 0


def test_sweep_child_runs_one_budget_without_sweeping() -> None:
    argv = ["--workload", "long-mixed", "--max-num-batched-tokens-sweep", "2048,4096"]
    cmd = sweep_command(argv, 4096)
    assert cmd[0] == sys.executable and cmd[1] == bench_serving.__file__
    ns = parse_args(cmd[2:])
    assert ns.max_num_batched_tokens == 4096 and not ns.max_num_batched_tokens_sweep
    assert ns.shape == "llama3.1-8b"


def test_sweep_table_has_one_row_per_budget_and_rate() -> None:
    base = dict(ttft_p50_ms=12.34, ttft_p99_ms=56.78, itl_p50_ms=9.876, itl_p99_ms=20.0,
                output_tokens_per_s=1234.56)
    table = sweep_table([dict(base, max_num_batched_tokens=2048, rate=4.0,
                              fraction_of_floor=0.6123),
                         dict(base, max_num_batched_tokens=8192, rate="inf")]).splitlines()
    assert table[0].startswith("| max_num_batched_tokens | rate (req/s) | TTFT p50 ms")
    assert table[1] == "|" + " --- |" * 8
    assert table[2] == "| 2048 | 4.0 | 12.3 | 56.8 | 9.88 | 20.00 | 1234.6 | 0.612 |"
    assert table[3] == "| 8192 | inf | 12.3 | 56.8 | 9.88 | 20.00 | 1234.6 | — |"
