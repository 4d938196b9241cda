"""Packed weight words dotted with x in half-precision pairs, for the one-row GEMVs.

A batch-1 quantized GEMV must unpack every weight value it reads. Unpacking one value at a
time into float32 costs the int4 GEMV about seven instructions a value, and at 4.25 TB/s int4
delivers 8.5 G values per ms, more than the multiprocessors issue at that rate. Here one
32-bit word of packed weights becomes f16x2 pairs with bit operations (an integer OR'ed into
the mantissa of 1024.0 reads back as 1024 + q), the zero point leaves in one packed
subtraction and the products with x are packed FMAs, so two values share each instruction
(the approach of the Marlin and exllama kernels). Each word's products are summed in fp16
(one rounding of 2^-11 per addition, below a bf16 output's 2^-8) and returned in float32;
sums across words stay float32.

x arrives as f16x2 pairs divided by 2^shift (`pack_f16_pair`, the *_X_SCALE constants): a
word's fp16 sum may hold up to 60 |x| (int4), 510 |x| (int8) or 896 |x| (e4m3) unscaled, and
the shift keeps it below fp16's 65504 for any activation a layer meets (|x| up to about
17,000 for int4 with shift 4, 32,000 for int8 and 18,000 for e4m3 with shift 8). Values
below 2^-14 * 2^shift become fp16 subnormals, which keep their products to about
2^-24 * 2^shift absolute: far below a bf16 output's rounding. The caller multiplies its sums
by 2^shift (the X_SCALE) with the weights' scale.

Under the Triton interpreter, which has no PTX, each helper forms the same sum in float32
from the same pairs and words.
"""

from __future__ import annotations

import torch

from asyncengine_kernels._triton_utils import INLINE_PTX, tl, triton
from asyncengine_kernels.activation import silu_times

__all__ = [
    "E4M3_X_SCALE",
    "INT4_X_SCALE",
    "INT8_X_SCALE",
    "check_pair_activation",
    "check_pair_words",
    "e4m3_word_dot",
    "int4_word_dot",
    "int8_word_dot",
    "int_x_pairs",
    "pack_f16_pair",
    "zero_pairs",
]

# x is divided by these powers of two before its fp16 rounding (the sums multiplied back).
INT4_X_SCALE = tl.constexpr(16.0)
INT8_X_SCALE = tl.constexpr(256.0)
E4M3_X_SCALE = tl.constexpr(256.0)


def check_pair_activation(x: torch.Tensor) -> None:
    """The pairs round x to fp16: a float32 activation would lose precision silently."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"half-precision pairs take 16-bit activations, got {x.dtype}")


def check_pair_words(weight: torch.Tensor) -> None:
    """An e4m3 weight read as 4-byte words needs rows of whole, aligned words."""
    if weight.shape[1] % 4 or weight.stride(0) % 4 or weight.data_ptr() % 4:
        raise ValueError("half-precision pairs need weight rows of whole 4-byte words")


def _word_dot_ptx(body: str) -> tl.constexpr:
    """A word dot's PTX: `body` leaves the word's products in the f16x2 register acc; its two
    halves are added in fp16 and returned in float32 ($0, as the bits of an int32)."""
    return tl.constexpr(
        "{\n.reg .b32 a, b, c, d, w8, s, acc;\n.reg .b16 w01, w23, lo, hi;\n" + body
        + "\nmov.b32 {lo, hi}, acc;\nadd.rn.f16 lo, lo, hi;\ncvt.f32.f16 $0, lo;\n}"
    )  # fmt: skip


# $1: the word; int4: $2-$5 the x pairs, $6 (1024 + z) pairs, $7 -(64 + z) pairs.
_INT4_DOT = _word_dot_ptx("""
mov.b32 s, 0x2C002C00;
lop3.b32 a, $1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 b, $1, 0x00F000F0, 0x64006400, 0xEA;
shr.u32 w8, $1, 8;
lop3.b32 c, w8, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 d, w8, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 a, a, $6;
fma.rn.f16x2 b, b, s, $7;
sub.f16x2 c, c, $6;
fma.rn.f16x2 d, d, s, $7;
mul.rn.f16x2 acc, a, $2;
fma.rn.f16x2 acc, b, $3, acc;
fma.rn.f16x2 acc, c, $4, acc;
fma.rn.f16x2 acc, d, $5, acc;""")
# int8: $2, $3 the x pairs, $4 (1024 + z) pairs.
_INT8_DOT = _word_dot_ptx("""
shr.u32 w8, $1, 8;
lop3.b32 a, $1, 0x00FF00FF, 0x64006400, 0xEA;
lop3.b32 b, w8, 0x00FF00FF, 0x64006400, 0xEA;
sub.f16x2 a, a, $4;
sub.f16x2 b, b, $4;
mul.rn.f16x2 acc, a, $2;
fma.rn.f16x2 acc, b, $3, acc;""")
# e4m3: $2, $3 the x pairs.
_E4M3_DOT = _word_dot_ptx("""
mov.b32 {w01, w23}, $1;
cvt.rn.f16x2.e4m3x2 a, w01;
cvt.rn.f16x2.e4m3x2 b, w23;
mul.rn.f16x2 acc, a, $2;
fma.rn.f16x2 acc, b, $3, acc;""")


@triton.jit
def _word_dot_asm(ASM: tl.constexpr, args):
    """Run a word dot's PTX (`_word_dot_ptx`) on `args` (the word first), one output
    register: the float32 sum, as int32 bits."""
    return tl.inline_asm_elementwise(
        asm=ASM,
        constraints="=r" + ",r" * len(args),
        args=args,
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    ).to(tl.float32, bitcast=True)


@triton.jit
def pack_f16_pair(lo, hi, SCALE: tl.constexpr):
    """Two float tensors -> int32 holding (lo, hi) / SCALE as fp16 (lo in bits 0-15)."""
    lo16 = (lo.to(tl.float32) / SCALE).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    hi16 = (hi.to(tl.float32) / SCALE).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return (lo16 & 0xFFFF) | (hi16 << 16)


@triton.jit
def zero_pairs(z, BITS: tl.constexpr):
    """The per-column constants the packed dots subtract, from integer-valued zeros z:
    (1024 + z) in both halves, and for int4 also -(64 + z) (the odd nibbles are read as
    16 q, scaled back by 1/16 in an FMA)."""
    biased = pack_f16_pair(z + 1024.0, z + 1024.0, 1.0)
    if BITS == 4:
        return biased, pack_f16_pair(-(z + 64.0), -(z + 64.0), 1.0)
    return biased, biased


@triton.jit
def _load_x(xk, mask):
    if mask is None:
        x = tl.load(xk)
    else:
        x = tl.load(xk, mask=mask, other=0.0)
    return x


@triton.jit
def _x_at(xk, mask, up_offset):
    """x at xk; with `up_offset`, xk is a gate and x is silu(gate) * up (up at xk +
    up_offset), rounded to x's dtype as `asyncengine_kernels.activation.silu_and_mul` rounds it."""
    x = _load_x(xk, mask)
    if up_offset is not None:
        gate = x.to(tl.float32)
        up = _load_x(xk + up_offset, mask).to(tl.float32)
        x = silu_times(gate, up).to(xk.dtype.element_ty)
    return x


@triton.jit
def int_x_pairs(xk, BITS: tl.constexpr, mask=None, up_offset=None):
    """x as the f16x2 pairs an integer word's values meet in `int4_word_dot` or
    `int8_word_dot`, loaded from xk (the addresses of each word's first input value; where
    `mask` is false, x reads as 0; with `up_offset`, x is formed from [gate, up] as
    `_x_at` says). int4: (0, 4), (1, 5), (2, 6), (3, 7); int8: (0, 2), (1, 3), and the
    second pair twice more, so both widths give four."""
    if BITS == 4:
        x04 = pack_f16_pair(_x_at(xk, mask, up_offset), _x_at(xk + 4, mask, up_offset),
                            INT4_X_SCALE)  # fmt: skip
        x15 = pack_f16_pair(_x_at(xk + 1, mask, up_offset), _x_at(xk + 5, mask, up_offset),
                            INT4_X_SCALE)  # fmt: skip
        x26 = pack_f16_pair(_x_at(xk + 2, mask, up_offset), _x_at(xk + 6, mask, up_offset),
                            INT4_X_SCALE)  # fmt: skip
        x37 = pack_f16_pair(_x_at(xk + 3, mask, up_offset), _x_at(xk + 7, mask, up_offset),
                            INT4_X_SCALE)  # fmt: skip
        return x04, x15, x26, x37
    x02 = pack_f16_pair(_x_at(xk, mask, up_offset), _x_at(xk + 2, mask, up_offset),
                        INT8_X_SCALE)  # fmt: skip
    x13 = pack_f16_pair(_x_at(xk + 1, mask, up_offset), _x_at(xk + 3, mask, up_offset),
                        INT8_X_SCALE)  # fmt: skip
    return x02, x13, x13, x13


@triton.jit
def _f16_lo(pair):
    return (pair & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_hi(pair):
    return (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(word, i: tl.constexpr):
    return ((word >> (4 * i)) & 0xF).to(tl.float32)


@triton.jit
def int4_word_dot(word, x04, x15, x26, x37, z_biased, z_neg_high, z):
    """sum_i (q_i - z) x_i over a word of eight 4-bit values (value i in bits 4i..4i+3), with
    x as pairs (x0, x4), (x1, x5), (x2, x6), (x3, x7) from `pack_f16_pair`; z_biased and
    z_neg_high from `zero_pairs(z, 4)`, z itself (float32) for the interpreter's form."""
    if INLINE_PTX:
        return _word_dot_asm(_INT4_DOT, (word, x04, x15, x26, x37, z_biased, z_neg_high))
    else:
        return (
            (_nibble(word, 0) - z) * _f16_lo(x04) + (_nibble(word, 4) - z) * _f16_hi(x04)
            + (_nibble(word, 1) - z) * _f16_lo(x15) + (_nibble(word, 5) - z) * _f16_hi(x15)
            + (_nibble(word, 2) - z) * _f16_lo(x26) + (_nibble(word, 6) - z) * _f16_hi(x26)
            + (_nibble(word, 3) - z) * _f16_lo(x37) + (_nibble(word, 7) - z) * _f16_hi(x37)
        )  # fmt: skip


@triton.jit
def _byte(word, i: tl.constexpr):
    return (word >> (8 * i)) & 0xFF


@triton.jit
def int8_word_dot(word, x02, x13, z_biased, z):
    """sum_i (q_i - z) x_i over a word of four 8-bit values (value i in bits 8i..8i+7), with
    x as pairs (x0, x2), (x1, x3); z_biased from `zero_pairs(z, 8)`."""
    if INLINE_PTX:
        return _word_dot_asm(_INT8_DOT, (word, x02, x13, z_biased))
    else:
        return (
            (_byte(word, 0).to(tl.float32) - z) * _f16_lo(x02)
            + (_byte(word, 2).to(tl.float32) - z) * _f16_hi(x02)
            + (_byte(word, 1).to(tl.float32) - z) * _f16_lo(x13)
            + (_byte(word, 3).to(tl.float32) - z) * _f16_hi(x13)
        )


@triton.jit
def _e4m3_value(byte):
    """An e4m3 (fn) byte's value in float32, from its bits (the interpreter's form)."""
    exp = (byte >> 3) & 0xF
    man = (byte & 7).to(tl.float32)
    mag = tl.where(exp == 0, man * 0.001953125, (man + 8.0) * tl.exp2((exp - 10).to(tl.float32)))
    return tl.where((byte & 0x80) != 0, -mag, mag)


@triton.jit
def e4m3_word_dot(word, x01, x23):
    """sum_i w_i x_i over a word of four e4m3 values (value i in byte i), with x as pairs
    (x0, x1), (x2, x3): one `cvt.rn.f16x2.e4m3x2` widens two values."""
    if INLINE_PTX:
        return _word_dot_asm(_E4M3_DOT, (word, x01, x23))
    else:
        return (
            _e4m3_value(_byte(word, 0)) * _f16_lo(x01) + _e4m3_value(_byte(word, 1)) * _f16_hi(x01)
            + _e4m3_value(_byte(word, 2)) * _f16_lo(x23)
            + _e4m3_value(_byte(word, 3)) * _f16_hi(x23)
        )  # fmt: skip
