"""Tensor-parallel state: this process's rank and world size, and the collectives layers use.

With one rank every collective is the identity, so models are written once for any size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_tp_rank = 0
_tp_size = 1


def set_tensor_parallel(rank: int, size: int) -> None:
    global _tp_rank, _tp_size
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid tensor-parallel rank {rank} of {size}")
    _tp_rank, _tp_size = rank, size


def get_tp_rank() -> int:
    return _tp_rank


def get_tp_size() -> int:
    return _tp_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp_size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard of the last dimension (vocab-parallel logits)."""
    if _tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor_parallel_size {denominator}")
    return numerator // denominator


def local_kv_heads(total_kv_heads: int) -> range:
    """The KV heads this rank holds: its equal share when there are at least as many heads as
    ranks, else the one head its group of ranks replicates."""
    if total_kv_heads >= _tp_size:
        per = divide(total_kv_heads, _tp_size)
        return range(_tp_rank * per, (_tp_rank + 1) * per)
    head = _tp_rank // divide(_tp_size, total_kv_heads)
    return range(head, head + 1)
