"""Speculative decoding counters: derived rates, the engine snapshot, /metrics and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.spec_decode.metrics import SpecDecodingMetrics
from asyncengine.stat_loggers import PrometheusStatLogger
from asyncengine.stats_schema import EngineStats, SpecDecodeStats
from frontends.cli import build_parser, engine_args_from


def test_rates() -> None:
    m = SpecDecodingMetrics(3)
    assert (m.acceptance_rate, m.mean_acceptance_length) == (0.0, 0.0)
    m.observe(3, 2)
    m.observe(3, 0)
    m.observe(2, 2)
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (3, 8, 4)
    assert m.accepted_per_pos == [2, 2, 0]
    assert m.acceptance_rate == 0.5
    assert m.mean_acceptance_length == pytest.approx(1 + 4 / 3)


def test_engine_snapshot_and_prometheus(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # fmt: skip
    llm.generate([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]], SamplingParams(temperature=0, max_tokens=12),
                 use_tqdm=False)  # fmt: skip
    snap = llm.llm_engine.get_stats()
    spec = snap.spec_decode
    m = llm.llm_engine.spec_decoder.metrics
    assert spec is not None and spec.num_drafts == m.num_drafts > 0
    assert spec.num_draft_tokens == m.num_draft_tokens
    assert spec.acceptance_rate == m.acceptance_rate
    logger = PrometheusStatLogger("tiny")
    logger.on_stats(snap)
    logger.on_stats(snap)  # running totals: counted once
    text = logger.render().decode()
    assert f'asyncengine_spec_decode_num_drafts_total{{model_name="tiny"}} {m.num_drafts}.0' in text
    assert (f'asyncengine_spec_decode_num_draft_tokens_total{{model_name="tiny"}} '
            f"{m.num_draft_tokens}.0") in text  # fmt: skip
    assert "asyncengine_spec_decode_num_accepted_tokens_total" in text
    assert 'asyncengine_spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in text  # noqa: E501


def test_spec_series_stay_zero_without_speculation() -> None:
    logger = PrometheusStatLogger("m")
    logger.on_stats(EngineStats())
    series = 'asyncengine_spec_decode_num_drafts_total{model_name="m"}'
    assert f"{series} 0.0" in logger.render().decode()
    logger.on_stats(EngineStats(spec_decode=SpecDecodeStats(num_drafts=2, accepted_per_pos=[1])))
    text = logger.render().decode()
    assert 'asyncengine_spec_decode_num_drafts_total{model_name="m"} 2.0' in text


def test_cli_flag_takes_json() -> None:
    raw = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
    ns = build_parser().parse_args(["generate", "--speculative-config", json.dumps(raw), "hi"])
    assert engine_args_from(ns).speculative_config == raw
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--speculative-config", "[1]", "hi"])
    ns = build_parser().parse_args(
        ["generate", "--speculative-config", '{"method": "x", "num_speculative_tokens": 1}', "hi"]
    )
    with pytest.raises(ValueError, match=r"speculative_config\.method"):
        engine_args_from(ns)
