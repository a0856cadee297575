"""Number formats inside Triton kernels: load a state tile as fp32, encode and store it.

Mirrors ``replayssm.formats`` element for element: the same block layouts, the same scale
arithmetic (correctly rounded fp32 divisions: ``div_rn``, or ``quotient`` by a block's divisor), the
same grid rounding and the same counter-based random bits, so that encoding an identical fp32 tile
gives identical bits on both backends. Format ids (constexpr ``FMT``): 0 fp32, 1 fp16, 2 bf16, 3
fp8-e4m3 (32-element fp32 block scales), 4 NVFP4 (16-element e4m3 scales + fp32 global scale per matrix).
A tile is one [BV, BK] block of one (slot, head) matrix: BV rows, and all dk columns or BK
contiguous ones from a multiple of 32. Tiles are a power of two wide (``DKP``, ``launch.column_pad``):
columns from dk on are padding, masked to zero on loads and never stored past the row's stored width
(``stored_width``: fp8 and NVFP4 rows hold whole scale blocks, their padding encoded as zeros, as
``replayssm.formats`` pads them). Where a tile is full its masks are constants (``below``), so the
kernels compile as they would without them.
"""
import math
import os

import triton
import triton.language as tl

#: Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, read when Triton decorates
#: them too). On a GPU, casts to e4m3 round to nearest-even and saturate in hardware
#: (``cvt.rn.satfinite``), the bits of ``replayssm.formats`` (ties, subnormals, limits: checked on an
#: H200 by ``tests/test_triton_formats.py`` with ``REPLAYSSM_TEST_DEVICE=cuda``); the interpreter's
#: cast does not round so, and there the value is first rounded onto the e4m3 grid (``grid_round``).
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

FMT_IDS = {"fp32": 0, "fp16": 1, "bf16": 2, "fp8_e4m3": 3, "nvfp4": 4}


@triton.constexpr_function
def stored_width(DK, FMT):
    """Elements of a stored row of a state matrix in format FMT: dk, rounded up to whole scale
    blocks for fp8 (32) and NVFP4 (16), as ``replayssm.formats`` lays rows out."""
    block = {3: 32, 4: 16}.get(FMT, 1)
    return -(-DK // block) * block


@triton.jit
def below(idx, N: tl.constexpr, FULL: tl.constexpr):
    """idx < N; a constant true when FULL (every index of the tile is known to be below N), so
    that a full tile's masked loads and stores compile as unmasked ones."""
    if FULL:
        ok = tl.full(idx.shape, 1, tl.int1)
    else:
        ok = idx < N
    return ok


@triton.constexpr_function
def _divides(BK, N):
    return N % BK == 0


@triton.jit
def within(idx, N: tl.constexpr):
    """``below`` for a tile of BK consecutive indices [BK] that starts at a multiple of BK: known
    full where N is a multiple of BK (all of dk, a column chunk of it, a block of rows)."""
    return below(idx, N, _divides(idx.shape[0], N))


@triton.jit
def _mix(x):
    """lowbias32 on uint32 lanes (the products wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _u32(x):
    """The low 32 bits of int64 x, as uint32."""
    return (x & 0xFFFFFFFF).to(tl.uint32)


@triton.jit
def random_u32(seed, stream, base, offset, SPAN: tl.constexpr):
    """``formats.random_bits(seed, stream, base + offset)`` bit for bit, as uint32: scalar seed,
    stream and base, uint32 offsets [...] below SPAN <= 2**32. The mixes of seed and stream are
    scalar, and so are those of the elements' high words, which are hi32(base) or the next one (a
    carry out of the low word): one mix per element, on 32-bit lanes, where the definition has six
    on 64-bit ones."""
    tl.static_assert(SPAN <= 2**32)
    seed, stream, base = seed.to(tl.int64), stream.to(tl.int64), base.to(tl.int64)
    h = _mix(_u32(seed >> 32) ^ 0x9E3779B9)
    h = _mix(h ^ _u32(seed))
    h = _mix(h ^ _u32(stream >> 32))
    h = _mix(h ^ _u32(stream))
    hi = base >> 32
    within_hi = _mix(h ^ _u32(hi))
    next_hi = _mix(h ^ _u32(hi + 1))
    lo = _u32(base) + offset  # the low word of base + offset (wraps)
    return _mix(tl.where(lo < _u32(base), next_hi, within_hi) ^ lo)


@triton.jit
def _pow2(k):
    """Exact fp32 2**k for int32 k in [-126, 127]."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _clamp(y, MAXV: tl.constexpr):
    """y clamped to [-MAXV, MAXV], NaN kept (max.NaN / min.NaN on the GPU: no compare and select)."""
    return tl.minimum(tl.maximum(y, -MAXV, propagate_nan=tl.PropagateNan.ALL), MAXV,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def grid_round(y, r24, M: tl.constexpr, EMIN: tl.constexpr, MAXV: tl.constexpr, SR: tl.constexpr):
    """Round fp32 ``y`` onto a binary grid with M mantissa bits, min normal exponent EMIN and
    largest value MAXV (saturating). SR: round up iff r24 < frac * 2**24, else nearest-even."""
    yd = _clamp(y, MAXV)
    bits = yd.to(tl.int32, bitcast=True)
    if not SR and EMIN == -126:
        # the grid has fp32's exponent range (bf16): nearest-even on the bits, carries into the
        # exponent included, 4 integer operations
        DROP: tl.constexpr = 23 - M
        half: tl.constexpr = (1 << (DROP - 1)) - 1
        res = ((bits + half + ((bits >> DROP) & 1)) & -(1 << DROP)).to(tl.float32, bitcast=True)
        return tl.where(y != y, y, res)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)
    if SR:
        # q = y 2**(M - e), exact: powers of two, each factor in range even for e = -126 or 127
        q = (yd * _pow2(-(e >> 1))) * _pow2(M - (e - (e >> 1)))
        fl = tl.floor(q)  # signed: lo <= y < hi, as in formats._round_grid
        up = r24.to(tl.float32) < (q - fl) * 16777216.0
        qr = fl + up.to(tl.float32)
        res = tl.abs((qr * _pow2(tl.full(e.shape, -M, tl.int32))) * _pow2(e))  # |qr 2**-M| <= 2: no overflow
    else:
        # nearest-even by adding and taking away c = 1.5 * 2**(e + 23 - M): the sum's ulp is the
        # grid's spacing 2**(e - M), so the fp32 addition rounds onto the grid (|y| < 2**(e + 1)
        # keeps the sum in c's binade). c is a normal fp32 number for every grid but bf16's
        # (e + 150 - M in [1, 254]), which rounds on its bits above
        c = (((e + (150 - M)) << 23) | 0x400000).to(tl.float32, bitcast=True)
        res = (yd + c) - c
    # copy the sign bit (a zero result keeps the sign of y; triton's negation is 0 - x)
    res = (res.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(y != y, y, res)


@triton.jit
def quotient(X, d):
    """X / d for d > 0 that broadcasts against X (one divisor per block, or per tile), at one
    division per divisor instead of one per element: the bits of ``div_rn`` (IEEE fp32 division, as
    ``replayssm.formats`` divides) wherever the quotient's magnitude is at least 2**-100; a smaller
    quotient comes out below 2**-99 with X's sign, which every encoder's grid rounds to the same
    signed zero. On the GPU: X and d scaled by the power of two that takes d to [1, 2) (exact, unless
    the scaled X is subnormal: a quotient below 2**-126), then Markstein's correction of the product
    with the correctly rounded reciprocal y: q0 = X y, r = X - d q0 (exact by FMA), q = q0 + r y,
    rounded once. The interpreter's FMA rounds twice, so there it divides."""
    if INTERPRETED:
        return tl.math.div_rn(X, d + tl.zeros(X.shape, tl.float32))
    e = tl.minimum(tl.maximum((d.to(tl.int32, bitcast=True) >> 23) & 0xFF, 1), 253)
    p = _pow2(127 - e)
    ds = d * p
    y = tl.math.div_rn(tl.full(ds.shape, 1.0, tl.float32), ds)
    xs = X * p
    q0 = xs * y
    q = tl.fma(tl.fma(-q0, ds, xs), y, q0)
    return tl.where(tl.abs(q0) < 7.888609052210118e-31, q0, q)  # 2**-100: below it r may not be exact


@triton.jit
def _e2m1_nearest_code(y):
    """The e2m1 code (sign bit 3, magnitude index bits 0-2) of finite fp32 y rounded to nearest-even
    onto the e2m1 grid and saturated at 6: ``grid_round(y, _, 1, 0, 6.0, False)``'s code, from the
    bits in about 10 integer and float operations instead of about 25. Where the grid's spacing is
    2**(k - 1) (k = 0 below 2, 1 in [2, 4), 2 from 4 on), |y| 2**(1 - k) rounded to an integer by
    adding 1.5 * 2**23 (exact product; the sum's ulp is 1, so its low bits are that integer) plus 2k
    is the index; from 8 on it saturates at 7."""
    mag = tl.abs(y)
    k = tl.minimum(tl.maximum(mag.to(tl.int32, bitcast=True) >> 23, 127), 129) - 127
    t = mag * ((128 - k) << 23).to(tl.float32, bitcast=True) + 12582912.0
    idx = tl.minimum(t.to(tl.int32, bitcast=True) - 0x4B400000 + 2 * k, 7)
    return idx | ((y.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def as_stored(x, dtype: tl.constexpr):
    """x cast to ``dtype`` (a replay buffer's: inputs stored as given), rounding to nearest-even as
    the GPU's cast does. The interpreter's cast to bf16 truncates instead: there x is first rounded
    on its fp32 bits (overflow to inf, NaN kept), so the cast is exact and the bits are the GPU's."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        near = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, near).to(dtype)
    return x.to(dtype)


@triton.jit
def _to_e4m3(y, r24, SR: tl.constexpr):
    """fp32 y as e4m3 (saturating at 448, NaN kept; SR: ``grid_round``'s stochastic rounding),
    ``replayssm.formats``' bits: rounded onto the grid first where the cast would not round so
    (stochastic rounding, the interpreter, ``INTERPRETED``)."""
    if SR or INTERPRETED:
        return grid_round(y, r24, 3, -6, 448.0, SR).to(tl.float8e4nv)
    return _clamp(y, 448.0).to(tl.float8e4nv)


@triton.constexpr_function
def row_block(DV):
    """Rows of a head's storage block, gcd(dv, 32) (``ReplayCache.row_block``): NVFP4 keeps one
    global scale per block."""
    return math.gcd(DV, 32)


@triton.jit
def global_scale_index(mat, r0, BV: tl.constexpr, DV: tl.constexpr):
    """The NVFP4 global-scale index of rows r0 .. r0 + BV of matrix ``mat`` (r0 a multiple of BV, BV
    a multiple of the row block): a scalar where the rows are one block, else one per row [BV, 1],
    so that a program may own several blocks (``load_read`` takes either)."""
    RB: tl.constexpr = row_block(DV)
    if BV == RB:  # both returns in branches of the constexpr if: the compiler keeps only one
        return mat * (DV // RB) + r0 // RB
    else:
        return (mat * DV + r0 + tl.arange(0, BV))[:, None] // RB


#: e2m1 pairs on the GPU: four bytes per 32-bit register; each pair of bytes spread to the two
#: 16-bit lanes of a register (``prmt``: a = bytes 0 and 1, b = bytes 2 and 3), then a nibble's
#: sign bit (to bit 15) and its exponent-mantissa bits (to bits 11..9) shifted and masked into place
#: in both lanes at once, so that each instruction makes two fp16 values. Outputs $0, $1: the low
#: nibbles of a and b; $2, $3: their high nibbles (4 bits further up, so shifted 4 less).
_E2M1_PAIRS_ASM = tl.constexpr(
    "{\n.reg .b32 a, b, t, u;\nprmt.b32 a, $4, 0, 0x4140;\nprmt.b32 b, $4, 0, 0x4342;\n"
    + "".join(f"shl.b32 t, {lanes}, {9 - up};\nand.b32 t, t, 0x0E000E00;\n"
              f"shl.b32 u, {lanes}, {12 - up};\nand.b32 u, u, 0x80008000;\nor.b32 ${out}, t, u;\n"
              for out, (lanes, up) in enumerate((("a", 0), ("b", 0), ("a", 4), ("b", 4))))
    + "}")


@triton.jit
def e2m1_pairs(byte):
    """The two e2m1 codes of each NVFP4 byte (uint8), low nibble first, as fp16: a code's fp16 bit
    pattern, sign moved to bit 15 and exponent and mantissa to bits 11..9, is its value times 2^-14.
    On the GPU four bytes at a time (``_E2M1_PAIRS_ASM``: about 2 instructions per value, where
    16-bit integer lanes took about 6); the interpreter, which runs no PTX, computes the same bits on
    int16 lanes."""
    if INTERPRETED:
        b = byte.to(tl.int16)
        lo = (((b & 8) << 12) | ((b & 7) << 9)).to(tl.float16, bitcast=True)
        hi = (((b & 128) << 8) | ((b & 112) << 5)).to(tl.float16, bitcast=True)
        return lo, hi
    return tl.inline_asm_elementwise(_E2M1_PAIRS_ASM, "=r,=r,=r,=r,r", [byte.to(tl.uint8, bitcast=True)],
                                     dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def load_tile(v_ptr, s_ptr, g_ptr, mat, gidx, rv, ck, DV: tl.constexpr, DK: tl.constexpr, FMT: tl.constexpr):
    """Rows ``rv`` [BV] x columns ``ck`` [BK] of matrix ``mat`` decoded to fp32: all DK columns
    (a tile of DKP), or BK contiguous ones starting at a multiple of 32 (``gidx``: the NVFP4
    global-scale index of this row block); columns from DK on are zero."""
    row = mat * DV + rv[:, None]
    W: tl.constexpr = stored_width(DK, FMT)
    ok = within(ck, DK)[None, :]
    if FMT <= 2:
        return tl.load(v_ptr + row * DK + ck[None, :], mask=ok, other=0.0).to(tl.float32)
    elif FMT == 3:
        vals = tl.load(v_ptr + row * W + ck[None, :], mask=ok, other=0.0).to(tl.float32)
        return vals * tl.load(s_ptr + row * (W // 32) + ck[None, :] // 32, mask=ok, other=0.0)
    else:
        BK: tl.constexpr = ck.shape[0]
        half = tl.min(ck, 0) // 2 + tl.arange(0, BK // 2)
        byte = tl.load(v_ptr + row * (W // 2) + half[None, :], mask=within(half, (DK + 1) // 2)[None, :],
                       other=0)
        lo, hi = e2m1_pairs(byte)
        lo, hi = lo.to(tl.float32), hi.to(tl.float32)
        # fp16 bit patterns of e2m1 codes are the values times 2**-14
        vals = tl.reshape(tl.join(lo, hi), (rv.shape[0], BK)) * 16384.0
        scale = tl.load(s_ptr + row * (W // 16) + ck[None, :] // 16, mask=ok, other=0.0).to(tl.float32)
        return (vals * scale) * tl.load(g_ptr + gidx)


@triton.jit
def pin_vector_width(ptr, mat, rv, ck, never, DV: tl.constexpr, DK: tl.constexpr, PER_THREAD: tl.constexpr = 16):
    """A store of zeros shaped like the state tile [BV, BK] that never happens (``never`` is false
    at run time but unknown to the compiler), 16 bytes per PER_THREAD elements (16: int8, 8:
    int16, 4: int32). Triton vectorizes a load as widely as the widest access of the same shape in
    its data-flow slice, so a state tile's load, and the layout of what is computed from it,
    otherwise follow the widest format in the kernel (fp32: 4 elements per thread, fp16: 8, fp8:
    16) and row reductions sum in a format-dependent order. With this store in the slice the tile
    loads at least PER_THREAD elements per thread."""
    at = (mat * DV + rv[:, None]) * DK + ck[None, :]
    if PER_THREAD == 16:
        tl.store(ptr.to(tl.pointer_type(tl.int8)) + at, tl.zeros(at.shape, tl.int8), mask=never)
    elif PER_THREAD == 8:
        tl.store(ptr.to(tl.pointer_type(tl.int16)) + at, tl.zeros(at.shape, tl.int16), mask=never)
    else:
        tl.store(ptr.to(tl.pointer_type(tl.int32)) + at, tl.zeros(at.shape, tl.int32), mask=never)


@triton.jit
def store_tile(S, v_ptr, s_ptr, g_ptr, mat, gidx, head, rv, ck, seed, stream,
               DV: tl.constexpr, DK: tl.constexpr, FMT: tl.constexpr, SR: tl.constexpr):
    """Encode fp32 tile S [BV, BK] (rows rv, columns ck of matrix ``mat``) into format FMT and
    store it: all DK columns (a tile of DKP), or BK contiguous ones from a multiple of 32 (one fp8
    scale block each), except NVFP4, whose tile is one whole global-scale row block, stored at
    ``gidx``. Columns from DK on encode as zeros (the padding of fp8 and NVFP4 rows) and are not
    stored past the row's stored width. Stochastic rounding is keyed by (seed, stream, logical
    element index)."""
    BV: tl.constexpr = S.shape[0]
    BK: tl.constexpr = S.shape[1]
    W: tl.constexpr = stored_width(DK, FMT)
    row = mat * DV + rv[:, None]
    S = tl.where(within(ck, DK)[None, :], S, 0.0)  # exact zeros, as replayssm.formats pads
    r24 = tl.zeros((BV, BK), dtype=tl.int32)
    if SR:  # keyed by the logical element index (head, row, column), not the storage row
        base = head.to(tl.int64) * (DV * DK)
        offset = rv[:, None].to(tl.uint32) * DK + ck[None, :].to(tl.uint32)
        r24 = (random_u32(seed, stream, base, offset, DV * DK) >> 8).to(tl.int32)
    if FMT == 0:
        tl.store(v_ptr + row * DK + ck[None, :], S, mask=within(ck, DK)[None, :])
    elif FMT <= 2:
        if FMT == 1:
            MAXV: tl.constexpr = 65504.0
            M: tl.constexpr = 10
            EMIN: tl.constexpr = -14
        else:
            MAXV: tl.constexpr = 3.3895313892515355e38
            M: tl.constexpr = 7
            EMIN: tl.constexpr = -126
        if FMT == 1 and not SR:  # the cast rounds to nearest-even, here and in the interpreter (numpy)
            y = _clamp(S, MAXV)
        else:  # rounded here, so the cast below is exact (the interpreter's bf16 cast truncates)
            y = grid_round(S, r24, M, EMIN, MAXV, SR)
        y = tl.where(tl.abs(S) < float("inf"), y, S)  # NaN and inf pass through
        v = y.to(v_ptr.dtype.element_ty)
        tl.store(v_ptr + row * DK + ck[None, :], v, mask=within(ck, DK)[None, :])
    elif FMT == 3:
        NB: tl.constexpr = BK // 32
        X = tl.reshape(S, (BV, NB, 32))
        amax = tl.reduce(tl.abs(X), 2, _max_nan)  # NaN or inf when the block has one: its scale is then NaN
        bad = (amax < float("inf")) == 0
        scale = quotient(amax, tl.full((), 448.0, tl.float32))
        scale = tl.where(scale > 0, scale, 1.0)
        scale = tl.where(bad, float("nan"), scale)
        y = tl.where(bad[:, :, None], 0.0, quotient(X, tl.where(bad, 1.0, scale)[:, :, None]))
        y = tl.reshape(y, (BV, BK))
        v = _to_e4m3(y, r24, SR)
        tl.store(v_ptr + row * W + ck[None, :], v, mask=within(ck, W)[None, :])
        sb = tl.min(ck, 0) // 32 + tl.arange(0, NB)
        tl.store(s_ptr + row * (W // 32) + sb[None, :], scale, mask=within(sb, W // 32)[None, :])
    else:
        NB: tl.constexpr = BK // 16
        fin = tl.abs(S) < float("inf")
        gs = tl.max(tl.max(tl.where(fin, tl.abs(S), 0.0), axis=1), axis=0)
        gs = tl.math.div_rn(gs, 2688.0)
        gs = tl.where(gs > 0, gs, 1.0)
        X = tl.reshape(S, (BV, NB, 16))
        bamax = tl.reduce(tl.abs(X), 2, _max_nan)  # as for fp8
        bad = (bamax < float("inf")) == 0
        t = quotient(quotient(bamax, tl.full((), 6.0, tl.float32)), gs)
        s = _to_e4m3(t, t.to(tl.int64), False).to(tl.float32)  # RNE onto the e4m3 grid
        s = tl.where(bad, float("nan"), s)
        denom = s * gs
        ok = denom > 0
        y = tl.where(ok[:, :, None], quotient(X, tl.where(ok, denom, 1.0)[:, :, None]), 0.0)
        y = tl.reshape(y, (BV, BK))
        if SR:
            q = grid_round(y, r24, 1, 0, 6.0, SR)
            mag = tl.abs(q)
            idx = tl.where(mag <= 2.0, mag * 2.0, tl.where(mag < 6.0, mag + 2.0, 7.0)).to(tl.int32)
            code = idx | ((q.to(tl.int32, bitcast=True) >> 28) & 8)
        else:
            code = _e2m1_nearest_code(y)
        even, odd = tl.split(tl.reshape(code, (BV, BK // 2, 2)))
        half = tl.arange(0, BK // 2)
        tl.store(v_ptr + row * (W // 2) + half[None, :], (even | (odd << 4)).to(tl.uint8),
                 mask=within(half, W // 2)[None, :])
        sb = tl.arange(0, NB)
        tl.store(s_ptr + row * (W // 16) + sb[None, :], s.to(tl.float8e4nv), mask=within(sb, W // 16)[None, :])
        tl.store(g_ptr + gidx, gs)


@triton.jit
def load_read(v_ptr, s_ptr, g_ptr, mat, gidx, rv, DV: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
              FMT: tl.constexpr):
    """Rows ``rv`` of a read copy in the format's own layout, for ``matvec``: (values_a,
    values_b, scale). fp32/16/bf16: ([BV, DKP], same, 1). fp8: ([BV, DKP/32, 32], same, block
    scales [BV, DKP/32]). NVFP4: (even elements [BV, DKP/16, 8], odd elements, block scale x
    global scale [BV, DKP/16]; ``gidx`` from ``global_scale_index``). Nothing is expanded to [BV,
    DKP] with per-element scale loads.
    Columns past the stored row are zero (fp8 and NVFP4 read whole stored blocks, whose padding
    holds zeros)."""
    row = mat * DV + rv
    W: tl.constexpr = stored_width(DK, FMT)
    if FMT <= 2:
        ck = tl.arange(0, DKP)
        v = tl.load(v_ptr + row[:, None] * DK + ck[None, :], mask=within(ck, DK)[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        return v, v, 1.0
    elif FMT == 3:
        NB: tl.constexpr = DKP // 32
        nb = tl.arange(0, NB)
        e = tl.arange(0, 32)
        ok = within(nb, W // 32)[None, :]
        v = tl.load(v_ptr + row[:, None, None] * W + nb[None, :, None] * 32 + e[None, None, :], mask=ok[:, :, None],
                    other=0.0).to(tl.float32)
        sc = tl.load(s_ptr + row[:, None] * (W // 32) + nb[None, :], mask=ok, other=0.0)
        return v, v, sc
    else:
        NB: tl.constexpr = DKP // 16
        nb = tl.arange(0, NB)
        e = tl.arange(0, 8)
        ok = within(nb, W // 16)[None, :]
        byte = tl.load(v_ptr + row[:, None, None] * (W // 2) + nb[None, :, None] * 8 + e[None, None, :],
                       mask=ok[:, :, None], other=0)
        # the fp16 bit pattern of an e2m1 code is its value times 2**-14 (folded into the scale)
        lo, hi = e2m1_pairs(byte)
        lo, hi = lo.to(tl.float32), hi.to(tl.float32)
        sc = tl.load(s_ptr + row[:, None] * (W // 16) + nb[None, :], mask=ok, other=0.0).to(tl.float32) * (
            tl.load(g_ptr + gidx) * 16384.0)
        return lo, hi, sc


@triton.jit
def load_query(ptr, se, DK: tl.constexpr, DKP: tl.constexpr, FMT: tl.constexpr):
    """A query vector of DK elements at ``ptr`` (element stride ``se``) as fp32, zero-padded to
    DKP, in the layout ``matvec`` pairs with ``load_read``'s values (``as_query``; fp8's loaded in
    its [DKP/32, 32] blocks: a reshape after the load took more registers)."""
    FULL: tl.constexpr = DKP == DK
    if FMT == 3:
        nb, e = tl.arange(0, DKP // 32)[:, None], tl.arange(0, 32)[None, :]
        q = tl.load(ptr + (nb * 32 + e) * se, mask=below(nb * 32 + e, DK, FULL), other=0.0).to(tl.float32)
        return q, q
    off = tl.arange(0, DKP)
    return as_query(tl.load(ptr + off * se, mask=below(off, DK, FULL), other=0.0).to(tl.float32), FMT)


@triton.jit
def as_query(q, FMT: tl.constexpr):
    """A query vector q [DKP] fp32 in the layout ``matvec`` pairs with ``load_read``'s values:
    (q, q) [DKP]; [DKP/32, 32]; or NVFP4's (even, odd) elements [DKP/16, 8]."""
    DKP: tl.constexpr = q.shape[0]
    if FMT <= 2:
        return q, q
    elif FMT == 3:
        q = tl.reshape(q, (DKP // 32, 32))
        return q, q
    else:
        return tl.split(tl.reshape(q, (DKP // 16, 8, 2)))


@triton.jit
def matvec(va, vb, sc, qa, qb, FMT: tl.constexpr):
    """S_read q [BV] from ``load_read`` values and a ``load_query`` vector: block partial sums
    first, then one scale multiply per block."""
    if FMT <= 2:
        return tl.sum(va * qa[None, :], 1)
    elif FMT == 3:
        return tl.sum(tl.sum(va * qa[None, :, :], 2) * sc, 1)
    else:
        return tl.sum((tl.sum(va * qa[None, :, :], 2) + tl.sum(vb * qb[None, :, :], 2)) * sc, 1)


@triton.jit
def _tf32_high(x):
    """fp32 x rounded to tf32 (10 mantissa bits) to nearest, ties away from zero, as ``cvt.rna.tf32``
    rounds the large part of 3-pass tf32 (infinities and NaN stay what they are)."""
    return ((x.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def exact_b_products(A, B, acc):
    """A B + acc [M, N] fp32 on tensor cores, fp32-accurate, for A [M, K] fp32 and B [K, N] in the
    dtype it is stored in. A 16-bit B (inputs kept as given) is a tf32 value exactly: A is split
    into its tf32 part and the rest, and each multiplies B in one single-pass product, the small one
    first — 3-pass tf32 without its third pass, over B's low part, which is zero (two tensor-core
    passes instead of three, and no split of B). An fp32 B takes 3-pass tf32."""
    if B.dtype == tl.float32:
        return tl.dot(A, B, acc, input_precision="tf32x3")
    B = B.to(tl.float32)
    high = _tf32_high(A)
    P = tl.dot(A - high, B, input_precision="tf32")
    P = tl.where(P != P, 0.0, P)  # as 3-pass tf32: a NaN of the small parts (inf - inf) is not the result's
    return tl.dot(high, B, P, input_precision="tf32") + acc


@triton.jit
def _power_of_two_scale(Q):
    """(up, down) [R] for the rows of Q [R, C] fp32: powers of two, ``up`` taking a row's largest
    magnitude into [2^14, 2^15) (fp16's top binades end at 65504), ``down`` = 1 / up exactly (both
    built from exponent bits, no division)."""
    E = (tl.max(tl.abs(Q), 1).to(tl.int32, bitcast=True) >> 23) & 255
    c = tl.minimum(tl.maximum(268 - E, 1), 253)
    return (c << 23).to(tl.float32, bitcast=True), ((254 - c) << 23).to(tl.float32, bitcast=True)


@triton.jit
def exact_operand_products(S, Q, FMT: tl.constexpr):
    """S Q^T [BV, QP] fp32 on tensor cores, for a read-copy chunk S [BV, KB] in its stored dtype
    (fp16, bf16 or fp8 e4m3 values, block scales not applied) and query rows Q [QP, KB] fp32, with
    operands the tensor cores take exactly: S as it is stored (e4m3 values are fp16 values), Q split
    into pieces of S's 16-bit type, one single-pass product per piece, accumulated in fp32.
    bf16: Q = q1 + q2 + q3 exactly (8 + 8 + 8 bits). fp16 and e4m3: each row of Q scaled by a power
    of two into fp16's range (``_power_of_two_scale``, undone on the products), Q = q1 + q2 to 22
    bits. Against 3-pass tf32 on the fp32-decoded tile: a third (fp16, fp8) or half (bf16) of the
    tensor-core instructions, half the operand bytes, and no split of the tile."""
    if FMT == 2:
        q1 = Q.to(tl.bfloat16)
        rest = Q - q1.to(tl.float32)  # exact
        q2 = rest.to(tl.bfloat16)
        q3 = (rest - q2.to(tl.float32)).to(tl.bfloat16)  # exact: 8 bits are left
        if INTERPRETED:  # the interpreter's products do not take bf16; fp32 holds these values exactly
            S, q1, q2, q3 = S.to(tl.float32), q1.to(tl.float32), q2.to(tl.float32), q3.to(tl.float32)
        P = tl.dot(S, tl.trans(q3))  # smallest pieces first
        P = tl.dot(S, tl.trans(q2), P)
        return tl.dot(S, tl.trans(q1), P)
    else:
        up, down = _power_of_two_scale(Q)
        Qs = Q * up[:, None]
        q1 = Qs.to(tl.float16)
        q2 = (Qs - q1.to(tl.float32)).to(tl.float16)
        S16 = S.to(tl.float16)
        P = tl.dot(S16, tl.trans(q2))
        P = tl.dot(S16, tl.trans(q1), P)
        return P * down[None, :]


@triton.jit
def _nvfp4_chunk(v_ptr, s_ptr, row, k0, W: tl.constexpr, KB: tl.constexpr):
    """Columns k0 .. k0 + KB of NVFP4 rows ``row`` [BV] as fp16 [BV, KB]: each e2m1 value times its
    e4m3 block scale, exactly (a value has at most 2 significant bits and a scale 4, and their
    products lie in [2^-10, 2688], fp16's normal range), without the global scale. A code's fp16
    bit pattern is its value times 2^-14; the power of two is undone in fp16, exactly."""
    BV: tl.constexpr = row.shape[0]
    half = k0 // 2 + tl.arange(0, KB // 2)
    byte = tl.load(v_ptr + row[:, None] * (W // 2) + half[None, :], mask=within(half, W // 2)[None, :], other=0)
    lo, hi = e2m1_pairs(byte)
    vals = tl.reshape(tl.join(lo, hi), (BV, KB // 16, 16)) * tl.full((), 16384.0, tl.float16)
    sb = k0 // 16 + tl.arange(0, KB // 16)
    scale = tl.load(s_ptr + row[:, None] * (W // 16) + sb[None, :], mask=within(sb, W // 16)[None, :], other=0.0)
    return tl.reshape(vals * scale.to(tl.float16)[:, :, None], (BV, KB))


@triton.jit
def streamed_products(v_ptr, s_ptr, g_ptr, mat, gidx, rv, a_ptr, b_ptr, pid_b, hidx, sqb, sqt, sqh, sqe,
                      T: tl.constexpr, ROWS: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr, FMT: tl.constexpr,
                      QP: tl.constexpr, KB: tl.constexpr, STAGES: tl.constexpr):
    """S_read Q^T [BV, QP] on tensor cores, instead of QP row reductions across threads (``column``
    takes one query's column out), without the read copy's tile in registers: accumulated over KB
    columns at a time, in a loop that Triton software-pipelines (STAGES
    chunks in flight through shared memory), so a program holds one [BV, KB] chunk instead of
    [BV, DK]. Query row r < T is token r of ``a_ptr``, T <= r < ROWS (ROWS = T or 2T) token
    r - T of ``b_ptr`` (both [b, T, heads, DK] of strides sq*, any float dtype, head ``hidx``), other
    rows zero. fp32 read
    copies: 3-pass tf32 (fp32-accurate); fp16, bf16 and fp8 (KB = 32: one block scale per row and
    chunk, applied to the chunk's products): ``exact_operand_products``. NVFP4: each chunk decoded
    to fp16 with its e4m3 block scales applied there, exactly (``_nvfp4_chunk``), products as for
    fp16, the global scale (``gidx``: ``global_scale_index``) applied once at the end. The last
    chunk is zero from column DK on."""
    row = mat * DV + rv
    W: tl.constexpr = stored_width(DK, FMT)
    r = tl.arange(0, QP)[:, None]
    at = pid_b * sqb + (r % T) * sqt + hidx * sqh
    acc = tl.zeros((rv.shape[0], QP), dtype=tl.float32)
    for k0 in tl.range(0, DK, KB, num_stages=STAGES):
        cols = k0 + tl.arange(0, KB)
        ok = within(cols, DK)[None, :]
        S = 0.0
        if FMT != 4:
            S = tl.load(v_ptr + row[:, None] * W + cols[None, :], mask=ok, other=0.0, eviction_policy="evict_first")
        Q = tl.load(a_ptr + at + cols[None, :] * sqe, mask=(r < T) & ok, other=0.0).to(tl.float32)
        if ROWS > T:
            Q = tl.where(r < T, Q, tl.load(b_ptr + at + cols[None, :] * sqe, mask=(r >= T) & (r < ROWS) & ok,
                                           other=0.0).to(tl.float32))
        if FMT == 0:
            acc = tl.dot(S.to(tl.float32), tl.trans(Q), acc, input_precision="tf32x3")
        elif FMT == 3:
            acc += exact_operand_products(S, Q, FMT) * tl.load(s_ptr + row * (W // 32) + k0 // 32)[:, None]
        elif FMT == 4:
            acc += exact_operand_products(_nvfp4_chunk(v_ptr, s_ptr, row, k0, W, KB), Q, 1)
        else:
            acc += exact_operand_products(S, Q, FMT)
    if FMT == 4:
        acc = acc * tl.load(g_ptr + gidx)
    return acc


@triton.jit
def column(Y, c):
    """Column ``c`` of Y [BV, QP] as [BV]."""
    return tl.sum(tl.where(tl.arange(0, Y.shape[1])[None, :] == c, Y, 0.0), 1)


@triton.jit
def write_checkpoint(S, av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, mat, gidx, head, rv, ck,
                     seed, tokens, DV: tl.constexpr, DK: tl.constexpr, A_FMT: tl.constexpr,
                     A_SR: tl.constexpr, R_FMT: tl.constexpr, R_SR: tl.constexpr, SHARED: tl.constexpr):
    """Cast the unrounded fp32 rows S independently into the anchor and (unless shared) the read
    copy, with separate stochastic-rounding streams (2 * tokens and 2 * tokens + 1, as
    ``ReplayCache.write_checkpoint``). A program that goes on to read the read copy loads it
    back after a barrier (``load_read``): products over registers in the encoder's layout could
    reduce in another order than the step kernel's, so outputs would depend on where the refresh ran."""
    store_tile(S, av_ptr, as_ptr, ag_ptr, mat, gidx, head, rv, ck, seed, tokens * 2, DV, DK, A_FMT, A_SR)
    if not SHARED:
        store_tile(S, rv_ptr, rs_ptr, rg_ptr, mat, gidx, head, rv, ck, seed, tokens * 2 + 1, DV, DK, R_FMT, R_SR)


@triton.jit
def read_copy_from_anchor(av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, mat, gidx, head, rv, seed, tokens,
                          DV: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, A_FMT: tl.constexpr,
                          R_FMT: tl.constexpr, R_SR: tl.constexpr):
    """Encode the read copy of rows ``rv`` from the fp32 anchor rows this program has just stored
    (the unrounded state, bit for bit), whole rows at once (``launch.read_copy_after_fold``); its
    stochastic-rounding stream as in ``write_checkpoint``."""
    tl.debug_barrier()  # the anchor rows were stored by other threads of the program
    ck = tl.arange(0, DKP)
    store_tile(load_tile(av_ptr, as_ptr, ag_ptr, mat, gidx, rv, ck, DV, DK, A_FMT), rv_ptr, rs_ptr, rg_ptr, mat, gidx,
               head, rv, ck, seed, tokens * 2 + 1, DV, DK, R_FMT, R_SR)
