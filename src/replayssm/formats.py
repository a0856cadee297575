"""Low-precision storage formats for recurrent-state checkpoints.

A state tensor has logical shape ``[..., R, C]`` (e.g. ``[slots, heads, dv, dk]``)
and logical dtype float32.  A :class:`Format` encodes it into a dict of physical
storage tensors ("parts") and decodes the parts back to float32.  All scaling
blocks run along the LAST axis (``C``); ``C`` is zero-padded up to a multiple of
the block size (``Cp``) and :meth:`Format.decode` slices the padding off again,
which is why it takes ``cols``.

Formats
-------
=============  ==============================================================
``fp32``       ``values`` float32 ``[..., R, C]`` (identity)
``fp16``       ``values`` float16 ``[..., R, C]``
``bf16``       ``values`` bfloat16 ``[..., R, C]``
``fp8_e4m3``   ``values`` float8_e4m3fn ``[..., R, Cp]``, ``scales`` float32
               ``[..., R, Cp/32]``; ``Cp = ceil(C/32)*32``.
               ``scale = amax(|block|) / 448`` (fp32 division); decoded value
               ``= float(value) * scale`` (fp32).
``nvfp4``      ``values`` uint8 ``[..., R, Cp/2]`` (two e2m1 codes per byte,
               element ``2i`` in the low nibble, ``2i+1`` in the high nibble),
               ``scales`` float8_e4m3fn ``[..., R, Cp/16]``, ``global_scale``
               float32 ``[...]`` (one per ``[R, C]`` matrix); ``Cp =
               ceil(C/16)*16``.
               ``global_scale = amax_finite(|matrix|) / (6*448)`` (fp32);
               ``scale = RNE_e4m3(min((amax(|block|) / 6) / global_scale, 448))``
               (fp32 ops, left to right); decoded value
               ``= (e2m1(code) * float(scale)) * global_scale`` (fp32; the
               first product is exact).
=============  ==============================================================

e2m1 codes: bit 3 is the sign, bits 0-2 index the magnitudes
``0, 0.5, 1, 1.5, 2, 3, 4, 6``.

Scaled domain
-------------
Element rounding happens on the value ``y`` in the target element grid:

* fp16 / bf16: ``y = x``.
* fp8_e4m3:    ``y = x / scale`` (IEEE fp32 division, correctly rounded).
* nvfp4:       ``y = x / (float(scale) * global_scale)`` (fp32 multiply then fp32
  division, each correctly rounded).

Scales are never stochastically rounded (fp8 scales are exact fp32 quotients,
nvfp4 block scales are RNE casts to e4m3).

Rounding of ``y``
-----------------
Every target grid is a sign-symmetric binary float grid with ``m`` mantissa bits,
minimum normal exponent ``emin`` and largest finite value ``maxval``:

==========  ===  =====  ==========================
format      m    emin   maxval
==========  ===  =====  ==========================
fp16        10   -14    65504
bf16        7    -126   (2 - 2**-7) * 2**127
e4m3        3    -6     448
e2m1        1    0      6
==========  ===  =====  ==========================

1. Saturation: ``y`` is clamped to ``[-maxval, maxval]`` (finite overflow
   saturates, never produces inf).
2. The grid spacing at ``y`` is ``ulp = 2**(max(floor(log2|y|), emin) - m)``
   (constant ``2**(emin - m)`` in the subnormal range; ``y = 0`` uses ``emin``).
   All of this is evaluated in float64, where it is exact for fp32 ``y``.
3. ``"nearest"``: round-to-nearest, ties to even (even mantissa / even e2m1
   code).  fp16/bf16/e4m3 use torch's casts (which are RNE for in-range
   values); e2m1 computes ``round_half_even(y / ulp) * ulp``.
4. ``"stochastic"``: with ``lo = floor(y / ulp) * ulp``, ``hi = lo + ulp`` (so
   ``lo <= y < hi`` in the signed sense), ``frac = (y - lo) / ulp`` (exact in
   float64) and ``r = (random_bits >> 8) & 0xFFFFFF`` (24 uniform bits), the
   result is ``hi`` iff ``r < frac * 2**24`` and ``lo`` otherwise.  Grid values
   (``frac == 0``) never move, ``P(hi) = ceil(frac * 2**24) / 2**24`` so
   ``E[round(y)] = y`` up to ``2**-24 * ulp``.  A zero result keeps the sign of
   ``y`` (``-0.0`` for negative ``y``).  ``random_bits`` are indexed like the
   *logical* tensor ``x`` (padding elements are zero and need no bits).

Non-finite values
-----------------
* fp32: identity (NaN, ±Inf kept).
* fp16 / bf16: NaN stays NaN, ±Inf stays ±Inf (only *finite* overflow
  saturates).
* fp8_e4m3: a block containing NaN or ±Inf stores a NaN scale and zero values,
  so the whole 32-element block decodes to NaN (an infinite scale would be
  meaningless).
* nvfp4: e2m1 has no NaN/Inf; a 16-element block containing NaN or ±Inf stores
  a NaN e4m3 block scale (0x7F) and zero codes, so that block decodes to NaN.
  The global scale ignores non-finite values, so other blocks are unaffected.

Degenerate scales (no division by zero)
---------------------------------------
* fp8_e4m3: if ``amax / 448`` is 0 (all-zero block, or amax so tiny the
  quotient underflows) the scale is stored as 1.0; such a block encodes to
  zeros (tiny values flush to 0).
* nvfp4: a global amax of 0 (or an all-non-finite matrix) gives
  ``global_scale = 1.0``.  A block scale that RNE-rounds to 0 (block amax below
  the format's dynamic range relative to the matrix amax) stores scale 0 and
  zero codes: the block decodes to (signed) zeros.

Random bits
-----------
:func:`random_bits` is a stateless counter-based hash; see its docstring for
the exact bit-level definition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Format", "FORMATS", "get_format", "random_bits"]

_M32 = 0xFFFFFFFF
_ROUNDINGS = ("nearest", "stochastic")

# --------------------------------------------------------------------------
# Counter-based random bits
# --------------------------------------------------------------------------


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` and a uint32 constant.

    The constant is split into 16-bit halves so no intermediate exceeds 2**49:
    this avoids relying on signed int64 overflow wrapping.
    """
    c_lo, c_hi = c & 0xFFFF, c >> 16
    return (x * c_lo + (((x * c_hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The "lowbias32" integer finalizer (a bijection of uint32), on int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


def random_bits(seed, stream, offset) -> torch.Tensor:
    """Stateless uniform 32-bit random values from ``(seed, stream, offset)``.

    Args:
        seed, stream, offset: Python ints or integer tensors (converted to
            int64), broadcast together.  Typically ``seed`` is a run-level
            seed, ``stream`` identifies the tensor / step, and ``offset`` is the
            logical element index, so results do not depend on where or how a
            tensor is stored.

    Returns:
        int64 tensor of the broadcast shape, values in ``[0, 2**32)``.

    Exact definition (all arithmetic on uint32, i.e. mod 2**32; ``lo32(v) =
    v & 0xFFFFFFFF`` and ``hi32(v) = (v >> 32) & 0xFFFFFFFF`` of the int64
    two's-complement value)::

        mix(x):                       # "lowbias32"
            x ^= x >> 16
            x *= 0x7FEB352D
            x ^= x >> 15
            x *= 0x846CA68B
            x ^= x >> 16
            return x

        h = mix(hi32(seed) ^ 0x9E3779B9)
        h = mix(h ^ lo32(seed))
        h = mix(h ^ hi32(stream))
        h = mix(h ^ lo32(stream))
        h = mix(h ^ hi32(offset))
        h = mix(h ^ lo32(offset))
        return h

    Because ``mix`` is a bijection, for fixed ``seed``, ``stream`` and
    ``hi32(offset)`` the map ``lo32(offset) -> h`` is a permutation of uint32
    (distinct offsets never collide within a 2**32 window).
    """
    device = next((v.device for v in (seed, stream, offset) if isinstance(v, torch.Tensor)), None)
    args = []
    for name, v in (("seed", seed), ("stream", stream), ("offset", offset)):
        if isinstance(v, torch.Tensor) and (v.dtype.is_floating_point or v.dtype.is_complex):
            raise TypeError(f"random_bits: {name} must be an integer tensor, got {v.dtype}")
        args.append(torch.as_tensor(v, dtype=torch.int64, device=device))
    seed_t, stream_t, offset_t = torch.broadcast_tensors(*args)

    def lo32(v):
        return v & _M32

    def hi32(v):
        return (v >> 32) & _M32  # arithmetic shift, masked: two's-complement high word

    h = _mix32(hi32(seed_t) ^ 0x9E3779B9)
    h = _mix32(h ^ lo32(seed_t))
    h = _mix32(h ^ hi32(stream_t))
    h = _mix32(h ^ lo32(stream_t))
    h = _mix32(h ^ hi32(offset_t))
    h = _mix32(h ^ lo32(offset_t))
    return h


# --------------------------------------------------------------------------
# Grid rounding helpers
# --------------------------------------------------------------------------


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact float64 ``2**e`` for int64 ``e`` in the normal float64 range (bit construction)."""
    return ((e + 1023) << 52).view(torch.float64)


def _round_grid(
    y: torch.Tensor, mant_bits: int, emin: int, maxval: float, r24: torch.Tensor | None
) -> torch.Tensor:
    """Round ``y`` onto a binary float grid (see module docstring), exactly, in float64.

    Args:
        y: float32 tensor (any shape); NaN propagates, ±Inf saturates.
        mant_bits, emin, maxval: grid parameters.
        r24: ``None`` for round-to-nearest-even, else int64 tensor (shape of
            ``y``) of 24-bit uniform integers for stochastic rounding.

    Returns:
        float64 tensor of grid values, same shape as ``y``.
    """
    yd = y.to(torch.float64).clamp(-maxval, maxval)
    _, e = torch.frexp(yd)  # |yd| = m * 2**e with m in [0.5, 1)
    e = (e.to(torch.int64) - 1).clamp_min(emin)
    ulp = _pow2(e - mant_bits)
    q = yd / ulp  # exact: division by a power of two
    if r24 is None:
        res = torch.round(q) * ulp  # torch.round is round-half-to-even
    else:
        fl = torch.floor(q)
        frac = q - fl  # exact, in [0, 1)
        up = r24.to(torch.float64) < frac * 2.0**24
        res = (fl + up.to(torch.float64)) * ulp
    return torch.copysign(res, yd)


def _as_f32(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"encode expects a floating-point tensor, got {type(x).__name__}"
                        f"{'' if not isinstance(x, torch.Tensor) else ' of dtype ' + str(x.dtype)}")
    if x.dim() < 2:
        raise ValueError(f"encode expects shape [..., rows, cols], got {tuple(x.shape)}")
    return x.to(torch.float32)  # fp16/bf16 inputs upcast exactly


def _r24(rounding: str, bits: torch.Tensor | None, shape: torch.Size, device) -> torch.Tensor | None:
    """Validate rounding arguments; return 24-bit ints broadcast to ``shape`` (stochastic) or None."""
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be one of {_ROUNDINGS}, got {rounding!r}")
    if rounding == "nearest":
        return None  # random_bits, if given, is ignored
    if bits is None:
        raise ValueError('rounding="stochastic" requires random_bits')
    if bits.dtype != torch.int64:
        raise TypeError(f"random_bits must be int64 (uint32 values), got {bits.dtype}")
    return torch.broadcast_to((bits.to(device) >> 8) & 0xFFFFFF, shape)


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad_last(t: torch.Tensor, cp: int) -> torch.Tensor:
    """Zero-pad the last axis of ``t`` to length ``cp``."""
    c = t.shape[-1]
    return t if c == cp else torch.nn.functional.pad(t, (0, cp - c))


def _int_fill(fill, dtype: torch.dtype) -> int:
    """``int(fill)`` if it is an integer representable in ``dtype``, else 0."""
    f, info = float(fill), torch.iinfo(dtype)
    return int(f) if math.isfinite(f) and f == int(f) and info.min <= f <= info.max else 0


def _check_shape(shape) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(f"state shape must be [..., rows, cols], got {shape}")
    return shape


# --------------------------------------------------------------------------
# Formats
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Format:
    """A physical storage format for fp32 state tensors of shape ``[..., R, C]``."""

    name: str

    def parts_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Physical part shapes/dtypes for a logical fp32 tensor of ``shape`` ``[..., R, C]``."""
        raise NotImplementedError

    def allocate(self, shape, device, fill=None) -> dict[str, torch.Tensor]:
        """Allocate (``torch.empty``) the parts for a logical tensor of ``shape``.

        ``fill`` (optional number) is written with ``.fill_`` into every
        floating part (float8 NaN for non-representable values such as inf, per
        torch's cast).  Integer parts (nvfp4 ``values``) receive ``int(fill)``
        when ``fill`` is an integer within the dtype's range, else 0; with
        ``fill=nan`` nvfp4 still decodes to all-NaN through its NaN scales.
        """
        parts = {}
        for key, (shp, dtype) in self.parts_shapes(shape).items():
            t = torch.empty(shp, dtype=dtype, device=device)
            if fill is not None:
                if dtype.is_floating_point:
                    t.fill_(fill)
                else:
                    t.fill_(_int_fill(fill, dtype))
            parts[key] = t
        return parts

    def encode(
        self, x: torch.Tensor, rounding: str = "nearest", random_bits: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Encode ``x`` (float32 ``[..., R, C]``) into parts.

        ``rounding`` is ``"nearest"`` (RNE) or ``"stochastic"``; the latter needs
        ``random_bits``: int64 tensor broadcastable to ``x`` with values in
        ``[0, 2**32)`` (see :func:`random_bits`).  ``random_bits`` is ignored for
        ``"nearest"``.  Other floating dtypes of ``x`` are upcast to fp32.
        """
        raise NotImplementedError

    def decode(self, parts: dict[str, torch.Tensor], cols: int) -> torch.Tensor:
        """Decode parts back to float32 ``[..., R, cols]``."""
        raise NotImplementedError

    def bytes_per_element(self, cols: int, rows: int | None = None) -> float:
        """Physical bytes per logical element, including padding and scales.

        Per-matrix scalars (nvfp4 ``global_scale``) are only included when
        ``rows`` is given (amortised over ``rows * cols``).
        """
        raise NotImplementedError


@dataclass(frozen=True)
class _FloatFormat(Format):
    """Element-wise cast to an IEEE-like dtype (fp32 / fp16 / bf16); ``values`` only."""

    dtype: torch.dtype = torch.float32
    mant_bits: int = 23
    emin: int = -126
    maxval: float = 3.4028234663852886e38

    def parts_shapes(self, shape):
        shape = _check_shape(shape)
        return {"values": (shape, self.dtype)}

    def encode(self, x, rounding="nearest", random_bits=None):
        x = _as_f32(x)
        r24 = _r24(rounding, random_bits, x.shape, x.device)
        if self.dtype == torch.float32:
            return {"values": x.clone()}  # identity; clone so parts never alias the input
        if r24 is None:
            # Clamp only finite values: inf stays inf, finite overflow saturates.
            y = torch.where(torch.isinf(x), x, x.clamp(-self.maxval, self.maxval))
            v = y.to(self.dtype)  # torch casts are RNE
        else:
            v = _round_grid(x, self.mant_bits, self.emin, self.maxval, r24).to(torch.float32).to(self.dtype)
            v = torch.where(torch.isinf(x), x.to(self.dtype), v)
        return {"values": v}

    def decode(self, parts, cols):
        v = parts["values"]
        if v.shape[-1] != cols:
            raise ValueError(f"{self.name}: values have {v.shape[-1]} cols, expected cols={cols}")
        return v.to(torch.float32)

    def bytes_per_element(self, cols, rows=None):
        return float(torch.empty((), dtype=self.dtype).element_size())


_E4M3 = torch.float8_e4m3fn
_E4M3_MAX = 448.0


@dataclass(frozen=True)
class _FP8BlockFormat(Format):
    """float8_e4m3fn values with one fp32 scale per 32 consecutive elements along C."""

    block: int = 32

    def parts_shapes(self, shape):
        *lead, r, c = _check_shape(shape)
        cp = _ceil_to(c, self.block)
        return {
            "values": ((*lead, r, cp), _E4M3),
            "scales": ((*lead, r, cp // self.block), torch.float32),
        }

    def encode(self, x, rounding="nearest", random_bits=None):
        x = _as_f32(x)
        r24 = _r24(rounding, random_bits, x.shape, x.device)
        *lead, r, c = x.shape
        cp = _ceil_to(c, self.block)
        nb = cp // self.block
        xb = _pad_last(x, cp).reshape(*lead, r, nb, self.block)
        fin = torch.isfinite(xb)
        bad = ~fin.all(-1)  # block contains NaN / ±Inf  [..., R, nb]
        amax = torch.where(fin, xb.abs(), 0.0).amax(-1)
        scale = amax / _E4M3_MAX
        scale = torch.where(scale > 0, scale, 1.0)  # zero / underflowed block: any positive scale works
        scale = torch.where(bad, float("nan"), scale)
        y = torch.where(bad[..., None], 0.0, xb / torch.where(bad, 1.0, scale)[..., None])
        if r24 is None:
            v = y.clamp(-_E4M3_MAX, _E4M3_MAX).to(_E4M3)  # torch's e4m3 cast is RNE (NaN beyond 464)
        else:
            rb = _pad_last(r24, cp).reshape(xb.shape)
            v = _round_grid(y, 3, -6, _E4M3_MAX, rb).to(torch.float32).to(_E4M3)
        return {"values": v.reshape(*lead, r, cp), "scales": scale}

    def decode(self, parts, cols):
        v, s = parts["values"], parts["scales"]
        *lead, r, cp = v.shape
        if cp != _ceil_to(cols, self.block) or s.shape[-1] * self.block != cp:
            raise ValueError(f"{self.name}: parts of width {cp} / {s.shape[-1]} scales do not match cols={cols}")
        out = v.to(torch.float32).reshape(*lead, r, cp // self.block, self.block) * s[..., None]
        return out.reshape(*lead, r, cp)[..., :cols]

    def bytes_per_element(self, cols, rows=None):
        cp = _ceil_to(cols, self.block)
        return (cp * 1 + (cp // self.block) * 4) / cols


# e2m1 magnitudes by 3-bit code; full 16-entry decode table (bit 3 = sign).
_E2M1_MAG = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_TABLE = _E2M1_MAG + tuple(-m for m in _E2M1_MAG)
_E2M1_MAX = 6.0


@dataclass(frozen=True)
class _NVFP4Format(Format):
    """Packed e2m1 values, e4m3 scale per 16 elements, fp32 global scale per [R, C] matrix."""

    block: int = 16

    def parts_shapes(self, shape):
        *lead, r, c = _check_shape(shape)
        cp = _ceil_to(c, self.block)
        return {
            "values": ((*lead, r, cp // 2), torch.uint8),
            "scales": ((*lead, r, cp // self.block), _E4M3),
            "global_scale": (tuple(lead), torch.float32),
        }

    def encode(self, x, rounding="nearest", random_bits=None):
        x = _as_f32(x)
        r24 = _r24(rounding, random_bits, x.shape, x.device)
        *lead, r, c = x.shape
        cp = _ceil_to(c, self.block)
        nb = cp // self.block

        # Global scale ignores non-finite values so a NaN only poisons its own block.
        ax = torch.where(torch.isfinite(x), x.abs(), 0.0)
        gs = ax.amax(dim=(-2, -1)) / (_E2M1_MAX * _E4M3_MAX)
        gs = torch.where(gs > 0, gs, 1.0)  # [...]
        gs_b = gs[..., None, None]  # broadcast over [R, nb]

        xb = _pad_last(x, cp).reshape(*lead, r, nb, self.block)
        fin = torch.isfinite(xb)
        bad = ~fin.all(-1)
        bamax = torch.where(fin, xb.abs(), 0.0).amax(-1)
        t = (bamax / _E2M1_MAX) / gs_b
        s = t.clamp(max=_E4M3_MAX).to(_E4M3).to(torch.float32)  # RNE e4m3, decoded back to fp32
        s = torch.where(bad, float("nan"), s)

        denom = s * gs_b
        ok = denom > 0  # False for NaN scale and for scales that rounded to 0
        y = torch.where(ok[..., None], xb / torch.where(ok, denom, 1.0)[..., None], 0.0)
        rb = None if r24 is None else _pad_last(r24, cp).reshape(xb.shape)
        q = _round_grid(y, 1, 0, _E2M1_MAX, rb)  # float64 on the e2m1 grid
        mag = q.abs()
        # magnitude -> 3-bit index: {0,.5,1,1.5,2} -> 2*mag, {3,4} -> mag+2, 6 -> 7
        idx = torch.where(mag <= 2.0, mag * 2.0, torch.where(mag < 6.0, mag + 2.0, 7.0)).to(torch.uint8)
        codes = (idx | (torch.signbit(q).to(torch.uint8) << 3)).reshape(*lead, r, cp)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        return {"values": packed, "scales": s.to(_E4M3), "global_scale": gs}

    def decode(self, parts, cols):
        packed, s, gs = parts["values"], parts["scales"], parts["global_scale"]
        *lead, r, half = packed.shape
        cp = 2 * half
        if cp != _ceil_to(cols, self.block) or s.shape[-1] * self.block != cp:
            raise ValueError(f"{self.name}: parts of width {cp} / {s.shape[-1]} scales do not match cols={cols}")
        codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*lead, r, cp)
        table = torch.tensor(_E2M1_TABLE, dtype=torch.float32, device=packed.device)
        v = table[codes.long()].reshape(*lead, r, cp // self.block, self.block)
        out = (v * s.to(torch.float32)[..., None]) * gs[..., None, None, None]
        return out.reshape(*lead, r, cp)[..., :cols]

    def bytes_per_element(self, cols, rows=None):
        cp = _ceil_to(cols, self.block)
        b = (cp // 2 + cp // self.block) / cols
        if rows is not None:
            b += 4.0 / (rows * cols)
        return b


FORMATS: dict[str, Format] = {
    "fp32": _FloatFormat("fp32", torch.float32, 23, -126, 3.4028234663852886e38),
    "fp16": _FloatFormat("fp16", torch.float16, 10, -14, 65504.0),
    "bf16": _FloatFormat("bf16", torch.bfloat16, 7, -126, (2.0 - 2.0**-7) * 2.0**127),
    "fp8_e4m3": _FP8BlockFormat("fp8_e4m3"),
    "nvfp4": _NVFP4Format("nvfp4"),
}


def get_format(name_or_format: str | Format) -> Format:
    """Return the :class:`Format` for a name in :data:`FORMATS` (or pass a Format through)."""
    if isinstance(name_or_format, Format):
        return name_or_format
    if isinstance(name_or_format, str) and name_or_format in FORMATS:
        return FORMATS[name_or_format]
    raise ValueError(f"unknown format {name_or_format!r}; expected one of {sorted(FORMATS)}")
