"""Gated DeltaNet ReplaySSM in PyTorch: residual solves, the fold (refresh), output-only form.

With residuals u_j = beta_j (v_j - alpha_j S_{j-1} k_j), S_j = alpha_j S_{j-1} + u_j k_j^T: the
Mamba-2 form with u in place of v. The residuals of a window solve the unit lower-triangular
system (docs/design.md, section 2)

    u_j + sum_{i<j} beta_j gamma_{i+1:j} (k_i . k_j) u_i = beta_j (v_j - gamma_{1:j} S0 k_j).

The fold re-solves every committed residual from the anchor (raw k, v, g, beta are kept in the
buffer for that), so a residual computed from a rounded read copy never enters the recurrence.
Outputs solve only the new tokens' rows against the read copy; committed rows reuse the cached
read-path residuals (identity rows whose right-hand side is the cached u).
"""
from __future__ import annotations

import torch

from ..step import path_log_decay, segment_log_decay


def keys(buf):
    """The buffered keys the recurrence uses, fp32 [b, L, HK, K]: the keys as given times their
    normalizing factors (``buf["k_scale"]``)."""
    return buf["k"].float() * buf["k_scale"][..., None]


def heads_of_groups(t, nheads):
    """[b, L, HK, K] -> [b, L, HV, K]: value head h reads key head h // (HV / HK)."""
    return t.repeat_interleave(nheads // t.shape[2], dim=2)


def _solve(state, k, buf, c, solve_rows, cached_u=None, visible=None):
    """Residuals u [b, L, HV, V] from checkpoint ``state`` [b, HV, V, K].

    k [b, L, HV, K] fp32; c [b, L, HV] cumulative log decay (along each row's path for a tree);
    solve_rows [b, L] bool: rows solved from the equations; the others are identity rows with
    right-hand side ``cached_u`` (or 0). visible bool [b, L(j), L(i)] (a draft tree's mask,
    ``step.tree_visibility``): row j couples only to the entries on its path, so each draft's
    residual is the one of its own ancestor chain.
    """
    L = k.shape[1]
    beta = buf["beta"]
    rhs = beta[..., None] * (buf["v"].float()
                             - torch.exp(c)[..., None] * torch.einsum("bhvk,blhk->blhv", state, k))
    other = torch.zeros_like(rhs) if cached_u is None else cached_u
    rhs = torch.where(solve_rows[:, :, None, None], rhs, other)
    j, i = torch.arange(L, device=k.device)[:, None], torch.arange(L, device=k.device)[None, :]
    rows_t = j.T.expand(k.shape[0], L)  # [b, L]: every position as a query
    seg = segment_log_decay(buf["g"], rows_t, visible).permute(0, 3, 1, 2)  # [b, HV, L(j), L(i)]
    decay = torch.exp(torch.where(i < j, seg, float("-inf")))
    kk = torch.einsum("bjhk,bihk->bhji", k, k)
    rows = (solve_rows[:, None, :] * beta.permute(0, 2, 1))[..., None]  # beta_j on solved rows
    lower = torch.eye(L, device=k.device) + rows * decay * kk
    u = torch.linalg.solve_triangular(lower, rhs.permute(0, 2, 1, 3), upper=False, unitriangular=True)
    return u.permute(0, 2, 1, 3)


def fold(state, buf, count):
    """Committed state after ``count`` entries, residuals re-solved from ``state`` (the anchor).

    state fp32 [b, HV, V, K]; buf: k [b, L, HK, K], k_scale [b, L, HK], v [b, L, HV, V], g/beta
    [b, L, HV], entries past count zero; count int64 [b]. Returns fp32 [b, HV, V, K].
    """
    HV, L = state.shape[1], buf["g"].shape[1]
    k = heads_of_groups(keys(buf), HV)
    c = buf["g"].cumsum(1)
    solve_rows = torch.arange(L, device=k.device)[None, :] < count[:, None]
    u = _solve(state, k, buf, c, solve_rows)
    total = c[:, -1]
    last = torch.full((c.shape[0], 1), L - 1, device=c.device)
    w = torch.exp(segment_log_decay(buf["g"], last)[:, 0])  # [b, L, HV] gamma_{j+1:L}
    return torch.exp(total)[:, :, None, None] * state + torch.einsum("blhv,blhk->bhvk", u * w[..., None], k)


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
    g = buf["g"]
    pos = torch.arange(L, device=h.device)
    c = path_log_decay(g, pos.expand(g.shape[0], L), visible)  # [b, L, HV], along each position's path
    u = _solve(state, k, buf, c, pos[None, :] >= h[:, None], buf["u"].float(), visible)
    t = h[:, None] + torch.arange(T, device=h.device)  # [b, T]
    c_t = torch.gather(c, 1, t[:, :, None].expand(-1, -1, HV))  # [b, T, HV]
    o = torch.exp(c_t)[..., None] * torch.einsum("bhvk,bthk->bthv", state, qh)
    vis_t = None if visible is None else torch.gather(visible, 1, t[:, :, None].expand(-1, -1, L))
    decay = torch.exp(segment_log_decay(g, t, vis_t))  # [b, T, L, HV], 0 off the query's path
    scores = torch.einsum("blhk,bthk->btlh", k, qh) * decay
    o = o + torch.einsum("btlh,blhv->bthv", scores, u)
    u_new = torch.gather(u, 1, t[:, :, None, None].expand(-1, -1, HV, u.shape[-1]))
    return o, {"u": u_new}
