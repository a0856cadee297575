"""Tests for replayssm.formats: storage layout, rounding, saturation, random bits.

References are brute force where possible: every finite value of fp16 / bf16 /
e4m3 / e2m1 is enumerated from its bit patterns and rounding is checked against
searches over that grid in float64.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from replayssm.formats import FORMATS, Format, get_format, random_bits
from replayssm.formats import _round_grid  # internal grid rounding, shared by all formats

LOWP = ["fp16", "bf16", "fp8_e4m3", "nvfp4"]
BLOCK = {"fp8_e4m3": 32, "nvfp4": 16}
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TABLE = torch.tensor(E2M1 + tuple(-m for m in E2M1), dtype=torch.float64)
NAN, INF = float("nan"), float("inf")
BF16_MAX = (2.0 - 2.0**-7) * 2.0**127
# (mantissa bits, emin, maxval) of each element grid, as documented in formats.py
GRID_PARAMS = {"fp16": (10, -14, 65504.0), "bf16": (7, -126, BF16_MAX),
               "fp8_e4m3": (3, -6, 448.0), "nvfp4": (1, 0, 6.0)}


# ----------------------------------------------------------------------------
# Reference helpers
# ----------------------------------------------------------------------------

_GRID_CACHE: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def grid(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """All finite values of the element format (sorted float64) and their bit-pattern LSB."""
    if name not in _GRID_CACHE:
        if name in ("fp16", "bf16"):
            bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
            vals = bits.view(torch.float16 if name == "fp16" else torch.bfloat16).double()
        elif name == "fp8_e4m3":
            bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
            vals = bits.view(torch.float8_e4m3fn).double()
        else:
            bits = torch.arange(16)
            vals = E2M1_TABLE.clone()
        lsb = bits.to(torch.int64) & 1
        keep = torch.isfinite(vals) & ~((vals == 0) & torch.signbit(vals))  # drop -0 duplicate
        vals, lsb = vals[keep], lsb[keep]
        order = torch.argsort(vals)
        _GRID_CACHE[name] = (vals[order].contiguous(), lsb[order])
    return _GRID_CACHE[name]


def _bracket(name, y):
    g, lsb = grid(name)
    y = y.double().clamp(g[0].item(), g[-1].item())  # saturation
    i = torch.searchsorted(g, y, right=True).clamp(1, len(g) - 1)
    return y, g[i - 1], g[i], lsb[i - 1]


def ref_nearest(name, y):
    """Brute-force round-to-nearest, ties to the even bit pattern (float64)."""
    y, lo, hi, lo_lsb = _bracket(name, y)
    dl, dh = y - lo, hi - y
    return torch.where(dl < dh, lo, torch.where(dh < dl, hi, torch.where(lo_lsb == 0, lo, hi)))


def ref_floor_ceil(name, y):
    """Adjacent grid values lo <= y <= hi (equal when y is on the grid)."""
    y, lo, hi, _ = _bracket(name, y)
    return torch.where(y == hi, hi, lo), torch.where(y == lo, lo, hi)


def scaled_input(name, x, parts):
    """The documented scaled-domain value y that gets rounded, [..., R, C] float32."""
    if name in ("fp16", "bf16"):
        return x
    *lead, r, c = x.shape
    b = BLOCK[name]
    cp = -(-c // b) * b
    xb = torch.nn.functional.pad(x, (0, cp - c)).reshape(*lead, r, cp // b, b)
    if name == "fp8_e4m3":
        denom = parts["scales"]
    else:
        denom = parts["scales"].float() * parts["global_scale"][..., None, None]
    return (xb / denom[..., None]).reshape(*lead, r, cp)[..., :c]


def nvfp4_codes(packed):
    """Unpack (independently of the module): low nibble = even element."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def scaled_values(name, parts, cols):
    """Stored element values in the scaled domain (float64), [..., R, cols]."""
    if name == "nvfp4":
        return E2M1_TABLE[nvfp4_codes(parts["values"]).long()][..., :cols]
    return parts["values"].double()[..., :cols]


def unbiased_report(samples: torch.Tensor, target: float, z_max: float = 5.0):
    """(ok, z): is the mean of `samples` consistent with `target` within z_max standard errors?"""
    samples = samples.double().flatten()
    mean, sd = samples.mean().item(), samples.std().item()
    if sd == 0.0:
        return mean == target, (0.0 if mean == target else math.inf)
    z = (mean - target) / (sd / math.sqrt(samples.numel()))
    return abs(z) < z_max, z


def logical_bits(shape, seed=1234, stream=7):
    return random_bits(seed, stream, torch.arange(math.prod(shape)).reshape(shape))


def bits_view(t):
    """Reinterpret a tensor as raw integers of the same width (for bitwise comparison)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same_parts(a, b):
    """Bitwise equality of two parts dicts (NaN-safe)."""
    return a.keys() == b.keys() and all(
        torch.equal(bits_view(a[k]), bits_view(b[k])) for k in a)


# ----------------------------------------------------------------------------
# API / registry
# ----------------------------------------------------------------------------


def test_registry_and_get_format():
    assert set(FORMATS) == {"fp32", "fp16", "bf16", "fp8_e4m3", "nvfp4"}
    for name, f in FORMATS.items():
        assert isinstance(f, Format) and f.name == name
        assert get_format(name) is f and get_format(f) is f
    with pytest.raises(ValueError, match="fp7"):
        get_format("fp7")
    with pytest.raises(dataclasses.FrozenInstanceError):
        FORMATS["fp16"].name = "x"


def test_argument_errors():
    x = torch.randn(2, 8)
    f = FORMATS["fp16"]
    with pytest.raises(ValueError, match="random_bits"):
        f.encode(x, "stochastic")
    with pytest.raises(ValueError, match="rounding"):
        f.encode(x, "truncate")
    with pytest.raises(ValueError):
        f.encode(torch.randn(8))
    with pytest.raises(ValueError):
        FORMATS["fp8_e4m3"].decode(FORMATS["fp8_e4m3"].encode(torch.randn(2, 40)), 70)


# ----------------------------------------------------------------------------
# Physical storage
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("cols", [8, 24, 128])
def test_parts_shapes_allocate_and_bytes(name, cols):
    f = FORMATS[name]
    shape = (3, 2, 4, cols)
    x = torch.randn(shape)
    parts = f.encode(x)
    expected = f.parts_shapes(shape)
    assert {k: (tuple(v.shape), v.dtype) for k, v in parts.items()} == expected
    alloc = f.allocate(shape, "cpu")
    assert {k: (tuple(v.shape), v.dtype) for k, v in alloc.items()} == expected
    # bytes_per_element (with rows) equals the real storage footprint
    nbytes = sum(v.numel() * v.element_size() for v in parts.values())
    assert f.bytes_per_element(cols, rows=4) == pytest.approx(nbytes / x.numel(), rel=1e-12)
    if name == "fp8_e4m3":
        cp = -(-cols // 32) * 32
        assert parts["values"].element_size() == 1 and parts["scales"].element_size() == 4
        assert f.bytes_per_element(cols) == (cp + cp // 32 * 4) / cols
    if name == "nvfp4":
        cp = -(-cols // 16) * 16
        assert parts["values"].element_size() == 1 and parts["values"].shape[-1] == cp // 2
        assert parts["scales"].element_size() == 1 and parts["global_scale"].shape == (3, 2)
        assert f.bytes_per_element(cols) == (cp // 2 + cp // 16) / cols


def test_bytes_per_element_values():
    assert FORMATS["fp32"].bytes_per_element(128) == 4.0
    assert FORMATS["fp16"].bytes_per_element(128) == 2.0
    assert FORMATS["bf16"].bytes_per_element(128) == 2.0
    assert FORMATS["fp8_e4m3"].bytes_per_element(128) == 1.125
    assert FORMATS["fp8_e4m3"].bytes_per_element(24) == 1.5
    assert FORMATS["nvfp4"].bytes_per_element(128) == 0.5625
    assert FORMATS["nvfp4"].bytes_per_element(128, rows=128) == 0.5625 + 4 / 128**2


@pytest.mark.parametrize("name", list(FORMATS))
def test_allocate_fill_nan_poisons(name):
    f = FORMATS[name]
    parts = f.allocate((2, 3, 24), "cpu", fill=NAN)
    assert torch.isnan(f.decode(parts, 24)).all()
    zeros = f.allocate((2, 3, 24), "cpu", fill=0)
    if name != "nvfp4":  # nvfp4 zero scales decode to 0 too, but global_scale 0 is fine as well
        assert (f.decode(zeros, 24) == 0).all()


def test_nvfp4_packing_order():
    # global amax 2688 -> global_scale 1; second row block amax 6 -> block scale 1, so y == x
    x = torch.zeros(2, 16)
    x[0, 0] = 2688.0
    x[1, :4] = torch.tensor([6.0, 1.0, -0.5, 3.0])
    p = FORMATS["nvfp4"].encode(x)
    assert p["global_scale"].item() == 1.0 and p["scales"].float()[1, 0].item() == 1.0
    # codes: 6 -> 7, 1 -> 2, -0.5 -> 8|1 = 9, 3 -> 5; element 2i low nibble, 2i+1 high nibble
    assert p["values"][1, 0].item() == (2 << 4) | 7
    assert p["values"][1, 1].item() == (5 << 4) | 9


# ----------------------------------------------------------------------------
# Round trip accuracy
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_round_trip_error_bounds(name, rounding):
    f = FORMATS[name]
    gen = torch.Generator().manual_seed(11)
    k = 1.0 if rounding == "nearest" else 2.0  # stochastic: up to a full ulp instead of half
    for scale in (1e-3, 1.0, 1e3):
        for cols in (8, 24, 128):
            shape = (3, 2, 5, cols)
            x = torch.randn(shape, generator=gen) * scale
            x[0, 0, 0, 0] = 0.0
            bits = logical_bits(shape, seed=int(scale * 1000) + cols)
            parts = f.encode(x, rounding, bits)
            d = f.decode(parts, cols)
            assert d.dtype == torch.float32 and d.shape == x.shape
            err, ax = (d.double() - x.double()).abs(), x.double().abs()
            if name == "fp32":
                assert torch.equal(d, x)
            elif name == "fp16":
                assert (err <= k * torch.clamp(2.0**-11 * ax, min=2.0**-25)).all()
            elif name == "bf16":
                assert (err <= k * 2.0**-8 * ax).all()
            elif name == "fp8_e4m3":
                b = 32
                cp = -(-cols // b) * b
                xb = torch.nn.functional.pad(x, (0, cp - cols)).reshape(3, 2, 5, cp // b, b)
                amax = xb.abs().amax(-1)
                assert torch.equal(parts["scales"], torch.where(amax > 0, amax / 448, 1.0))
                s = parts["scales"].double().repeat_interleave(b, -1)[..., :cols]
                # half ulp: 2^-4 relative for normals, 2^-10 * scale for e4m3 subnormals
                assert (err <= k * (2.0**-4 * ax + 2.0**-10 * s) * (1 + 1e-6)).all()
                assert (err <= k * 2.0**-4 * amax.repeat_interleave(b, -1)[..., :cols] * 1.0001).all()
            else:  # nvfp4
                b = 16
                cp = -(-cols // b) * b
                xb = torch.nn.functional.pad(x, (0, cp - cols)).reshape(3, 2, 5, cp // b, b)
                amax = xb.abs().amax(-1)
                gs = x.abs().amax((-2, -1)) / 2688
                assert torch.equal(parts["global_scale"], gs)
                t = (amax / 6) / gs[..., None, None]
                assert torch.equal(parts["scales"].float(), t.clamp(max=448).to(torch.float8_e4m3fn).float())
                S = (parts["scales"].float() * gs[..., None, None]).double()
                S_el = S.repeat_interleave(b, -1)[..., :cols]
                # block scale within e4m3 relative rounding of amax/6 (normal scales here)
                assert ((S - amax.double() / 6).abs() <= 2.0**-4 * amax.double() / 6 * 1.0001).all()
                # e2m1 half ulp <= 0.25*|y| + 0.25, plus saturation above 6
                y = ax / S_el
                bound = S_el * (k * (0.25 * y + 0.25) + torch.clamp(y - 6, min=0))
                assert (err <= bound * (1 + 1e-6)).all()
                a_el = amax.double().repeat_interleave(b, -1)[..., :cols]
                assert (err <= k * a_el * 0.18).all()


@pytest.mark.parametrize("name", LOWP)
def test_exact_values_never_move(name):
    """Values already on the element grid survive stochastic rounding bit-exactly."""
    f = FORMATS[name]
    g, _ = grid(name)
    gen = torch.Generator().manual_seed(3)
    x = torch.zeros(64, 2, 16)
    if name in ("fp16", "bf16"):
        x = g[torch.randint(len(g), (64, 2, 16), generator=gen)].float()
    elif name == "fp8_e4m3":  # amax 448 -> scale 1
        x[:, 1, 1:] = g[torch.randint(len(g), (64, 15), generator=gen)].float()
        x[:, 1, 0] = 448.0
    else:  # global scale 1 (amax 2688), block amax 6 -> block scale 1
        x[:, 0, 0] = 2688.0
        x[:, 1, 0] = 6.0
        x[:, 1, 1:] = g[torch.randint(len(g), (64, 15), generator=gen)].float()
    d = f.decode(f.encode(x, "stochastic", logical_bits(x.shape)), 16)
    assert torch.equal(d, x)


# ----------------------------------------------------------------------------
# Nearest rounding vs references
# ----------------------------------------------------------------------------


def _wide_input(gen, shape):
    """Random values spanning many binades (incl. fp16/e4m3 subnormal ranges) and signs."""
    mag = torch.exp2(torch.empty(shape).uniform_(-30, 15, generator=gen))
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    return (mag * sign * (1 + torch.rand(shape, generator=gen))).float()


@pytest.mark.parametrize("name", LOWP)
def test_nearest_matches_torch_cast_and_brute_force(name):
    f = FORMATS[name]
    gen = torch.Generator().manual_seed(5)
    for cols in (8, 24, 128):
        x = _wide_input(gen, (4, 6, cols))
        if name in ("fp8_e4m3", "nvfp4"):
            x = x * torch.exp2(torch.empty(4, 6, 1).uniform_(-10, 10, generator=gen))  # varied block amax
        parts = f.encode(x, "nearest")
        y = scaled_input(name, x, parts)
        got = scaled_values(name, parts, cols)
        ok = torch.isfinite(y)
        assert ok.any()
        assert torch.equal(got[ok], ref_nearest(name, y[ok]))
        if name in ("fp16", "bf16", "fp8_e4m3"):  # torch's casts are RNE for in-range values
            dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}[name]
            inr = ok & (y.abs() <= GRID_PARAMS[name][2])
            assert torch.equal(got[inr], y[inr].to(dt).double())


@pytest.mark.parametrize("name", LOWP)
def test_round_grid_ties_to_even(name):
    """Exact midpoints between neighbours (and random points) on every element grid."""
    g, _ = grid(name)
    m, emin, maxval = GRID_PARAMS[name]
    mids = ((g[:-1] + g[1:]) / 2).float()
    assert torch.equal(mids.double(), (g[:-1] + g[1:]) / 2)  # midpoints are exact in fp32
    got = _round_grid(mids, m, emin, maxval, None)
    assert torch.equal(got, ref_nearest(name, mids))


def test_nvfp4_nearest_ties_explicit():
    """Literal tie table: ties go to the even e2m1 code."""
    x = torch.zeros(2, 16)
    x[0, 0] = 2688.0  # global scale 1
    x[1, 0] = 6.0  # block scale 1 -> y == x
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.25]
    x[1, 1:1 + len(ties)] = torch.tensor(ties)
    d = FORMATS["nvfp4"].decode(FORMATS["nvfp4"].encode(x), 16)
    got = d[1, 1:1 + len(ties)]
    assert got.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, -0.0]
    assert torch.signbit(got[-1])  # -0.25 -> -0 (sign kept)


# ----------------------------------------------------------------------------
# Stochastic rounding
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", LOWP)
def test_stochastic_picks_a_neighbour(name):
    """SR returns floor or ceil of y; bits 0 force ceil, bits 2**32-1 force floor."""
    f = FORMATS[name]
    gen = torch.Generator().manual_seed(8)
    x = _wide_input(gen, (4, 6, 40))
    if name in ("fp8_e4m3", "nvfp4"):
        x = x * torch.exp2(torch.empty(4, 6, 1).uniform_(-10, 10, generator=gen))
    near = f.encode(x, "nearest")
    for k in near:  # scales never depend on the rounding mode
        if k != "values":
            assert same_parts({k: f.encode(x, "stochastic", logical_bits(x.shape))[k]}, {k: near[k]})
    y = scaled_input(name, x, near)
    ok = torch.isfinite(y)
    lo, hi = ref_floor_ceil(name, y[ok])
    sr = scaled_values(name, f.encode(x, "stochastic", logical_bits(x.shape)), 40)[ok]
    assert ((sr == lo) | (sr == hi)).all()
    assert (sr != lo).any() and (sr != hi).any()
    up = scaled_values(name, f.encode(x, "stochastic", torch.zeros((), dtype=torch.int64)), 40)[ok]
    assert torch.equal(up, hi)
    # all-ones bits round down except when frac > 1 - 2**-24
    frac = torch.where(hi > lo, (y[ok].double().clamp(lo.min(), hi.max()) - lo) / (hi - lo), 0.0)
    dn = scaled_values(name, f.encode(x, "stochastic", torch.full((), 2**32 - 1)), 40)[ok]
    sel = frac <= 1 - 2.0**-24
    assert torch.equal(dn[sel], lo[sel])


def _sr_cases(name):
    """(x [N, 2, 16], positions, targets): repeated values to stochastically round N times."""
    vals = {"fp16": [1 / 3, 1e-6, -2.718281828, 1000.1],
            "bf16": [1 / 3, 1e-39, -3.14159265, 7.77e5],
            "fp8_e4m3": [0.3, 0.004, -100.7, 3.3],
            "nvfp4": [0.3, 1.2, -2.6, 5.1]}[name]
    n = 20000
    x = torch.zeros(n, 2, 16)
    if name == "fp8_e4m3":
        x[:, 1, 0] = 448.0  # scale 1
    if name == "nvfp4":
        x[:, 0, 0] = 2688.0  # global scale 1
        x[:, 1, 0] = 6.0  # block scale 1
    targets = torch.tensor(vals, dtype=torch.float32)
    x[:, 1, 1:1 + len(vals)] = targets
    return x, slice(1, 1 + len(vals)), targets.double()


@pytest.mark.parametrize("name", LOWP)
def test_stochastic_unbiased(name):
    f = FORMATS[name]
    x, pos, targets = _sr_cases(name)
    d = f.decode(f.encode(x, "stochastic", logical_bits(x.shape, seed=99)), 16)[:, 1, pos]
    nd = f.decode(f.encode(x, "nearest"), 16)[0, 1, pos]
    for j, t in enumerate(targets.tolist()):
        assert nd[j].item() != t  # the target is not on the grid: the test has something to check
        ok, z = unbiased_report(d[:, j], t)
        assert ok, (name, t, z)
    # teeth: always-round-down (bits all ones) and always-round-up (bits zero) are caught
    for fixed in (2**32 - 1, 0):
        biased = f.decode(f.encode(x, "stochastic", torch.full((), fixed)), 16)[:, 1, pos]
        assert not unbiased_report(biased[:, 0], targets[0].item())[0]


def test_unbiased_report_detects_small_bias():
    gen = torch.Generator().manual_seed(0)
    fair = (torch.rand(20000, generator=gen, dtype=torch.float64) < 0.3).double()
    assert unbiased_report(fair, 0.3)[0]
    assert not unbiased_report(fair, 0.33)[0]
    assert not unbiased_report(torch.zeros(100), 0.3)[0]
    assert unbiased_report(torch.full((100,), 0.5), 0.5)[0]


@pytest.mark.parametrize("name", LOWP)
def test_stochastic_reproducible_and_placement_independent(name):
    f = FORMATS[name]
    gen = torch.Generator().manual_seed(21)
    shape = (6, 2, 4, 24)
    x = torch.randn(shape, generator=gen)
    offs = torch.arange(math.prod(shape)).reshape(shape)
    p1 = f.encode(x, "stochastic", random_bits(5, 3, offs))
    p2 = f.encode(x, "stochastic", random_bits(5, 3, offs))
    assert same_parts(p1, p2)
    p3 = f.encode(x, "stochastic", random_bits(6, 3, offs))
    p4 = f.encode(x, "stochastic", random_bits(5, 4, offs))
    for p in (p3, p4):  # a different seed or stream changes many stochastic choices
        assert (bits_view(p["values"]) != bits_view(p1["values"])).float().mean() > 0.05
    # permuting the leading (slot) axis of x together with its logical offsets permutes the parts
    perm = torch.randperm(shape[0], generator=gen)
    pp = f.encode(x[perm], "stochastic", random_bits(5, 3, offs[perm]))
    assert same_parts(pp, {k: v[perm] for k, v in p1.items()})


# ----------------------------------------------------------------------------
# Saturation, NaN, Inf, zeros
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fp16_bf16_fp32_special_values(rounding):
    bits = logical_bits((1, 8))
    x = torch.tensor([[70000.0, -1e10, 65504.0, 65519.0, INF, -INF, NAN, 3.4e38]])
    d = FORMATS["fp16"].decode(FORMATS["fp16"].encode(x, rounding, bits), 8)
    exp = torch.tensor([[65504.0, -65504.0, 65504.0, 65504.0, INF, -INF, NAN, 65504.0]])
    assert torch.equal(d.isnan(), exp.isnan()) and (d[~d.isnan()] == exp[~exp.isnan()]).all()
    x = torch.tensor([[3.3999e38, -3.4028234e38, BF16_MAX, INF, -INF, NAN, 1.0, -0.0]])
    d = FORMATS["bf16"].decode(FORMATS["bf16"].encode(x, rounding, bits), 8)
    exp = torch.tensor([[BF16_MAX, -BF16_MAX, BF16_MAX, INF, -INF, NAN, 1.0, -0.0]])
    assert torch.equal(d.isnan(), exp.isnan()) and (d[~d.isnan()] == exp[~exp.isnan()]).all()
    x = torch.tensor([[3.4028234e38, INF, -INF, NAN, 1e-45, -0.0, 1 / 3, 7.0]])
    d = FORMATS["fp32"].decode(FORMATS["fp32"].encode(x, rounding, bits), 8)
    assert torch.equal(d.view(torch.int32), x.view(torch.int32))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("name", ["fp8_e4m3", "nvfp4"])
def test_block_formats_nonfinite_poison_only_their_block(name, rounding):
    f = FORMATS[name]
    b = BLOCK[name]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 4 * b, generator=gen)
    x[0, 1, 3] = NAN
    x[0, 2, b + 1] = INF
    x[1, 0, 2 * b] = -INF
    bad = torch.zeros(2, 3, 4, dtype=torch.bool)
    bad[0, 1, 0] = bad[0, 2, 1] = bad[1, 0, 2] = True
    parts = f.encode(x, rounding, logical_bits(x.shape))
    d = f.decode(parts, 4 * b)
    assert torch.equal(torch.isnan(d), bad.repeat_interleave(b, -1))
    assert torch.equal(torch.isnan(parts["scales"].float()), bad)
    clean = ~bad.repeat_interleave(b, -1)
    ref = f.decode(f.encode(torch.where(clean, x, 0.0), rounding, logical_bits(x.shape)), 4 * b)
    assert torch.equal(d[clean], ref[clean])  # other blocks (and nvfp4 global scale) unaffected
    if name == "nvfp4":
        assert torch.isfinite(parts["global_scale"]).all()


@pytest.mark.parametrize("name", list(FORMATS))
def test_zeros_and_tiny_blocks(name):
    f = FORMATS[name]
    for rounding in ("nearest", "stochastic"):
        z = f.encode(torch.zeros(2, 3, 24), rounding, logical_bits((2, 3, 24)))
        assert all(torch.isfinite(v.float()).all() for v in z.values())
        assert (f.decode(z, 24) == 0).all()
    if name == "nvfp4":  # a block far below the matrix amax flushes to zero (scale 0), no NaN
        x = torch.zeros(1, 2, 16)
        x[0, 0, 0] = 1e6
        x[0, 1, :] = 1e-6
        p = f.encode(x)
        assert p["scales"].float()[0, 1, 0].item() == 0.0
        d = f.decode(p, 16)
        assert (d[0, 1] == 0).all() and d[0, 0, 0].item() == pytest.approx(1e6, rel=2**-4)
    if name == "fp8_e4m3":  # amax / 448 underflows to 0: safe scale 1, values flush to 0
        x = torch.full((1, 32), 1e-44)
        p = f.encode(x)
        assert p["scales"].item() == 1.0 and (f.decode(p, 32) == 0).all()


# ----------------------------------------------------------------------------
# random_bits
# ----------------------------------------------------------------------------

M32 = 0xFFFFFFFF


def _mix_py(x):
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return x


def _random_bits_py(seed, stream, offset):
    """Independent pure-Python implementation of the documented definition."""
    h = _mix_py(((seed >> 32) & M32) ^ 0x9E3779B9)
    for w in (seed & M32, (stream >> 32) & M32, stream & M32, (offset >> 32) & M32, offset & M32):
        h = _mix_py(h ^ w)
    return h


def test_random_bits_known_answers():
    cases = [(0, 0, 0), (1, 2, 3), (-1, 5, 2**33 + 7), (2**62 + 12345, -(2**40), 99), (7, 0, 2**32 - 1)]
    seeds, streams, offsets = (torch.tensor(c, dtype=torch.int64) for c in zip(*cases))
    got = random_bits(seeds, streams, offsets).tolist()
    assert got == [_random_bits_py(*c) for c in cases]
    assert _mix_py(1) != 1 and _random_bits_py(0, 0, 0) != 0


def test_random_bits_range_uniformity_determinism():
    offs = torch.arange(200_000)
    r = random_bits(42, 3, offs)
    assert r.dtype == torch.int64 and r.shape == offs.shape
    assert int(r.min()) >= 0 and int(r.max()) < 2**32
    assert abs((r.double() / 2**32).mean().item() - 0.5) < 0.005
    bit_freq = ((r[:, None] >> torch.arange(32)) & 1).double().mean(0)
    assert ((bit_freq - 0.5).abs() < 0.01).all()
    assert len(torch.unique(r)) == len(r)  # bijective in the low offset word
    assert torch.equal(r, random_bits(42, 3, offs))
    assert (r != random_bits(43, 3, offs)).float().mean() > 0.99
    assert (r != random_bits(42, 4, offs)).float().mean() > 0.99
    # broadcasting of the three arguments
    b = random_bits(torch.tensor([[1], [2]]), 0, torch.arange(5))
    assert b.shape == (2, 5) and torch.equal(b[1], random_bits(2, 0, torch.arange(5)))
    with pytest.raises(TypeError):
        random_bits(1.5 * torch.ones(2), 0, 0)
