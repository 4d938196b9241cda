"""Tokenization that keeps the event loop responsive: long inputs go to a worker thread.

Tokenizing a few hundred characters takes microseconds and a thread hop would cost more;
tokenizing a book-length prompt, or rendering thousands of chat messages through a
template, would stall every other connection of the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

# Inputs longer than this (characters) are tokenized off the event loop.
TOKENIZE_INLINE_CHARS = 16_384
# What a chat message costs the template beyond its content, in characters of the above:
# thousands of empty messages must not render on the loop either.
CHAT_MESSAGE_OVERHEAD_CHARS = 32

T = TypeVar("T")


def chat_size(messages: Sequence[Mapping[str, Any]], tools: object = None) -> int:
    """The characters a chat template renders for `messages` (and `tools`), as
    `maybe_in_thread` counts them."""
    size = sum(len(str(m["content"])) + CHAT_MESSAGE_OVERHEAD_CHARS for m in messages)
    return size + (len(str(tools)) if tools else 0)


async def maybe_in_thread(size: int, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), in a worker thread when `size` characters are past `TOKENIZE_INLINE_CHARS`."""
    if size > TOKENIZE_INLINE_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)
