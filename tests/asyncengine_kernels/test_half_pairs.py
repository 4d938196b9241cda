"""The half-precision-pair word dots against float64 sums of the same words and x: in the
interpreter (their float32 form) and on the GPU (the inline PTX), there also with activations
large and small enough to overflow or underflow fp16 without the x shift."""

from __future__ import annotations

import pytest
import torch

from asyncengine_kernels._triton_utils import tl, triton
from asyncengine_kernels.half_pairs import (
    E4M3_X_SCALE,
    INT4_X_SCALE,
    INT8_X_SCALE,
    e4m3_word_dot,
    int4_word_dot,
    int8_word_dot,
    int_x_pairs,
    pack_f16_pair,
    zero_pairs,
)
from asyncengine_kernels.quant_linear import pack_int_weight

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@triton.jit
def _word_dots_kernel(w_ptr, x_ptr, z_ptr, out_ptr, KIND: tl.constexpr, WORDS: tl.constexpr):
    """out[i] = word i's dot with its x values (x[i * per_word + j]); KIND 4 or 8: integers
    with zero z[i]; KIND 0: e4m3 bytes."""
    offs = tl.arange(0, WORDS)
    words = tl.load(w_ptr + offs)
    z = tl.load(z_ptr + offs)
    if KIND == 4:
        zb, zh = zero_pairs(z, 4)
        x04, x15, x26, x37 = int_x_pairs(x_ptr + offs * 8, 4)
        out = int4_word_dot(words, x04, x15, x26, x37, zb, zh, z) * INT4_X_SCALE
    elif KIND == 8:
        zb, _ = zero_pairs(z, 8)
        x02, x13, _, _ = int_x_pairs(x_ptr + offs * 4, 8)
        out = int8_word_dot(words, x02, x13, zb, z) * INT8_X_SCALE
    else:
        xk = x_ptr + offs * 4
        x01 = pack_f16_pair(tl.load(xk), tl.load(xk + 1), E4M3_X_SCALE)
        x23 = pack_f16_pair(tl.load(xk + 2), tl.load(xk + 3), E4M3_X_SCALE)
        out = e4m3_word_dot(words, x01, x23) * E4M3_X_SCALE
    tl.store(out_ptr + offs, out)


def _case(kind: int, words: int, x_scale: float, device: str, seed: int = 0):
    """(words int32, x bf16, z float32, want float64): the words' values and dots."""
    gen = torch.Generator().manual_seed(seed)
    per_word = 8 if kind == 4 else 4
    x = (torch.randn(words * per_word, generator=gen) * x_scale).to(torch.bfloat16)
    if kind == 0:
        w = (torch.randn(words * 4, generator=gen) * 100).clamp(-448, 448)
        w8 = w.to(torch.float8_e4m3fn)
        packed = w8.view(torch.uint8).view(-1, 4).to(torch.int64)
        packed = (packed << torch.tensor([0, 8, 16, 24])).sum(1)
        vals = w8.float().double().view(words, 4)
        z = torch.zeros(words)
    else:
        q = torch.randint(0, 1 << kind, (1, words * per_word), generator=gen)
        z = torch.randint(0, 1 << kind, (words,), generator=gen).float()
        packed = pack_int_weight(q, kind).view(-1).to(torch.int64)
        vals = q.view(words, per_word).double() - z.double()[:, None]
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    want = (vals * x.double().view(words, per_word)).sum(1)
    bound = (vals.abs() * x.double().abs().view(words, per_word)).sum(1)
    return (packed.to(device), x.to(device), z.to(device), want, bound)


def _check(kind: int, x_scale: float, device: str) -> None:
    words, x, z, want, bound = _case(kind, 256, x_scale, device)
    out = torch.empty(256, dtype=torch.float32, device=device)
    _word_dots_kernel[(1,)](words, x, z, out, KIND=kind, WORDS=256)
    got = out.double().cpu()
    assert torch.isfinite(got).all()
    # fp16 products and sums within one word: a few roundings of 2^-11 of its magnitude,
    # plus x's fp16 subnormal step (2^-24 * 2^shift) per value when x is tiny.
    shift = {4: 4, 8: 8, 0: 8}[kind]
    tol = 4e-3 * bound + 8 * 448 * 2.0 ** (shift - 24)
    assert ((got - want).abs() <= tol).all(), float(((got - want).abs() - tol).max())


@pytest.mark.parametrize("kind", [4, 8, 0], ids=["int4", "int8", "e4m3"])
def test_word_dots_equal_their_sums(kind: int) -> None:
    _check(kind, 1.0, "cpu")


def test_the_int4_pairs_hold_values_0_4_1_5_2_6_3_7() -> None:
    """One nonzero value per position: a pair order mix-up cannot cancel out."""
    for pos in range(8):
        q = torch.zeros(1, 8, dtype=torch.int64)
        q[0, pos] = 9
        word = pack_int_weight(q, 4).view(1)
        x = torch.zeros(8, dtype=torch.bfloat16)
        x[pos] = 2.0
        out = torch.empty(1)
        _word_dots_kernel[(1,)](word, x, torch.zeros(1), out, KIND=4, WORDS=1)
        assert float(out[0]) == 18.0, pos


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("x_scale", [1e-3, 1.0, 2000.0], ids=["tiny", "unit", "large"])
@pytest.mark.parametrize("kind", [4, 8, 0], ids=["int4", "int8", "e4m3"])
def test_gpu_word_dots_hold_over_the_activation_range(kind: int, x_scale: float) -> None:
    _check(kind, x_scale, "cuda")
