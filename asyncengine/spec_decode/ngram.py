"""The n-gram (prompt lookup) proposer: drafts copied from earlier in a request's own tokens.

The longest suffix of the request's tokens, `prompt_lookup_max` tokens down to
`prompt_lookup_min`, that occurred before is looked up; the tokens that followed that
earlier occurrence are the drafts. No second model: the right tool for edits, code and
answers grounded in the prompt, where the output copies long runs of the input.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from asyncengine.request import Request


def ngram_drafts(tokens: Sequence[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` drafts continuing `tokens`: after the latest earlier occurrence of its longest
    matching suffix (of `max_n` down to `min_n` tokens) that is followed by `k` tokens, else
    after the earliest occurrence (which has the longest continuation)."""
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    if k < 1 or length < 2:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows of the tokens before the last one: every match is followed by a token.
        windows = sliding_window_view(arr[: length - 1], n)
        starts = np.flatnonzero((windows == arr[length - n :]).all(axis=1))
        if starts.size == 0:
            continue
        full = starts[starts + n + k <= length]
        begin = int(full[-1] if full.size else starts[0]) + n
        return arr[begin : begin + k].tolist()
    return []


class NgramProposer:
    """Prompt-lookup drafts for each request from its own prompt and output."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        return [
            ngram_drafts(req.all_token_ids, self.min_n, self.max_n, k)
            for req, k in zip(requests, num_drafts, strict=True)
        ]
