"""Compiles constraints into xgrammar `CompiledGrammar`s off the step loop, and caches them.

A constraint is converted to a grammar synchronously (cheap; invalid input raises there,
see `grammar.to_grammar`), then compiled against the model's vocabulary in a worker thread
(xgrammar releases the GIL while compiling). Requests that wait for a compile wait alone:
the engine polls `Future`s, frontends await them. Compiled grammars are cached by the
constraint's canonical key (`StructuredOutputsParams.key`), and concurrent requests for the
same constraint share one compile.

The vocabulary is the model's logits width, not the tokenizer's length: padded embeddings
have rows no tokenizer entry maps to, and xgrammar masks them off.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from asyncengine.errors import InvalidRequestError
from asyncengine.structured_outputs.grammar import to_grammar
from asyncengine.structured_outputs.params import FIELD_PREFIX, StructuredOutputsParams

logger = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT_S = 30.0
_CACHE_ENTRIES = 512


@dataclass
class CompileStats:
    """Compile counts and times since start (seconds)."""

    num_compiled: int = 0  # cold compiles (cache misses)
    num_cache_hits: int = 0
    compile_s_total: float = 0.0
    compile_s_max: float = 0.0
    last_compile_s: float = 0.0
    tokenizer_info_s: float = 0.0


def failed(future: Future[Any]) -> bool:
    """Whether a compile ended without a grammar (an error, or cancelled)."""
    return future.done() and (future.cancelled() or future.exception() is not None)


class GrammarCompileTimeout(InvalidRequestError):
    """A constraint whose grammar took longer than the limit to compile."""


class StructuredOutputCompiler:
    """The engine's grammar compiler: validation, compile in threads, a bounded LRU cache."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        *,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        max_workers: int = 2,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self.stats = CompileStats()
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, bool], Future[xgr.CompiledGrammar]] = (
            OrderedDict()
        )
        self._compiler: xgr.GrammarCompiler | None = None

    # ------------------------------------------------------------------ API
    def check(self, params: StructuredOutputsParams) -> xgr.Grammar:
        """The constraint's grammar; `InvalidRequestError` naming the field if invalid."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                "structured outputs need a tokenizer (skip_tokenizer_init is set)",
                field=FIELD_PREFIX,
            )
        return to_grammar(params)

    def submit(
        self, params: StructuredOutputsParams, grammar: xgr.Grammar | None = None
    ) -> Future[xgr.CompiledGrammar]:
        """The compile of the constraint: cached, in progress, or started now."""
        key = params.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not failed(fut):
                self._cache.move_to_end(key)
                self.stats.num_cache_hits += 1
                return fut
            if grammar is None:
                grammar = self.check(params)
            fut = self._executor.submit(self._compile, grammar, params.field_name)
            self._cache[key] = fut
            while len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return fut

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Compile now (or take from the cache), waiting at most the time limit."""
        fut = self.submit(params)
        try:
            return fut.result(timeout=self.compile_timeout_s)
        except TimeoutError:
            raise self.timeout_error(params) from None

    def timeout_error(self, params: StructuredOutputsParams) -> GrammarCompileTimeout:
        return GrammarCompileTimeout(
            f"compiling {params.field_name} took longer than {self.compile_timeout_s:g}s",
            field=params.field_name,
        )

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ worker side
    def _compile(self, grammar: xgr.Grammar, field: str) -> xgr.CompiledGrammar:
        compiler = self._get_compiler()
        t0 = time.perf_counter()
        try:
            compiled = compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise InvalidRequestError(f"cannot compile {field}: {e}", field=field) from None
        dt = time.perf_counter() - t0
        stats = self.stats
        stats.num_compiled += 1
        stats.compile_s_total += dt
        stats.compile_s_max = max(stats.compile_s_max, dt)
        stats.last_compile_s = dt
        return compiled

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                t0 = time.perf_counter()
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids,
                )  # fmt: skip
                # The cache is ours (keyed by constraint); xgrammar's would hold a second copy.
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
                self.stats.tokenizer_info_s = time.perf_counter() - t0
            return self._compiler
