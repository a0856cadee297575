"""Float64 conventional recurrence for Kimi Delta Attention (KDA): the oracle every test of the
layer measures against.

KDA is Gated DeltaNet with one decay per key channel instead of one per head. With the state laid
out [HV, V, K] (rows: value channels, columns: key channels), a step is

    S_t = S_{t-1} Diag(alpha_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,    y_t = S_t (scale q_t),

alpha_t = exp(g_t) in (0, 1]^K given as the log decay g_t <= 0. It follows flash-linear-attention's
``fused_recurrent_kda`` conventions for the already-prepared gate (g is the per-channel log decay
itself, no in-kernel gate activation): optional in-kernel L2 normalization of q and k, scale K^-1/2
by default, value head h reading key head h // (HV / HK). It never calls any other replayssm code.
"""
from __future__ import annotations

import torch


def l2norm64(x, eps=1e-6):
    """x / sqrt(sum(x^2) + eps) over the last axis, in float64 (flash-linear-attention's l2norm)."""
    x = x.double()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_reference_step(state, q, k, v, g, beta, scale=None, use_qk_l2norm=False):
    """One conventional KDA decode step in float64.

    state [b, HV, V, K]; q, k [b, HK, K]; v [b, HV, V]; g [b, HV, K] (per-channel log decay);
    beta [b, HV].
    S = S Diag(exp(g));  u = beta (v - S k);  S = S + u k^T;  o = S (scale q).
    Returns (o [b, HV, V] float64, new_state [b, HV, V, K] float64).
    """
    state, q, k, v, g, beta = (t.double() for t in (state, q, k, v, g, beta))
    HK, K = q.shape[1], q.shape[2]
    HV = v.shape[1]
    if scale is None:
        scale = K ** -0.5
    if use_qk_l2norm:
        q, k = l2norm64(q), l2norm64(k)
    head = torch.arange(HV, device=v.device) // (HV // HK)
    qh, kh = q[:, head] * scale, k[:, head]  # [b, HV, K]
    state = state * torch.exp(g)[:, :, None, :]  # column c (key channel c) decays by alpha_c
    u = beta[:, :, None] * (v - (state * kh[:, :, None, :]).sum(-1))
    state = state + u[..., None] * kh[:, :, None, :]
    o = (state * qh[:, :, None, :]).sum(-1)
    return o, state


def kda_reference(state, q, k, v, g, beta, scale=None, use_qk_l2norm=False):
    """Run ``kda_reference_step`` over a time axis.

    q, k [b, T, HK, K]; v [b, T, HV, V]; g [b, T, HV, K]; beta [b, T, HV]; state [b, HV, V, K].
    Returns (o [b, T, HV, V] float64, final state float64).
    """
    outs = []
    for t in range(q.shape[1]):
        o, state = kda_reference_step(state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t],
                                      scale, use_qk_l2norm)
        outs.append(o)
    if not outs:  # no tokens: the state is unchanged
        return None, state.double()
    return torch.stack(outs, 1), state
