"""CPU linear layers through oneDNN with a prepacked weight, for small batches.

At decode sizes (tens of rows) the BLAS call packs the weight on every call, which costs as
much as the product for wide layers such as the LM head; oneDNN packs it once. Large batches
(prefill) stay with the BLAS library, which is faster there. Whether the packed path wins
depends on the shape and the CPU, so `models/linear_tuning.py` times both at start-up and
puts the winner into each layer's matmul plan. The reference is `F.linear`.
"""

from __future__ import annotations

import torch

__all__ = ["PACKED_MAX_ROWS", "cpu_packing_available", "pack_weight", "packed_linear"]

# A packed plan serves batches up to this many rows (decode); larger ones keep the BLAS call.
PACKED_MAX_ROWS = 64


def _has_dense_io_linear() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(
            torch.ops.mkldnn, "_linear_pointwise"
        )
    except (AttributeError, RuntimeError):
        return False


# oneDNN's linear that takes and returns dense tensors (the op torch.compile's CPU backend
# runs on a prepacked weight), where this build has it.
_DENSE_IO = _has_dense_io_linear()


def cpu_packing_available() -> bool:
    return torch.backends.mkldnn.is_available()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A oneDNN copy of a float32 [N, K] weight (the dense one is kept for large batches)."""
    return weight.detach().contiguous().to_mkldnn()


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] float32 @ packed^T (+ bias) -> [M, N] dense."""
    if _DENSE_IO:
        # The same oneDNN product on dense input and output: converting the activations to
        # and from oneDNN's format cost as much as the product at decode sizes.
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")
    else:
        y = torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), packed, None).to_dense()
    return y if bias is None else y + bias
