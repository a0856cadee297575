"""The in-kernel number formats (replayssm._triton.formats) against replayssm.formats, bit for bit.

Runs the Triton code under TRITON_INTERPRET=1 on the CPU (set in conftest for triton tests); with
REPLAYSSM_GPU_TESTS=1 the same kernels run compiled on the GPU (its hardware casts included):

    REPLAYSSM_GPU_TESTS=1 python -m pytest tests/test_triton_formats.py
"""
import os
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from replayssm import formats  # noqa: E402
from replayssm._triton import formats as tf  # noqa: E402


#: Where the kernels of this file run: the tensors are made on the CPU and copied there and back.
DEVICE = "cuda" if os.environ.get("REPLAYSSM_GPU_TESTS") == "1" else "cpu"


def _launch(kernel, grid, *args):
    """kernel[grid](*args) on DEVICE, every tensor argument copied back in place afterwards."""
    moved = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    kernel[grid](*moved)
    for a, m in zip(args, moved):
        if isinstance(a, torch.Tensor):
            a.copy_(m.cpu())


@triton.jit
def _roundtrip_kernel(x_ptr, v_ptr, s_ptr, g_ptr, load_ptr, q_ptr, mv_ptr, seed_ptr, stream,
                      DV: tl.constexpr, DK: tl.constexpr, FMT: tl.constexpr, SR: tl.constexpr):
    mat = tl.program_id(0)
    rv = tl.arange(0, DV)
    ck = tl.arange(0, DK)
    S = tl.load(x_ptr + (mat * DV + rv[:, None]) * DK + ck[None, :])
    seed = tl.load(seed_ptr + mat)
    tf.store_tile(S, v_ptr, s_ptr, g_ptr, mat, mat, mat % 3, rv, ck, seed, stream, DV, DK, FMT, SR)
    tl.debug_barrier()
    back = tf.load_tile(v_ptr, s_ptr, g_ptr, mat, mat, rv, ck, DV, DK, FMT)
    tl.store(load_ptr + (mat * DV + rv[:, None]) * DK + ck[None, :], back)
    ra, rb, rsc = tf.load_read(v_ptr, s_ptr, g_ptr, mat, mat, rv, DV, DK, DK, FMT)
    qa, qb = tf.load_query(q_ptr, 1, DK, DK, FMT)
    tl.store(mv_ptr + mat * DV + rv, tf.matvec(ra, rb, rsc, qa, qb, FMT))


def _run(name, rounding, x, seeds, stream):
    fmt = formats.get_format(name)
    mats, DV, DK = x.shape
    parts = fmt.allocate(x.shape, "cpu")
    dummy = torch.zeros(1)
    v, s, g = parts["values"], parts.get("scales", dummy), parts.get("global_scale", dummy)
    back = torch.empty_like(x)
    q = torch.randn(DK, generator=torch.Generator().manual_seed(3))
    mv = torch.empty(mats, DV)
    _launch(_roundtrip_kernel, (mats,), x, v, s, g, back, q, mv, seeds, stream, DV, DK, tf.FMT_IDS[name],
            rounding == "stochastic")
    # the step kernels' products over load_read's layout: the decoded tile times q
    want = (fmt.decode(parts, DK).double() @ q.double()).float()
    torch.testing.assert_close(mv, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(), equal_nan=True)
    return parts, back


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_kernel_encode_matches_torch_bit_for_bit(name, rounding):
    g = torch.Generator().manual_seed(7)
    mats, DV, DK = 6, 16, 64
    x = torch.randn(mats, DV, DK, generator=g) * torch.logspace(-3, 2, DK)[None, None, :]
    x[0, 0, :5] = torch.tensor([65504.0 * 2, -1e-9, 0.0, -0.0, 3.0])
    seeds = torch.randint(0, 2**40, (mats,), generator=g)
    stream = 11
    parts, back = _run(name, rounding, x, seeds, stream)
    heads = torch.arange(mats) % 3
    offsets = (heads[:, None, None] * DV + torch.arange(DV)[None, :, None]) * DK + torch.arange(DK)
    bits = formats.random_bits(seeds[:, None, None], stream, offsets)
    fmt = formats.get_format(name)
    want = fmt.encode(x, rounding, bits if rounding == "stochastic" else None)
    for key, t in want.items():
        got = parts[key]
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)) if t.element_size() == 1 else \
            torch.equal(got.view(-1).view(torch.int16 if t.element_size() == 2 else torch.int32),
                        t.reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)), key
    ref = fmt.decode(want, DK)
    torch.testing.assert_close(back, ref, rtol=0, atol=0, equal_nan=True)


@triton.jit
def _padded_roundtrip_kernel(x_ptr, v_ptr, s_ptr, g_ptr, load_ptr, q_ptr, mv_ptr, seed_ptr, stream,
                             DV: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, CH: tl.constexpr,
                             FMT: tl.constexpr, SR: tl.constexpr):
    """The round trip of ``_roundtrip_kernel`` for rows of DK columns in tiles of DKP (padded to a
    power of two), stored and loaded CH columns at a time as a refresh's passes do; the padding of
    the tile is NaN on the way in, so an encode that let it into a scale block would show."""
    mat = tl.program_id(0)
    rv = tl.arange(0, DV)
    seed = tl.load(seed_ptr + mat)
    for c in tl.static_range((DK + CH - 1) // CH):
        ck = c * CH + tl.arange(0, CH)
        S = tl.load(x_ptr + (mat * DV + rv[:, None]) * DK + ck[None, :], mask=ck[None, :] < DK, other=float("nan"))
        tf.store_tile(S, v_ptr, s_ptr, g_ptr, mat, mat, mat % 3, rv, ck, seed, stream, DV, DK, FMT, SR)
    tl.debug_barrier()
    for c in tl.static_range((DK + CH - 1) // CH):
        ck = c * CH + tl.arange(0, CH)
        back = tf.load_tile(v_ptr, s_ptr, g_ptr, mat, mat, rv, ck, DV, DK, FMT)
        tl.store(load_ptr + (mat * DV + rv[:, None]) * DK + ck[None, :], back, mask=ck[None, :] < DK)
    ra, rb, rsc = tf.load_read(v_ptr, s_ptr, g_ptr, mat, mat, rv, DV, DK, DKP, FMT)
    qa, qb = tf.load_query(q_ptr, 1, DK, DKP, FMT)
    tl.store(mv_ptr + mat * DV + rv, tf.matvec(ra, rb, rsc, qa, qb, FMT))


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("DK", [5, 24, 40])
def test_kernel_encode_of_rows_in_padded_tiles_matches_torch_bit_for_bit(name, rounding, DK):
    """dk that is no power of two, and not a multiple of a scale block (5, 24, 40: fp8 rows of one
    and two 32-element blocks, NVFP4 rows of one to three 16-element blocks): every part, padding
    bytes included, bit for bit as ``replayssm.formats`` encodes it, in 32-column passes (fp8's
    block) or whole rows (NVFP4's global scale); decoded tiles and products with a query exact or
    to rounding."""
    from replayssm._triton import launch

    g = torch.Generator().manual_seed(8 + DK)
    mats, DV = 4, 8
    x = torch.randn(mats, DV, DK, generator=g) * torch.logspace(-2, 1, DK)[None, None, :]
    if name != "nvfp4":  # (the interpreter casts a NaN to e4m3 as 384: NVFP4's NaN block scale is GPU-only)
        x[1, 2, DK // 2] = float("nan")  # one bad block
    seeds = torch.randint(0, 2**40, (mats,), generator=g)
    fmt = formats.get_format(name)
    parts = fmt.allocate(x.shape, "cpu", fill=float("nan"))  # storage never written shows
    dummy = torch.zeros(1)
    v, s, gs = parts["values"], parts.get("scales", dummy), parts.get("global_scale", dummy)
    DKP = launch.column_pad(SimpleNamespace(dk=DK, precision=SimpleNamespace(anchor=fmt, read_format=fmt)))
    CH = DKP if name == "nvfp4" else min(DKP, 32)
    back = torch.empty_like(x)
    q = torch.randn(DK, generator=g)
    mv = torch.empty(mats, DV)
    _launch(_padded_roundtrip_kernel, (mats,), x, v, s, gs, back, q, mv, seeds, 5, DV, DK, DKP, CH,
            tf.FMT_IDS[name], rounding == "stochastic")
    heads = torch.arange(mats) % 3
    offsets = (heads[:, None, None] * DV + torch.arange(DV)[None, :, None]) * DK + torch.arange(DK)
    bits = formats.random_bits(seeds[:, None, None], 5, offsets)
    want = fmt.encode(x, rounding, bits if rounding == "stochastic" else None)
    for key, t in want.items():  # bit for bit, NaN for NaN (whose payload no format defines)
        got = parts[key]
        nan = torch.isnan(t.float()) if t.is_floating_point() else torch.zeros_like(t, dtype=torch.bool)
        assert torch.equal(torch.isnan(got.float()) if got.is_floating_point() else nan, nan), key
        same = got.contiguous().view(torch.uint8) == t.contiguous().view(torch.uint8)
        assert same.view(*t.shape, -1).all(-1)[~nan].all(), key
    ref = fmt.decode(want, DK)
    torch.testing.assert_close(back, ref, rtol=0, atol=0, equal_nan=True)
    good = ~torch.isnan(ref).any(-1)  # rows without the bad block
    prod = (ref.double() @ q.double()).float()
    torch.testing.assert_close(mv[good], prod[good], rtol=1e-5, atol=1e-5 * prod[good].abs().max().item())
    assert torch.isnan(mv[~good]).all() and (name == "nvfp4" or not good.all())


@triton.jit
def _grid_round_kernel(x_ptr, r_ptr, out_ptr, N: tl.constexpr, M: tl.constexpr, EMIN: tl.constexpr,
                       MAXV: tl.constexpr, SR: tl.constexpr):
    i = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(out_ptr + i, tf.grid_round(tl.load(x_ptr + i), tl.load(r_ptr + i), M, EMIN, MAXV, SR))


def _hard_cases(M, emin, maxv, g):
    """fp32 values where a rounding onto the grid (M mantissa bits, min exponent emin, max maxv)
    goes wrong first: every grid point of a span of binades and the midpoints between them (the
    ties), one fp32 ulp either side of each midpoint, subnormals of the grid and of fp32, signed
    zeros, the largest values and beyond, and random fp32 bit patterns."""
    top = int(torch.tensor(maxv).log2().floor())
    exps = sorted({*range(emin - 3, emin + 4), *range(-2, 3), *range(top - 3, top + 1)})
    pts = torch.cat([(1 + torch.arange(2 ** M, dtype=torch.float64) / 2 ** M) * 2.0 ** e for e in exps])
    pts = torch.cat([pts, torch.arange(2 ** M, dtype=torch.float64) * 2.0 ** (emin - M)])  # grid subnormals
    spacing = 2.0 ** (torch.floor(torch.log2(pts.clamp_min(2.0 ** emin))) - M)
    mids = (pts + spacing / 2).float()
    near = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1), pts.float()])
    special = torch.tensor([0.0, maxv, maxv * 1.0001, 3e38, 1e-45, 1e-40, 2.0 ** -126, 2.0 ** -127])
    rand = torch.randint(0, 2 ** 31 - 2 ** 23, (4096,), generator=g, dtype=torch.int32).view(torch.float32)
    x = torch.cat([near, special, rand])
    return torch.cat([x, -x])


@pytest.mark.parametrize("grid", [(10, -14, 65504.0), (7, -126, 3.3895313892515355e38), (3, -6, 448.0),
                                  (1, 0, 6.0)], ids=["fp16", "bf16", "e4m3", "e2m1"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_grid_round_matches_torch_on_ties_subnormals_and_limits(grid, rounding):
    """``formats.grid_round`` (whose nearest-even form adds and takes away a constant, or rounds
    the bits for bf16) against ``replayssm.formats._round_grid`` in float64, bit for bit, on the
    values where a rounding errs first; a planted error (ties rounded away from zero) must fail."""
    M, emin, maxv = grid
    g = torch.Generator().manual_seed(29)
    x = _hard_cases(M, emin, maxv, g)
    x = torch.cat([x, torch.zeros((-x.numel()) % 1024)])
    r24 = torch.randint(0, 2 ** 24, x.shape, generator=g, dtype=torch.int64)
    sr = rounding == "stochastic"
    want = formats._round_grid(x, M, emin, maxv, r24 if sr else None).float()
    got = torch.empty_like(x)
    _launch(_grid_round_kernel, (x.numel() // 1024,), x, r24, got, 1024, M, emin, maxv, sr)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    if not sr:  # teeth: ties rounded away from zero would differ on some of these values
        away = formats._round_grid(x, M + 1, emin, maxv, None).float()  # the ties on the finer grid
        tie = (away == x) & (formats._round_grid(x, M, emin, maxv, None).float() != x)
        assert ((want.abs() < x.abs()) & tie).sum() >= 8


@triton.jit
def _quotient_kernel(x_ptr, d_ptr, out_ptr, NB: tl.constexpr, N: tl.constexpr):
    i = tl.program_id(0)
    b, e = tl.arange(0, NB), tl.arange(0, N)
    X = tl.load(x_ptr + (i * NB + b[:, None]) * N + e[None, :])
    d = tl.load(d_ptr + i * NB + b)
    q = tf.quotient(tl.reshape(X, (1, NB, N)), tl.reshape(d, (1, NB, 1)))
    tl.store(out_ptr + (i * NB + b[:, None]) * N + e[None, :], tl.reshape(q, (NB, N)))


def _quotient_cases(g, blocks, n):
    """(X [blocks, n], d [blocks]) where a division errs first: divisors over the whole positive
    range (subnormals, all-ones significands), numerators that are exact multiples of them by the
    rounding midpoints of the e2m1 and e4m3 grids and their neighbours, signed zeros, tiny values."""
    d = torch.exp2(torch.empty(blocks).uniform_(-140, 100, generator=g))
    d = d * torch.empty(blocks).uniform_(1, 2, generator=g)
    ones = torch.rand(blocks, generator=g) < 0.3
    d = torch.where(ones, (d.view(torch.int32) | 0x7FFFFF).view(torch.float32), d)
    d[:4] = torch.tensor([1.0, 2.0 ** -149, 3 * 2.0 ** -140, 2.0 ** 110])
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 1.0625, 1.1875, 416.0, 448.0])
    m = mids[torch.randint(0, len(mids), (blocks, n), generator=g)]
    X = (m * d[:, None]).float()
    step = torch.randint(-1, 2, (blocks, n), generator=g)
    X = torch.where(step < 0, torch.nextafter(X, torch.zeros(())), torch.where(step > 0, torch.nextafter(X, X * 2), X))
    X = X * torch.where(torch.rand(blocks, n, generator=g) < 0.5, -1.0, 1.0)
    free = torch.rand(blocks, n, generator=g) < 0.25
    X = torch.where(free, d[:, None] * torch.empty(blocks, n).uniform_(-9, 9, generator=g), X)
    X[:, 0], X[:, 1], X[:, 2], X[:, 3] = 0.0, -0.0, -d * 2.0 ** -130, d * 2.0 ** -99
    return X, d


def _assert_quotient_bits(got, want):
    """The bits of IEEE division where |quotient| >= 2**-100, else below 2**-99 with its sign."""
    big = want.abs() >= 2.0 ** -100
    assert torch.equal(torch.where(big, got, 0.0).view(torch.int32), torch.where(big, want, 0.0).view(torch.int32))
    assert bool(((got.abs() < 2.0 ** -99) & (torch.signbit(got) == torch.signbit(want)) | big).all())


def test_quotient_is_correctly_rounded_division():
    """``quotient`` (one reciprocal per block and Markstein's correction on the GPU) gives the
    bits of IEEE fp32 division, as ``replayssm.formats`` divides, on the numerators where a quotient
    from the reciprocal alone errs: the e2m1 and e4m3 rounding midpoints times the divisor."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    NB, N = 16, 16
    X, d = _quotient_cases(g, 64 * NB, N)
    got = torch.empty_like(X)
    _launch(_quotient_kernel, (64,), X, d, got, NB, N)
    want = X / d[:, None]
    _assert_quotient_bits(got, want)
    # teeth: the product with the correctly rounded reciprocal alone misses some of them
    assert (X * (1.0 / d[:, None]) != want).sum() >= 16


def _fma32(a, b, c):
    """fp32 a * b + c rounded once, exactly (float64 sums rounded twice are tried against fractions)."""
    from fractions import Fraction
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = torch.tensor(float(exact)).float()
    inf = torch.tensor(float("inf"))
    cands = [torch.nextafter(near, -inf), near, torch.nextafter(near, inf)]
    return min(cands, key=lambda v: (abs(Fraction(v.item()) - exact), v.view(torch.int32).item() & 1))


def test_markstein_quotient_steps_are_exact_in_exact_arithmetic():
    """The steps of ``quotient``'s GPU form (which the interpreter cannot run: its FMA rounds
    twice) in fp32 with exactly rounded FMAs: the bits of IEEE division on the hard cases."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    X, d = _quotient_cases(g, 24, 16)
    for xb, db in zip(X, d):
        e = min(max((db.view(torch.int32).item() >> 23) & 0xFF, 1), 253)
        p = torch.tensor(2.0 ** (127 - e))
        ds = (db * p).float()
        y = (1.0 / ds).float()
        for x in xb:
            xs = (x * p).float()
            q0 = (xs * y).float()
            q = q0 if q0.abs() < 2.0 ** -100 else _fma32(_fma32(-q0, ds, xs), y, q0)
            _assert_quotient_bits(q, x / db)


@triton.jit
def _e2m1_pairs_kernel(byte_ptr, lo_ptr, hi_ptr):
    at = (tl.arange(0, 8)[:, None, None] * 4 + tl.arange(0, 4)[None, :, None]) * 8 + tl.arange(0, 8)[None, None, :]
    lo, hi = tf.e2m1_pairs(tl.load(byte_ptr + at))  # a [rows, blocks, 8] tile, as load_read takes NVFP4 rows
    tl.store(lo_ptr + at, lo.to(tl.float32) * 16384.0)
    tl.store(hi_ptr + at, hi.to(tl.float32) * 16384.0)


def test_e2m1_pairs_decode_every_byte():
    """``e2m1_pairs`` (on the GPU four bytes per register in PTX) against ``replayssm.formats``'
    decode table, for all 256 bytes in a fresh random order, signed zeros included."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    byte = torch.randperm(256, generator=g).to(torch.uint8)
    lo, hi = torch.empty(256), torch.empty(256)
    _launch(_e2m1_pairs_kernel, (1,), byte, lo, hi)
    table = torch.tensor(formats._E2M1_TABLE)
    code = byte.long()
    assert torch.equal(lo.view(torch.int32), table[code & 15].view(torch.int32))
    assert torch.equal(hi.view(torch.int32), table[code >> 4].view(torch.int32))


@triton.jit
def _e2m1_code_kernel(y_ptr, code_ptr, N: tl.constexpr):
    at = tl.arange(0, N)
    tl.store(code_ptr + at, tf._e2m1_nearest_code(tl.load(y_ptr + at)))


def test_e2m1_nearest_code_rounds_ties_to_even_and_saturates():
    """The NVFP4 encoder's code of a block-scaled value (nearest-even onto the e2m1 grid from the
    bits) against the nearest grid magnitude found by search, ties to the even index, on every
    midpoint of the grid and its fp32 neighbours, signed zeros, subnormals and values past 6."""
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    points = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 8.0, 1.0, 2.0, 4.0, 0.5, 1e-40, 1e30])
    inf = torch.full_like(points, float("inf"))
    near = torch.cat([points, torch.nextafter(points, inf), torch.nextafter(points, -inf)])
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    rand = torch.rand(256 - 2 * near.numel() - 2, generator=g) * 9.0
    y = torch.cat([near, -near, rand, torch.tensor([0.0, -0.0])])
    y[2 * near.numel():-2] *= torch.where(torch.rand(rand.numel(), generator=g) < 0.5, -1.0, 1.0)
    code = torch.empty(y.numel(), dtype=torch.int32)
    _launch(_e2m1_code_kernel, (1,), y, code, y.numel())
    dist = (y.double().abs().clamp(max=6.0)[:, None] - mags[None, :]).abs()
    best = dist.min(1, keepdim=True).values
    index = torch.arange(8)[None, :]
    # the nearest magnitude; of two at the same distance the even index
    want = torch.where(dist == best, index + 8 * (index % 2), 99).min(1).values % 8
    want = want + 8 * torch.signbit(y).long()
    assert torch.equal(code.long(), want)


@triton.jit
def _random_bits_kernel(base_ptr, seed_ptr, stream_ptr, out_ptr, SPAN: tl.constexpr):
    i = tl.program_id(0)
    offset = tl.arange(0, SPAN).to(tl.uint32)
    bits = tf.random_u32(tl.load(seed_ptr + i), tl.load(stream_ptr + i), tl.load(base_ptr + i), offset, SPAN)
    tl.store(out_ptr + i * SPAN + offset, bits.to(tl.int64))


def test_kernel_random_bits_match_torch_across_the_high_word():
    """``random_u32`` (the seed's and stream's mixes scalar, one 32-bit mix per element) against
    ``formats.random_bits`` on ranges that start below and end above a multiple of 2**32, so that
    some elements take the carry into the high word, with fresh 64-bit seeds and streams."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    span = 256
    starts = torch.tensor([0, 2**32 - 100, 5 * 2**32 - 1, 2**40 - span // 2, 2**32 + 7])
    seeds = torch.randint(-2**62, 2**62, starts.shape, generator=g)
    streams = torch.randint(0, 2**40, starts.shape, generator=g)
    got = torch.empty(len(starts), span, dtype=torch.int64)
    _launch(_random_bits_kernel, (len(starts),), starts, seeds, streams, got, span)
    want = formats.random_bits(seeds[:, None], streams[:, None], starts[:, None] + torch.arange(span))
    assert torch.equal(got, want)
    # teeth: without the carry, the elements past each multiple of 2**32 would differ
    wrong = formats.random_bits(seeds[:, None], streams[:, None],
                                (starts[:, None] >> 32 << 32) + ((starts[:, None] + torch.arange(span)) & 0xFFFFFFFF))
    assert (wrong != want).sum() >= span // 2


@triton.jit
def _exact_b_kernel(a_ptr, b_ptr, c_ptr, out_ptr, high_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    m, k, n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    A = tl.load(a_ptr + m[:, None] * K + k[None, :])
    B = tl.load(b_ptr + k[:, None] * N + n[None, :])  # bf16, as a buffer holds inputs given in bf16
    acc = tl.load(c_ptr + m[:, None] * N + n[None, :])
    tl.store(out_ptr + m[:, None] * N + n[None, :], tf.exact_b_products(A, B, acc))
    tl.store(high_ptr + m[:, None] * K + k[None, :], tf._tf32_high(A))


def _tf32_round_away(x):
    """x rounded to 11 significant bits, to nearest, ties away from zero (cvt.rna.tf32), in float64."""
    m, e = torch.frexp(x.double())
    return (torch.sign(m) * torch.floor(m.abs() * 2**11 + 0.5) * torch.exp2(e.double() - 11)).float()


def test_exact_b_products_are_fp32_accurate_and_split_at_tf32():
    """``exact_b_products`` (A split at tf32 into two single-pass products with a bf16 B) against
    float64, within fp32 rounding of the accumulation; its split point rounds ties away from zero
    as ``cvt.rna.tf32`` does (ties chosen where nearest-even would round the other way)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    M, K, N = 32, 32, 16
    A = torch.randn(M, K, generator=g) * torch.logspace(-4, 3, K)[None, :]
    ties = (torch.randint(2**10, 2**11, (M, 4), generator=g) * 2 + 1).double() * 2.0**-12  # odd 12-bit values
    A[:, :4] = (ties * torch.exp2(torch.randint(-20, 20, (M, 1), generator=g).double())).float()
    B = torch.randn(K, N, generator=g).bfloat16()
    acc = torch.randn(M, N, generator=g)
    out, high = torch.empty(M, N), torch.empty(M, K)
    _launch(_exact_b_kernel, (1,), A, B, acc, out, high, M, K, N)
    want = A.double() @ B.double() + acc.double()
    bound = (A.double().abs() @ B.double().abs() + acc.double().abs()) * 2.0**-20
    assert ((out.double() - want).abs() <= bound).all()
    assert torch.equal(high, _tf32_round_away(A))
    even = (ties * 2**11).round() != torch.floor(ties * 2**11 + 0.5)  # ties where nearest-even differs
    assert even.sum() >= 8
