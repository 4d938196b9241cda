"""SamplingParams: the DESIGN defaults, accepted values, a ValueError naming each bad field."""

from __future__ import annotations

import math

import pytest

from asyncengine.sampling_params import RequestOutputKind, SamplingParams


def test_defaults_match_the_design() -> None:
    p = SamplingParams()
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == -1
    assert p.min_p == 0.0
    assert p.repetition_penalty == 1.0
    assert p.presence_penalty == 0.0
    assert p.frequency_penalty == 0.0
    assert p.seed is None
    assert p.stop is None and p.stop_strings == []
    assert p.stop_token_ids == []  # None is normalised to an empty list
    assert p.ignore_eos is False
    assert p.max_tokens == 16
    assert p.min_tokens == 0
    assert p.logprobs is None
    assert p.skip_special_tokens is True
    assert p.include_stop_str_in_output is False
    assert p.output_kind == RequestOutputKind.CUMULATIVE
    assert not p.is_greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0},
        {"temperature": 0.0},
        {"temperature": 2.5},
        {"top_p": 1e-3},
        {"top_p": 1},
        {"top_k": 0},
        {"top_k": 1},
        {"top_k": 50},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"repetition_penalty": 0.5},
        {"repetition_penalty": 2},
        {"presence_penalty": -2.0},
        {"presence_penalty": 2},
        {"frequency_penalty": -2},
        {"frequency_penalty": 1.5},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"stop": "###"},
        {"stop": ["a", "bc"]},
        {"stop": []},
        {"stop_token_ids": [0, 7]},
        {"ignore_eos": True},
        {"max_tokens": 1},
        {"max_tokens": None},
        {"min_tokens": 16},
        {"max_tokens": None, "min_tokens": 1000},
        {"logprobs": 0},
        {"logprobs": 20},
        {"skip_special_tokens": False},
        {"include_stop_str_in_output": True},
        {"output_kind": RequestOutputKind.DELTA},
        {"output_kind": 2},
    ],
)
def test_good_values_pass(kwargs: dict) -> None:
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if name != "stop":
            assert getattr(p, name) == value


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", -1),
        ("n", 1.0),
        ("n", True),
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", "1"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_k", -2),
        ("top_k", 1.5),
        ("top_k", True),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("presence_penalty", 2.1),
        ("presence_penalty", -2.1),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("seed", -1),
        ("seed", 2**63),
        ("seed", 1.0),
        ("stop", ""),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", 3),
        ("ignore_eos", 1),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("max_tokens", 2.0),
        ("min_tokens", -1),
        ("min_tokens", 17),  # above the default max_tokens (16)
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", 1.0),
        ("skip_special_tokens", "yes"),
        ("include_stop_str_in_output", None),
        ("output_kind", 7),
    ],
)
def test_bad_values_raise_value_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**{field: value})


def test_greedy_threshold() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy


def test_stop_is_normalised_to_a_list() -> None:
    assert SamplingParams(stop="x").stop_strings == ["x"]
    assert SamplingParams(stop=("a", "b")).stop_strings == ["a", "b"]
