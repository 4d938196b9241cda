"""Requests whose grammar is still compiling: they wait here, not in the scheduler, so no
step waits for them; `poll` hands them over once their compile is done (or failed, or past
its time limit).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncengine.errors import RequestError

if TYPE_CHECKING:
    import xgrammar as xgr

    from asyncengine.request import Request


@dataclass
class _Waiting:
    seqs: list[Request]
    future: Future[xgr.CompiledGrammar]
    deadline: float
    timeout_error: RequestError


class GrammarWaitingRoom:
    """Sequences of requests waiting for their compiled grammar, in arrival order."""

    def __init__(self) -> None:
        self._waiting: list[_Waiting] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def add(
        self,
        seqs: list[Request],
        future: Future[xgr.CompiledGrammar],
        timeout_s: float,
        timeout_error: RequestError,
    ) -> None:
        self._waiting.append(_Waiting(seqs, future, time.monotonic() + timeout_s, timeout_error))

    def poll(self) -> tuple[list[tuple[list[Request], xgr.CompiledGrammar]],
                            list[tuple[list[Request], BaseException]]]:
        """(requests now ready and their grammar; requests refused and why)."""
        ready: list[tuple[list[Request], xgr.CompiledGrammar]] = []
        failed: list[tuple[list[Request], BaseException]] = []
        still: list[_Waiting] = []
        now = time.monotonic()
        for w in self._waiting:
            if w.future.cancelled():
                failed.append((w.seqs, RuntimeError("the compile was cancelled")))
            elif w.future.done():
                exc = w.future.exception()
                if exc is None:
                    ready.append((w.seqs, w.future.result()))
                else:
                    failed.append((w.seqs, exc))
            elif now >= w.deadline:
                failed.append((w.seqs, w.timeout_error))
            else:
                still.append(w)
        self._waiting = still
        return ready, failed

    def remove(self, request_id: str) -> list[Request]:
        """Take a request's sequences out (it was aborted); [] when it is not here."""
        for i, w in enumerate(self._waiting):
            if w.seqs[0].request_id == request_id:
                del self._waiting[i]
                return w.seqs
        return []

    def request_ids(self) -> list[str]:
        return [w.seqs[0].request_id for w in self._waiting]

    def wait(self, timeout_s: float) -> None:
        """Block until a compile finishes or `timeout_s` passes (an otherwise idle engine)."""
        if self._waiting:
            wait_futures([w.future for w in self._waiting], timeout_s, FIRST_COMPLETED)
