"""Rotary embeddings built with equal settings share one cos/sin table."""

from __future__ import annotations

import torch

from models.layers import RotaryEmbedding, compute_cos_sin_cache


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
