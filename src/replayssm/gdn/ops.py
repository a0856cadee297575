"""Public Gated DeltaNet calls: ``gdn_decode`` and ``gdn_verify``.

public call -> argument checks -> input preparation (L2 norm, scale) -> backend.

Both calls are inference: they run under ``torch.no_grad()``, so inputs that require grad never
make the cache storage part of an autograd graph. Slot ids (int32 or int64, any strides) reach
the backends as a contiguous int64 tensor; every other input as the caller's tensor (views of
packed projections are read in place); an empty batch launches nothing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import checks
from ..backend import pick_backend
from ..step import torch_step
from . import replay


def l2norm(x, eps=1e-6):
    """x / sqrt(sum(x^2) + eps) over the last axis, in fp32 (flash-linear-attention's l2norm)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def buffered_keys(k, dtype, use_qk_l2norm):
    """(k as the buffer holds it, of ``dtype``; k_scale [..., HK] fp32, the factor that normalizes
    it: 1 / sqrt(k . k + 1e-6) of the buffered k with ``use_qk_l2norm``, else 1). The key the
    recurrence uses is k_scale * k, read back from the buffer (``replay.keys``) for new and old
    entries alike."""
    k = k.to(dtype)
    kf = k.float()
    k_scale = torch.rsqrt((kf * kf).sum(-1) + 1e-6) if use_qk_l2norm else torch.ones_like(kf[..., 0])
    return k, k_scale


def _check(cache, slots, q, k, v, g, beta, scale, draft: bool, gate=None, backend=None):
    """Validate every argument; returns the slots as ``checks.slot_ids`` does for ``backend``
    (contiguous int64, or int32 as given for Triton). ``gate``: the raw gate inputs (a, b, A_log,
    dt_bias), given instead of g and beta."""
    slots = checks.slot_ids(cache, slots, keep_int32=pick_backend(cache, backend) == "triton")
    b = slots.shape[0]
    HK, HV, K, V = cache.num_k_heads, cache.num_v_heads, cache.head_k_dim, cache.head_v_dim
    T = q.shape[1] if draft and isinstance(q, torch.Tensor) and q.dim() == 4 else 1
    if draft:
        checks.check_draft_len(cache, T)
    lead = (b, T) if draft else (b,)
    dev = cache.device
    checks.check_tensor("q", q, (*lead, HK, K), dev)
    checks.check_tensor("k", k, (*lead, HK, K), dev)
    checks.check_tensor("v", v, (*lead, HV, V), dev)
    if gate is None:
        checks.check_tensor("g", g, (*lead, *cache.decay_shape(HV, K)), dev)  # KDA: per key channel
        checks.check_tensor("beta", beta, (*lead, HV), dev)
    else:
        if g is not None or beta is not None:
            raise ValueError("g and beta must be None when the raw gate inputs a, b, A_log are given")
        gate_a, gate_b, A_log, dt_bias = gate
        if gate_a is None or gate_b is None or A_log is None:
            raise ValueError("a, b and A_log go together (dt_bias optional), or give g and beta")
        checks.check_tensor("a", gate_a, (*lead, HV), dev)
        checks.check_tensor("b", gate_b, (*lead, HV), dev)
        checks.check_tensor("A_log", A_log, (HV,), dev)
        checks.check_tensor("dt_bias", dt_bias, (HV,), dev, optional=True)
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)):
        raise ValueError(f"scale must be a float or None, got {scale!r}")
    if gate is None:
        checks.check_finite_nonpositive("g", g, cache)
    checks.check_no_pending(cache, slots)
    return slots


def gates(gate_a, gate_b, A_log, dt_bias=None):
    """(g, beta) fp32 from the raw gate inputs, as flash-linear-attention's gated delta rule takes
    them: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)."""
    x = gate_a.float() if dt_bias is None else gate_a.float() + dt_bias.float()
    return -torch.exp(A_log.float()) * F.softplus(x), torch.sigmoid(gate_b.float())


def _step(cache, slots, q, k, v, g, beta, scale, use_qk_l2norm, commit, backend, out, out_dtype, gate=None,
          parents=None):
    """o [b, T, HV, V] of ``out_dtype``, written into ``out`` ([b, T, HV, V] view) when given.
    ``gate``: the raw gate inputs instead of g and beta. ``parents`` [b, T] (validated by
    ``checks.draft_parents``) for a tree verify."""
    if scale is None:
        scale = cache.head_k_dim ** -0.5
    kind = pick_backend(cache, backend)
    cache.follow_inputs(v.dtype)  # a cache with buffer_dtype=None buffers its inputs as given
    if slots.shape[0] == 0:  # nothing to compute or store; the kernels' grids would be empty
        return torch.zeros(v.shape, dtype=out_dtype, device=v.device) if out is None else out
    if kind == "triton":  # prepares q, k, g, beta inside its kernels
        from . import triton as kernels
        o = out if out is not None and out.is_contiguous() else torch.empty(v.shape, dtype=out_dtype, device=v.device)
        kernels.step(cache, slots, q, k, v, g, beta, scale, use_qk_l2norm, commit, o, gate, parents)
        return o if out is None or o is out else out.copy_(o)
    q = (l2norm(q) if use_qk_l2norm else q.float()) * scale
    k, k_scale = buffered_keys(k, cache.buffer_dtype, use_qk_l2norm)
    g, beta = gates(*gate) if gate is not None else (g.float(), beta.float())
    entries = {"k": k, "k_scale": k_scale, "v": v, "g": g, "beta": beta}
    o = torch_step(cache, slots, q.shape[1], entries,
                   lambda state, buf, h, vis=None: replay.outputs(state, buf, h, q, vis), commit, parents)
    return o.to(out_dtype) if out is None else out.copy_(o)


@torch.no_grad()
def gdn_decode(cache, slots, q, k, v, g=None, beta=None, scale=None, use_qk_l2norm=False, backend=None, out=None,
               out_dtype=None, a=None, b=None, A_log=None, dt_bias=None):
    """One decode token per slot; refreshes the checkpoint when the window is full.

    slots int32/int64 [b] (-1 = pad); q, k [b, HK, K]; v [b, HV, V]; g [b, HV] (log decay <= 0);
    beta [b, HV]; or instead of g and beta the raw gate inputs a, b [b, HV], A_log [HV] and
    optionally dt_bias [HV] (``gates``; on the Triton backend computed inside its first launch).
    Inputs fp32/fp16/bf16, any strides, read in place on both backends (no copy): q, k, v may be
    views of one packed [b, 2 HK K + HV V] projection, the gates of another. Returns o [b, HV, V]
    (zero for pads), fp32 unless ``out_dtype``
    (fp16/bf16: the kernels store the rounded outputs); written into ``out`` when given.
    """
    gate = None if a is None and b is None and A_log is None else (a, b, A_log, dt_bias)
    slots = _check(cache, slots, q, k, v, g, beta, scale, draft=False, gate=gate, backend=backend)
    dtype = checks.output_spec(out, out_dtype, tuple(v.shape), cache.device)
    u = lambda t: None if t is None else t.unsqueeze(1)  # noqa: E731
    if gate is not None:
        gate = (u(a), u(b), A_log, dt_bias)
    o = _step(cache, slots, u(q), u(k), u(v), u(g), u(beta), scale, use_qk_l2norm, True, backend, u(out), dtype,
              gate)
    return o[:, 0] if out is None else out


@torch.no_grad()
def gdn_verify(cache, slots, q, k, v, g=None, beta=None, scale=None, use_qk_l2norm=False, backend=None, out=None,
               out_dtype=None, a=None, b=None, A_log=None, dt_bias=None, parents=None):
    """Verify T drafts per slot, output-only; nothing is committed until ``cache.accept``.

    q, k [b, T, HK, K]; v [b, T, HV, V]; g, beta (or a, b) [b, T, HV]; A_log, dt_bias [HV]; any
    strides, as in decode.
    parents int32/int64 [b, T] for a draft tree (None: a chain), as in ``mamba2_verify``: each
    draft's residual and output are those of its own ancestor chain (Triton: at most 32 drafts).
    Returns o [b, T, HV, V] (``out``, ``out_dtype`` as in decode).
    """
    gate = None if a is None and b is None and A_log is None else (a, b, A_log, dt_bias)
    slots = _check(cache, slots, q, k, v, g, beta, scale, draft=True, gate=gate, backend=backend)
    dtype = checks.output_spec(out, out_dtype, tuple(v.shape), cache.device)
    parents = checks.draft_parents(cache, slots, parents, q.shape[1], pick_backend(cache, backend))
    return _step(cache, slots, q, k, v, g, beta, scale, use_qk_l2norm, False, backend, out, dtype, gate, parents)
