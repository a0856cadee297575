"""The Mamba-2 ReplaySSM cache: geometry and replay-buffer fields."""
from __future__ import annotations

import torch

from .. import checks
from ..cache import ReplayCache
from . import replay


class Mamba2Cache(ReplayCache):
    """Checkpoints and replay buffers for one Mamba-2 layer over ``num_slots`` sequences.

    State per slot [nheads, headdim, dstate] (= [H, P, N]); head h reads B/C group
    h // (nheads / ngroups). Buffer fields per token: ``x`` [H, P] (buffer_dtype), ``dt`` [H]
    (fp32, after bias and softplus), ``log_alpha`` [H] (fp32, A * dt), ``B`` [G, N] (buffer_dtype).
    ``buffer_dtype`` None (default): x's dtype at the first decode or verify, so the buffer holds the
    inputs exactly as given. See ``ReplayCache`` for the storage layout and cursors.
    """

    kind = "mamba2"

    def __init__(self, num_slots, nheads, headdim, dstate, ngroups=1, window=16, max_draft=4,
                 precision="s32_rs", device="cpu", buffer_dtype=None, seed=0):
        for name, v in (("nheads", nheads), ("headdim", headdim), ("dstate", dstate), ("ngroups", ngroups)):
            checks.check_int(name, v, 1)
        if nheads % ngroups:
            raise ValueError(f"nheads ({nheads}) must be a multiple of ngroups ({ngroups})")
        self.headdim, self.dstate, self.ngroups = headdim, dstate, ngroups
        f32 = torch.float32
        fields = {"x": ((nheads, headdim), None), "dt": ((nheads,), f32),
                  "log_alpha": ((nheads,), f32), "B": ((ngroups, dstate), None)}
        super().__init__(num_slots, nheads, headdim, dstate, window=window, max_draft=max_draft,
                         precision=precision, device=device, buffer_dtype=buffer_dtype, seed=seed,
                         buffer_fields=fields)

    def config(self) -> dict:
        return {**super().config(), "ngroups": self.ngroups}

    def _fold(self, state, entries, count):
        return replay.fold(state, entries, count)
