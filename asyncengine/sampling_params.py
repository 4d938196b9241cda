"""Per-request sampling parameters, spelled as in vLLM, validated on construction.

A bad value raises `InvalidRequestError` (a ValueError) whose `field` names the parameter.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from asyncengine.errors import InvalidRequestError
from asyncengine.structured_outputs.params import StructuredOutputsParams


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` of a request carries."""

    CUMULATIVE = 0  # the whole text and token ids so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # a single output when the request finishes


_MAX_LOGPROBS = 20  # vLLM's default max_logprobs, for `logprobs` and `prompt_logprobs`


@dataclass
class SamplingParams:
    """How to sample one request. Temperature 0 means greedy; invalid values raise
    `InvalidRequestError` (a ValueError).

    `n` > 1 samples n sequences from one prompt (its KV computed once and shared); with a
    `seed`, sample i uses `seed + i`, as in vLLM. `prompt_logprobs=k` scores every prompt
    token after the first: its logprob and the top-k alternatives
    (`RequestOutput.prompt_logprobs`).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # One constraint on the output (JSON schema, regex, choice, grammar), or None.
    structured_outputs: StructuredOutputsParams | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()
        if self.stop is None:
            self._stop_list = []
        elif isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self.output_kind = RequestOutputKind(self.output_kind)

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        """Raise `InvalidRequestError` naming the first bad parameter (also run by the
        request check, so a value changed after construction is caught too)."""

        def fail(name: str, msg: str) -> None:
            raise InvalidRequestError(f"{name} {msg}, got {getattr(self, name)!r}", field=name)

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.n) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if not is_num(self.temperature) or self.temperature < 0:
            fail("temperature", "must be a finite number >= 0")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            fail("top_k", "must be -1 or 0 (disabled) or at least 1")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be a finite number > 0")
        if not is_num(self.presence_penalty) or not -2 <= self.presence_penalty <= 2:
            fail("presence_penalty", "must be in [-2, 2]")
        if not is_num(self.frequency_penalty) or not -2 <= self.frequency_penalty <= 2:
            fail("frequency_penalty", "must be in [-2, 2]")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            fail("seed", "must be an integer in [0, 2**63)")
        if self.stop is not None:
            items = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(items, list | tuple) or not all(
                isinstance(s, str) and s for s in items
            ):
                fail("stop", "must be a non-empty string or a list of non-empty strings")
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, list | tuple)
            or not all(is_int(t) and t >= 0 for t in self.stop_token_ids)
        ):
            fail("stop_token_ids", "must be a list of non-negative integers")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (
            not is_int(self.logprobs) or not 0 <= self.logprobs <= _MAX_LOGPROBS
        ):
            fail("logprobs", f"must be an integer in [0, {_MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= _MAX_LOGPROBS
        ):
            fail("prompt_logprobs", f"must be an integer in [0, {_MAX_LOGPROBS}]")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be a boolean")
        try:
            RequestOutputKind(self.output_kind)
        except ValueError:
            fail("output_kind", "must be a RequestOutputKind")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                fail("structured_outputs", "must be a StructuredOutputsParams")
            self.structured_outputs.validate()
