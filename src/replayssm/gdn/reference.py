"""Float64 conventional recurrence for Gated DeltaNet: the oracle every test measures against.

Follows flash-linear-attention's ``fused_recurrent_gated_delta_rule`` conventions (g is the log
decay, beta the write strength, optional in-kernel L2 normalization of q and k, scale K^-1/2 by
default), with the state laid out [HV, V, K]. It never calls any other replayssm code.
"""
from __future__ import annotations

import torch


def l2norm64(x, eps=1e-6):
    """x / sqrt(sum(x^2) + eps) over the last axis, in float64 (flash-linear-attention's l2norm)."""
    x = x.double()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_reference_step(state, q, k, v, g, beta, scale=None, use_qk_l2norm=False):
    """One conventional Gated DeltaNet decode step in float64.

    state [b, HV, V, K]; q, k [b, HK, K]; v [b, HV, V]; g, beta [b, HV].
    S = exp(g) S;  u = beta (v - S k);  S = S + u k^T;  o = S (scale q).
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
    state = torch.exp(g)[:, :, None, None] * state
    u = beta[:, :, None] * (v - (state * kh[:, :, None, :]).sum(-1))
    state = state + u[..., None] * kh[:, :, None, :]
    o = (state * qh[:, :, None, :]).sum(-1)
    return o, state


def gdn_reference(state, q, k, v, g, beta, scale=None, use_qk_l2norm=False):
    """Run ``gdn_reference_step`` over a time axis.

    q, k [b, T, HK, K]; v [b, T, HV, V]; g, beta [b, T, HV]; state [b, HV, V, K].
    Returns (o [b, T, HV, V] float64, final state float64).
    """
    outs = []
    for t in range(q.shape[1]):
        o, state = gdn_reference_step(state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t],
                                      scale, use_qk_l2norm)
        outs.append(o)
    if not outs:  # no tokens: the state is unchanged
        return None, state.double()
    return torch.stack(outs, 1), state
