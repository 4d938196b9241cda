"""What the `LLMEngine` holds for structured outputs: the grammar compiler (made on first
use), the requests waiting for their grammar and the refusals to report. (Jump-forward is
speculative decoding's: `spec_decode.forced`.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from asyncengine.errors import InvalidRequestError, RequestError
from asyncengine.structured_outputs.waiting import GrammarWaitingRoom

if TYPE_CHECKING:
    from asyncengine.request import Request
    from asyncengine.structured_outputs.compiler import StructuredOutputCompiler

# How long an otherwise idle engine blocks for a compile before looking again.
_IDLE_WAIT_S = 0.005


class StructuredOutputs:
    """The engine's structured-output state (one per engine)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        *,
        compile_timeout_s: float,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self.waiting = GrammarWaitingRoom()
        self._compiler: StructuredOutputCompiler | None = None
        self._lock = threading.Lock()  # the step thread and the event loop both compile
        self._rejected: list[tuple[str, float, RequestError]] = []

    @property
    def compiler(self) -> StructuredOutputCompiler:
        with self._lock:
            if self._compiler is None:
                # xgrammar (a second to import) loads with the first constrained request.
                from asyncengine.structured_outputs.compiler import StructuredOutputCompiler

                self._compiler = StructuredOutputCompiler(
                    self._tokenizer, self._vocab_size, self._stop_token_ids,
                    compile_timeout_s=self.compile_timeout_s,
                )  # fmt: skip
            return self._compiler

    def admit(self, seqs: list[Request]) -> bool:
        """Start a request: True when its grammar is ready (matchers attached) and it may be
        scheduled now, False when it waits here for the compile. An invalid constraint
        raises `InvalidRequestError` at once."""
        params = seqs[0].params.structured_outputs
        assert params is not None
        future = self.compiler.submit(params)
        if future.done() and not future.cancelled():
            exc = future.exception()
            if exc is not None:
                raise exc
            from asyncengine.structured_outputs.matcher import attach_grammar

            attach_grammar(seqs, future.result())
            return True
        self.waiting.add(
            seqs, future, self.compile_timeout_s, self.compiler.timeout_error(params)
        )
        return False

    def ready_requests(self, idle: bool) -> list[list[Request]]:
        """Requests whose grammar is now compiled; failed ones are kept for
        `take_rejected`. `idle`: nothing else to run, so wait a moment for a compile."""
        if not len(self.waiting):
            return []
        if idle:
            self.waiting.wait(_IDLE_WAIT_S)
        ready, failed = self.waiting.poll()
        if ready:
            from asyncengine.structured_outputs.matcher import attach_grammar

            for seqs, compiled in ready:
                attach_grammar(seqs, compiled)
        for seqs, exc in failed:
            if not isinstance(exc, RequestError):
                params = seqs[0].params.structured_outputs
                field = params.field_name if params is not None else None
                exc = InvalidRequestError(f"cannot compile {field}: {exc}", field=field)
            self._rejected.append((seqs[0].request_id, seqs[0].arrival_time, exc))
        return [seqs for seqs, _ in ready]

    def take_rejected(self) -> list[tuple[str, float, RequestError]]:
        rejected, self._rejected = self._rejected, []
        return rejected

    def shutdown(self) -> None:
        """Stop the compile threads; a later constrained request starts a new compiler."""
        with self._lock:
            compiler, self._compiler = self._compiler, None
        if compiler is not None:
            compiler.shutdown()
