"""Mamba-2 ReplaySSM in PyTorch: the fold (refresh) and the output-only form.

One head, h buffered tokens after the checkpoint S0 (docs/design.md, section 2):

    S_h = gamma_{1:h} S0 + sum_j gamma_{j+1:h} v_j k_j^T,        v_j = dt_j x_j, k_j = B_j
    y_s = gamma_{1:t} S0 q_s + sum_{j<=t} gamma_{j+1:t} (k_j . q_s) v_j,   t = h + s, q = C

Decays are exponents of fp32 segment sums of log(alpha) (``step.segment_log_decay``: each
segment summed directly, not as the difference c_t - c_j of two prefix sums), masked before the
exponent. No per-token [P, N] state is ever formed in the output path.
Buffer entries of positions past the valid count arrive zeroed (``ReplayCache.gather``), so they
contribute nothing and do not decay.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..step import path_log_decay, segment_log_decay


def heads_of_groups(t, nheads):
    """[b, L, G, N] -> [b, L, H, N]: head h reads group h // (H / G)."""
    return t.repeat_interleave(nheads // t.shape[2], dim=2)


def fold(state, buf, count):
    """Committed state after ``count`` buffered entries.

    state fp32 [b, H, P, N]; buf: x [b, L, H, P], dt/log_alpha [b, L, H] fp32, B [b, L, G, N];
    count int64 [b] (entries beyond it are zero). Returns fp32 [b, H, P, N].
    """
    H = state.shape[1]
    la = buf["log_alpha"]
    total = la.cumsum(1)[:, -1]  # zero entries past count add no decay
    last = torch.full((la.shape[0], 1), la.shape[1] - 1, device=la.device)
    w = torch.exp(segment_log_decay(la, last)[:, 0]) * buf["dt"]  # [b, L, H] gamma_{j+1:L}
    k = heads_of_groups(buf["B"].float(), H)
    v = buf["x"].float() * w[..., None]
    return torch.exp(total)[:, :, None, None] * state + torch.einsum("blhp,blhn->bhpn", v, k)


def outputs(state, buf, h, C, D=None, z=None, x_new=None, visible=None):
    """Outputs for the T queries at positions h .. h+T-1 (the last T appended entries).

    state fp32 [b, H, P, N] (the read copy); buf as in ``fold`` with entries valid below h+T;
    h int64 [b]; C [b, T, G, N]; D [H]; z [b, T, H, P]; x_new [b, T, H, P] (for the D skip);
    visible bool [b, L, L] (``step.tree_visibility``) for a draft tree, None for a chain: query
    h + s then sums and decays over the committed history and its ancestors only.
    Returns y fp32 [b, T, H, P].
    """
    H, T = state.shape[1], C.shape[1]
    la = buf["log_alpha"]
    t = h[:, None] + torch.arange(T, device=h.device)  # [b, T] query positions
    if visible is not None:  # the queries' rows: [b, T, L]
        visible = torch.gather(visible, 1, t[:, :, None].expand(-1, -1, visible.shape[2]))
    c_t = path_log_decay(la, t, visible)  # [b, T, H], along each query's path
    q = heads_of_groups(C.float(), H)  # [b, T, H, N]
    y = torch.exp(c_t)[..., None] * torch.einsum("bhpn,bthn->bthp", state, q)
    decay = torch.exp(segment_log_decay(la, t, visible))  # [b, T, L, H], 0 off the query's path
    k = heads_of_groups(buf["B"].float(), H)
    scores = torch.einsum("blhn,bthn->btlh", k, q) * decay * buf["dt"][:, None]
    y = y + torch.einsum("btlh,blhp->bthp", scores, buf["x"].float())
    if D is not None:
        y = y + D.float()[:, None] * x_new.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y
