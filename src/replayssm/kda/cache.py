"""The Kimi Delta Attention ReplaySSM cache: geometry and replay-buffer fields."""
from __future__ import annotations

import torch

from .. import checks
from ..cache import ReplayCache
from . import replay


class KDACache(ReplayCache):
    """Checkpoints and replay buffers for one KDA layer over ``num_slots`` sequences.

    State per slot [num_v_heads, head_v_dim, head_k_dim] (= [HV, V, K], the Gated DeltaNet
    layout); value head h reads key head h // (HV / HK). Buffer fields per token: raw ``k``
    [HK, K] (fp32, after optional L2 norm) and ``v`` [HV, V] (buffer_dtype), the per-channel log
    decay ``g`` [HV, K] and ``beta`` [HV] fp32 (kept raw so that refresh re-solves residuals from
    the anchor), and the read-path residuals ``u`` [HV, V] fp32 (reused by later outputs of the
    same window).

    ``accept``, ``load_state`` (state [b, HV, V, K]), ``materialize``, ``reset`` and persistence
    are those of every cache. There are no KDA Triton kernels yet: calls on this cache use the
    PyTorch backend (``backend="torch"``), on CPU and on CUDA.
    """

    kind = "kda"

    def __init__(self, num_slots, num_k_heads, num_v_heads, head_k_dim, head_v_dim, window=16,
                 max_draft=4, precision="s32_rs", device="cpu", buffer_dtype=torch.float32, seed=0):
        for name, val in (("num_k_heads", num_k_heads), ("num_v_heads", num_v_heads),
                          ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim)):
            checks.check_int(name, val, 1)
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        f32 = torch.float32
        # k in fp32 for the reason GDN keeps it so (normalized in fp32 before storage); g is fp32
        # because the fold and the outputs sum it per channel into every decay factor
        fields = {"k": ((num_k_heads, head_k_dim), f32), "v": ((num_v_heads, head_v_dim), buffer_dtype),
                  "g": ((num_v_heads, head_k_dim), f32), "beta": ((num_v_heads,), f32),
                  "u": ((num_v_heads, head_v_dim), f32)}
        super().__init__(num_slots, num_v_heads, head_v_dim, head_k_dim, window=window,
                         max_draft=max_draft, precision=precision, device=device,
                         buffer_dtype=buffer_dtype, seed=seed, buffer_fields=fields)

    def config(self) -> dict:
        return {**super().config(), "num_k_heads": self.num_k_heads}

    def _fold(self, state, entries, count):
        return replay.fold(state, entries, count)
