"""The WebSocket message schema: decoding, validation errors with JSON paths, encoding."""

from __future__ import annotations

import json

import msgspec
import pytest

from asyncengine.errors import ErrorCode
from asyncengine.sampling_params import RequestOutputKind
from asyncengine.stats_schema import EngineStats, LatencySummary
from frontends import protocol as p


def _decode(obj: object) -> object:
    return p.decode_client_message(json.dumps(obj).encode())


def test_generate_round_trip_and_defaults() -> None:
    msg = p.Generate(request_id="a", prompt="hi", params=p.GenerateParams(max_tokens=4))
    back = p.decode_client_message(p.encode(msg))
    assert back == msg
    assert isinstance(back, p.Generate)
    assert back.params.temperature == 1.0 and back.params.top_k == -1
    # omit_defaults keeps frames small: unset params are not sent
    assert json.loads(p.encode(msg)) == {"type": "generate", "request_id": "a", "prompt": "hi",
                                         "params": {"max_tokens": 4}}


@pytest.mark.parametrize("obj", [
    {"type": "generate", "request_id": "m", "messages": [{"role": "user", "content": "x"}]},
    {"type": "generate", "request_id": "t", "prompt_token_ids": [1, 2, 3]},
    {"type": "cancel", "request_id": "c"},
    {"type": "stats.subscribe", "interval": 0.5},
    {"type": "stats.unsubscribe"},
])
def test_every_client_type_decodes(obj: dict) -> None:
    msg = _decode(obj)
    assert not isinstance(msg, p.Error)
    assert json.loads(p.encode(msg))["type"] == obj["type"]  # type: ignore[arg-type]


@pytest.mark.parametrize(("obj", "code", "needle", "rid"), [
    ({"type": "generate", "request_id": "a", "prompt": "x", "params": {"max_tokens": "9"}},
     ErrorCode.INVALID_REQUEST, "Expected `int`, got `str` - at `$.params.max_tokens`", "a"),
    ({"type": "generate", "request_id": "b", "prompt": "x", "params": {"temperature": -1}},
     ErrorCode.INVALID_REQUEST, "at `$.params.temperature`", "b"),
    ({"type": "generate", "request_id": "c", "prompt": "x", "params": {"top_p": 0}},
     ErrorCode.INVALID_REQUEST, "at `$.params.top_p`", "c"),
    ({"type": "generate", "request_id": "d", "prompt": "x", "params": {"max_tokens": 0}},
     ErrorCode.INVALID_REQUEST, ">= 1 - at `$.params.max_tokens`", "d"),
    ({"type": "generate", "request_id": "e", "prompt_token_ids": [1, -2]},
     ErrorCode.INVALID_REQUEST, "at `$.prompt_token_ids[1]`", "e"),
    ({"type": "generate", "request_id": "f"}, ErrorCode.INVALID_REQUEST, "exactly one of", "f"),
    ({"type": "generate", "request_id": "g", "prompt": "x", "prompt_token_ids": [1]},
     ErrorCode.INVALID_REQUEST, "exactly one of", "g"),
    ({"type": "generate", "request_id": "h", "prompt": "x", "bogus": 1},
     ErrorCode.INVALID_REQUEST, "unknown field `bogus`", "h"),
    ({"type": "generate", "request_id": "i", "prompt": "x",
      "params": {"max_tokens": 2, "min_tokens": 3}},
     ErrorCode.INVALID_REQUEST, "min_tokens", "i"),
    ({"type": "generate", "request_id": "", "prompt": "x"},
     ErrorCode.INVALID_REQUEST, "at `$.request_id`", ""),
    ({"type": "fly", "request_id": "j"}, ErrorCode.UNKNOWN_TYPE, "unknown message type 'fly'", "j"),
    ({"request_id": "k"}, ErrorCode.INVALID_REQUEST, "missing required field `type`", "k"),
    ({"type": "stats.subscribe", "interval": 0},
     ErrorCode.INVALID_REQUEST, "at `$.interval`", None),
    ([1, 2], ErrorCode.INVALID_REQUEST, "Expected `object`, got `array`", None),
])
def test_validation_errors_carry_path_and_request_id(
    obj: object, code: str, needle: str, rid: str | None
) -> None:
    err = _decode(obj)
    assert isinstance(err, p.Error)
    assert err.code == code
    assert needle in err.message
    assert err.request_id == rid


def test_malformed_json_is_an_invalid_request() -> None:
    err = p.decode_client_message(b'{"type": "generate", ')
    assert isinstance(err, p.Error)
    assert err.code == ErrorCode.INVALID_REQUEST and err.message.startswith("malformed JSON")
    assert err.request_id is None


def test_params_become_delta_sampling_params() -> None:
    params = p.GenerateParams(max_tokens=7, temperature=0.0, stop=["\n"], seed=3, ignore_eos=True)
    sp = params.to_sampling_params()
    assert sp.max_tokens == 7 and sp.is_greedy and sp.stop_strings == ["\n"]
    assert sp.seed == 3 and sp.ignore_eos
    assert sp.output_kind == RequestOutputKind.DELTA


def test_server_events_round_trip_with_nested_stats() -> None:
    stats = EngineStats(num_running=3, kv_blocks_total=10, ttft=LatencySummary(p50=0.1, count=2))
    events = [
        p.Delta(request_id="a", text="hé", token_ids=[1, 2]),
        p.Done(request_id="a", finish_reason="length",
               usage=p.Usage(prompt_tokens=3, completion_tokens=2)),
        p.Error(code=ErrorCode.OVERLOADED, message="busy", request_id="a"),
        p.Stats(stats=stats),
    ]
    for ev in events:
        assert p.decode_server_message(p.encode(ev)) == ev
    wire = json.loads(p.encode(events[3]))
    assert wire["type"] == "stats" and wire["stats"]["num_running"] == 3
    assert wire["stats"]["ttft"]["p50"] == 0.1


def test_parallel_sampling_fields_are_sent_only_for_n_above_one() -> None:
    assert p.GenerateParams(n=3, seed=1).to_sampling_params().n == 3
    bad = p.decode_client_message(
        b'{"type": "generate", "request_id": "x", "prompt": "hi", "params": {"n": 0}}')
    assert isinstance(bad, p.Error) and "$.params.n" in bad.message and bad.request_id == "x"
    usage = p.Usage(prompt_tokens=3, completion_tokens=2)
    # n = 1: the wire is what it was before parallel sampling existed.
    assert json.loads(p.encode(p.Delta(request_id="a", text="x", token_ids=[1]))) == {
        "type": "delta", "request_id": "a", "text": "x", "token_ids": [1]}
    assert "finish_reasons" not in json.loads(
        p.encode(p.Done(request_id="a", finish_reason="stop", usage=usage)))
    delta = p.Delta(request_id="a", text="x", token_ids=[1], index=2)
    done = p.Done(request_id="a", finish_reason="stop", usage=usage,
                  finish_reasons=["stop", "length"])
    assert json.loads(p.encode(delta))["index"] == 2
    for ev in (delta, done):
        assert p.decode_server_message(p.encode(ev)) == ev


def test_server_decoder_rejects_unknown_types() -> None:
    with pytest.raises(msgspec.ValidationError):
        p.decode_server_message(b'{"type": "nope"}')
