"""The layer kinds behind one interface, for code that drives either one: the reproduction
runner, the benchmarks and the tests.

A ``Layer`` builds a cache for a ``Geometry``, makes the public call on a dict of token inputs
(every tensor with a draft axis: ``[b, T, ...]``; a decode is T = 1), and runs the float64
conventional step on the same inputs. Mamba-2 applies ``dt_softplus=True`` with ``dt_bias`` (as
mamba_ssm and vLLM call it); Gated DeltaNet and Kimi Delta Attention normalize q and k
(``use_qk_l2norm=True``).
"""
from __future__ import annotations

from .geometry import Geometry


class Mamba2Layer:
    """Tokens x [b,T,H,P], dt [b,T,H] (before bias and softplus), B, C [b,T,G,N], z [b,T,H,P];
    constants A, D, dt_bias [H]."""

    name = "mamba2"
    token_fields = ("x", "dt", "B", "C", "z")

    @staticmethod
    def cache(geo: Geometry, num_slots: int, **kw):
        from .mamba2.cache import Mamba2Cache
        return Mamba2Cache(num_slots, geo.H, geo.P, geo.N, ngroups=geo.G, **kw)

    @staticmethod
    def call(cache, slots, tok: dict, consts: dict, verify: bool, backend=None, parents=None):
        """Outputs fp32 [b, T, H, P]; ``parents`` [b, T]: a verify of draft trees."""
        from .mamba2.ops import mamba2_decode, mamba2_verify
        c = consts
        if verify:
            return mamba2_verify(cache, slots, tok["x"], tok["dt"], c["A"], tok["B"], tok["C"], c.get("D"),
                                 tok.get("z"), c.get("dt_bias"), True, backend=backend, parents=parents)
        t = {k: v[:, 0] for k, v in tok.items()}
        return mamba2_decode(cache, slots, t["x"], t["dt"], c["A"], t["B"], t["C"], c.get("D"), t.get("z"),
                             c.get("dt_bias"), True, backend=backend)[:, None]

    @staticmethod
    def reference_step(state, tok: dict, consts: dict, t: int):
        """The float64 step on token ``t``: (y [b, H, P], new state [b, H, P, N])."""
        from .mamba2.reference import mamba2_reference_step
        c, z = consts, tok.get("z")
        return mamba2_reference_step(state, tok["x"][:, t], tok["dt"][:, t], c["A"], tok["B"][:, t],
                                     tok["C"][:, t], c.get("D"), None if z is None else z[:, t],
                                     c.get("dt_bias"), True)


class GDNLayer:
    """Tokens q, k [b,T,G,N], v [b,T,H,P], g (log decay) and beta [b,T,H]; no constants."""

    name = "gdn"
    token_fields = ("q", "k", "v", "g", "beta")

    @staticmethod
    def cache(geo: Geometry, num_slots: int, **kw):
        from .gdn.cache import GDNCache
        return GDNCache(num_slots, geo.G, geo.H, geo.N, geo.P, **kw)

    @staticmethod
    def call(cache, slots, tok: dict, consts: dict, verify: bool, backend=None, parents=None):
        """Outputs fp32 [b, T, H, P]; ``parents`` [b, T]: a verify of draft trees."""
        from .gdn.ops import gdn_decode, gdn_verify
        if verify:
            return gdn_verify(cache, slots, tok["q"], tok["k"], tok["v"], tok["g"], tok["beta"],
                              use_qk_l2norm=True, backend=backend, parents=parents)
        t = {k: v[:, 0] for k, v in tok.items()}
        return gdn_decode(cache, slots, t["q"], t["k"], t["v"], t["g"], t["beta"], use_qk_l2norm=True,
                          backend=backend)[:, None]

    @staticmethod
    def reference_step(state, tok: dict, consts: dict, t: int):
        """The float64 step on token ``t``: (y [b, H, P], new state [b, H, P, N])."""
        from .gdn.reference import gdn_reference_step
        return gdn_reference_step(state, tok["q"][:, t], tok["k"][:, t], tok["v"][:, t], tok["g"][:, t],
                                  tok["beta"][:, t], use_qk_l2norm=True)


class KDALayer:
    """Tokens q, k [b,T,G,N], v [b,T,H,P], g (per-key-channel log decay) [b,T,H,N] and beta
    [b,T,H]; no constants."""

    name = "kda"
    token_fields = ("q", "k", "v", "g", "beta")

    @staticmethod
    def cache(geo: Geometry, num_slots: int, **kw):
        from .kda.cache import KDACache
        return KDACache(num_slots, geo.G, geo.H, geo.N, geo.P, **kw)

    @staticmethod
    def call(cache, slots, tok: dict, consts: dict, verify: bool, backend=None, parents=None):
        """Outputs fp32 [b, T, H, P]; ``parents`` [b, T]: a verify of draft trees."""
        from .kda.ops import kda_decode, kda_verify
        if verify:
            return kda_verify(cache, slots, tok["q"], tok["k"], tok["v"], tok["g"], tok["beta"],
                              use_qk_l2norm=True, backend=backend, parents=parents)
        t = {k: v[:, 0] for k, v in tok.items()}
        return kda_decode(cache, slots, t["q"], t["k"], t["v"], t["g"], t["beta"], use_qk_l2norm=True,
                          backend=backend)[:, None]

    @staticmethod
    def reference_step(state, tok: dict, consts: dict, t: int):
        """The float64 step on token ``t``: (y [b, H, P], new state [b, H, P, N])."""
        from .kda.reference import kda_reference_step
        return kda_reference_step(state, tok["q"][:, t], tok["k"][:, t], tok["v"][:, t], tok["g"][:, t],
                                  tok["beta"][:, t], use_qk_l2norm=True)


# the order fixes each kind's index in the runner's input seeds: new kinds go last
LAYERS = {"mamba2": Mamba2Layer, "gdn": GDNLayer, "kda": KDALayer}
ARCHS = tuple(LAYERS)
