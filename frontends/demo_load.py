"""`serve --demo-load`: keep a few generations running so the dashboard moves at once.

A handful of client workers pick prompts from a fixed list, vary their lengths, cancel some
mid-way and pause briefly between requests. Servers without a tokenizer get token ids.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

from frontends.client import AsyncClient, InvalidRequestError, OverloadedError, ServerError

logger = logging.getLogger(__name__)

DEMO_PROMPTS = [
    "Write a short poem about the sea.",
    "Explain how a hash table works.",
    "What is the capital of France?",
    "List five uses for a paperclip.",
    "Summarise the plot of a detective story in three sentences.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "Describe a walk through a forest in autumn.",
    "What are the benefits of unit tests?",
    "Tell me a joke about computers.",
]


async def run_demo_load(
    url: str,
    api_key: str | None = None,
    *,
    concurrency: int = 4,
    max_tokens: tuple[int, int] = (16, 160),
    cancel_fraction: float = 0.2,
    pause_s: tuple[float, float] = (0.0, 0.5),
    seed: int = 0,
) -> None:
    """Run demo traffic against `url` until cancelled."""
    async with AsyncClient(url, api_key) as client:
        token_ids_only = False  # the server has no tokenizer
        use_messages = True  # the model has a chat template

        async def worker(index: int) -> None:
            nonlocal token_ids_only, use_messages
            rng = random.Random(seed + index)
            while True:
                limit = rng.randint(*max_tokens)
                cancel_after = rng.randint(1, limit) if rng.random() < cancel_fraction else None
                prompt = rng.choice(DEMO_PROMPTS)
                kwargs: dict[str, Any] = {"max_tokens": limit, "temperature": 0.8}
                if token_ids_only:
                    kwargs["prompt_token_ids"] = [rng.randrange(1, 1000) for _ in range(32)]
                elif use_messages and rng.random() < 0.5:
                    kwargs["messages"] = [{"role": "user", "content": prompt}]
                else:
                    kwargs["prompt"] = prompt
                try:
                    received = 0
                    async for chunk in client.generate(**kwargs):
                        received += len(chunk.token_ids)
                        if cancel_after is not None and received >= cancel_after:
                            break  # leaving the loop cancels the request
                except InvalidRequestError as exc:
                    if "tokenizer" in exc.message:
                        token_ids_only = True
                    elif "chat template" in exc.message:
                        use_messages = False
                    else:
                        logger.warning("demo request rejected: %s", exc.message)
                        await asyncio.sleep(1.0)
                except OverloadedError:
                    await asyncio.sleep(1.0)
                except ServerError as exc:
                    logger.warning("demo load stopped: %s", exc)
                    return
                await asyncio.sleep(rng.uniform(*pause_s))

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
