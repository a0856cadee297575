"""One decode or verify step of the PyTorch backend, common to both layer kinds.

The order is the same for every architecture:

1. refresh the slots whose committed history plus the T new tokens would overflow the window
   (h + T > L), folding only their *committed* entries, from the anchor;
2. append the T new entries at positions h .. h+T-1;
3. compute outputs from the read copy and the buffer (the architecture's output-only form);
4. commit (decode) or mark the T entries pending (verify).

A tree verify (``parents`` given) changes only step 3: draft s sees the committed history and its
ancestors (``tree_visibility``), never its siblings or their subtrees.

Every per-slot decision is a device-side mask: no host synchronization on CUDA, so a step can
be captured in a CUDA graph. (On CPU the refresh is skipped when no slot needs it.)
"""
from __future__ import annotations

import torch


def torch_step(cache, slots, T: int, entries: dict, outputs, commit: bool, parents=None):
    """Run one step.

    entries: dict of buffer fields, each [b, T, ...], for the new tokens.
    outputs: callable (read_state [b,H,dv,dk] fp32, buffer dict [b,L,...], h [b] int64[, visible])
             -> (y [b, T, ...], dict of extra buffer fields [b, T, ...] to store for the new tokens);
             ``visible`` (bool [b, L, L], see ``tree_visibility``) is passed for tree verifies only.
    parents: int64 [b, T] (validated) for a tree verify, None for a chain.
    Returns y with pad rows zeroed.
    """
    rows, valid = cache.rows_of(slots)
    h = torch.where(valid, cache.committed[rows].long(), 0)
    need = valid & (h + T > cache.window)
    if slots.device.type != "cpu" or bool(need.any()):
        cache.refresh(rows, need)
    h = torch.where(need, 0, h)
    cache.append(rows, h, entries)
    args = (cache.decode_read(rows), cache.gather(rows, h + T), h)
    if parents is None:
        y, extra = outputs(*args)
    else:
        y, extra = outputs(*args, tree_visibility(parents, h, cache.window))
    if extra:
        cache.append(rows, h, extra)
    if commit:
        cache.committed[rows] = torch.where(valid, (h + T).to(torch.int32), cache.committed[rows])
        cache.tokens[rows] += valid.long() * T
    else:
        cache.pending[rows] = torch.where(valid, T, cache.pending[rows])
        if parents is not None:  # accept validates its path against them
            gaps = torch.arange(-1, T - 1, device=parents.device) - parents
            old = cache.draft_gaps[rows, :T]
            cache.draft_gaps[rows, :T] = torch.where(valid[:, None], gaps.to(old.dtype), old)
    return torch.where(valid.view(-1, *([1] * (y.dim() - 1))), y, 0)


def ancestors(parents):
    """Ancestor-or-self relation of a draft tree: bool [b, T, T], [i, s, a] true when draft a is
    draft s or one of its ancestors. parents int64 [b, T] with -1 <= parents[i, s] < s."""
    b, T = parents.shape
    eye = torch.eye(T, dtype=torch.bool, device=parents.device)
    rows = []
    for s in range(T):  # parents come earlier, so their rows are complete
        row = eye[s].expand(b, T)
        if s:
            p = parents[:, s]
            above = torch.stack(rows, 1)[torch.arange(b, device=p.device), p.clamp(min=0)]
            row = row | (above & (p >= 0)[:, None])
        rows.append(row)
    return torch.stack(rows, 1)


def tree_visibility(parents, h, L: int):
    """Which buffer entries each buffer position sees: bool [b, L(j), L(i)].

    Committed positions (< h) and positions past the drafts see the causal prefix i <= j; draft
    position j = h + s sees the committed history and the drafts on its own root path (itself
    included). parents int64 [b, T]; h int64 [b].
    """
    T = parents.shape[1]
    anc = ancestors(parents)
    pos = torch.arange(L, device=h.device)
    rel = pos[None, :] - h[:, None]  # [b, L] draft index of each position
    draft = (rel >= 0) & (rel < T)
    r = rel.clamp(0, T - 1)
    b = torch.arange(h.shape[0], device=h.device)[:, None, None]
    on_path = anc[b, r[:, :, None], r[:, None, :]]  # [b, L, L]
    causal = pos[None, None, :] <= pos[None, :, None]
    both = draft[:, :, None] & draft[:, None, :]
    return torch.where(both, on_path, causal.expand_as(on_path))


def path_log_decay(log_alpha, t, visible=None):
    """Log decays from the checkpoint, sum_{i <= t_s} log_alpha_i, for query positions ``t``.

    log_alpha [b, L, ...] fp32 (any trailing axes: heads, or heads and key channels); t int64
    [b, T]. Returns [b, T, ...]. ``visible`` (bool [b, T, L], optional: a draft tree's ancestor
    mask, as in ``segment_log_decay``) sums over the entries on the query's path instead of the
    causal prefix, so a draft never decays by its siblings.
    """
    if visible is None:
        idx = t.view(*t.shape, *([1] * (log_alpha.dim() - 2))).expand(-1, -1, *log_alpha.shape[2:])
        return torch.gather(log_alpha.cumsum(1), 1, idx)
    vis = visible.view(*visible.shape, *([1] * (log_alpha.dim() - 2)))
    return torch.where(vis, log_alpha[:, None], 0.0).sum(2)


def segment_log_decay(log_alpha, t, visible=None):
    """Log decays sum_{i=j+1..t_s} log_alpha_i for query positions ``t`` and entries ``j``.

    log_alpha [b, L, H] fp32; t int64 [b, T]. Returns [b, T, L, H]: the segment sum for
    j <= t_s (0 at j = t_s), -inf for j > t_s (masked before the exponent). Each segment is
    summed directly (a masked suffix cumsum) rather than as c_t - c_j of two prefix sums: once a
    prefix sum is large (strong decays, long windows) that difference loses ~ulp(c) absolutely,
    which is a relative error of every decay factor.

    ``visible`` (bool [b, T, L], optional) replaces the causal mask j <= t_s: the entries on the
    query's path (a draft tree's ancestor mask); the segment then sums along that path only.
    """
    L = log_alpha.shape[1]
    pos = torch.arange(L, device=log_alpha.device)
    causal = pos[None, None, :] <= t[:, :, None] if visible is None else visible  # [b, T, L]
    terms = torch.where(causal[..., None], log_alpha[:, None], 0.0)  # log_alpha_i for i <= t_s
    suffix = terms.flip(2).cumsum(2).flip(2)  # sum_{j <= i <= t_s}
    seg = torch.cat([suffix[:, :, 1:], torch.zeros_like(suffix[:, :, :1])], 2)  # sum_{j < i <= t_s}
    return torch.where(causal[..., None], seg, float("-inf"))
