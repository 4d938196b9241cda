"""How a parameter names the function that loads a checkpoint tensor into it.

`load_weights` calls `param.weight_loader(param, tensor, shard_id)`; layers attach theirs with
`set_weight_loader`, which keeps a layer's bound method from tying the layer into a reference
cycle through its own parameters.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

__all__ = ["set_weight_loader"]


class _LayerLoader:
    """A layer's bound `weight_loader`, held by the layer's own parameter through a weak
    reference: a strong one makes layer → parameter → bound method → layer a cycle that only
    the garbage collector breaks, so a dropped engine's weights would stay in (GPU) memory
    until the next collection instead of going with the engine."""

    __slots__ = ("_method",)

    def __init__(self, method: Any) -> None:
        self._method = weakref.WeakMethod(method)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        method = self._method()
        if method is None:
            raise RuntimeError("the layer that owns this parameter is gone")
        method(*args, **kwargs)


def set_weight_loader(param: nn.Parameter, loader: Any) -> None:
    """Attach the loader the model's `load_weights` calls for `param`: a layer's bound
    method (held weakly, see `_LayerLoader`) or a plain function."""
    bound = getattr(loader, "__self__", None) is not None
    param.weight_loader = _LayerLoader(loader) if bound else loader  # type: ignore[attr-defined]
