"""simulate_admission.py: with room kept for growth a pool too small for every output runs
without preemptions; without it the same workload preempts and runs more requests at once."""

from __future__ import annotations

import argparse

from scripts.simulate_admission import simulate


def args(**overrides: object) -> argparse.Namespace:
    base = dict(num_requests=40, prompt_len=64, output_len=64, pool_tokens=40 * 128 // 2,
                block_size=16, max_num_seqs=64, max_num_batched_tokens=512,
                weight_bytes=8.5e9, kv_bytes_per_token=65536, prefill_s_per_token=15e-6,
                warm=True, max_tokens=None, finish_margin=1.5, seed=0)
    return argparse.Namespace(**{**base, **overrides})


def test_room_for_growth_avoids_preemption_that_no_room_causes() -> None:
    kept = simulate(args(), 1.0)
    none = simulate(args(), 0.0)
    assert kept["preemptions"] == 0
    assert none["preemptions"] > 0
    assert none["peak_running"] > kept["peak_running"]
    # 20 requests of 128 tokens fit at once; all 40 run to the end either way.
    assert kept["peak_running"] <= 20
    assert kept["modelled_output_tok_s"] > 0 and none["modelled_output_tok_s"] > 0
    assert none["final_ratio"] is None


def test_without_warm_up_the_first_requests_are_admitted_boldly() -> None:
    cold = simulate(args(warm=False), 1.0)
    warm = simulate(args(), 1.0)
    assert cold["peak_running"] > warm["peak_running"]
