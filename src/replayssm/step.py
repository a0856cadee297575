"""One decode or verify step of the PyTorch backend, common to both layer kinds.

The order is the same for every architecture:

1. refresh the slots whose committed history plus the T new tokens would overflow the window
   (h + T > L), folding only their *committed* entries, from the anchor;
2. append the T new entries at positions h .. h+T-1;
3. compute outputs from the read copy and the buffer (the architecture's output-only form);
4. commit (decode) or mark the T entries pending (verify).

Every per-slot decision is a device-side mask: no host synchronization on CUDA, so a step can
be captured in a CUDA graph. (On CPU the refresh is skipped when no slot needs it.)
"""
from __future__ import annotations

import torch


def torch_step(cache, slots, T: int, entries: dict, outputs, commit: bool):
    """Run one step.

    entries: dict of buffer fields, each [b, T, ...], for the new tokens.
    outputs: callable (read_state [b,H,dv,dk] fp32, buffer dict [b,L,...], h [b] int64)
             -> (y [b, T, ...], dict of extra buffer fields [b, T, ...] to store for the new tokens).
    Returns y with pad rows zeroed.
    """
    rows, valid = cache.rows_of(slots)
    h = torch.where(valid, cache.committed[rows].long(), 0)
    need = valid & (h + T > cache.window)
    if slots.device.type != "cpu" or bool(need.any()):
        cache.refresh(rows, need)
    h = torch.where(need, 0, h)
    cache.append(rows, h, entries)
    y, extra = outputs(cache.decode_read(rows), cache.gather(rows, h + T), h)
    if extra:
        cache.append(rows, h, extra)
    if commit:
        cache.committed[rows] = torch.where(valid, (h + T).to(torch.int32), cache.committed[rows])
        cache.tokens[rows] += valid.long() * T
    else:
        cache.pending[rows] = torch.where(valid, T, cache.pending[rows])
    return torch.where(valid.view(-1, *([1] * (y.dim() - 1))), y, 0)


def segment_log_decay(log_alpha, t):
    """Log decays sum_{i=j+1..t_s} log_alpha_i for query positions ``t`` and entries ``j``.

    log_alpha [b, L, H] fp32; t int64 [b, T]. Returns [b, T, L, H]: the segment sum for
    j <= t_s (0 at j = t_s), -inf for j > t_s (masked before the exponent). Each segment is
    summed directly (a masked suffix cumsum) rather than as c_t - c_j of two prefix sums: once a
    prefix sum is large (strong decays, long windows) that difference loses ~ulp(c) absolutely,
    which is a relative error of every decay factor.
    """
    L = log_alpha.shape[1]
    pos = torch.arange(L, device=log_alpha.device)
    causal = pos[None, None, :] <= t[:, :, None]  # [b, T, L]
    terms = torch.where(causal[..., None], log_alpha[:, None], 0.0)  # log_alpha_i for i <= t_s
    suffix = terms.flip(2).cumsum(2).flip(2)  # sum_{j <= i <= t_s}
    seg = torch.cat([suffix[:, :, 1:], torch.zeros_like(suffix[:, :, :1])], 2)  # sum_{j < i <= t_s}
    return torch.where(causal[..., None], seg, float("-inf"))
