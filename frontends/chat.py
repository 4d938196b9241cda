"""`asyncengine chat`: an interactive terminal chat with a running server.

Built on `AsyncClient`: keeps the conversation as `messages` (the server applies the chat
template) and prints each reply as its tokens stream in. `/reset` clears the history,
`/exit` (or end of input) quits.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import TextIO

from frontends.client import AsyncClient, ServerError


async def run_chat(
    url: str,
    api_key: str | None = None,
    *,
    system: str | None = None,
    max_tokens: int = 256,
    temperature: float = 0.7,
    input_fn: Callable[[str], str] = input,
    output: TextIO = sys.stdout,
) -> list[dict[str, str]]:
    """Chat until `/exit` or end of input; returns the conversation."""
    base = [{"role": "system", "content": system}] if system else []
    history = list(base)
    async with AsyncClient(url, api_key) as client:
        output.write(f"connected to {url} — /reset clears the history, /exit quits\n")
        while True:
            try:
                line = await asyncio.to_thread(input_fn, "you> ")
            except EOFError:
                break
            text = line.strip()
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                history = list(base)
                output.write("(history cleared)\n")
                continue
            if not text:
                continue
            history.append({"role": "user", "content": line})
            output.write("assistant> ")
            output.flush()
            reply: list[str] = []
            try:
                async for chunk in client.generate(messages=history, max_tokens=max_tokens,
                                                   temperature=temperature):
                    output.write(chunk.text)
                    output.flush()
                    reply.append(chunk.text)
            except ServerError as exc:
                history.pop()  # the turn failed: do not keep the unanswered message
                output.write(f"\n[error {exc.code}: {exc.message}]\n")
                continue
            output.write("\n")
            history.append({"role": "assistant", "content": "".join(reply)})
    return history
