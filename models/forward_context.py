"""The forward context: the attention metadata of the step being run
(`asyncengine_kernels.attention_metadata`), shared by every layer of a forward pass.

The model runner sets it around `model(...)`; attention layers read it. Keeping it out of the
forward signatures lets the same model run eagerly, under CUDA graphs (with static buffers)
and under tensor parallelism without threading metadata through every module. It is
per thread: two engines in one process (an `AsyncLLMEngine`'s step thread beside an
offline `LLM`, say) each see only their own step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from asyncengine_kernels.attention_metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "get_attention_metadata", "set_forward_context"]


class _State(threading.local):
    current: AttentionMetadata | None = None


_state = _State()


def get_attention_metadata() -> AttentionMetadata:
    current = _state.current
    if current is None:
        raise RuntimeError(
            "attention metadata is not set: run the model inside set_forward_context"
        )
    return current


@contextmanager
def set_forward_context(meta: AttentionMetadata) -> Iterator[None]:
    previous, _state.current = _state.current, meta
    try:
        yield
    finally:
        _state.current = previous
