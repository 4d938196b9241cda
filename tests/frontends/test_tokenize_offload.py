"""Tokenization off the event loop: short inputs inline, long ones in a worker thread."""

from __future__ import annotations

import asyncio
import threading

from frontends.tokenize_offload import (
    CHAT_MESSAGE_OVERHEAD_CHARS,
    TOKENIZE_INLINE_CHARS,
    chat_size,
    maybe_in_thread,
)


def _thread_of(*_: object) -> int:
    return threading.get_ident()


def test_short_inputs_run_on_the_loop_and_long_ones_in_a_thread() -> None:
    async def main() -> tuple[int, int, int]:
        loop_thread = threading.get_ident()
        short = await maybe_in_thread(TOKENIZE_INLINE_CHARS, _thread_of, "x")
        long = await maybe_in_thread(TOKENIZE_INLINE_CHARS + 1, _thread_of, "x")
        return loop_thread, short, long

    loop_thread, short, long = asyncio.run(main())
    assert short == loop_thread and long != loop_thread


def test_chat_size_counts_each_message_and_the_tools() -> None:
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": ""}]
    assert chat_size(messages) == 5 + 2 * CHAT_MESSAGE_OVERHEAD_CHARS
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert chat_size(messages, tools) == chat_size(messages) + len(str(tools))
    # Thousands of empty messages still count past the inline limit.
    many = [{"role": "user", "content": ""}] * (TOKENIZE_INLINE_CHARS // 32 + 1)
    assert chat_size(many) > TOKENIZE_INLINE_CHARS
