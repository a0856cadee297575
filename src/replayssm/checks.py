"""Argument validation shared by every public call.

Every check raises ``ValueError`` naming the offending argument, and runs before anything in the
cache is written, so a rejected call leaves the cache bit-identical. Checks on tensor *metadata*
(shape, dtype, device) are free; checks on tensor *values* (slot ids, accepted counts, pending
verifies) read device memory and synchronize, so they run only while ``cache.check_values`` is
true and no CUDA graph is being captured (``values_checked``): a step captures with the default
settings, its value checks skipped (the same calls checked eagerly before capture catch the errors).
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int32, torch.int64)


def check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_tensor(name: str, t, shape: tuple, device: torch.device, dtypes=FLOAT_DTYPES,
                 optional: bool = False) -> None:
    """``t`` must be a tensor of exactly ``shape`` on ``device`` with a dtype in ``dtypes``."""
    if t is None:
        if optional:
            return
        raise ValueError(f"{name} is required")
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def per_head(name: str, t, shape: tuple, expanded: tuple, device: torch.device, optional: bool = False):
    """A per-head input of ``shape`` (its last axis the heads), or the same expanded over the head's
    state dims ``expanded`` with stride 0 there, as mamba_ssm's ``selective_state_update`` takes dt
    [b, H, P], A [H, P, N], D and dt_bias [H, P] ("tie_hdim", ``expand``ed views). Returns the
    ``shape`` view (the expanded dims' first entry: no copy) or None. Values that may differ along
    the expanded dims (stride != 0 on a dim of size > 1) do not fit one decay per head: ValueError."""
    full = (*shape, *expanded)
    if isinstance(t, torch.Tensor) and t.dim() == len(full) and len(expanded):
        check_tensor(name, t, full, device)
        n = len(expanded)
        if any(t.stride(d) != 0 and t.shape[d] != 1 for d in range(-n, 0)):
            raise ValueError(f"{name} of shape {full} must be expanded from one value per head (stride 0 along "
                             f"its last {n} dims, as expand() gives), got strides {tuple(t.stride())}")
        return t[(..., *([0] * n))]
    if isinstance(t, torch.Tensor) and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} or {full} (stride 0 along the last "
                         f"{len(expanded)}), got {tuple(t.shape)}")
    check_tensor(name, t, shape, device, optional=optional)
    return t


def values_checked(cache) -> bool:
    """Whether value checks run now: ``cache.check_values`` and no CUDA-graph capture in progress
    on the current stream (a value check synchronizes, which capture forbids)."""
    if not cache.check_values:
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def check_slots(cache, slots) -> int:
    """``slots``: int32 or int64 [b] of slot ids in [0, num_slots) or -1 (pad), no repeats.
    Returns b."""
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1:
        raise ValueError("slots must be a 1-D int32 or int64 tensor of slot ids")
    check_tensor("slots", slots, tuple(slots.shape), cache.device, INT_DTYPES)
    if values_checked(cache) and slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < -1 or hi >= cache.num_slots:
            raise ValueError(f"slots must lie in [-1, {cache.num_slots}), got range [{lo}, {hi}]")
        real = slots[slots >= 0]
        if real.unique().numel() != real.numel():
            raise ValueError("slots must not repeat a slot id (only the pad id -1 may repeat)")
    return slots.shape[0]


def _contiguous_ints(t, keep_int32: bool) -> torch.Tensor:
    """``t`` itself where it is contiguous and int64 (or int32 with ``keep_int32``), else a
    contiguous int64 copy."""
    if t.is_contiguous() and (t.dtype == torch.int64 or keep_int32):
        return t
    return t.to(torch.int64).contiguous()


def slot_ids(cache, slots, keep_int32: bool = False) -> torch.Tensor:
    """Validate ``slots`` (see ``check_slots``) and return them as a contiguous int64 [b] tensor,
    or as given where they are a contiguous int32 one and ``keep_int32`` (the Triton kernels load
    either width; an engine's int32 state indices then cost no copy kernel per layer and step).

    Backends index storage with the ids as laid out in memory, so a strided view is copied (a few
    bytes per row) instead of being read from its raw storage.
    """
    check_slots(cache, slots)
    return _contiguous_ints(slots, keep_int32)


def accepted_counts(cache, slots, num_accepted, keep_int32: bool = False) -> torch.Tensor:
    """Validate ``num_accepted`` against ``slots`` (already normalized by ``slot_ids``) and
    return it as a contiguous int64 [b] tensor (int32 as given with ``keep_int32``, as ``slot_ids``)."""
    check_accepted(cache, slots, num_accepted)
    return _contiguous_ints(num_accepted, keep_int32)


def check_draft_len(cache, T: int) -> None:
    if not 1 <= T <= cache.max_draft:
        raise ValueError(f"draft length (axis 1 of the inputs) must be in [1, {cache.max_draft}], got {T}")


def check_no_pending(cache, slots) -> None:
    """A decode or verify may not start while a verify of the same slot awaits ``accept``."""
    if values_checked(cache) and slots.numel():
        rows = slots[slots >= 0]
        if bool((cache.pending[rows] > 0).any()):
            bad = rows[cache.pending[rows] > 0].tolist()
            raise ValueError(f"slots {bad} have a pending verify: call accept(slots, num_accepted) first")


def check_accepted(cache, slots, num_accepted) -> None:
    """``num_accepted``: int [b], 0 <= n <= pending draft count of that slot."""
    check_tensor("num_accepted", num_accepted, tuple(slots.shape), cache.device, INT_DTYPES)
    if values_checked(cache) and slots.numel():
        valid = slots >= 0
        limit = cache.pending[slots.clamp(min=0)].to(num_accepted.dtype)
        bad = valid & ((num_accepted < 0) | (num_accepted > limit))
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"num_accepted[{i}] = {int(num_accepted[i])} is outside [0, {int(limit[i])}] "
                             f"(the pending draft count of slot {int(slots[i])})")


def check_finite_nonpositive(name: str, t, cache) -> None:
    """Log decays must be <= 0 (decay in (0, 1]); checked only with ``check_values``."""
    if values_checked(cache) and t.numel() and bool((t > 0).any()):
        raise ValueError(f"{name} must be <= 0 (a log decay), got max {float(t.max())}")


def output_spec(out, out_dtype, shape: tuple, device: torch.device) -> torch.dtype:
    """Validate a call's ``out`` (a preallocated output, or None) and ``out_dtype`` (fp32, fp16 or
    bf16; None: ``out``'s dtype, else fp32) against the output's ``shape``; returns the output dtype."""
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be one of {FLOAT_DTYPES} or None, got {out_dtype!r}")
    if out is None:
        return out_dtype or torch.float32
    check_tensor("out", out, shape, device)
    if out_dtype is not None and out.dtype != out_dtype:
        raise ValueError(f"out has dtype {out.dtype} but out_dtype is {out_dtype}")
    return out.dtype


#: Most drafts of a tree verify on the Triton backend: a draft's ancestors are one int32 bitmask.
TRITON_TREE_MAX = 32


#: Why a verify refuses a draft tree on a backend without tree kernels (KDA on Triton).
def draft_parents(cache, slots, parents, T: int, backend_kind: str):
    """``parents``: int32/int64 [b, T] (or None, a chain), -1 <= parents[i, s] < s on real rows:
    the draft that draft s follows, -1 the last committed token. Returns int64 [b, T] (PyTorch
    backend: pads and unchecked values clamped into a tree), the contiguous tensor as given
    (Triton: its kernels clamp, so a step stays free of PyTorch work), or None."""
    if parents is None:
        return None
    check_tensor("parents", parents, (slots.shape[0], T), cache.device, INT_DTYPES)
    if backend_kind == "triton" and T > TRITON_TREE_MAX:
        raise ValueError(f"parents: backend='triton' verifies trees of at most {TRITON_TREE_MAX} drafts, got {T}")
    parents = parents.contiguous() if backend_kind == "triton" else parents.to(torch.int64).contiguous()
    if values_checked(cache) and slots.numel():
        s = torch.arange(T, device=parents.device)
        bad = (slots >= 0)[:, None] & ((parents < -1) | (parents >= s))
        if bool(bad.any()):
            i, j = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"parents[{i}, {j}] = {int(parents[i, j])} must be in [-1, {j}) "
                             f"(a draft follows an earlier draft or the last committed token)")
    if backend_kind == "triton":
        return parents
    # pads (and values left unchecked) never index outside the tree: pads become a chain
    s = torch.arange(T, device=parents.device)
    parents = torch.where((slots >= 0)[:, None], torch.minimum(parents, s - 1).clamp(min=-1), s - 1)
    return parents


def accepted_path(cache, slots, num_accepted, path, keep_int32: bool = False) -> torch.Tensor | None:
    """``path``: int32/int64 [b, W] (1 <= W <= max_draft) or None (0, 1, 2, ...). On real rows its
    first num_accepted[i] entries must be pending drafts forming a root path of the pending
    verify's tree (``cache.pending_parents``). Returns int64 [b, W] (int32 as given with
    ``keep_int32``, as ``slot_ids``) or None."""
    if path is None:
        path_t = None
        W = cache.max_draft
    else:
        if not isinstance(path, torch.Tensor) or path.dim() != 2:
            raise ValueError("path must be a 2-D int32 or int64 tensor [b, W]")
        W = path.shape[1]
        check_tensor("path", path, (slots.shape[0], W), cache.device, INT_DTYPES)
        if not 1 <= W <= cache.max_draft:
            raise ValueError(f"path must have 1 to max_draft={cache.max_draft} columns, got {W}")
        path_t = _contiguous_ints(path, keep_int32)
    if not (values_checked(cache) and slots.numel()):
        return path_t
    valid = slots >= 0
    rows = slots.clamp(min=0)
    n = torch.where(valid, num_accepted, 0)
    if path_t is not None and bool((n > W).any()):
        i = int((n > W).nonzero()[0])
        raise ValueError(f"num_accepted[{i}] = {int(n[i])} exceeds the path's length {W}")
    cols = torch.arange(W, device=cache.device)
    used = cols[None, :] < n[:, None]  # [b, W]
    p = cols.expand(slots.shape[0], W) if path_t is None else path_t
    pending = cache.pending[rows].long()
    out = used & ((p < 0) | (p >= pending[:, None]))
    if path_t is not None and bool(out.any()):  # without a path, n <= pending already holds
        i, j = (int(v) for v in out.nonzero()[0])
        raise ValueError(f"path[{i}, {j}] = {int(p[i, j])} is not a pending draft of slot "
                         f"{int(slots[i])} (it has {int(pending[i])})")
    parent = torch.gather(cache.pending_parents(rows), 1, p.clamp(0, cache.max_draft - 1).long())
    before = torch.cat([torch.full_like(p[:, :1], -1), p[:, :-1]], 1)
    broken = used & (parent != before)
    if bool(broken.any()):
        i, j = (int(v) for v in broken.nonzero()[0])
        name = "path" if path_t is not None else "num_accepted (no path: drafts 0, 1, 2, ...)"
        raise ValueError(f"{name}: entry {j} of row {i} is draft {int(p[i, j])}, whose parent is "
                         f"{int(parent[i, j])}, not {int(before[i, j])}: not a root path of the "
                         f"pending draft tree")
    return path_t
