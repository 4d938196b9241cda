"""Incremental detokenization of one request's output, with stop strings.

Each step decodes only a small window of token ids (the previously released tokens plus the new
ones) and releases the text that window adds, so the cost per token stays constant however long
the output grows. Text is held back while it ends in an incomplete UTF-8 character (U+FFFD from
a split byte-level token) or while its tail could still grow into a stop string. Touches nothing
but the tokenizer it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# How many prompt tokens seed the decode window: enough context for tokenizers that render a
# token differently at the start of a text (sentencepiece's leading space, split byte runs).
_INITIAL_WINDOW = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into a stream of text deltas.

    `append(ids)` returns the text newly released by those ids; `flush()` releases what is held
    back when the request ends for another reason; `output_text` is everything released so far.
    When a stop string matches, `finished_by_stop` becomes True, `stop_reason` is that string,
    the text ends right before it (or after it with `include_stop_str_in_output`) and nothing
    more is ever released.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_reason: str | None = None
        self.finished_by_stop = False

        # Window ids: a few prompt tokens for context, then every output token. The text of
        # ids[prefix_offset:read_offset] has already been accounted for; ids[read_offset:] not.
        self._ids: list[int] = list(prompt_token_ids[-_INITIAL_WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # Decoded text not released yet because it may be the start of a stop string.
        self._pending = ""
        self._output_text = ""
        # Longest tail that can be held for stop strings: len(longest stop) - 1.
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1

    @property
    def output_text(self) -> str:
        """All text released so far."""
        return self._output_text

    @property
    def finished(self) -> bool:
        return self.finished_by_stop

    def append(self, token_ids: Sequence[int]) -> str:
        """Feed newly generated ids; return the newly released text (possibly empty)."""
        if self.finished_by_stop or not token_ids:
            return ""
        self._ids.extend(token_ids)
        return self._release(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """Release everything held back (the request ended without a stop string): text kept for
        a possible stop string, and decoded text short of any trailing incomplete character."""
        if self.finished_by_stop:
            return ""
        return self._release(self._decode_new(final=True), final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _decode_new(self, *, final: bool) -> str:
        """Text added by ids[read_offset:], or "" while it ends in a partial character."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if new_text.endswith(_REPLACEMENT_CHAR):
            if not final:
                return ""  # a byte-level token split a character: wait for the rest
            new_text = new_text.rstrip(_REPLACEMENT_CHAR)
        if len(new_text) <= len(prefix_text):
            return ""
        # The released window becomes the next prefix, so the window stays a few tokens wide.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _release(self, text: str, *, final: bool) -> str:
        """Run new text through the stop-string matcher and return what may be released."""
        pending = self._pending + text
        if not pending:
            return ""
        if self.stop:
            match = self._first_stop(pending)
            if match is not None:
                index, stop = match
                end = index + len(stop) if self.include_stop_str_in_output else index
                self.stop_reason = stop
                self.finished_by_stop = True
                self._pending = ""
                return self._emit(pending[:end])
        hold = 0 if final or not self.stop else self._hold_length(pending)
        self._pending = pending[len(pending) - hold :] if hold else ""
        return self._emit(pending[: len(pending) - hold])

    def _emit(self, delta: str) -> str:
        self._output_text += delta
        return delta

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string that starts earliest in `text` (list order breaks ties)."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = text.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _hold_length(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        for length in range(min(self._max_hold, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self.stop):
                return length
        return 0
