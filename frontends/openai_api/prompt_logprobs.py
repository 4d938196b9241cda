"""The engine's prompt logprobs as the OpenAI API shows them, as vLLM does.

Two views of `RequestOutput.prompt_logprobs`: vLLM's `prompt_logprobs` field (per prompt
token, None for the first, then `{token id: {logprob, rank, decoded_token}}` holding the
token itself and its top-k), and the prompt's part of a completion's `logprobs` object under
`echo` (tokens, token_logprobs with None first, top_logprobs keyed by text, text_offset from
0). Logprobs are clamped at -9999.0, as vLLM does, so JSON never sees -inf.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from asyncengine.outputs import Logprob, PromptLogprobs

_FLOOR = -9999.0


class PromptLogprob(msgspec.Struct, kw_only=True):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobsField = list[dict[int, PromptLogprob] | None]


def _top(entry: dict[int, Logprob], token: int, k: int) -> list[tuple[int, Logprob]]:
    """The prompt token, then its top-k alternatives by rank (the engine may hold more)."""
    out = [(token, entry[token])]
    out += [(t, lp) for t, lp in entry.items()
            if t != token and lp.rank is not None and lp.rank <= k]  # fmt: skip
    return out


def prompt_logprobs_field(
    prompt_ids: list[int], entries: PromptLogprobs, k: int
) -> PromptLogprobsField:
    """vLLM's `prompt_logprobs`: each position's token and its top-`k`."""
    out: PromptLogprobsField = [None]
    for token, entry in zip(prompt_ids[1:], entries[1:], strict=True):
        assert entry is not None
        out.append({t: PromptLogprob(logprob=max(lp.logprob, _FLOOR), rank=lp.rank,
                                     decoded_token=lp.decoded_token)
                    for t, lp in _top(entry, token, k)})  # fmt: skip
    return out


@dataclass
class EchoLogprobs:
    """The prompt's part of a completion's `logprobs` object."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)


def echo_logprobs(
    prompt_ids: list[int], entries: PromptLogprobs, k: int, token_text: Callable[[int], str]
) -> EchoLogprobs:
    """Per prompt token: its text, logprob (None for the first), `{text: logprob}` of the
    token and its top-`k` (None for the first), and its offset in the echoed text."""
    out = EchoLogprobs()
    offset = 0
    for i, token in enumerate(prompt_ids):
        text = token_text(token)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        entry = entries[i] if i < len(entries) else None
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        top = {token_text(t): max(lp.logprob, _FLOOR) for t, lp in _top(entry, token, k)}
        own = max(entry[token].logprob, _FLOOR)
        top[text] = own  # tokens that decode alike share a key: the prompt token's is kept
        out.token_logprobs.append(own)
        out.top_logprobs.append(top)
    return out
