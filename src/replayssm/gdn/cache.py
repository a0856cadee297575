"""The Gated DeltaNet ReplaySSM cache: geometry and replay-buffer fields."""
from __future__ import annotations

import torch

from .. import checks
from ..cache import ReplayCache
from . import replay


class GDNCache(ReplayCache):
    """Checkpoints and replay buffers for one Gated DeltaNet layer over ``num_slots`` sequences.

    State per slot [num_v_heads, head_v_dim, head_k_dim] (= [HV, V, K], the layout of vLLM's
    packed decode); value head h reads key head h // (HV / HK). Buffer fields per token: ``k``
    [HK, K] and ``v`` [HV, V] as given (buffer_dtype), ``k_scale`` [HK] fp32 (the factor that
    normalizes the key: k_scale * k is the key the recurrence uses; 1 / sqrt(k . k + 1e-6) with
    ``use_qk_l2norm``, else 1), ``g`` and ``beta`` [HV] fp32 (kept raw so that refresh re-solves
    residuals from the anchor), and the read-path residuals ``u`` [HV, V] fp32 (reused by later
    outputs of the same window). ``buffer_dtype`` None (default): v's dtype at the first decode or
    verify, so bf16 inputs are buffered exactly as given, in half the bytes of fp32 ones.
    """

    kind = "gdn"

    @staticmethod
    def decay_shape(num_v_heads: int, head_k_dim: int) -> tuple:
        """Per-token shape of the buffered log decay ``g``: one per value head."""
        return (num_v_heads,)

    def __init__(self, num_slots, num_k_heads, num_v_heads, head_k_dim, head_v_dim, window=16,
                 max_draft=4, precision="s32_rs", device="cpu", buffer_dtype=None, seed=0):
        for name, val in (("num_k_heads", num_k_heads), ("num_v_heads", num_v_heads),
                          ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim)):
            checks.check_int(name, val, 1)
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        f32 = torch.float32
        # k is stored as given with its normalizing factor, not normalized: a normalized key rounded
        # to a 16-bit buffer would add an error the conventional kernel lacks
        fields = {"k": ((num_k_heads, head_k_dim), None), "k_scale": ((num_k_heads,), f32),
                  "v": ((num_v_heads, head_v_dim), None),
                  "g": (self.decay_shape(num_v_heads, head_k_dim), f32), "beta": ((num_v_heads,), f32),
                  "u": ((num_v_heads, head_v_dim), f32)}
        super().__init__(num_slots, num_v_heads, head_v_dim, head_k_dim, window=window,
                         max_draft=max_draft, precision=precision, device=device,
                         buffer_dtype=buffer_dtype, seed=seed, buffer_fields=fields)

    def config(self) -> dict:
        return {**super().config(), "num_k_heads": self.num_k_heads}

    def _fold(self, state, entries, count):
        return replay.fold(state, entries, count)
