"""Inputs at the edges of fp32, both backends against the float64 recurrence, decodes across
refreshes and verify rounds with every accept count:

- GDN and KDA under keys that make the residual system hard: nearly parallel unit keys, beta near
  1 and decays near 1, so that every entry below the diagonal of the window's unit lower-triangular
  system is near 1 in magnitude and every power of it counts in the inverse; a Triton inverse
  missing a level of its blocks fails.
- Every layer under strong forgetting: decays down to 1e-39 (log decays -5 to -90 per token,
  Mamba-2 steps dt of 20-60), whose products over a window underflow fp32.
"""
import pytest
import torch

import helpers
from helpers import Tracker, uniform

pytest.importorskip("triton")

from test_triton_backend import TritonLayer  # noqa: E402

GEOMETRY = dict(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=16)
MAMBA2_GEOMETRY = dict(nheads=4, headdim=16, dstate=32, ngroups=2)

#: Max abs errors against float64 on nearly parallel keys, outputs and committed states: both backends
#: measure 1.3e-7 to 2.4e-7 and 5.8e-7 to 9.9e-7; the Triton inverse as the product
#: (I - M)(I + M^2)(I + M^4)(I + M^8) gave 2.3e-6 and 5.8e-6 (GDN), 6.1e-6 and 8.8e-6 (KDA).
TOL, STATE_TOL = 1e-6, 2e-6


class Inputs:
    """A helpers or Triton layer whose token inputs ``tokens`` redraws in part."""

    def __init__(self, layer):
        self.layer = layer

    def __getattr__(self, name):
        return getattr(self.layer, name)


class NearlyParallelKeys(Inputs):
    """Keys one fixed direction per key head plus 1e-2 of noise, beta in [0.9, 1] and decays (per
    key channel for KDA) in [0.995, 1]."""

    def __init__(self, layer):
        super().__init__(layer)
        g = helpers.generator(7)
        self.direction = torch.randn(GEOMETRY["num_k_heads"], GEOMETRY["head_k_dim"], generator=g)

    def tokens(self, g, b, T):
        tok = self.layer.tokens(g, b, T)
        tok["k"] = self.direction + 1e-2 * torch.randn(tok["k"].shape, generator=g)
        tok["beta"] = uniform(g, tok["beta"].shape, 0.9, 1.0)
        tok["g"] = torch.log(uniform(g, tok["g"].shape, 0.995, 1.0))
        return tok


class StrongForgetting(Inputs):
    """Log decays from -90 to -5 per token (GDN, KDA: g; Mamba-2: dt from 20 to 60, its A from -2
    to -0.3), the other inputs as the layer draws them."""

    def tokens(self, g, b, T):
        tok = self.layer.tokens(g, b, T)
        if "dt" in tok:
            tok["dt"] = uniform(g, tok["dt"].shape, 20.0, 60.0)
        else:
            tok["g"] = -uniform(g, tok["g"].shape, 5.0, 90.0)
        return tok


def _run(arch, backend, inputs=NearlyParallelKeys, decodes=36, rounds=6, window=16):
    """Three slots: ``decodes`` decodes (36 at window 16: two refreshes of full windows each), then
    ``rounds`` verify rounds of 1-4 drafts with every accept count, a pad and staggered slots."""
    geometry = MAMBA2_GEOMETRY if arch == "mamba2" else GEOMETRY
    base = TritonLayer(arch, **geometry) if backend == "triton" else helpers.make_layer(arch, **geometry)
    layer = inputs(base)
    tr = Tracker(layer, layer.cache(3, window=window, max_draft=4), seed=3)
    tr.load([0, 1, 2])
    tr.decode([2, 1])
    for _ in range(decodes - 1):
        tr.decode([0, -1, 2, 1])
    for r in range(rounds):
        T = 1 + r % 4
        tr.verify([1, -1, 2, 0], T)
        tr.accept([r % (T + 1), 0, T, (r + 1) % (T + 1)])
    assert min(tr.refreshes.values()) >= decodes // (window + 1)
    return tr


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("arch", ["gdn", "kda"])
def test_nearly_parallel_keys_match_float64(arch, backend):
    tr = _run(arch, backend)
    state_err = tr.state_error([0, 1, 2])
    helpers.record(f"{backend} {arch} nearly parallel keys max abs err", tr.max_err)
    helpers.record(f"{backend} {arch} nearly parallel keys state err", state_err)
    assert tr.max_err <= TOL
    assert state_err <= STATE_TOL


@pytest.mark.parametrize("arch", ["gdn", "kda"])
def test_nearly_parallel_keys_in_long_windows_match_float64(arch):
    """Window 64: the system's powers reach M^63. The product form of the inverse, (I - M)(I +
    M^2) .. (I + M^32), has partial products near 1e10 here and was off by far more than the
    inverse's entries even after a Newton step; the doubled blocks stay at rounding."""
    tr = _run(arch, "triton", decodes=70, rounds=4, window=64)
    helpers.record(f"triton {arch} nearly parallel keys window 64 max abs err", tr.max_err)
    assert tr.max_err <= TOL
    assert tr.state_error([0, 1, 2]) <= STATE_TOL


@pytest.mark.parametrize("arch", ["gdn", "kda"])
def test_an_inverse_missing_a_level_is_detected(arch, monkeypatch):
    """Teeth: an inverse whose diagonal blocks stop at LP / 2 rows (its lower-left quarter zero)."""
    from replayssm._triton import launch

    monkeypatch.setattr(launch, "inverse_levels", lambda LP: LP.bit_length() - 3)
    assert _run(arch, "triton").max_err > 1e-2


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("arch", ["mamba2", "gdn", "kda"])
def test_strong_forgetting_matches_float64(arch, backend):
    """Errors relative to the largest reference output (Mamba-2's reach 3.5e3 at these steps):
    measured 2.9e-8 to 1.0e-7, states within 1e-6 of the same scale."""
    tr = _run(arch, backend, StrongForgetting, decodes=20, rounds=4)
    scale = max(1.0, tr.max_ref)
    helpers.record(f"{backend} {arch} strong forgetting max err / max |y_ref|", tr.max_err / scale)
    assert tr.max_err <= TOL * scale
    assert tr.state_error([0, 1, 2]) <= STATE_TOL * scale
