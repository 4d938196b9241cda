"""The int4/int8 wgmma matmul (`asyncengine_kernels.quant_wgmma`): its weight packing, the int8
bit trick (emulated on the words) and the launch rules on the CPU, the kernel against
`quant_matmul_ref` on an H100/H200 (GPU-marked). Its build for sm_90 is checked with the other
kernels (`test_compile_for_gpu`)."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
import torch

from asyncengine_kernels import quant_wgmma
from asyncengine_kernels.quant_linear import pack_int_weight, quant_matmul_ref
from asyncengine_kernels.quant_wgmma import (
    ITER_K,
    LAUNCH_MAX_ROWS,
    MAX_ROWS,
    RING_PROGRAMS,
    X_RING,
    X_SLICE_BYTES,
    max_rows,
    pack_quant_wgmma,
    quant_wgmma_config,
    quant_wgmma_matmul,
    reads_zeros,
    supported,
    unpack_quant_wgmma,
)

requires_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU (wgmma)",
)


def _codes(n: int, k: int, seed: int = 0, bits: int = 4) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.int64)


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_round_trips(bits: int) -> None:
    q = _codes(128, 256, bits=bits)
    words = pack_quant_wgmma(pack_int_weight(q, bits), bits)
    assert words.dtype == torch.int32 and words.numel() == 128 * 256 * bits // 32
    assert torch.equal(unpack_quant_wgmma(words, 128, 256, bits), q)


def test_each_code_sits_in_its_threads_fragment_slot() -> None:
    """The documented mapping, element by element: thread 32 w + 4 g + q's word j of chunk c
    holds at nibble 4 e + hr + 2 hc the code of row 16 w + 8 hr + g, column 64 c + 16 j +
    8 hc + 2 q + e (of its 64-row tile)."""
    n, k = 128, 128
    q = _codes(n, k, seed=1)
    words = pack_quant_wgmma(pack_int_weight(q, 4)).view(n // 64, k // 64, 4, 8, 4, 4)
    checked = 0
    for tile, c, w, g, lane_q, j in itertools.product(range(2), range(2), range(4), range(8),
                                                      range(4), range(4)):  # fmt: skip
        word = int(words[tile, c, w, g, lane_q, j]) & 0xFFFFFFFF
        for e, hr, hc in itertools.product(range(2), repeat=3):
            row = tile * 64 + 16 * w + 8 * hr + g
            col = 64 * c + 16 * j + 8 * hc + 2 * lane_q + e
            assert (word >> (4 * (4 * e + hr + 2 * hc))) & 0xF == int(q[row, col])
            checked += 1
    assert checked == n * k


def test_int8_words_hold_each_threads_registers() -> None:
    """int8: thread 32 w + 4 g + q's word (j, hr) of chunk c, at [c, j // 2, w, g, q, j % 2,
    hr], holds at byte 2 e + hc the code of row 16 w + 8 hr + g, column 64 c + 16 j + 8 hc +
    2 q + e; the 128 threads' words of steps 0-1 (and of 2-3) are contiguous."""
    n, k = 128, 128
    q = _codes(n, k, seed=2, bits=8)
    words = pack_quant_wgmma(pack_int_weight(q, 8), 8).view(n // 64, k // 64, 2, 4, 8, 4, 2, 2)
    checked = 0
    for tile, c, jh, w, g, lane_q, jl, hr in itertools.product(
        range(2), range(2), range(2), range(4), range(8), range(4), range(2), range(2)
    ):
        word = int(words[tile, c, jh, w, g, lane_q, jl, hr]) & 0xFFFFFFFF
        for e, hc in itertools.product(range(2), repeat=2):
            row = tile * 64 + 16 * w + 8 * hr + g
            col = 64 * c + 16 * (2 * jh + jl) + 8 * hc + 2 * lane_q + e
            assert (word >> (8 * (2 * e + hc))) & 0xFF == int(q[row, col])
            checked += 1
    assert checked == n * k


def _bf16_halves(bits: torch.Tensor) -> torch.Tensor:
    """int64 words holding two bf16 -> float32 [..., 2] (low half first)."""
    halves = torch.stack([bits & 0xFFFF, (bits >> 16) & 0xFFFF], dim=-1)
    return (halves << 16).to(torch.int32).view(torch.float32)


def _int8_registers(words: torch.Tensor) -> torch.Tensor:
    """The kernel's int8 PTX on the words, step by step: two `lop3` and a `sub.bf16x2` per
    register, the second register after `shr 8` -> the values [..., hc, e] (float32)."""
    out = []
    for word in (words, words >> 8):
        low = (word & 0x007F007F) | 0x43004300  # 128 + low seven bits
        top = (word & 0x00800080) ^ 0x43804380  # 256 (top bit clear) or 128 (set)
        diff = _bf16_halves(low) - _bf16_halves(top)
        assert torch.equal(diff.to(torch.bfloat16).float(), diff)  # the bf16 sub is exact
        out.append(diff)
    return torch.stack(out, dim=-2)


def test_int8_bit_trick_gives_code_less_128_exactly() -> None:
    codes = torch.arange(256, dtype=torch.int64)
    # Every code in every byte slot: the word's registers read (code - 128) at [hc, e].
    for slot in range(4):
        words = codes << (8 * slot)
        values = _int8_registers(words)
        hc, e = slot % 2, slot // 2
        assert torch.equal(values[:, hc, e], (codes - 128).float())
        others = [(a, b) for a in range(2) for b in range(2) if (a, b) != (hc, e)]
        assert all(torch.equal(values[:, a, b], torch.full((256,), -128.0)) for a, b in others)


def test_int8_registers_are_the_fragment_values() -> None:
    """The emulated PTX on packed words gives each thread's wgmma fragment: register
    (hr, hc) of step j, value e, is row 16 w + 8 hr + g, column 16 j + 8 hc + 2 q + e."""
    n, k = 64, 64
    q = _codes(n, k, seed=3, bits=8)
    words = pack_quant_wgmma(pack_int_weight(q, 8), 8).to(torch.int64) & 0xFFFFFFFF
    values = _int8_registers(words.view(2, 4, 8, 4, 2, 2))  # [jh, w, g, q, jl, hr, hc, e]
    frag = values.permute(1, 5, 2, 0, 4, 6, 3, 7).reshape(64, 64)  # [w, hr, g | j, hc, q, e]
    assert torch.equal(frag, (q - 128).float())


_HALF = {"bf16x2": torch.bfloat16, "f16x2": torch.float16}


def _halves(word: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int64 words of two 16-bit floats -> float32 [..., 2] (low half first)."""
    bits = torch.stack([word & 0xFFFF, (word >> 16) & 0xFFFF], dim=-1)
    return bits.to(torch.int16).view(dtype).float()


def _word(halves: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 [..., 2] -> int64 words of the two rounded to `dtype` (low half first)."""
    bits = halves.to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF
    return bits[..., 0] | (bits[..., 1] << 16)


def _run_ptx(asm: str, n_out: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run one of the kernel's inline-asm blocks, element-wise over int64 tensors of 32-bit
    words: the instructions it uses (`lop3`, `shr.u32`, `mov.b32`, 16-bit pair `sub` and
    `mul.rn`), each as PTX defines it. `$i` are the `n_out` outputs (16-bit halves), then the
    inputs.
    Returns the outputs as 16-bit patterns."""
    regs: dict[str, torch.Tensor] = {}
    outs: list[torch.Tensor | None] = [None] * n_out

    def val(op: str) -> torch.Tensor:
        op = op.strip()
        if op.startswith("$"):
            return inputs[int(op[1:]) - n_out] & 0xFFFFFFFF
        if op[0].isdigit():  # an immediate
            return torch.tensor(int(op, 0), dtype=torch.int64)
        return regs[op]

    for line in asm.replace("{", "").replace("}", "").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, _, rest = line.partition(" ")
        if op == "mov.b32" and rest.lstrip().startswith("$"):  # unpack into two halves
            lo, hi, src = re.match(r"\$(\d+), \$(\d+)\s*,\s*(\w+)", rest).groups()
            outs[int(lo)], outs[int(hi)] = regs[src] & 0xFFFF, (regs[src] >> 16) & 0xFFFF
            continue
        dst, *args = [a.strip() for a in rest.split(",")]
        a = [val(x) for x in args]
        if op == "lop3.b32":
            lut, out = int(args[3], 16), torch.zeros_like(a[0])
            for bit in range(32):
                idx = (((a[0] >> bit) & 1) << 2) | (((a[1] >> bit) & 1) << 1) | ((a[2] >> bit) & 1)
                out |= ((lut >> idx) & 1) << bit
            regs[dst] = out
        elif op == "shr.u32":
            regs[dst] = (a[0] & 0xFFFFFFFF) >> int(args[1])
        elif op == "mov.b32":
            regs[dst] = a[0] & 0xFFFFFFFF
        elif op.startswith(("sub.", "mul.rn.")):
            dtype = _HALF[op.rsplit(".", 1)[1]]
            x, y = _halves(a[0], dtype), _halves(a[1], dtype)
            # float32 holds the exact difference or product of two 16-bit values here, so
            # one rounding to the type is the instruction's round-to-nearest-even.
            regs[dst] = _word(x - y if op.startswith("sub.") else x * y, dtype)
        else:
            raise AssertionError(f"the emulator does not know {op}")
    return outs  # type: ignore[return-value]


def _pairs(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A value twice as a 16-bit pair (int64 word), as the kernel's `_row_pairs` makes it."""
    return _word(torch.stack([values, values], dim=-1).float(), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaled", [False, True])
def test_int4_asm_gives_code_less_zero_times_scale(dtype: torch.dtype, scaled: bool) -> None:
    """The int4 asm the kernel runs, emulated, picked from its table as the kernel picks it:
    every code in every nibble against every zero point reads code - zero (times the scale,
    rounded to the type as the reference rounds)."""
    f16 = dtype == torch.float16
    asm = quant_wgmma._INT4_ASM.value[2 * f16 + scaled]
    codes, zeros = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    codes, zeros = codes.flatten(), zeros.flatten()
    base = 1024.0 if f16 else 128.0
    z_lo, z_hi = _pairs(base + zeros, dtype), _pairs(base + zeros, dtype)
    scale = torch.full_like(codes, 3, dtype=torch.float32) * 0.0123
    s = _pairs(scale, dtype)
    for nibble in range(8):
        words = codes << (4 * nibble)
        outs = _run_ptx(asm, 8, [words, z_lo, z_hi, s, s] if scaled else [words, z_lo, z_hi])
        # nibble 4 e + r: register r (output 2 r + e); registers 1, 3 take z_hi (the same).
        e, r = nibble // 4, nibble % 4
        got = torch.stack(outs).to(torch.int16).view(dtype).float()
        want = (codes - zeros).float()
        if scaled:
            want = (want * scale.to(dtype).float()).to(dtype).float()
        assert torch.equal(got[2 * r + e], want)
        blank = (-zeros.float() * (scale.to(dtype).float() if scaled else 1)).to(dtype).float()
        assert all(torch.equal(got[i], blank) for i in range(8) if i != 2 * r + e)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("has_zero", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
def test_int8_asm_gives_code_less_zero_times_scale(dtype: torch.dtype, has_zero: bool,
                                                   scaled: bool) -> None:  # fmt: skip
    """The int8 asm, emulated, picked from its table as the kernel picks it: every code in
    every byte reads code - zero (zero 128 when none is read), times the scale when scaled.
    The zero pair is what the kernel passes: bf16 zero - 128, fp16 1024 + zero."""
    f16 = dtype == torch.float16
    asm = quant_wgmma._INT8_ASM.value[4 * f16 + 2 * has_zero + scaled]
    codes = torch.arange(256).repeat_interleave(4)
    zeros = torch.tensor([0, 77, 128, 255]).repeat(256) if has_zero else torch.full_like(codes, 128)
    z = _pairs(zeros + (1024.0 if f16 else -128.0), dtype)
    scale = torch.full((codes.numel(),), 0.0071)
    s = _pairs(scale, dtype)
    for byte in range(4):
        outs = _run_ptx(asm, 4, [codes << (8 * byte), z, s])
        got = torch.stack(outs).to(torch.int16).view(dtype).float()  # [e + 2 hc]
        hc, e = byte % 2, byte // 2
        want = (codes - zeros).float()
        if scaled:
            want = (want * scale.to(dtype).float()).to(dtype).float()
        assert torch.equal(got[e + 2 * hc], want)


def test_packing_refuses_shapes_off_the_tiles() -> None:
    with pytest.raises(ValueError, match="multiples of 64"):
        pack_quant_wgmma(pack_int_weight(_codes(96, 128), 4))
    with pytest.raises(ValueError, match="serves"):
        pack_quant_wgmma(pack_int_weight(_codes(64, 128, bits=2), 2), 2)


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "bits"),
    [(1, 4096, 4096, 128, 4), (1, 4096, 11008, 128, 4), (1, 22016, 4096, 128, 4),
     (8, 12288, 4096, 128, 4), (16, 4096, 11008, 128, 4), (16, 4096, 4096, 128, 8),
     (2, 4096, 11008, 128, 8), (1, 4096, 4096, 4096, 4), (4, 4096, 4096, 256, 4)],
)  # fmt: skip
def test_config_splits_k_in_whole_groups_within_shared_memory(
    m: int, n: int, k: int, group: int, bits: int
) -> None:
    """Whole-slice launches (up to 16 rows)."""
    cfg = quant_wgmma_config(m, n, k, group, bits=bits)
    assert not cfg.x_ring
    assert cfg.rows >= max(8, m) and cfg.rows & (cfg.rows - 1) == 0
    assert cfg.k_split % ITER_K == 0
    if group < k:
        assert cfg.k_split % group == 0  # a group's products never straddle two splits
    assert cfg.k_split * cfg.rows * 2 <= max(X_SLICE_BYTES, group * cfg.rows * 2)
    splits = -(-k // cfg.k_split)
    assert (splits - 1) * cfg.k_split < k  # no split is empty
    assert cfg.scale_on_acc == (cfg.rows <= 16)


@pytest.mark.parametrize("m", [1, 8, 16, 33, 64, 128])
def test_groups_of_64_split_k_in_whole_iterations(m: int) -> None:
    """Groups of 64 input features (one chunk; two an iteration) take the same launches as
    groups of 128: splits of whole iterations, which hold whole groups."""
    for bits in (4, 8):
        cfg64 = quant_wgmma_config(m, 4096, 4096, 64, bits=bits)
        assert cfg64 == quant_wgmma_config(m, 4096, 4096, 128, bits=bits)
        assert cfg64.k_split % ITER_K == 0


def test_groups_fit_chunks_or_whole_iterations() -> None:
    fits = quant_wgmma._groups_fit
    assert all(fits(4096, g) for g in (32, 64, 128, 256, 4096))
    assert not fits(4096, 16) and not fits(4096, 192) and not fits(4160, 64)


@pytest.mark.parametrize("m", [1, 16, 32, 128])
def test_groups_of_32_take_the_scale_on_the_weights(m: int) -> None:
    """Groups of 32 split a chunk's four wgmma steps between two scales, so the scale goes
    on the weights at every row count, and asking for it on the accumulator is refused."""
    for bits in (4, 8):
        cfg = quant_wgmma_config(m, 4096, 4096, 32, bits=bits)
        assert not cfg.scale_on_acc
        assert cfg.k_split == quant_wgmma_config(m, 4096, 4096, 128, bits=bits).k_split
        with pytest.raises(ValueError, match="on the weights"):
            quant_wgmma_config(m, 4096, 4096, 32, scale_on_acc=True, bits=bits)


def test_config_fills_the_gpu_at_one_row() -> None:
    cfg = quant_wgmma_config(1, 4096, 4096, 128)
    assert (4096 // 64) * (4096 // cfg.k_split) >= 132 * 4


@pytest.mark.parametrize(("m", "n", "k"), [(65, 12288, 4096), (128, 4096, 4096),
                                            (100, 22016, 4096), (128, 4096, 11008)])
def test_config_streams_the_activations_above_64_rows(m: int, n: int, k: int) -> None:
    """Above 64 rows the slice goes through the ring and K is split only to give each
    multiprocessor about two programs: whole groups, no split where the tiles already fill
    the GPU (o and down: 64 tiles, four splits)."""
    for bits in (4, 8):
        cfg = quant_wgmma_config(m, n, k, 128, bits=bits)
        assert cfg.x_ring == X_RING and cfg.rows == LAUNCH_MAX_ROWS
        assert not cfg.scale_on_acc and cfg.k_split % 128 == 0
        splits = -(-k // cfg.k_split)
        tiles = n // 64
        assert splits == (1 if tiles > RING_PROGRAMS else 4)
        assert tiles * splits <= max(tiles, 2 * RING_PROGRAMS)
        assert (splits - 1) * cfg.k_split < k
        assert X_RING * cfg.rows * 64 * 2 <= 128 * 1024  # the ring's shared memory


@pytest.mark.parametrize(("n", "k", "overlap4"), [(12288, 4096, True), (4096, 4096, True),
                                                  (22016, 4096, False), (4096, 11008, True)])
def test_config_overlaps_the_wgmma_above_64_rows_where_it_costs_no_wave(
        n: int, k: int, overlap4: bool) -> None:  # fmt: skip
    """Above 64 rows the wgmma runs asynchronously with the scale on the weights, but for
    int4 grids past two programs a multiprocessor (gate/up: 344 tiles), which the
    synchronous form's fewer registers fit in one wave; never at 17-64 rows or with the scale
    on the accumulator."""
    for m in (65, 128):
        assert quant_wgmma_config(m, n, k, 128).async_mma == overlap4
        assert quant_wgmma_config(m, n, k, 128, bits=8).async_mma
        assert quant_wgmma_config(m, n, k, 32, bits=8).async_mma
    for m in (1, 16, 32, 64):
        for bits in (4, 8):
            assert not quant_wgmma_config(m, n, k, 128, bits=bits).async_mma
            assert not quant_wgmma_config(m, n, k, 128, scale_on_acc=False,
                                          bits=bits).async_mma  # fmt: skip


@pytest.mark.parametrize("m", [17, 32, 33, 64])
@pytest.mark.parametrize(("n", "k", "splits"), [(12288, 4096, 2), (22016, 4096, 1),
                                                 (4096, 4096, 6), (4096, 11008, 6)])
def test_config_streams_the_activations_from_17_rows(m: int, n: int, k: int,
                                                     splits: int) -> None:  # fmt: skip
    """At 17-64 rows the activations go through the ring too, K split to about three
    programs a multiprocessor (the 7B layers' measured best: q/k/v 2 splits, gate/up 1, o
    and down 6); int4 takes the scale on the accumulator up to 32 rows, int8 on the
    weights."""
    for bits in (4, 8):
        cfg = quant_wgmma_config(m, n, k, 128, bits=bits)
        assert cfg.x_ring == X_RING and cfg.rows == (32 if m <= 32 else 64)
        assert cfg.scale_on_acc == (bits == 4 and m <= 32) and cfg.k_split % 128 == 0
        assert -(-k // cfg.k_split) == splits


def test_config_refuses_more_rows_than_one_launch_takes() -> None:
    with pytest.raises(ValueError, match="up to 128 rows"):
        quant_wgmma_config(LAUNCH_MAX_ROWS + 1, 4096, 4096, 128)


@pytest.mark.parametrize(("m", "launches"), [(64, [64]), (128, [128]), (200, [128, 72]),
                                             (256, [128, 128])])
def test_rows_past_one_launch_run_as_launches_in_order(
    m: int, launches: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """More rows than a launch takes run as 128-row launches over consecutive row ranges of
    x and of the output, each with its own launch rules (the kernel itself stood in for by
    the reference, on the CPU)."""
    n, k, group = 128, 256, 128
    q = _codes(n, k)
    qweight = pack_int_weight(q, 4)
    gen = torch.Generator().manual_seed(1)
    scales = (torch.rand(k // group, n, generator=gen) + 0.5).to(torch.bfloat16)
    zeros = torch.full((k // group, n), 8.0, dtype=torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    seen: list[tuple[int, int]] = []

    def reference_launch(xs, words, s, z, g, bias, cfg, counters, y, bits, has_zero):  # type: ignore[no-untyped-def]
        seen.append((xs.shape[0], cfg.rows))
        assert xs.shape[0] <= cfg.rows <= LAUNCH_MAX_ROWS
        y.copy_(quant_matmul_ref(xs, qweight, s, z, bits, g))

    monkeypatch.setattr(quant_wgmma, "_launch", reference_launch)
    got = quant_wgmma_matmul(x, pack_quant_wgmma(qweight), scales, zeros, group)
    assert [rows for rows, _ in seen] == launches
    assert torch.equal(got, quant_matmul_ref(x, qweight, scales, zeros, 4, group))


def test_a_given_config_must_fit_one_launch() -> None:
    """A config for fewer rows than the launch gets, or for more than a launch takes, is
    refused before launching."""
    words = pack_quant_wgmma(pack_int_weight(_codes(128, 256), 4))
    s = torch.ones(2, 128, dtype=torch.bfloat16)
    z = torch.full((2, 128), 8.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at most 128 a launch"):
        quant_wgmma_matmul(torch.zeros(100, 256, dtype=torch.bfloat16), words, s, z, 128,
                           config=quant_wgmma_config(64, 128, 256, 128))  # fmt: skip
    too_wide = quant_wgmma.QuantWgmmaConfig(rows=256, k_split=256, scale_on_acc=False,
                                            x_ring=X_RING)  # fmt: skip
    with pytest.raises(ValueError, match="at most 128 a launch"):
        quant_wgmma_matmul(torch.zeros(1, 256, dtype=torch.bfloat16), words, s, z, 128,
                           config=too_wide)  # fmt: skip


@pytest.mark.parametrize("bits", [4, 8])
def test_both_widths_stop_at_256_rows_before_launching(bits: int) -> None:
    assert max_rows(bits) == MAX_ROWS == 256
    words = pack_quant_wgmma(pack_int_weight(_codes(64, 256, bits=bits), bits), bits)
    s = torch.ones(2, 64, dtype=torch.bfloat16)
    z = torch.full((2, 64), float(1 << (bits - 1)), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"up to 256 rows in int{bits}"):
        quant_wgmma_matmul(torch.zeros(257, 256, dtype=torch.bfloat16), words, s, z, 128,
                           bits=bits)  # fmt: skip


@pytest.mark.parametrize("m", [65, 128, 200, 256])
def test_int8_streams_through_the_ring_above_64_rows(m: int) -> None:
    """int8 past its whole slice's 64 rows takes the ring, 128 rows a launch, with the
    scale on the weights, as int4 does."""
    for bits in (4, 8):
        cfg = quant_wgmma_config(min(m, LAUNCH_MAX_ROWS), 4096, 4096, 128, bits=bits)
        assert cfg.x_ring == X_RING and cfg.rows == 128 and not cfg.scale_on_acc


def test_supported_only_on_sm90_bf16_whole_groups() -> None:
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    assert not supported(x, 4096, 4096, 4, 128)  # on the CPU
    assert not supported(x, 4096, 4096, 8, 128)


def test_reads_zeros_only_off_the_symmetric_point() -> None:
    assert not reads_zeros(torch.full((2, 64), 8.0), 4)
    assert reads_zeros(torch.full((2, 64), 128.0), 4)
    assert not reads_zeros(torch.full((2, 64), 128.0), 8)
    assert reads_zeros(torch.tensor([[128.0, 127.0]]), 8)


def test_matmul_refuses_bad_operands_before_launching() -> None:
    q = pack_quant_wgmma(pack_int_weight(_codes(64, 256), 4))
    s = torch.ones(2, 64, dtype=torch.bfloat16)
    z = torch.full((2, 64), 8.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        quant_wgmma_matmul(torch.zeros(1, 256, dtype=torch.float32), q, s, z, 128)
    with pytest.raises(ValueError, match="scales in the activations' type"):
        quant_wgmma_matmul(torch.zeros(1, 256, dtype=torch.float16), q, s, z, 128)
    with pytest.raises(ValueError, match="chunks or whole"):
        quant_wgmma_matmul(torch.zeros(1, 256, dtype=torch.bfloat16), q,
                          torch.ones(16, 64, dtype=torch.bfloat16), z, 16)  # fmt: skip
    on_acc = quant_wgmma.QuantWgmmaConfig(rows=8, k_split=256, scale_on_acc=True)
    s32 = torch.ones(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="groups of 32 take the scale on the weights"):
        quant_wgmma_matmul(torch.zeros(1, 256, dtype=torch.bfloat16), q, s32, z, 32,
                           config=on_acc)  # fmt: skip
    async_on_acc = quant_wgmma.QuantWgmmaConfig(rows=8, k_split=256, scale_on_acc=True,
                                                async_mma=True)  # fmt: skip
    with pytest.raises(ValueError, match="asynchronous wgmma takes the scale on the weights"):
        quant_wgmma_matmul(torch.zeros(1, 256, dtype=torch.bfloat16), q, s, z, 128,
                           config=async_on_acc)  # fmt: skip
    with pytest.raises(ValueError, match="codes"):
        quant_wgmma_matmul(torch.zeros(1, 128, dtype=torch.bfloat16), q, s, z, 128)
    with pytest.raises(ValueError, match="8-bit codes"):  # int4 words read as int8
        quant_wgmma_matmul(torch.zeros(1, 256, dtype=torch.bfloat16), q, s, z, 128, bits=8)


def _operands(n: int, k: int, group: int, symmetric: bool, seed: int, bits: int = 4,
              dtype: torch.dtype = torch.bfloat16,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    groups = k // group
    q = torch.randint(0, 1 << bits, (n, k), generator=gen)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).to(dtype)
    if symmetric:
        zeros = torch.full((groups, n), float(1 << (bits - 1)))
    else:
        zeros = torch.randint(0, 1 << bits, (groups, n), generator=gen).float()
    return pack_int_weight(q, bits).cuda(), scales.cuda(), zeros.to(dtype).cuda()


@requires_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 8, 16, 17, 33, 64])
@pytest.mark.parametrize(("n", "k", "group", "symmetric"),
                         [(4096, 4096, 128, True), (1024, 11008, 128, False),
                          (512, 4096, 4096, False), (768, 2048, 256, True)])  # fmt: skip
@pytest.mark.parametrize("scale_on_acc", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_matches_reference(m: int, n: int, k: int, group: int, symmetric: bool,
                               scale_on_acc: bool, bits: int) -> None:  # fmt: skip
    qweight, scales, zeros = _operands(n, k, group, symmetric, seed=m + n, bits=bits)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    words = pack_quant_wgmma(qweight, bits)
    cfg = quant_wgmma_config(m, n, k, group, scale_on_acc=scale_on_acc, bits=bits)
    ref = quant_matmul_ref(x, qweight, scales, zeros, bits, group).float()
    got = quant_wgmma_matmul(x, words, scales, zeros, group, config=cfg, bits=bits).float()
    err = (got - ref).abs().max().item()
    assert err <= 0.01 * ref.abs().max().item(), (cfg, err)


def _check_with_bias(m: int, n: int, k: int, group: int, symmetric: bool, bits: int,
                     dtype: torch.dtype, config: quant_wgmma.QuantWgmmaConfig | None) -> None:
    """`quant_wgmma_matmul` with a bias and `config` (None: the launch rules'), against
    `quant_matmul_ref` on random operands (on the GPU)."""
    qweight, scales, zeros = _operands(n, k, group, symmetric, seed=m + 3 * group, bits=bits,
                                       dtype=dtype)  # fmt: skip
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    ref = quant_matmul_ref(x, qweight, scales, zeros, bits, group, bias).float()
    got = quant_wgmma_matmul(x, pack_quant_wgmma(qweight, bits), scales, zeros, group, bias,
                             config, bits=bits).float()  # fmt: skip
    err = (got - ref).abs().max().item()
    assert err <= 0.01 * ref.abs().max().item(), (config, err)


@requires_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 16, 33, 64, 130])
@pytest.mark.parametrize(("dtype", "group", "symmetric"),
                         [(torch.float16, 128, True), (torch.float16, 128, False),
                          (torch.float16, 64, False), (torch.bfloat16, 64, True),
                          (torch.bfloat16, 64, False), (torch.float16, 4096, False),
                          (torch.bfloat16, 32, False), (torch.float16, 32, True)])  # fmt: skip
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_fp16_and_groups_of_64_match_reference(m: int, dtype: torch.dtype, group: int,
                                                   symmetric: bool, bits: int) -> None:  # fmt: skip
    """fp16 activations and groups of 64 and 32 input features, at the launch rules' configs
    for each row count (the whole slice, the ring, two launches past 128), with bias, and
    with the scale on both sides at 16 rows (groups of 64 and more)."""
    n, k = 1024, 4096
    configs: list[quant_wgmma.QuantWgmmaConfig | None] = [None]
    if m == 16 and group >= 64:
        configs = [quant_wgmma_config(m, n, k, group, scale_on_acc=on, bits=bits)
                   for on in (True, False)]  # fmt: skip
    for cfg in configs:
        _check_with_bias(m, n, k, group, symmetric, bits, dtype, cfg)


@requires_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("m", [20, 64, 128, 200])
@pytest.mark.parametrize(("dtype", "group", "symmetric"),
                         [(torch.bfloat16, 128, True), (torch.bfloat16, 128, False),
                          (torch.float16, 64, False), (torch.bfloat16, 32, True),
                          (torch.float16, 4096, False)])  # fmt: skip
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_async_mma_matches_reference(m: int, dtype: torch.dtype, group: int,
                                         symmetric: bool, bits: int) -> None:  # fmt: skip
    """The asynchronous wgmma (each chunk's next operand formed while its wgmma runs) at the
    launch rules' rows, split and activation form, the scale on the weights, with bias: the
    ring, the whole slice (int8 to 64 rows) and two launches past 128."""
    n, k = 1024, 4096
    cfg = quant_wgmma_config(min(m, LAUNCH_MAX_ROWS), n, k, group, scale_on_acc=False,
                             bits=bits)  # fmt: skip
    _check_with_bias(m, n, k, group, symmetric, bits, dtype,
                     dataclasses.replace(cfg, async_mma=True))  # fmt: skip


@requires_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 33, 64])
@pytest.mark.parametrize(("n", "k", "group", "symmetric"),
                         [(4096, 4096, 128, True), (1024, 11008, 128, False),
                          (512, 4096, 4096, False)])  # fmt: skip
@pytest.mark.parametrize("scale_on_acc", [True, False])
def test_gpu_int8_through_the_ring_matches_reference(m: int, n: int, k: int, group: int,
                                                     symmetric: bool, scale_on_acc: bool
                                                     ) -> None:  # fmt: skip
    """int8 at 17-64 rows with its activations through the ring (the launch rules' form
    there, with the scale on the weights), with and without K splits."""
    qweight, scales, zeros = _operands(n, k, group, symmetric, seed=m + n, bits=8)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    rows = 32 if m <= 32 else 64
    cfg = quant_wgmma.ring_config(rows, n, k, group, scale_on_acc)
    ref = quant_matmul_ref(x, qweight, scales, zeros, 8, group).float()
    got = quant_wgmma_matmul(x, pack_quant_wgmma(qweight, 8), scales, zeros, group, config=cfg,
                             bits=8).float()  # fmt: skip
    err = (got - ref).abs().max().item()
    assert err <= 0.01 * ref.abs().max().item(), (cfg, err)


@requires_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("m", [65, 128, 130, 256])
@pytest.mark.parametrize(("n", "k", "group", "symmetric"),
                         [(4096, 4096, 128, True), (1024, 11008, 128, False),
                          (512, 4096, 4096, False)])  # fmt: skip
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_ring_rows_match_reference(m: int, n: int, k: int, group: int,
                                       symmetric: bool, bits: int) -> None:  # fmt: skip
    """int4 and int8 at 65-256 rows: the activations through the ring, split K where the
    tiles are few (n = 512, 1024) and not where they are many, with bias; past 128 rows in
    launches of 128 rows (and the rest)."""
    qweight, scales, zeros = _operands(n, k, group, symmetric, seed=m + k, bits=bits)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    cfg = quant_wgmma_config(min(m, LAUNCH_MAX_ROWS), n, k, group, bits=bits)
    assert cfg.x_ring
    ref = quant_matmul_ref(x, qweight, scales, zeros, bits, group, bias).float()
    got = quant_wgmma_matmul(x, pack_quant_wgmma(qweight, bits), scales, zeros, group, bias,
                             bits=bits).float()  # fmt: skip
    err = (got - ref).abs().max().item()
    assert err <= 0.01 * ref.abs().max().item(), (cfg, err)


@requires_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("k_split", [128, 512, 4096])
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_split_k_counters_are_left_zeroed_with_bias(k_split: int, bits: int) -> None:
    n, k, group = 2048, 4096, 128
    qweight, scales, zeros = _operands(n, k, group, symmetric=False, seed=7, bits=bits)
    words = pack_quant_wgmma(qweight, bits)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    counters = torch.zeros(n // 64, device="cuda", dtype=torch.int32)
    cfg = quant_wgmma_config(2, n, k, group)
    cfg = type(cfg)(rows=cfg.rows, k_split=k_split, scale_on_acc=True)
    for seed in range(3):  # the counters of one call serve the next
        torch.manual_seed(seed)
        x = torch.randn(2, k, device="cuda", dtype=torch.bfloat16)
        ref = quant_matmul_ref(x, qweight, scales, zeros, bits, group, bias).float()
        got = quant_wgmma_matmul(x, words, scales, zeros, group, bias, cfg, counters,
                                 bits=bits).float()  # fmt: skip
        assert (got - ref).abs().max().item() <= 0.01 * ref.abs().max().item()
    assert int(counters.abs().sum()) == 0


@requires_hopper
@pytest.mark.gpu
def test_gpu_strided_rows_of_a_wider_input() -> None:
    """x may be a view with a row stride wider than K (a slice of a fused output)."""
    n, k, group = 1024, 4096, 128
    qweight, scales, zeros = _operands(n, k, group, symmetric=True, seed=3)
    wide = torch.randn(5, 2 * k, device="cuda", dtype=torch.bfloat16)
    x = wide[:, k:]
    ref = quant_matmul_ref(x.contiguous(), qweight, scales, zeros, 4, group).float()
    got = quant_wgmma_matmul(x, pack_quant_wgmma(qweight), scales, zeros, group).float()
    assert (got - ref).abs().max().item() <= 0.01 * ref.abs().max().item()
