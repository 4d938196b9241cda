"""speculative_config parsing: vLLM's spelling accepted, bad values refused naming the field."""

from __future__ import annotations

import pytest

from asyncengine import EngineArgs
from asyncengine.spec_decode.config import SpeculativeConfig


def test_ngram_and_draft_model_spellings() -> None:
    cfg = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 5}
    )  # fmt: skip
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min) == ("ngram", 4, 2)
    draft = SpeculativeConfig.from_dict({"model": "/some/dir", "num_speculative_tokens": 3})
    assert draft.method == "draft_model" and draft.model == "/some/dir"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
         "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
          "prompt_lookup_max": 2}, "prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"},
         "speculative_config.model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "speculative_config.bogus"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ],
)
def test_bad_config_is_refused_naming_the_field(raw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        SpeculativeConfig.from_dict(raw)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        EngineArgs(speculative_config=raw)


def test_not_a_dict() -> None:
    with pytest.raises(ValueError, match="speculative_config must be a JSON object"):
        EngineArgs(speculative_config="ngram")  # type: ignore[arg-type]


def test_draft_model_with_tensor_parallelism_is_accepted() -> None:
    raw = {"model": "/d", "num_speculative_tokens": 2}
    args = EngineArgs(speculative_config=raw, tensor_parallel_size=2)
    assert args.tensor_parallel_size == 2 and args.speculative_config == raw


def test_draft_model_with_swap_preemption_is_accepted() -> None:
    raw = {"model": "/d", "num_speculative_tokens": 2}
    args = EngineArgs(speculative_config=raw, preemption_mode="swap")
    assert args.preemption_mode == "swap" and args.speculative_config == raw


def test_drafts_shrink_as_the_batch_grows() -> None:
    default = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert [default.num_drafts_for_batch(b) for b in (1, 2, 3, 8)] == [4, 1, 0, 0]
    cfg = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 4, "max_draft_tokens_per_step": 64}
    )
    got = [cfg.num_drafts_for_batch(b) for b in (1, 8, 12, 16, 24, 32, 40, 64, 200)]
    assert got == [4, 4, 4, 3, 1, 1, 0, 0, 0]
    off = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 2,
         "max_draft_tokens_per_step": 64}
    )
    assert [off.num_drafts_for_batch(b) for b in (1, 2, 3)] == [4, 4, 0]
