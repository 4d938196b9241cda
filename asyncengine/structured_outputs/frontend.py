"""For frontends on the event loop: compile a request's grammar before queueing it.

The compile runs in the engine compiler's worker thread; the loop awaits it without
blocking, within the compile time limit, so an invalid or too slow grammar is refused
(`InvalidRequestError` naming the field) before the request exists, and the engine later
finds the grammar in its cache.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncengine.async_engine import AsyncLLMEngine
    from asyncengine.structured_outputs.params import StructuredOutputsParams


async def compile_constraint(engine: AsyncLLMEngine, params: StructuredOutputsParams) -> None:
    compiler = engine.engine.structured.compiler
    future = compiler.submit(params)  # an invalid constraint raises here
    if not future.done():
        # `shield`: a client leaving cancels this wait, not the shared compile.
        waiter = asyncio.shield(asyncio.wrap_future(future))
        try:
            await asyncio.wait_for(waiter, compiler.compile_timeout_s)
        except TimeoutError:
            raise compiler.timeout_error(params) from None
    exc = future.exception()
    if exc is not None:
        raise exc
