"""Rotary embeddings built with equal settings share one cos/sin table."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.layers import RotaryEmbedding, RowParallelLinear, compute_cos_sin_cache
from models.parallel import set_tensor_parallel


def test_equal_rotary_settings_share_one_table() -> None:
    a = RotaryEmbedding(16, 64, 10000.0, None)
    b = RotaryEmbedding(16, 64, 10000.0, None)
    c = RotaryEmbedding(16, 64, 500000.0, None)
    d = RotaryEmbedding(16, 64, 10000.0, {"rope_type": "linear", "factor": 2.0})
    assert a.cos_sin_cache is b.cos_sin_cache
    assert c.cos_sin_cache is not a.cos_sin_cache and d.cos_sin_cache is not a.cos_sin_cache
    torch.testing.assert_close(
        a.cos_sin_cache, compute_cos_sin_cache(16, 64, 10000.0, None), atol=0, rtol=0
    )
    torch.testing.assert_close(
        d.cos_sin_cache,
        compute_cos_sin_cache(16, 64, 10000.0, {"rope_type": "linear", "factor": 2.0}),
        atol=0, rtol=0,
    )  # fmt: skip


def test_a_row_parallel_layer_built_whole_never_reduces_under_a_split_process() -> None:
    """A draft model is built before the tensor-parallel ranks start: its layers keep their
    own split (none) and run on rank 0 with no collective (no process group exists here, so
    one would raise)."""
    layer = RowParallelLinear(8, 4)
    layer.weight.data.normal_()
    x = torch.randn(3, 8)
    set_tensor_parallel(0, 2)
    try:
        y = layer(x)
    finally:
        set_tensor_parallel(0, 1)
    torch.testing.assert_close(y, F.linear(x, layer.weight))
