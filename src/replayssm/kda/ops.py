"""Public Kimi Delta Attention calls: ``kda_decode`` and ``kda_verify``.

public call -> argument checks -> backend: PyTorch (input preparation, L2 norm and scale, here)
or Triton (``kda/triton.py``, which prepares its inputs inside its first launch).

``backend=None`` picks Triton for a CUDA cache, as for the other layer kinds. Both calls are
inference (``torch.no_grad()``); slot ids (int32 or int64, any strides) reach the backend as a
contiguous int64 tensor; an empty batch computes nothing.
"""
from __future__ import annotations

import torch

from .. import checks
from ..backend import pick_backend
from ..gdn import ops as gdn_ops
from ..gdn.ops import buffered_keys, l2norm
from ..step import torch_step
from . import replay


def _check(cache, slots, q, k, v, g, beta, scale, backend, draft: bool):
    """Validate every argument (GDN's checks, g [..., HV, K]; the backend's name); returns the slots
    as GDN's checks give them."""
    return gdn_ops._check(cache, slots, q, k, v, g, beta, scale, draft, backend=backend)


def _step(cache, slots, q, k, v, g, beta, scale, use_qk_l2norm, commit, backend, out, out_dtype, parents=None):
    """o [b, T, HV, V] of ``out_dtype``, written into ``out`` ([b, T, HV, V] view) when given.
    ``parents`` [b, T] (validated by ``checks.draft_parents``) for a tree verify."""
    if scale is None:
        scale = cache.head_k_dim ** -0.5
    kind = pick_backend(cache, backend)
    cache.follow_inputs(v.dtype)  # a cache with buffer_dtype=None buffers its inputs as given
    if slots.shape[0] == 0:  # nothing to compute or store; the kernels' grids would be empty
        return torch.zeros(v.shape, dtype=out_dtype, device=v.device) if out is None else out
    if kind == "triton":  # prepares q, k inside its kernels
        from . import triton as kernels
        o = out if out is not None and out.is_contiguous() else torch.empty(v.shape, dtype=out_dtype, device=v.device)
        kernels.step(cache, slots, q, k, v, g, beta, scale, use_qk_l2norm, commit, o, parents)
        return o if out is None or o is out else out.copy_(o)
    q = (l2norm(q) if use_qk_l2norm else q.float()) * scale
    k, k_scale = buffered_keys(k, cache.buffer_dtype, use_qk_l2norm)
    entries = {"k": k, "k_scale": k_scale, "v": v, "g": g.float(), "beta": beta.float()}
    o = torch_step(cache, slots, q.shape[1], entries,
                   lambda state, buf, h, vis=None: replay.outputs(state, buf, h, q, vis), commit, parents)
    return o.to(out_dtype) if out is None else out.copy_(o)


@torch.no_grad()
def kda_decode(cache, slots, q, k, v, g, beta, scale=None, use_qk_l2norm=False, backend=None, out=None,
               out_dtype=None):
    """One decode token per slot; refreshes the checkpoint when the window is full.

    slots int32/int64 [b] (-1 = pad); q, k [b, HK, K]; v [b, HV, V]; g [b, HV, K] (per-channel
    log decay <= 0); beta [b, HV]. Inputs fp32/fp16/bf16, any strides, read in place on both
    backends (no copy): q, k, v may be views of one packed projection, g and beta of another.
    ``backend`` None, "torch" or "triton".
    Returns o [b, HV, V] (zero for pads), fp32 unless ``out_dtype`` (fp16/bf16: the kernels store
    the rounded outputs); written into ``out`` when given.
    """
    slots = _check(cache, slots, q, k, v, g, beta, scale, backend, draft=False)
    dtype = checks.output_spec(out, out_dtype, tuple(v.shape), cache.device)
    u = lambda t: None if t is None else t.unsqueeze(1)  # noqa: E731
    o = _step(cache, slots, u(q), u(k), u(v), u(g), u(beta), scale, use_qk_l2norm, True, backend, u(out), dtype)
    return o[:, 0] if out is None else out


@torch.no_grad()
def kda_verify(cache, slots, q, k, v, g, beta, scale=None, use_qk_l2norm=False, backend=None, parents=None,
               out=None, out_dtype=None):
    """Verify T drafts per slot, output-only; nothing is committed until ``cache.accept``.

    q, k [b, T, HK, K]; v [b, T, HV, V]; g [b, T, HV, K]; beta [b, T, HV]; any strides, as in
    decode.
    parents int32/int64 [b, T] for a draft tree (None: a chain), as in ``gdn_verify``: each
    draft's per-channel decays, residual and output are those of its own ancestor chain (both
    backends; Triton: at most 32 drafts).
    Returns o [b, T, HV, V] (``out``, ``out_dtype`` as in decode).
    """
    slots = _check(cache, slots, q, k, v, g, beta, scale, backend, draft=True)
    dtype = checks.output_spec(out, out_dtype, tuple(v.shape), cache.device)
    parents = checks.draft_parents(cache, slots, parents, q.shape[1], pick_backend(cache, backend))
    return _step(cache, slots, q, k, v, g, beta, scale, use_qk_l2norm, False, backend, out, dtype, parents)
