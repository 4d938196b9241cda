"""The step-cost meter and the pause rule it drives: a request keeps speculating while its
accepted drafts pay for the verify step's measured cost."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from asyncengine.spec_decode.config import SpeculativeConfig
from asyncengine.spec_decode.cost import StepCostMeter
from asyncengine.spec_decode.decoder import FIRST_COOLDOWN, SpecDecoder


def test_ratio_is_one_until_both_kinds_are_seen() -> None:
    meter = StepCostMeter()
    assert meter.ratio == 1.0
    meter.observe(0.010, verify=True)
    assert meter.ratio == 1.0
    meter.observe(0.004, verify=False)
    assert meter.ratio == pytest.approx(2.5)


def test_periods_are_smoothed_and_idle_gaps_ignored() -> None:
    meter = StepCostMeter()
    meter.observe(0.004, verify=False)
    meter.observe(0.006, verify=False)
    assert meter.plain_s == pytest.approx(0.004 + 0.1 * 0.002)
    meter.observe(1.0, verify=False)  # the engine sat idle: not a step
    assert meter.plain_s == pytest.approx(0.0042)
    meter.observe(0.002, verify=True)
    assert meter.ratio == 1.0  # a verify step never counts as cheaper than a plain one


def _decoder(ratio: float) -> SpecDecoder:
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    decoder = SpecDecoder(config, proposer=None, pool=None, max_model_len=64)  # type: ignore[arg-type]
    decoder.observe_step(0.001, verify=False)
    decoder.observe_step(0.001 * ratio, verify=True)
    return decoder


@pytest.mark.parametrize(("ratio", "accepted", "pauses"), [
    (1.2, 1, False),  # 2 tokens per verify step for the cost of 1.2 steps: keep going
    (1.2, 0, True),  # nothing kept, again and again: pause
    (3.0, 1, True),  # 2 tokens kept, 3 steps paid: pause
    (3.0, 3, False),
])  # fmt: skip
def test_a_request_pauses_when_its_drafts_do_not_pay(
    ratio: float, accepted: int, pauses: bool
) -> None:
    decoder = _decoder(ratio)
    req = SimpleNamespace(spec_state=None)
    for _ in range(8):
        decoder._update(req, accepted)  # type: ignore[arg-type]
        if req.spec_state.cooldown:
            break
    assert (req.spec_state.cooldown == FIRST_COOLDOWN) == pauses


def _simulate(decoder: SpecDecoder, acceptance: float, k: int, steps: int, seed: int = 0
              ) -> tuple[int, int]:  # fmt: skip
    """Decode steps of one request whose drafts are each right with probability
    `acceptance` (a verify step keeps the drafts up to the first wrong one), paused as the
    engine pauses it: returns (verify steps, tokens generated)."""
    rng = random.Random(seed)
    req = SimpleNamespace(spec_state=None)
    verify = tokens = 0
    for _ in range(steps):
        state = req.spec_state
        if state is not None and state.cooldown:
            state.cooldown -= 1
            tokens += 1
            continue
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        decoder._update(req, accepted)  # type: ignore[arg-type]
        verify += 1
        tokens += accepted + 1
    return verify, tokens


def test_good_acceptance_seldom_pauses() -> None:
    """At acceptance 0.7 (k = 4) a verify step keeps 1.77 drafts on average, well above the
    0.4 an H200's verify step needs: misses in a row must not pause it often."""
    verify, _ = _simulate(_decoder(1.4), 0.7, 4, 2000)
    assert verify >= 0.97 * 2000
    # At 0.5 (0.94 drafts kept a step) speculation still pays; most steps verify.
    verify, _ = _simulate(_decoder(1.4), 0.5, 4, 2000)
    assert verify >= 0.6 * 2000


def test_useless_drafts_cost_little() -> None:
    """At acceptance 0, verify steps (each 1.4 plain steps on an H200) must add under 5 %
    to a 256-token run: they become rare as the pauses double."""
    verify, tokens = _simulate(_decoder(1.4), 0.0, 4, 256)
    assert tokens == 256
    assert verify * 0.4 / 256 < 0.05
