"""The hardware floor of bench_common on a shape small enough to work out by hand, and
bench_throughput's use of it."""

from __future__ import annotations

import math

import pytest

from scripts import bench_common
from scripts.bench_common import (
    PEAK_BW,
    PEAK_FLOPS,
    floor_seconds_for,
    kv_bytes_per_token,
    param_count,
    prefill_flops,
    request_floor_seconds,
)

# hidden 8, 2 query heads of 4, 1 KV head, MLP 16, vocab 10, one layer.
HAND = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=10)
# q,o: 8x8 each; k,v: 8x4 each -> 192; MLP 3 x 8 x 16 = 384; two norms 16; per layer 592.
# Embedding and LM head 2 x 10 x 8 = 160, final norm 8: 760 parameters.
PARAMS = 760
# K and V, one layer, one head of 4, 2 bytes each.
KV_BYTES = 16


@pytest.fixture(autouse=True)
def hand_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(bench_common.SHAPES, "hand", HAND)


def test_shape_arithmetic() -> None:
    assert param_count("hand") == PARAMS
    assert kv_bytes_per_token("hand") == KV_BYTES
    assert kv_bytes_per_token("hand", kv_elem_bytes=1) == KV_BYTES // 2


def test_prefill_counts_attention_quadratic_term() -> None:
    # 3 tokens: 2 x 760 x 3 linear; causal pairs 3 x 4 / 2 = 6, each 4 x hidden x layers.
    assert prefill_flops("hand", 3) == 2 * 760 * 3 + 4 * 8 * 6
    # Doubling the prompt more than doubles the work: the attention term grows as p^2.
    assert prefill_flops("hand", 2000) > 2 * prefill_flops("hand", 1000)


def test_floor_of_a_mixed_request_set() -> None:
    prompts, decodes = [3, 5], [(3, 4), (5, 2)]
    floor = floor_seconds_for("hand", prompts, decodes, concurrency=1, weight_bytes=1000)
    prefill_flop = (2 * 760 * 3 + 4 * 8 * 6) + (2 * 760 * 5 + 4 * 8 * 15)
    assert floor["prefill_s"] == pytest.approx(prefill_flop / PEAK_FLOPS)
    # Context read per output token: the prompt plus half the output, on average.
    assert floor["kv_read_s"] == pytest.approx((4 * (3 + 2) + 2 * (5 + 1)) * 16 / PEAK_BW)
    # One sequence per step: 6 steps, each reading the weights once.
    assert floor["weights_s"] == pytest.approx(6 * 1000 / PEAK_BW)
    assert floor["total_s"] == pytest.approx(
        floor["prefill_s"] + floor["kv_read_s"] + floor["weights_s"])
    # With room for both, the longest output sets the number of steps.
    wide = floor_seconds_for("hand", prompts, decodes, concurrency=4, weight_bytes=1000)
    assert wide["weights_s"] == pytest.approx(4 * 1000 / PEAK_BW)


def test_request_floor_is_its_prefill_then_one_step_per_later_token() -> None:
    seconds = request_floor_seconds("hand", 3, 4, weight_bytes=1000)
    expected = (2 * 760 * 3 + 4 * 8 * 6) / PEAK_FLOPS + (3 * 1000 + 3 * (3 + 2) * 16) / PEAK_BW
    assert seconds == pytest.approx(expected)
    assert request_floor_seconds("hand", 3, 1, weight_bytes=1000) == pytest.approx(
        prefill_flops("hand", 3) / PEAK_FLOPS)


def test_throughput_floor_uses_the_shared_one() -> None:
    from scripts.bench_throughput import floor_seconds

    w = dict(shape="hand", num_requests=2, prompt_len=3, output_len=4, n=2)
    shared = floor_seconds(w, concurrency=2)
    # Two prompts prefilled once each, four sequences decoding 4 tokens: 8 steps at 2 wide.
    expected = floor_seconds_for("hand", [3, 3], [(3, 4)] * 4, 2, 2 * PARAMS)
    assert shared == pytest.approx(expected)
    assert shared["weights_s"] == pytest.approx(math.ceil(16 / 2) * 2 * PARAMS / PEAK_BW)
    separate = floor_seconds(dict(w, shared_prompts=False), concurrency=2)
    assert separate["prefill_s"] == pytest.approx(2 * shared["prefill_s"])


def test_the_draft_shape_is_a_valid_draft_for_the_7b_shape() -> None:
    """`bench_spec_decode draft`'s pair: the engine's start-up check accepts it (same
    vocabulary, fewer parameters), so the benchmark times a draft the engine would take."""
    from asyncengine.spec_decode.draft_model import check_draft_config, num_parameters
    from models.config import ModelConfig

    draft = ModelConfig.from_dir(bench_common.dummy_model_dir("llama-160m"))
    target = ModelConfig.from_dir(bench_common.dummy_model_dir("llama2-7b"))
    check_draft_config(draft, target)
    assert 150e6 < num_parameters(draft) < 170e6
