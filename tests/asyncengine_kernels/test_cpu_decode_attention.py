"""The C paged decode attention (asyncengine_kernels/cpu_decode_attention.py) against the gather and
masked SDPA of kernels.paged_attention."""

from __future__ import annotations

import pytest
import torch

from asyncengine_kernels.cpu_decode_attention import (
    decode_attention_available,
    paged_decode_attention_cpu,
)
from asyncengine_kernels.paged_attention import decode_gather_index, decode_rows_attention

pytestmark = pytest.mark.skipif(not decode_attention_available(), reason="no C compiler")


def _reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               tables: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    index = decode_gather_index(tables, lens, int(lens.max()), k_cache.shape[1])
    return decode_rows_attention(q, k_cache, v_cache, *index, scale)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_matches_the_gather_and_sdpa(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(num_heads * block_size)
    blocks, head_dim, n = 120, 64, 11
    k_cache = torch.randn(blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(blocks, block_size, num_kv_heads, head_dim, generator=gen)
    lens = torch.randint(1, 150, (n,), generator=gen)
    lens[:4] = torch.tensor([0, 1, block_size, block_size + 1])  # empty, 1, block edges
    width = -(-150 // block_size) + 2  # table entries past a sequence's blocks are junk
    tables = torch.randint(0, blocks, (n, width), generator=gen)
    # q as the fused QKV output's view: heads of a row are not adjacent to the next row's.
    qkv = torch.randn(n, num_heads + 2 * num_kv_heads, head_dim, generator=gen) * 3
    q = qkv[:, :num_heads]
    got = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, 0.125)
    want = _reference(q, k_cache, v_cache, tables, lens, 0.125)
    assert got.shape == (n, num_heads, head_dim)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert not got[0].any()  # a row of length 0 gives zeros


def test_peaked_scores_keep_their_weight() -> None:
    """Large scores (a near one-hot softmax) and very negative ones stay exact."""
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(4, 16, 1, 8, generator=gen)
    v_cache = torch.randn(4, 16, 1, 8, generator=gen)
    q = k_cache[1, 3].unsqueeze(0) * 40  # [1, 1, 8]: aligned with one key
    tables = torch.tensor([[0, 1, 2, 3]])
    lens = torch.tensor([60])
    got = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, 1.0)
    torch.testing.assert_close(got, _reference(q, k_cache, v_cache, tables, lens, 1.0),
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_rejects_other_dtypes() -> None:
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(TypeError):
        paged_decode_attention_cpu(torch.zeros(1, 1, 8, dtype=torch.float64), cache, cache,
                                   torch.zeros(1, 2, dtype=torch.int64), torch.ones(1,
                                   dtype=torch.int64), 1.0)  # fmt: skip
