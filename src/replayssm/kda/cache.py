"""The Kimi Delta Attention ReplaySSM cache: geometry and replay-buffer fields."""
from __future__ import annotations

from ..gdn.cache import GDNCache
from . import replay


class KDACache(GDNCache):
    """Checkpoints and replay buffers for one KDA layer over ``num_slots`` sequences.

    State per slot [num_v_heads, head_v_dim, head_k_dim] (= [HV, V, K], the Gated DeltaNet
    layout); value head h reads key head h // (HV / HK). Buffer fields per token: ``k``
    [HK, K] and ``v`` [HV, V] as given (buffer_dtype), ``k_scale`` [HK] fp32 (k's normalizing
    factor, as ``GDNCache``), the per-channel log
    decay ``g`` [HV, K] and ``beta`` [HV] fp32 (kept raw so that refresh re-solves residuals from
    the anchor), and the read-path residuals ``u`` [HV, V] fp32 (reused by later outputs of the
    same window).

    The geometry, validation and fields are GDN's (``GDNCache``) but for ``g``'s shape; ``accept``,
    ``load_state`` (state [b, HV, V, K]), ``materialize``, ``reset`` and persistence are those of
    every cache. Calls on a CUDA cache run the Triton kernels (``kda/triton.py``) unless given
    ``backend="torch"``.
    """

    kind = "kda"

    @staticmethod
    def decay_shape(num_v_heads: int, head_k_dim: int) -> tuple:
        """Per-token shape of the buffered log decay ``g``: one per value head and key channel
        (fp32: the fold and the outputs sum it per channel into every decay factor)."""
        return (num_v_heads, head_k_dim)

    def _fold(self, state, entries, count):
        return replay.fold(state, entries, count)
