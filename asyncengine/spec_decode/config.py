"""`speculative_config` in vLLM's spelling, checked at start with the offending field named.

`{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
"prompt_lookup_max": b}` drafts by prompt lookup; `{"model": DIR, "num_speculative_tokens": k}`
(method "draft_model", implied by `model`) drafts with a smaller model of the same vocabulary.
The draft model's own checks (vocabulary, size) need its config and run when it is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """What proposes drafts and how many; the knobs that turn speculation down.

    `max_draft_tokens_per_step` caps the draft tokens of one step over the whole batch: each
    speculating request gets at most `cap // num_running - 1` drafts (never more than
    `num_speculative_tokens`), so speculation fades out as the batch grows and stops where a
    step is no longer bound by reading the weights. `disable_by_batch_size` (vLLM's name)
    turns it off outright above that many running requests.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    # Draft model only: its load format ("auto", "safetensors", "gguf" or "dummy").
    load_format: str = "auto"
    # 5: up to 4 drafts for one running request, 1 each for two, none from three. On an H200
    # (7B shape) a verify step runs eagerly and synchronously at 1.6-1.7x a decode step's
    # time: with a cap of 64, 16 and 32 running requests ran 0.31x and 0.35x the throughput
    # without speculation; with a cap of 8, four requests (1 draft each) ran 0.95x.
    max_draft_tokens_per_step: int = 5
    disable_by_batch_size: int | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """Parse and check a `speculative_config` dict; ValueError names the bad field."""
        if isinstance(raw, SpeculativeConfig):
            return raw
        if not isinstance(raw, Mapping):
            raise ValueError(
                f"speculative_config must be a JSON object (dict), got {type(raw).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"speculative_config.{unknown[0]} is not a known option "
                f"(known: {', '.join(sorted(known))})"
            )
        data = dict(raw)
        method = data.get("method")
        if method is None:
            method = "draft_model" if data.get("model") else None
        if method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(METHODS)} "
                f"(or give speculative_config.model for a draft model), got {method!r}"
            )
        data["method"] = method
        if "num_speculative_tokens" not in data:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        cfg = cls(**data)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def fail(name: str, msg: str) -> None:
            raise ValueError(f"speculative_config.{name} {msg}, got {getattr(self, name)!r}")

        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        k = self.num_speculative_tokens
        if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            fail("num_speculative_tokens", f"must be an integer in 1..{MAX_SPECULATIVE_TOKENS}")
        if self.method == "ngram":
            if self.model is not None:
                fail("model", "is for method draft_model, not ngram")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not is_int(lo) or lo < 1:
                fail("prompt_lookup_min", "must be an integer >= 1")
            if not is_int(hi) or hi < lo:
                fail("prompt_lookup_max", "must be an integer >= prompt_lookup_min")
        elif not isinstance(self.model, str) or not self.model:
            fail("model", "must name the draft model's directory for method draft_model")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            fail("load_format", "must be one of auto, safetensors, gguf, dummy")
        if not is_int(self.max_draft_tokens_per_step) or self.max_draft_tokens_per_step < 2:
            fail("max_draft_tokens_per_step", "must be an integer >= 2")
        if self.disable_by_batch_size is not None and (
            not is_int(self.disable_by_batch_size) or self.disable_by_batch_size < 1
        ):
            fail("disable_by_batch_size", "must be an integer >= 1")

    @property
    def max_verify_rows(self) -> int:
        """The most rows (tokens) a verify step can hold: the speculating requests' drafts
        and last tokens stay within the per-step cap (`num_drafts_for_batch`)."""
        return max(self.max_draft_tokens_per_step, self.num_speculative_tokens + 1)

    def num_drafts_for_batch(self, num_running: int) -> int:
        """Drafts per speculating request in a step with `num_running` running requests."""
        if self.disable_by_batch_size is not None and num_running > self.disable_by_batch_size:
            return 0
        per_request = self.max_draft_tokens_per_step // max(num_running, 1) - 1
        return max(0, min(self.num_speculative_tokens, per_request))
