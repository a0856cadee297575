"""Public Mamba-2 calls: ``mamba2_decode`` and ``mamba2_verify``.

public call -> argument checks -> input preparation (bias, softplus, log decay) -> backend.

Both calls are inference: they run under ``torch.no_grad()``, so inputs that require grad never
make the cache storage part of an autograd graph. Slot ids (int32 or int64, any strides) reach the
backends as a contiguous int64 tensor; every other input as the caller's tensor or a view of it (the
Triton kernels read any strides, so views of packed projections are never copied); an empty batch
launches nothing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import checks
from ..backend import pick_backend
from ..step import torch_step
from . import replay


def _check(cache, slots, x, dt, A, B, C, D, z, dt_bias, draft: bool, backend=None):
    """Validate every argument; returns (slots as ``checks.slot_ids`` gives them for ``backend``,
    T, dt, A, D, dt_bias), the last four as per-head views ([*lead, H] and [H]: head-dim-expanded
    inputs reduced, ``checks.per_head``)."""
    slots = checks.slot_ids(cache, slots, keep_int32=pick_backend(cache, backend) == "triton")
    b = slots.shape[0]
    H, P, N, G = cache.nheads, cache.headdim, cache.dstate, cache.ngroups
    T = x.shape[1] if draft and isinstance(x, torch.Tensor) and x.dim() == 4 else 1
    if draft:
        checks.check_draft_len(cache, T)
    lead = (b, T) if draft else (b,)
    dev = cache.device
    checks.check_tensor("x", x, (*lead, H, P), dev)
    dt = checks.per_head("dt", dt, (*lead, H), (P,), dev)
    A = checks.per_head("A", A, (H,), (P, N), dev)
    checks.check_tensor("B", B, (*lead, G, N), dev)
    checks.check_tensor("C", C, (*lead, G, N), dev)
    D = checks.per_head("D", D, (H,), (P,), dev, optional=True)
    checks.check_tensor("z", z, (*lead, H, P), dev, optional=True)
    dt_bias = checks.per_head("dt_bias", dt_bias, (H,), (P,), dev, optional=True)
    checks.check_finite_nonpositive("A", A, cache)
    checks.check_no_pending(cache, slots)
    return slots, T, dt, A, D, dt_bias


def _step(cache, slots, x, dt, A, B, C, D, z, dt_bias, dt_softplus, commit, backend, out, out_dtype,
          parents=None):
    """y [b, T, H, P] of ``out_dtype``, written into ``out`` ([b, T, H, P] view) when given.
    ``parents`` [b, T] (validated by ``checks.draft_parents``) for a tree verify."""
    kind = pick_backend(cache, backend)
    cache.follow_inputs(x.dtype)  # a cache with buffer_dtype=None buffers its inputs as given
    if slots.shape[0] == 0:  # nothing to compute or store; the kernels' grids would be empty
        return torch.zeros(x.shape, dtype=out_dtype, device=x.device) if out is None else out
    if kind == "triton":  # prepares dt and the log decay inside its kernels, reading every input in place
        from . import triton as kernels
        y = out if out is not None and out.is_contiguous() else torch.empty(x.shape, dtype=out_dtype, device=x.device)
        kernels.step(cache, slots, x, dt, A, B, C, D, z, dt_bias, dt_softplus, commit, y, parents)
        return y if out is None or y is out else out.copy_(y)
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    log_alpha = A.float() * dt
    entries = {"x": x, "dt": dt, "log_alpha": log_alpha, "B": B}
    y = torch_step(cache, slots, x.shape[1], entries,
                   lambda state, buf, h, vis=None: (replay.outputs(state, buf, h, C, D, z, x, vis), None),
                   commit, parents)
    return y.to(out_dtype) if out is None else out.copy_(y)


@torch.no_grad()
def mamba2_decode(cache, slots, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                  backend=None, out=None, out_dtype=None):
    """One decode token per slot; refreshes the checkpoint when the window is full.

    slots int32/int64 [b] (-1 = pad); x [b, H, P]; dt [b, H]; A [H]; B, C [b, G, N]; D [H]; z [b, H, P];
    dt_bias [H]. Inputs fp32/fp16/bf16, any strides, read in place on both backends (no copy): x, B,
    C may be views of one packed xBC tensor, z and dt of one in_proj output. As mamba_ssm's
    ``selective_state_update`` takes them, dt may also be [b, H, P], A [H, P, N], D and dt_bias
    [H, P], expanded with stride 0 over the head's dims (ValueError otherwise: one decay per head).
    Returns y [b, H, P] (zero for pads), fp32 unless ``out_dtype`` (fp16/bf16: the kernels store the
    rounded outputs, half the bytes); written into ``out`` when given.
    """
    slots, _, dt, A, D, dt_bias = _check(cache, slots, x, dt, A, B, C, D, z, dt_bias, draft=False, backend=backend)
    dtype = checks.output_spec(out, out_dtype, tuple(x.shape), cache.device)
    u = lambda t: None if t is None else t.unsqueeze(1)  # noqa: E731
    y = _step(cache, slots, u(x), u(dt), A, u(B), u(C), D, u(z), dt_bias, dt_softplus, True, backend, u(out), dtype)
    return y[:, 0] if out is None else out


@torch.no_grad()
def mamba2_verify(cache, slots, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                  backend=None, out=None, out_dtype=None, parents=None):
    """Verify T drafts per slot, output-only: draft s sees the checkpoint, the committed history
    and drafts 1..s. Nothing is committed: call ``cache.accept(slots, num_accepted)`` next.

    x [b, T, H, P]; dt [b, T, H] (or [b, T, H, P] expanded with stride 0); B, C [b, T, G, N]; z
    [b, T, H, P]; others as in decode (layouts too: any strides, read in place).
    parents int32/int64 [b, T] for a draft tree (None: a chain): parents[i, s] in [-1, s) is the
    draft that draft s follows (-1: the last committed token); draft s then sees the committed
    history and its ancestors only. Accept a root path with ``cache.accept(slots, n, path)``.
    The Triton backend takes trees of at most 32 drafts.
    Returns y [b, T, H, P] (``out``, ``out_dtype`` as in decode).
    """
    slots, T, dt, A, D, dt_bias = _check(cache, slots, x, dt, A, B, C, D, z, dt_bias, draft=True, backend=backend)
    dtype = checks.output_spec(out, out_dtype, tuple(x.shape), cache.device)
    parents = checks.draft_parents(cache, slots, parents, T, pick_backend(cache, backend))
    return _step(cache, slots, x, dt, A, B, C, D, z, dt_bias, dt_softplus, False, backend, out, dtype,
                 parents)
