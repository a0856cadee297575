"""Kimi Delta Attention ReplaySSM in PyTorch: residual solves, the fold (refresh), output-only form.

KDA is Gated DeltaNet with a decay per key channel: S_j = S_{j-1} D_j + u_j k_j^T with
D_j = Diag(exp(g_j)) and residuals u_j = beta_j (v_j - S_{j-1} D_j k_j) (docs/design.md, section 2,
"Kimi Delta Attention"). Every scalar product of the GDN form becomes a decay-weighted one,

    <a, b>_{i:t} = sum_c a_c b_c exp(sum_{i < m <= t} g_{m,c}),

and the window's residuals solve the unit lower-triangular system

    u_j + sum_{i<j} beta_j <k_i, k_j>_{i:j} u_i = beta_j (v_j - S0 (exp(G_j) * k_j)),

G_j = sum_{m <= j} g_m the per-channel log decay since the checkpoint. Outputs are
y_t = S0 (exp(G_t) * q_t) + sum_{i <= t} <k_i, q_t>_{i:t} u_i, and the fold is
S_L = S0 Diag(exp(G_L)) + sum_i u_i (exp(G_L - G_i) * k_i)^T.

Segment log decays. Each exponent sum_{i < m <= t} g_{m,c} is summed directly per channel (a
masked suffix sum, ``step.segment_log_decay``), not formed as the difference G_t - G_i of two
prefix sums: with strong decays a prefix sum grows large and the difference loses ~ulp(G)
absolutely, which is a relative error of the decay factor, per channel. Masked pairs (i >= t in
the system, i > t in the outputs) get -inf *before* the exponent, so no exp of a positive or
undefined exponent is ever formed, and no factorization exp(G_t) exp(-G_i) that could overflow is
used. The cost is a [T, L, HV, K] tensor of factors per slot (L = window), which the PyTorch
backend can afford; a kernel would stream it.

The fold re-solves every committed residual from the anchor (raw k, v, g, beta are kept in the
buffer for that), so a residual computed from a rounded read copy never enters the recurrence.
Outputs solve only the new tokens' rows against the read copy; committed rows reuse the cached
read-path residuals (identity rows whose right-hand side is the cached u).

A draft tree (``visible``, ``step.tree_visibility``) is handled as in Gated DeltaNet: G_j and
every segment sum run along position j's own ancestor path, and row j of the system couples only
to the entries on that path, so each draft's residual and output are those of its own chain.
"""
from __future__ import annotations

import torch

from ..gdn.replay import heads_of_groups, keys
from ..step import path_log_decay, segment_log_decay


def log_decays(buf):
    """Per-channel log decays of the buffer, fp32 [b, L, HV, K] (0 past the valid entries)."""
    return buf["g"].float()


def channel_segments(g, t, visible=None):
    """Per-channel segment log decays sum_{j < m <= t_s} g_m for queries ``t`` and entries ``j``.

    g fp32 [b, L, HV, K]; t int64 [b, T]; visible bool [b, T, L] (a draft tree's ancestor mask,
    ``step.segment_log_decay``) or None. Returns [b, T, L, HV, K]: 0 at j = t_s, -inf for
    j > t_s or off the query's path (``step.segment_log_decay`` with every (head, channel) pair
    as its own head); a tree's segments sum along the query's path only.
    """
    b, L, HV, K = g.shape
    return segment_log_decay(g.reshape(b, L, HV * K), t, visible).view(b, t.shape[1], L, HV, K)


def _solve(state, k, buf, g, solve_rows, cached_u=None, visible=None):
    """Residuals u [b, L, HV, V] from checkpoint ``state`` [b, HV, V, K].

    k [b, L, HV, K] fp32; g [b, L, HV, K] log decays; solve_rows [b, L] bool: rows solved from
    the equations; the others are identity rows with right-hand side ``cached_u`` (or 0).
    visible bool [b, L(j), L(i)] (a draft tree's mask, ``step.tree_visibility``): row j decays
    and couples only along its own path, so each draft's residual is that of its ancestor chain.
    """
    b, L = k.shape[0], k.shape[1]
    beta = buf["beta"]
    pos = torch.arange(L, device=k.device)
    rows_t = pos[None, :].expand(b, L)  # [b, L]: every position as a query
    # sums from the checkpoint (along each row's path): no difference is taken of them
    G = path_log_decay(g, rows_t, visible)
    rhs = beta[..., None] * (buf["v"].float()
                             - torch.einsum("bhvk,blhk->blhv", state, torch.exp(G) * k))
    other = torch.zeros_like(rhs) if cached_u is None else cached_u
    rhs = torch.where(solve_rows[:, :, None, None], rhs, other)
    j, i = pos[:, None], pos[None, :]
    seg = channel_segments(g, rows_t, visible)  # [b, L(j), L(i), HV, K], -inf off row j's path
    decay = torch.exp(torch.where((i < j)[None, :, :, None, None], seg, float("-inf")))
    kk = torch.einsum("bjhc,bihc,bjihc->bhji", k, k, decay)
    rows = (solve_rows[:, None, :] * beta.permute(0, 2, 1))[..., None]  # beta_j on solved rows
    lower = torch.eye(L, device=k.device) + rows * kk
    u = torch.linalg.solve_triangular(lower, rhs.permute(0, 2, 1, 3), upper=False, unitriangular=True)
    return u.permute(0, 2, 1, 3)


def fold(state, buf, count):
    """Committed state after ``count`` entries, residuals re-solved from ``state`` (the anchor).

    state fp32 [b, HV, V, K]; buf: k [b, L, HK, K], k_scale [b, L, HK], v [b, L, HV, V], g [b, L, HV, K],
    beta [b, L, HV], entries past count zero; count int64 [b]. Returns fp32 [b, HV, V, K].
    """
    HV, L = state.shape[1], buf["g"].shape[1]
    k = heads_of_groups(keys(buf), HV)
    g = log_decays(buf)
    solve_rows = torch.arange(L, device=k.device)[None, :] < count[:, None]
    u = _solve(state, k, buf, g, solve_rows)
    total = g.sum(1)  # [b, HV, K]: G at the last entry (entries past count add 0)
    last = torch.full((g.shape[0], 1), L - 1, device=g.device)
    w = torch.exp(channel_segments(g, last)[:, 0])  # [b, L, HV, K]: exp(G_L - G_j), summed directly
    return state * torch.exp(total)[:, :, None, :] + torch.einsum("blhv,blhk->bhvk", u, w * k)


def outputs(state, buf, h, q, visible=None):
    """Outputs of the T queries at positions h .. h+T-1, and the new tokens' residuals.

    state fp32 [b, HV, V, K] (the read copy); buf with entries valid below h+T and cached
    residuals ``u`` below h; h int64 [b]; q fp32 [b, T, HK, K] (normalized and scaled);
    visible bool [b, L, L] (``step.tree_visibility``) for a draft tree, None for a chain.
    Returns (o fp32 [b, T, HV, V], {"u": fp32 [b, T, HV, V]}).
    """
    HV, L, T = state.shape[1], buf["g"].shape[1], q.shape[1]
    k = heads_of_groups(keys(buf), HV)
    qh = heads_of_groups(q, HV)
    g = log_decays(buf)
    pos = torch.arange(L, device=h.device)
    u = _solve(state, k, buf, g, pos[None, :] >= h[:, None], buf["u"].float(), visible)
    t = h[:, None] + torch.arange(T, device=h.device)  # [b, T]
    vis_t = None if visible is None else torch.gather(visible, 1, t[:, :, None].expand(-1, -1, L))
    G_t = path_log_decay(g, t, vis_t)  # [b, T, HV, K], along each query's path
    o = torch.einsum("bhvk,bthk->bthv", state, torch.exp(G_t) * qh)
    decay = torch.exp(channel_segments(g, t, vis_t))  # [b, T, L, HV, K], 0 off the query's path
    scores = torch.einsum("blhc,bthc,btlhc->btlh", k, qh, decay)
    o = o + torch.einsum("btlh,blhv->bthv", scores, u)
    u_new = torch.gather(u, 1, t[:, :, None, None].expand(-1, -1, HV, u.shape[-1]))
    return o, {"u": u_new}
