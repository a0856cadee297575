"""Float64 conventional recurrence for Mamba-2: the oracle every test measures against.

Written as plainly as possible, one token at a time, after mamba_ssm's
``selective_state_update``. It never calls any other replayssm code.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def mamba2_reference_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """One conventional Mamba-2 decode step in float64.

    state [b, H, P, N]; x [b, H, P]; dt [b, H]; A [H]; B, C [b, G, N]; D [H]; z [b, H, P];
    dt_bias [H]. Any float dtype in; everything is promoted to float64.
    Returns (y [b, H, P] float64, new_state [b, H, P, N] float64).
    """
    f = lambda t: None if t is None else t.double()  # noqa: E731
    state, x, dt, A, B, C, D, z, dt_bias = map(f, (state, x, dt, A, B, C, D, z, dt_bias))
    H, G = x.shape[1], B.shape[1]
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    group = torch.arange(H, device=x.device) // (H // G)
    Bh, Ch = B[:, group], C[:, group]  # [b, H, N]
    decay = torch.exp(A * dt)  # [b, H]
    state = decay[:, :, None, None] * state + (dt[:, :, None] * x)[..., None] * Bh[:, :, None, :]
    y = (state * Ch[:, :, None, :]).sum(-1)
    if D is not None:
        y = y + D[:, None] * x
    if z is not None:
        y = y * F.silu(z)
    return y, state


def mamba2_reference(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """Run ``mamba2_reference_step`` over a time axis.

    x [b, T, H, P]; dt [b, T, H]; B, C [b, T, G, N]; z [b, T, H, P]; state [b, H, P, N].
    Returns (y [b, T, H, P] float64, final state float64).
    """
    ys = []
    for t in range(x.shape[1]):
        y, state = mamba2_reference_step(
            state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D,
            None if z is None else z[:, t], dt_bias, dt_softplus)
        ys.append(y)
    if not ys:  # no tokens: the state is unchanged
        return None, state.double()
    return torch.stack(ys, 1), state
