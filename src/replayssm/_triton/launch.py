"""Launch plumbing shared by the Mamba-2, GDN and KDA kernels, and the launch policy.

A step is two launches (GDN and KDA: three) with no host synchronization and no PyTorch work in
between:

1. the architecture's scores kernel, one program per (batch row, group or key head): the input
   preparation (softplus and log decays; L2 norms and the query scale), the dot products of the
   window's keys with the new queries, a copy of each batch row's committed count that the next
   launch reads without waiting on the slot id, the list of slots whose window is full
   (``window.list_due``) and their refresh's per-token scalars: Mamba-2's fold weights and decays
   here; GDN's decays and the inverse of its residual system in a launch of their own that follows
   (``_gdn_solve_kernel``, over the slots due only: its registers would hold the scores launch at
   a third of its occupancy). Those scalars are computed at one shape for every preset and batch,
   so that the anchor's bits cannot depend on the step kernel's tile shape;
2. the step kernel, one program per (block of state rows, head, batch row). A program whose slot
   is due folds its rows into a new checkpoint (from the anchor), encodes anchor and read copy
   from the same unrounded state, then computes its outputs from the read copy like every other
   program; a refresh is a branch of the step, not a launch of its own. One program per batch row
   then advances it (``advance_row``): the new tokens' *shared* buffer fields (B or k per group,
   dt/log decay/beta per head, read by several programs) and the cursors. For a slot folding in
   this launch that is the last of its programs to finish, since the new tokens go to positions
   0..T-1, which the others are still folding.

Where the policy says so (``StepShape.beside``: GDN decode from fp32 and 2-byte read copies, GDN
steps below batch 64 that expect a slot due, Mamba-2 decode from 2-byte and fp8 read copies), the
slots due run on a side stream (``side_stream``): GDN's solve, a refresh launch where the shape
splits it, then a step launch over them only (``DUE_ONLY``; its programs refresh first where the
refresh is a branch), beside the step launch over the others (``NOT_DUE``); the current stream
waits for the side stream after its own step launch.

Every launch goes through ``run``; at small batches (``programmatic``) each one is scheduled while
the one before it drains, and waits for it before its first memory access (``after_previous_launch``).

The policy (``step_shape``) is one table per architecture: rows per program, warps, and how the
outputs read the read copy. A refresh folds 32-row sub-tiles (``FOLD_ROWS``) whatever the program's
rows, with fp32-accurate products on tensor cores and no reduction whose order
depends on the layout, so the anchor's bits are the same for every read format.
"""
from __future__ import annotations

import contextlib
import functools
import math
import re
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .formats import FMT_IDS, as_stored

#: Rows of a refresh's fold sub-tile: a program folds its rows this many at a time. 16 measured
#: slower (H200, batch 256: GDN decode s32_rs 376.2 against 366.9 us, tp8_hi32 321.8 against 290.2,
#: verify of T = 4 869.1 against 805.0; Mamba-2 verify 641.4 against 632.2), with 1-warp refresh
#: programs or 64-column passes too.
FOLD_ROWS = 32


@triton.jit
def after_previous_launch(PDL: tl.constexpr):
    """First statement of every kernel of a step. With PDL (programmatic dependent launch,
    ``programmatic``), a launch may start before the one before it has finished: wait here until
    it has, and its writes are visible, then let the next launch start too. Only the launch
    latency and the block scheduling overlap, never memory accesses, so the results are the same."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _field_at(src_ptr, sb, st, sh, se, pid, s, F: tl.constexpr, F_PAD: tl.constexpr, W: tl.constexpr):
    """src[pid, s] [F_PAD] (zero from F on) of a [b, T, F / W, W] view of strides (sb, st, sh, se)
    (``token_strides``)."""
    f = tl.arange(0, F_PAD)
    if sh == W * se:  # one run of F elements (a dense or packed input): no per-head index math, whose
        off = f * se  # tensors two fields of one size would share, pinning both copies to one layout
    else:
        off = (f // W) * sh + (f % W) * se
    return tl.load(src_ptr + pid * sb + s * st + off, mask=f < F)


@triton.jit
def _store_field(vals, dst_ptr, row, at, L: tl.constexpr, F: tl.constexpr, F_PAD: tl.constexpr):
    """dst[row, at, :F] = vals [F_PAD], dst [rows, L, F] contiguous, in its dtype."""
    f = tl.arange(0, F_PAD)
    tl.store(dst_ptr + (row * L + at) * F + f, as_stored(vals, dst_ptr.dtype.element_ty), mask=f < F)


@triton.jit
def advance_row(pid_b, valid, row, start, need, first, counted, tokens_ptr, committed_ptr, pending_ptr,
                refreshes_ptr, done_ptr, s1, s1b: tl.constexpr, s1t: tl.constexpr, s1h: tl.constexpr,
                s1e: tl.constexpr, d1, s2, s2b: tl.constexpr, s2t: tl.constexpr, s2h: tl.constexpr,
                s2e: tl.constexpr, d2, s3, s3b: tl.constexpr, s3t: tl.constexpr, s3h: tl.constexpr,
                s3e: tl.constexpr, d3, s4, s4b: tl.constexpr, s4t: tl.constexpr, s4h: tl.constexpr,
                s4e: tl.constexpr, d4, T: tl.constexpr, L: tl.constexpr, COMMIT: tl.constexpr, F1: tl.constexpr,
                F1P: tl.constexpr, W1: tl.constexpr, F2: tl.constexpr, F2P: tl.constexpr, W2: tl.constexpr,
                F3: tl.constexpr, F3P: tl.constexpr, W3: tl.constexpr, F4: tl.constexpr, F4P: tl.constexpr,
                W4: tl.constexpr, DIRECT: tl.constexpr):
    """The last statement of a step program on batch row ``pid_b`` (storage ``row``, ``valid``: not
    a pad): one program per batch row advances it, writing the new tokens' shared buffer fields,
    three or four (s_i, a [b, T, ...] view of strides s_ib, s_it, s_ih, s_ie, into the contiguous
    buffer d_i [rows, L, F_i]; F4 = 0: no fourth) at positions ``start`` (h, or 0 after a refresh)
    .. start + T - 1, and the cursors. Which program: where no program of the launch reads the
    row's buffered shared fields (``counted`` false: no refresh folds in this launch), the
    ``first`` one (row block 0 of head 0); otherwise the last of the row's programs to finish,
    counted in ``done`` [rows] (then reset to zero), because the fold of the others reads the
    entries the new tokens overwrite. So the advance needs no launch of its own.

    DIRECT (a step of one launch): where the row does not refresh, the programs that prepare the
    fields have stored them into the buffer themselves (no program reads those entries), so the
    last program only moves the cursors, and counts itself with a relaxed atomic: it then reads
    nothing the others wrote, and every program's loads of the row's cursor and window have
    returned before its count, since the outputs it stored before depend on them. At batch 1 the
    advance is the step's tail: the fence of an acquire-release count and the round trip of the
    fields' loads were two of its round trips."""
    if valid:
        go = first
        if counted:
            tl.debug_barrier()  # every thread of the program is done with the row's entries
        refreshes, tokens = tl.load(refreshes_ptr + row), tl.load(tokens_ptr + row)  # before the count: no wait
        if counted:
            last = tl.num_programs(0) * tl.num_programs(1) - 1
            if DIRECT:
                if need:
                    go = tl.atomic_add(done_ptr + row, 1, sem="acq_rel") == last
                else:
                    go = tl.atomic_add(done_ptr + row, 1, sem="relaxed") == last
            else:
                go = tl.atomic_add(done_ptr + row, 1, sem="acq_rel") == last
            if go:
                tl.store(done_ptr + row, 0)
        if go:
            if DIRECT:
                if need:
                    _copy_fields(pid_b, row, start, s1, s1b, s1t, s1h, s1e, d1, s2, s2b, s2t, s2h, s2e, d2, s3, s3b,
                                 s3t, s3h, s3e, d3, s4, s4b, s4t, s4h, s4e, d4, T, L, F1, F1P, W1, F2, F2P, W2, F3,
                                 F3P, W3, F4, F4P, W4)
            else:
                _copy_fields(pid_b, row, start, s1, s1b, s1t, s1h, s1e, d1, s2, s2b, s2t, s2h, s2e, d2, s3, s3b, s3t,
                             s3h, s3e, d3, s4, s4b, s4t, s4h, s4e, d4, T, L, F1, F1P, W1, F2, F2P, W2, F3, F3P, W3,
                             F4, F4P, W4)
            if need:
                tl.store(refreshes_ptr + row, refreshes + 1)
            if COMMIT:
                tl.store(committed_ptr + row, (start + T).to(committed_ptr.dtype.element_ty))
                tl.store(tokens_ptr + row, tokens + T)
                tl.store(pending_ptr + row, 0)
            else:
                tl.store(committed_ptr + row, start.to(committed_ptr.dtype.element_ty))
                tl.store(pending_ptr + row, T)


@triton.jit
def _copy_fields(pid_b, row, start, s1, s1b: tl.constexpr, s1t: tl.constexpr, s1h: tl.constexpr, s1e: tl.constexpr,
                 d1, s2, s2b: tl.constexpr, s2t: tl.constexpr, s2h: tl.constexpr, s2e: tl.constexpr, d2, s3,
                 s3b: tl.constexpr, s3t: tl.constexpr, s3h: tl.constexpr, s3e: tl.constexpr, d3, s4, s4b: tl.constexpr,
                 s4t: tl.constexpr, s4h: tl.constexpr, s4e: tl.constexpr, d4, T: tl.constexpr, L: tl.constexpr,
                 F1: tl.constexpr, F1P: tl.constexpr, W1: tl.constexpr, F2: tl.constexpr, F2P: tl.constexpr,
                 W2: tl.constexpr, F3: tl.constexpr, F3P: tl.constexpr, W3: tl.constexpr, F4: tl.constexpr,
                 F4P: tl.constexpr, W4: tl.constexpr):
    """``advance_row``'s copy of the new tokens' shared fields into the buffer at positions start ..
    start + T - 1. Every load of a token issued before its stores: at batch 1 the advance is the
    step's tail, a round trip per load that waits on a store. A token at a time, in a loop that is
    not unrolled: a whole [T, F] tile (GDN's k: 2048 elements per token) made the step kernels that
    run under a register cap spill."""
    for s in tl.range(0, T, num_stages=1):
        f1 = _field_at(s1, s1b, s1t, s1h, s1e, pid_b, s, F1, F1P, W1)
        f2 = _field_at(s2, s2b, s2t, s2h, s2e, pid_b, s, F2, F2P, W2)
        f3 = _field_at(s3, s3b, s3t, s3h, s3e, pid_b, s, F3, F3P, W3)
        if F4 > 0:
            f4 = _field_at(s4, s4b, s4t, s4h, s4e, pid_b, s, F4, F4P, W4)
            _store_field(f4, d4, row, start + s, L, F4, F4P)
        _store_field(f1, d1, row, start + s, L, F1, F1P)
        _store_field(f2, d2, row, start + s, L, F2, F2P)
        _store_field(f3, d3, row, start + s, L, F3, F3P)


@triton.jit
def accept_kernel(slots_ptr, accepted_ptr, committed_ptr, pending_ptr, tokens_ptr, gaps_ptr, B,
                  BLOCK: tl.constexpr, MAXD: tl.constexpr, MAXDP: tl.constexpr, PDL: tl.constexpr):
    """``cache.accept`` in one launch: for each real slot of a block of batch rows, n = the
    accepted count clamped to [0, pending]; committed += n, tokens += n, pending = 0, and the
    pending verify's draft tree forgotten (``draft_gaps`` [rows, MAXD] zeroed: the next verify is a
    chain unless it says otherwise). Pads (-1) are skipped; slot ids do not repeat, so no two
    programs touch one slot."""
    after_previous_launch(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + i, mask=i < B, other=-1)
    real = slot >= 0
    pending = tl.load(pending_ptr + slot, mask=real, other=0)
    n = tl.minimum(tl.maximum(tl.load(accepted_ptr + i, mask=real, other=0), 0), pending)
    tl.store(committed_ptr + slot, tl.load(committed_ptr + slot, mask=real) + n.to(committed_ptr.dtype.element_ty),
             mask=real)
    tl.store(tokens_ptr + slot, tl.load(tokens_ptr + slot, mask=real) + n.to(tokens_ptr.dtype.element_ty), mask=real)
    tl.store(pending_ptr + slot, tl.zeros_like(pending), mask=real)
    d = tl.arange(0, MAXDP)[None, :]
    tl.store(gaps_ptr + slot[:, None] * MAXD + d, tl.zeros((BLOCK, MAXDP), tl.int32), mask=real[:, None] & (d < MAXD))


@triton.jit
def _move_entries(buf_ptr, row, h, src, moved, c, W: tl.constexpr, WP: tl.constexpr, L: tl.constexpr,
                  F: tl.constexpr, CH: tl.constexpr):
    """Elements c CH .. (c + 1) CH of the per-token entries of one buffer field [rows, L, F]: copy
    entry ``src`` [WP] to h + n for the columns n that are ``moved``. Every source is loaded before
    any destination is stored (a source may be another column's destination)."""
    if c * CH < F:
        n = tl.arange(0, WP)[:, None]
        e = c * CH + tl.arange(0, CH)[None, :]
        m = moved[:, None] & (e < F)
        vals = tl.load(buf_ptr + (row * L + src[:, None]) * F + e, mask=m)
        tl.debug_barrier()  # the loads of every thread before any store
        tl.store(buf_ptr + (row * L + h + n) * F + e, vals, mask=m)


@triton.jit
def compact_kernel(slots_ptr, accepted_ptr, committed_ptr, pending_ptr, path_ptr, f0, f1, f2, f3, f4, f5,
                   W: tl.constexpr, WP: tl.constexpr, L: tl.constexpr, F0: tl.constexpr, F1: tl.constexpr,
                   F2: tl.constexpr, F3: tl.constexpr, F4: tl.constexpr, F5: tl.constexpr, CH: tl.constexpr,
                   PDL: tl.constexpr):
    """The first half of ``cache.accept`` with a path (int [b, W]), before ``accept_kernel``:
    program (batch row, c) copies elements c CH .. (c + 1) CH of every buffer field's entries
    (f0 .. f5 [rows, L, F_i], F_i = 0: no field) of the accepted drafts, window positions h +
    path[n] -> h + n for n < the accepted count clamped to [0, pending] and to W, the columns with
    path[n] = n left alone. Path entries are clamped to the pending drafts, so unchecked values
    never reach outside the slot's window. Pads are skipped."""
    after_previous_launch(PDL)
    pid_b, c = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + pid_b)
    if slot >= 0:
        row = slot.to(tl.int64)
        h = tl.load(committed_ptr + row)
        pending = tl.load(pending_ptr + row)
        count = tl.minimum(tl.maximum(tl.load(accepted_ptr + pid_b), 0), pending)
        n = tl.arange(0, WP)
        p = tl.load(path_ptr + pid_b * W + n, mask=n < W, other=0).to(tl.int32)
        p = tl.minimum(tl.maximum(p, 0), tl.maximum(pending - 1, 0))
        moved = (n < W) & (n < count) & (p != n)
        src = h + p
        _move_entries(f0, row, h, src, moved, c, W, WP, L, F0, CH)
        if F1 > 0:
            _move_entries(f1, row, h, src, moved, c, W, WP, L, F1, CH)
        if F2 > 0:
            _move_entries(f2, row, h, src, moved, c, W, WP, L, F2, CH)
        if F3 > 0:
            _move_entries(f3, row, h, src, moved, c, W, WP, L, F3, CH)
        if F4 > 0:
            _move_entries(f4, row, h, src, moved, c, W, WP, L, F4, CH)
        if F5 > 0:
            _move_entries(f5, row, h, src, moved, c, W, WP, L, F5, CH)


#: Batch rows per program of ``accept_kernel``.
ACCEPT_BLOCK = 128

#: Elements of a buffer entry per program of ``compact_kernel``; at most this many fields.
COMPACT_CHUNK = 1024
COMPACT_FIELDS = 6


def accept(cache, slots, num_accepted, path=None):
    """Launch ``accept_kernel`` (a verify round's commit): one launch where the PyTorch form is
    about twenty small ones; with a ``path`` (int [b, W]), ``compact_kernel`` before it. Arguments
    already validated by ``cache.accept``."""
    b = slots.shape[0]
    if b and path is not None:
        fields = list(cache.buffer.values())
        if len(fields) > COMPACT_FIELDS:
            raise ValueError(f"accept with a path moves at most {COMPACT_FIELDS} buffer fields, got {len(fields)}")
        sizes = [f[0, 0].numel() for f in fields]
        chunk = min(COMPACT_CHUNK, triton.next_power_of_2(max(sizes)))
        pad = COMPACT_FIELDS - len(fields)
        W = path.shape[1]
        run(compact_kernel, (b, triton.cdiv(max(sizes), chunk)), slots, num_accepted, cache.committed,
            cache.pending, path.contiguous(), *fields, *[fields[0]] * pad, W=W, WP=triton.next_power_of_2(W),
            L=cache.window, **{f"F{i}": v for i, v in enumerate(sizes + [0] * pad)}, CH=chunk)
    if b:
        run(accept_kernel, (triton.cdiv(b, ACCEPT_BLOCK),), slots, num_accepted, cache.committed, cache.pending,
            cache.tokens, cache.draft_gaps, b, BLOCK=ACCEPT_BLOCK, MAXD=cache.max_draft,
            MAXDP=triton.next_power_of_2(cache.max_draft))


def _launch(kernel, grid, args, kwargs):
    kernel[grid](*args, **kwargs)


#: How ``run`` launches; ``benchmarks/ptxas_report.py`` swaps in a recorder to compile the
#: kernels of a step for a GPU target on a machine without one, and tests record the launches.
LAUNCHER = _launch

#: Largest batch whose steps use programmatic dependent launch (``programmatic``): it hides the
#: gaps between short launches (H200, batch 1: about 1.7 us per step), but slowed batch >= 32.
PROGRAMMATIC_MAX_BATCH = 16


def programmatic(slots) -> bool:
    """Whether the launches of a step over batch rows ``slots`` use programmatic dependent launch
    (Hopper and later). ``TUNING["pdl"]`` overrides the choice by batch size."""
    if slots.device.type != "cuda" or not _hopper_or_later(slots.device):
        return False
    return TUNING.get("pdl", slots.shape[0] <= PROGRAMMATIC_MAX_BATCH)


@functools.lru_cache(maxsize=None)
def _hopper_or_later(device) -> bool:
    """Whether the GPU has programmatic dependent launch (compute capability >= 9); asked once
    per device rather than on every launch."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def run(kernel, grid, *args, **kwargs):
    """Launch ``kernel[grid](*args, **kwargs)``: every launch of a step goes through here. Sets the
    kernel's PDL constexpr (``after_previous_launch``) by ``programmatic`` of the first argument
    (the slot ids)."""
    kwargs["PDL"] = programmatic(args[0])
    if kwargs["PDL"]:
        kwargs["launch_pdl"] = True
    LAUNCHER(kernel, grid, args, kwargs)


#: A step launch's ``DUE``: which batch rows its programs work on.
EVERY_SLOT, NOT_DUE, DUE_ONLY, DUE_FIRST = 0, 1, 2, 3


@functools.lru_cache(maxsize=None)
def _side_stream(device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device, priority=-1)  # high priority: its programs start first


@contextlib.contextmanager
def side_stream(device):
    """Launches inside run on a high-priority side stream of ``device``, after the work queued so far
    on the current stream and beside what is queued there next, until ``join_side_stream``. The
    slots due to refresh (a few per staggered step) then run beside the other slots' step instead
    of before it: their latency-bound refresh hides under the other programs' streaming. Off the
    GPU, in order on the current stream."""
    if device.type != "cuda":
        yield
        return
    side = _side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield


def join_side_stream(device):
    """The current stream waits for the side stream's launches (``side_stream``)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).wait_stream(_side_stream(device))


def step_launches(kernel, tile, b, shape, programs, rounds, args, consts, extra, due_work=()):
    """The step launches of ``shape`` over b batch rows: ``due_work`` first ((kernel, grid, args,
    constexprs) launches the slots due need before their step: GDN's solve, a refresh launch), then
    ``kernel`` over grid tile + (b,) with REFRESH where the refresh is a branch; with ``beside``,
    the due work and a DUE_ONLY launch over tile + (programs,) (``rounds`` ranks per program,
    ``refresh_grid``) on the side stream, beside a NOT_DUE launch. ``extra``: options of the launch
    over every slot only (its register cap)."""
    dev = args[0].device
    if shape.beside:
        with side_stream(dev):
            for k, grid, a, c in due_work:
                run(k, grid, *a, **c)
            run(kernel, (*tile, programs), *args, REFRESH=not shape.split, DUE=DUE_ONLY, ROUNDS=rounds, **consts)
        run(kernel, (*tile, b), *args, REFRESH=False, DUE=NOT_DUE, ROUNDS=1, **extra, **consts)
        join_side_stream(dev)
    else:
        for k, grid, a, c in due_work:
            run(k, grid, *a, **c)
        every = DUE_FIRST if shape.due_first and not shape.split else EVERY_SLOT
        run(kernel, (*tile, b), *args, REFRESH=not shape.split, DUE=every, ROUNDS=1, **extra, **consts)


def register_cap(maxnreg: int) -> dict:
    """The launch option capping a kernel's registers per thread at ``maxnreg`` (ptxas), none for 0
    (``StepShape.maxnreg``, ``StepShape.refresh_maxnreg``)."""
    return {"maxnreg": maxnreg} if maxnreg else {}


def token_strides(t) -> tuple[int, int, int, int]:
    """Strides (batch, token, head, element), in elements, of a [b, T, heads, width] input, or of
    a [b, T, heads] one seen as width 1: how every kernel indexes a caller's per-token tensor, so
    that views (q, k, v split from one packed projection, x, B, C from one xBC, dt from one
    in_proj output) run without a copy. The kernels take them as constexprs: the addresses fold
    into constants as with dense indexing (contiguous inputs: (T H W, H W, W, 1)): the step and
    scores kernels' instruction counts are within 1% of dense indexing's (``ptxas_report.py``;
    as runtime arguments, up to 3% more). Each layout compiles once: a model's inputs keep theirs
    from step to step."""
    st = t.stride()
    return (st[0], st[1], st[2], st[3] if t.dim() > 3 else 1)


def head_stride(t) -> int:
    """The stride of a per-head constant [H] (A, D, dt_bias, A_log), 0 for None: a strided view
    runs as it is (a constexpr of the kernels, as ``token_strides``)."""
    return 0 if t is None else t.stride(0)


#: Shared buffer fields ``advance_row`` writes at most (GDN and KDA: k, its scale, g, beta).
ADVANCE_FIELDS = 4


def advance_args(cache, commit: bool, shared_fields: dict) -> tuple[tuple, dict]:
    """(arguments, constexprs) of ``advance_row`` for a step kernel: the cursors and the three or
    four shared buffer fields (name -> input [b, T, heads(, width)], any strides) of the new
    tokens. The arguments follow the step kernel's own, from ``committed_ptr`` on."""
    args = [cache.committed, cache.pending, cache.refreshes, cache.programs_done]
    consts = dict(COMMIT=commit)
    items = list(shared_fields.items())
    for i in range(1, ADVANCE_FIELDS + 1):
        if i <= len(items):
            name, src = items[i - 1]
            F = math.prod(src.shape[2:])
            args += [src, *token_strides(src), cache.buffer[name]]
            consts.update({f"F{i}": F, f"F{i}P": triton.next_power_of_2(F),
                           f"W{i}": src.shape[3] if src.dim() > 3 else 1})
        else:  # no such field: never dereferenced
            args += [cache.committed, 0, 0, 0, 0, cache.committed]
            consts.update({f"F{i}": 0, f"F{i}P": 1, f"W{i}": 1})
    return tuple(args), consts


def format_args(cache):
    """Pointer triples and constexprs describing the anchor and read copy of ``cache``."""
    p = cache.precision
    dummy = cache.committed  # never dereferenced: the format does not have that part

    def triple(parts):
        return (parts["values"], parts.get("scales", dummy), parts.get("global_scale", dummy))

    anchor = triple(cache.anchor)
    read = anchor if cache.read_copy is None else triple(cache.read_copy)
    consts = dict(A_FMT=FMT_IDS[p.anchor.name], A_SR=p.anchor_rounding == "stochastic",
                  R_FMT=FMT_IDS[p.read_format.name], R_SR=p.read_rounding_used == "stochastic",
                  SHARED=p.shared)
    return anchor, read, consts


def column_pad(cache) -> int:
    """DKP: the width of the kernels' column tiles, dk padded to a power of two >= 16 (tl.dot
    needs K >= 16), >= 32 with an fp8 format (whole scale blocks). Any geometry tiles: a head's
    rows go to programs of whole row blocks (``step_shape``; gcd(dv, 32) rows, a power of two,
    where dv is not a multiple of 32), and columns from dk on are masked (``formats.within``)."""
    fmts = {cache.precision.anchor.name, cache.precision.read_format.name}
    return max(32 if "fp8_e4m3" in fmts else 16, triton.next_power_of_2(cache.dk))


#: Most batch rows the program listing the slots due scans at a time (``window.list_due``).
DUE_SCAN = 1024


def due_scan(b: int, split: bool) -> dict:
    """A scores launch's constexprs for ``window.list_due`` over b batch rows: rows per pass (a
    power of two; 0 = no list, when the refresh is a branch of the step) and passes."""
    rows = min(DUE_SCAN, triton.next_power_of_2(b)) if split else 0
    return dict(DUE_CH=rows, DUE_PASSES=triton.cdiv(b, rows) if rows else 0)


def refresh_grid(b: int, T: int, window: int) -> tuple[int, int]:
    """(n, rounds) of a refresh launch of its own over b batch rows: n programs per tile (the
    grid's last dimension), one per slot due in a staggered step, ceil(b T / L); program c
    refreshes the slots of ranks c, c + n, ..., c + (rounds - 1) n in the list of slots due
    (``window.list_due``) that exist, so that every slot due is refreshed however many are
    (aligned windows: all b)."""
    n = max(1, min(b, -(-b * T // window)))
    return n, -(-b // n)


def window_pad(cache) -> int:
    """LP: the window's length padded to a power of two >= 16 (tl.dot needs K >= 16)."""
    return max(16, triton.next_power_of_2(cache.window))


def inverse_levels(LP: int) -> int:
    """LEVELS of ``solve.unit_lower_inverse`` for a window padded to LP: log2(LP) - 1, its
    diagonal blocks doubled from 2 rows to LP; one fewer leaves the lower-left LP/2 x LP/2 block
    of the inverse zero."""
    return LP.bit_length() - 2


class StepShape(NamedTuple):
    """How a step kernel is launched (``step_shape``)."""
    rows: int        #: state rows of a head per program (a multiple of FOLD_ROWS, or the cache's row block)
    warps: int       #: warps per program
    pin: int         #: elements per thread pinned on the read-copy load (``formats.pin_vector_width``), 0 = none
    output_dot: bool  #: the read-copy products of all queries on tensor cores, the read copy streamed through
    #: them in column chunks (``formats.streamed_products``), instead of a row reduction per query
    stream: int      #: with output_dot: the read copy's chunks in flight (2 where a label gives none)
    split: bool = False  #: refresh in a launch of its own before the step (else a branch of the step)
    stages: int = 2  #: column chunks of a refresh's fold in flight (software-pipelined loop)
    maxnreg: int = 0  #: a register cap for the step kernel (ptxas), 0 = none
    refresh_warps: int = 2  #: warps per program of a split refresh launch (32 rows per program)
    refresh_maxnreg: int = 0  #: a register cap for the split refresh launch (ptxas), 0 = none
    beside: bool = False  #: the slots due stepped in a launch of their own (``DUE_ONLY``; after their
    #: refresh launch with split, else the refresh a branch) on a side stream (``side_stream``), beside
    #: the step of the other slots (``NOT_DUE``)
    fused: bool = False  #: GDN: the whole step in one launch, each program preparing its own inputs and
    #: solving its own refresh (no scores or solve launch; the refresh a branch; row reductions, or
    #: with output_dot (GDN) streamed products with the keys and queries it prepares)
    due_first: bool = False  #: the launch over every slot visits the slots due first (``DUE_FIRST``,
    #: ``window.step_item``), the refresh a branch
    scores_warps: int = 2  #: warps per program of the scores launch (``SCORES_WARPS``)
    solve_here: bool = False  #: GDN: each refreshing program solves its head's residual system itself
    #: (as a step of one launch does), with no solve launch before the refresh


#: Step shapes by (architecture, read format): entries (least draft length, fields of StepShape that
#: differ from ``BASE_SHAPE``), by increasing least length; a step of T tokens takes the last entry
#: whose least length is <= T. Each entry was the fastest of sweeps on an H200 (or an H100 where
#: named) at batch 256 (``benchmarks/sweep_shapes.py``: staggered windows, real geometries), us per
#: step or verify round of 4 drafts, the entry's figure first:
#:
#: - the refresh a branch of the step (``split`` off) for Mamba-2 from fp32 and 2-byte read copies
#:   (decode s32_rs 309.1 against 351.6 as a launch, verify s32_rs 568.7 against 606.0), a launch of
#:   its own elsewhere: a branch gives every program the refresh's registers (Mamba-2 tp8_hi32 decode
#:   222.1 against 238.5 as a branch, GDN verify s32_rs 695.0 against 779.4);
#: - the slots due on a side stream beside the others' step (``beside``): GDN decode from fp32 and
#:   2-byte read copies (s32_rs 365.3 against 377.4 in order), GDN verify of 4 drafts from fp8
#:   (904.7 against 928.3), GDN decode from NVFP4 after their refresh launch (H100, one run: 351.6
#:   against 358.9 and 363.9 in order), Mamba-2 decode from 2-byte and fp8 read copies (tp8_hi32
#:   188.8 against 198.7); not taken where slower or no faster (Mamba-2 s32_rs decode 325.0 against
#:   303.4, GDN verify s32_rs 803.9 against 808.1, GDN decode from fp8 303.7 against 286.7 (H100),
#:   GDN verify of 4 drafts from NVFP4 853.4 against 826.0 (H100); the launch over the slots due with
#:   2 or 4 warps: GDN decode 388.5, 448.2; GDN NVFP4 decode with the refresh a branch 511.6);
#: - GDN's refresh launch under a register cap (its loop over the slots due took 218 registers):
#:   decode s32_rs 390.2 at 128 (407.4 uncapped), tp16_hi32 341.5 at 168 (344.0 at 128), verify of 4
#:   drafts s32_rs 745.2 at 168 against 761.7 at 128 (H100, one run; uncapped 789.7 against 768.6 in
#:   another; the refresh a branch of the step instead: 739.9, and 744.5 against 745.1 in a third run,
#:   1229.5 against 1222.0 for 8 drafts); GDN verify from fp32 caps the step kernel at 168 (794.9
#:   against 831.2, no spills); from fp8 and NVFP4 read copies at 168 too (H100, two runs each, us:
#:   tp8_hi32 decode 275.0 / 275.6 against 280.6 / 281.4 at 128 and 284.2 uncapped, verify of 4
#:   drafts 609.0 / 612.3 against 659.8 / 653.6 and 648.7; tp4_hi32 decode 288.2 / 289.0 against
#:   298.2 / 297.0 uncapped (255 registers, 24 B spilled), 295.1 at 144, verify of 2 drafts 458.0 /
#:   453.9 against 461.7 / 460.0, of 4 720.5 / 704.6 against 723.1 / 741.1); not for an NVFP4 read
#:   copy of a 2-byte or NVFP4 anchor, whose refresh spills even uncapped (tp4_hi16_sr: 284 B at 255
#:   registers, 880 B at 168);
#: - GDN verify of 4 drafts takes its read-copy products on tensor cores, streamed (805.0; from
#:   the tile loaded whole 934.5, a form since deleted; row reductions 877.3), of exact operands
#:   from 2-byte and fp8 read copies (``formats.exact_operand_products``: tp16_hi32 679.0 against
#:   697.9 as 3-pass tf32); Mamba-2's verify keeps row reductions in 1-warp programs (639.1; 2
#:   warps 892.4, streamed products 726.8; measured again: s32_rs 577.8 against 627.8 to 701.0
#:   streamed at 32 x 1, 32 x 2 and 64 x 2);
#: - those GDN products in programs of 64 rows x 2 warps from fp32 and 2-byte read copies (one run:
#:   s32_rs 656.2 against 689.1 at 32 x 1, 8 drafts 1136.1 against 1217.6; tp16_hi32 627.1 against
#:   663.6, tpbf16_hi32 620.9 against 664.4; fp8 at 64 x 1, 647.7 against 687.8), from 2 drafts on
#:   for 2-byte and fp8 read copies (H100, one run, against the decode shapes: tp16_hi32 454.1
#:   against 602.6 for 2 drafts, 585.9 against 1050.4 for 3; tp8_hi32 421.2 against 463.3, 577.1
#:   against 634.4; KDA tp16_hi32 552.0 against 616.4, 763.0 against 952.0), with the refresh a
#:   launch of its own (tp16_hi32 485.2 and 637.1 with the slots due beside);
#: - NVFP4 read copies: the products streamed on tensor cores, GDN (and KDA) in 32-row 1-warp
#:   programs, 2 chunks in flight (two calls on one H200: decode tp4_hi32 359.5 against 425.7 with
#:   row reductions at 32 x 4, verify of 2 drafts 524.9 against 1000.9, of 4 825.1 against 2235.9; KDA 1098.2
#:   against 1821.9), Mamba-2 in 2-warp programs from 2 drafts on (779.9 against 945.2; 32 x 1
#:   663.6 but 168.2 against 140.1 at batch 32), its decode with row reductions at 32 x 4 (311.0;
#:   streamed at 32 x 1 293.8 but 60.2 against 50.4 at batch 32);
#: - a pin of 16 elements per thread for GDN decode from fp32 and Mamba-2 verify of 4 drafts from
#:   2-byte read copies (515.3 against 543.5 unpinned); none elsewhere (GDN decode tp16_hi32 299.1
#:   against 313.8 pinned, Mamba-2 verify of 2 drafts tp16_hi32 309.7 against 332.3);
#: - 3 fold stages in flight in a refresh launch, 2 in a branch (GDN decode 443.9 against 466.0 at 1);
#: - 64-row programs for the narrow formats where they measured faster, the shapes above otherwise
#:   (H100, one run, us): Mamba-2 NVFP4 decode with row reductions in 64 x 1 programs 254.7 against
#:   309.9 at 32 x 4 (64 x 2 265.7; its refresh launch at 2 or 8 warps 267.1, 331.8), and its slots
#:   due beside the others 248.5 against 254.5 in a second run (32 x 4: 308.8), its verify in
#:   64 x 2 programs, 3 chunks in flight, 401.2 against 477.0 for 2 drafts, 672.0 against 773.7 for 4
#:   (32 x 1 673.1, 64 x 4 993.9); Mamba-2 fp8 decode at 64 x 1 204.1 against 210.7 (64 x 2 209.1);
#:   GDN NVFP4 decode streamed at 64 x 1 313.1 against 343.8 (64 x 2 340.6), its verify at 32 x 1
#:   (64 x 1: 491.4 and 767.1 against 490.9 and 753.6 for 2 and 4 drafts); GDN fp8 decode at 32 x 1
#:   (277.7 against 356.1 at 64 x 1, 312.1 at 32 x 2). Below batch 64 the narrow formats keep 32 rows
#:   (``SMALL_BATCH_SHAPES``).
#:
#: One warp per 32 rows keeps row reductions inside a warp; NVFP4 row reductions of 32-row programs
#: take 4 warps (one cannot hide its nibble decoding), while one warp over 64 rows has twice the
#: elements per thread to hide it behind. The pin: Triton loads an fp32 tile 4 elements per thread and
#: an fp16 tile 8, spreading a 128-wide row over a whole warp, so every row reduction ends in 5
#: rounds of shuffles; pinned to 16 per thread, 3. bf16 read copies take fp16's entries.
BASE_SHAPE = StepShape(rows=32, warps=1, pin=0, output_dot=False, stream=0, split=True, stages=3)
_VERIFY_DOT = dict(output_dot=True, stream=3)
_BESIDE = dict(split=False, beside=True)  # the slots due beside the others, each refresh a branch of its step
SHAPES = {
    ("mamba2", "fp32"): ((1, dict(split=False, stages=2)), (2, dict(pin=16, split=False))),
    ("mamba2", "fp16"): ((1, dict(split=False, stages=2, beside=True)), (2, dict(split=False)),
                         (4, dict(pin=16, split=False))),
    ("mamba2", "bf16"): ((1, dict(split=False, stages=2, beside=True)), (2, dict(split=False)),
                         (4, dict(pin=16, split=False))),
    ("mamba2", "fp8_e4m3"): ((1, dict(rows=64, beside=True)), (2, {})),
    ("mamba2", "nvfp4"): ((1, dict(rows=64, refresh_warps=4, beside=True)),
                          (2, dict(rows=64, warps=2, refresh_warps=4, output_dot=True, stream=3))),
    ("gdn", "fp32"): ((1, dict(pin=16, refresh_maxnreg=128, **_BESIDE)),
                      (4, dict(rows=64, warps=2, refresh_maxnreg=168, maxnreg=168, **_VERIFY_DOT))),
    ("gdn", "fp16"): ((1, dict(refresh_maxnreg=168, **_BESIDE)),
                      (2, dict(rows=64, warps=2, refresh_maxnreg=168, **_VERIFY_DOT))),
    ("gdn", "bf16"): ((1, dict(refresh_maxnreg=168, **_BESIDE)),
                      (2, dict(rows=64, warps=2, refresh_maxnreg=168, **_VERIFY_DOT))),
    ("gdn", "fp8_e4m3"): ((1, dict(refresh_maxnreg=168)), (2, dict(rows=64, refresh_maxnreg=168, **_VERIFY_DOT)),
                          (4, dict(rows=64, refresh_maxnreg=168, beside=True, **_VERIFY_DOT))),
    ("gdn", "nvfp4"): ((1, dict(rows=64, output_dot=True, stream=2, beside=True, refresh_maxnreg=168)),
                       (2, dict(output_dot=True, stream=2, refresh_maxnreg=168))),
}
#: Entries of ``SHAPES`` that differ below SPLIT_MIN_BATCH rows, in the same form, applied over
#: them: where fewer programs share the GPU, smaller or reduction-bound programs measured faster
#: (H200, batch 32, us per step): GDN verify of 4 drafts from fp32 117.4 at 32 rows x 1 warp against
#: 123.3 at 64 x 2, from fp8 116.4 against 122.4 at 64 x 1 (2 and 3 drafts: row reductions, H100
#: 78.0 against 81.0 streamed at 32 x 1); GDN decode from NVFP4 69.4 with row reductions at 32 x 4
#: against 74.7 streamed. The fp32 verify entry keeps the 168-register cap of the batch-256 one, under
#: which its 32 x 1 programs spill 144 B (compiled for sm_90a; 238 registers and none uncapped, 165
#: and none at 32 x 2); whether the cap pays below batch 64 is not timed.
SMALL_BATCH_SHAPES = {
    ("mamba2", "fp8_e4m3"): ((1, dict(rows=32)), (2, {})),
    ("mamba2", "nvfp4"): ((1, dict(rows=32, warps=4)), (2, dict(rows=32, stream=2))),
    ("gdn", "fp32"): ((4, dict(rows=32, warps=1)),),
    ("gdn", "fp8_e4m3"): ((2, dict(rows=32, output_dot=False, stream=0)), (4, dict(rows=32))),
    ("gdn", "nvfp4"): ((1, dict(rows=32, warps=4, output_dot=False, stream=0)), (2, {})),  # verify: SHAPES' entry
}
# KDA's step kernel runs GDN's inner loop (its per-channel decays are applied in the scores launch):
# GDN's shapes, with the refresh in a launch of their own where GDN has the slots due beside the
# others (KDA's launches have no side stream). Swept for KDA at Kimi-Linear-48B's geometry (H100,
# one run, batch 256, us): none beat them by more than 2% (decode s32_rs 340.9, 339.1 at 64 x 2;
# tp16_hi32 276.0, 271.3 at 32 x 2; verify of 4 drafts s32_rs 642.8, 642.7 at 32 x 1; tp16_hi32
# 586.8, 588.5 at 64 x 1; 2-warp, streamed-product and 4-warp-refresh shapes 1-15% slower); NVFP4 decode
# at 64 x 1, as GDN's, 285.0 against 330.9 at 32 x 1. GDN's register caps on the refresh launch, which
# uncapped takes 246-255 registers (H100, one run, batch 256, us, capped against uncapped: decode
# s32_rs 347.5 / 349.6, tp16_hi32 298.4 / 300.9, tp8_hi32 246.0 / 250.3; verify of 4 drafts 652.3 /
# 668.2, 595.3 / 608.6, 575.3 / 592.7), but none from NVFP4 read copies (tp4_hi32 decode 279.0 and
# 277.1 at 168 against 273.0 and 273.1 uncapped, two runs)
def _kda_fields(fmt: str, fields: dict) -> dict:
    """A GDN entry's fields as KDA takes them: a refresh launch in place of a side stream, and no
    register cap on the refresh launch from NVFP4 read copies."""
    out = dict(fields, beside=False, split=True) if fields.get("beside") else dict(fields)
    return dict(out, refresh_maxnreg=0) if fmt == "nvfp4" else out


SHAPES.update({("kda", fmt): tuple((least, _kda_fields(fmt, fields)) for least, fields in entries)
               for (arch, fmt), entries in list(SHAPES.items()) if arch == "gdn"})
SMALL_BATCH_SHAPES.update({("kda", fmt): entries for (arch, fmt), entries in list(SMALL_BATCH_SHAPES.items())
                           if arch == "gdn"})

#: Overrides of ``step_shape``'s fields for benchmark sweeps ({"rows": 64, "warps": 2, ...});
#: ``parse_shape`` reads them from a label. Empty in normal use.
TUNING: dict = {}


def _uses_nvfp4(cache) -> bool:
    return "nvfp4" in {cache.precision.anchor.name, cache.precision.read_format.name}


#: Warps per program of each architecture's scores launch (``StepShape.scores_warps``), whose per-head
#: weights are [heads, LP] tiles (KDA: [LP, K] per draft, its decays per key channel). H100, one run,
#: batch 256, us per step at 1 / 2 / 4 warps: KDA decode s32_rs 341.1 / 373.7 / 391.8, verify of 4
#: drafts 645.2 / 656.7 / 689.4 (8 warps: 466.4, 1234.7; tp16_hi32 at 1 and 4: 275.8 / 325.1,
#: 586.5 / 625.2); GDN decode 468.9 / 470.6, verify 733.5 / 751.5 (tp16_hi32 340.1 / 342.3, 649.4 /
#: 663.8); Mamba-2 decode 423.5 / 422.5, verify 670.7 / 664.7. Earlier (H200, us per launch at 2 / 4
#: / 8 warps): GDN verify 42.8 / 55.8 / 67.4, decode 11.6 / 14.0 / 19.5; Mamba-2 verify 22.8 / 26.3
#: / 32.8, decode 10.5 / 10.6 / 13.6.
SCORES_WARPS = {"mamba2": 2, "gdn": 1, "kda": 1}


#: Smallest batch whose steps may refresh in a launch of their own (``StepShape.split``): below it a
#: step is bound by launch latency, and a branch saves a launch (H200, GDN s32_rs, us per step,
#: split -> branch: batch 1 7.9 -> 7.4, batch 32 76.2 -> 74.5).
SPLIT_MIN_BATCH = 64

#: Architectures whose step launches can run the slots due on a side stream (``StepShape.beside``).
#: Below SPLIT_MIN_BATCH they do whenever a step expects a slot due (batch x T >= the window) and
#: the slots due do not go first in the launch over every slot instead (``DUE_FIRST_MAX_BATCH``): the
#: slots due then start first instead of whenever their programs come up, and the step is as long as
#: the others' streaming rather than that plus a refresh's latency (H200, GDN s32_rs, us per step,
#: in order -> beside: batch 32 decode 73.7 -> 58.3, tp16_hi32 64.5 -> 50.3, tp8_hi32 66.8 -> 47.6;
#: verify of T = 4 138.0 -> 131.3; batch 16 decode 57.7 -> 52.5, verify 97.8 -> 85.3; batch 8 verify
#: 75.7 -> 67.5, but decode 29.5 -> 32.7, batch 1 decode 8.2 -> 9.0: no slot due in most steps).
SIDE_STREAM_ARCHS = ("gdn",)  # Mamba-2's slots due beside at batch 8-32 ran slower (s32_rs 30.2 -> 33.4 at 16)

#: Architectures whose step launch over every slot visits the slots due first below SPLIT_MIN_BATCH
#: (``StepShape.due_first``: the list of slots due extended to an order of every batch row, so the
#: refreshing programs' long chains start in the first wave instead of whenever their batch rows
#: come up). H100, one run, Mamba-2, staggered, us per step, batch order -> due first: decode
#: s32_rs batch 8 18.5 -> 17.6, 16 40.0 -> 36.0, 32 66.1 -> 62.0 (tp16_hi32 14.7 -> 14.5, 29.7 ->
#: 26.3, 50.1 -> 43.7); verify of 4 drafts 41.6 -> 41.0, 68.3 -> 68.5, 107.6 -> 104.4 (tp16_hi32
#: 37.9, 61.1 -> 60.9, 98.4 -> 99.6). From batch 64 on it no longer pays (decode 115.8 -> 113.0 at
#: 64, 217.1 -> 217.3 at 128, 416.7 -> 421.1 at 256; verify 184.1 -> 185.3, 348.1 -> 344.1, 659.3 ->
#: 665.1), where most programs stream and the slots due are a few of them.
DUE_FIRST_ARCHS = ("mamba2", "gdn")

#: Where an architecture can also run its slots due on a side stream (``SIDE_STREAM_ARCHS``), the
#: slots due go first instead at batch <= DUE_FIRST_MAX_BATCH and at most two windows of tokens per
#: step (batch x T <= 2 L). H100, one run, GDN, staggered, window 16, us per step, the side stream
#: (or batch order where b T < L) -> due first: decode s32_rs batch 8 25.6 -> 23.4, 16 48.4 -> 43.7
#: (tp16_hi32 23.2 -> 21.2, 43.1 -> 38.0), verify of 4 drafts at batch 8 69.6 -> 67.8 (64.7 ->
#: 63.3); not taken at batch 16 verify (86.8 -> 87.4, tp16_hi32 80.3 -> 85.9) nor batch 32 decode
#: (63.9 -> 72.5), nor at batch 256 (decode 471.7 -> 469.9 but tp16_hi32 347.2 -> 409.7; verify of
#: 4 drafts 779.0 -> 803.1 against a refresh launch of its own).
DUE_FIRST_MAX_BATCH = 16

#: GDN decode from fp32 and 2-byte read copies with the slots due beside the others below
#: SPLIT_MIN_BATCH: where the other slots' step is short (batch x value heads <=
#: SOLVE_HERE_MAX_HEAD_ROWS), the side stream's chain (the solve launch, then the launch over the
#: slots due) is the step's critical path, and each refreshing program solves its head's system itself
#: instead (``StepShape.solve_here``, one launch less on that chain). H100, one run, us per step,
#: solve launch -> solve in the programs, s32_rs / tp16_hi32 / tpbf16_hi32: Qwen3-Next's 32 value
#: heads at batch 24 37.6 -> 31.4 / 36.7 -> 28.6 / 38.1 -> 31.1, batch 32 43.2 -> 35.1 / 39.6 -> 32.7 /
#: 41.4 -> 35.0, batch 48 48.5 -> 46.5 / 42.8 -> 41.6 / 44.0 -> 44.5; Qwen3.5-122B's 64 at batch 17
#: 43.0 -> 36.3 / 40.0 -> 33.3 / 41.1 -> 35.6, batch 24 49.1 -> 46.9 / 44.3 -> 41.3, but batch 32
#: 58.9 -> 59.8 / 48.7 -> 51.2 / 50.0 -> 54.2. Earlier: verify of 4 drafts 84.4 -> 91.9 and 130.9 ->
#: 140.1; batch 256 decode 465.1 -> 480.0, verify 725.6 -> 813.1 (each program then repeats its
#: head's solve).
SOLVE_HERE_MAX_HEAD_ROWS = 1536
SOLVE_HERE_FORMATS = ("fp32", "fp16", "bf16")

#: GDN verify rounds of at least SPLIT_BESIDE_MIN_T drafts from fp32 read copies at SPLIT_BESIDE_MIN_BATCH
#: <= batch < SPLIT_MIN_BATCH: the slots due beside the others refresh in a launch of their own before
#: their step launch (``StepShape.split`` with ``beside``) instead of a branch of it, so that more
#: programs share each refresh. H100, one run, s32_rs, 4 drafts, us per round, branch -> refresh
#: launch: 64 value heads at batch 32 129.6 -> 126.2, 48 177.7 -> 171.9, but 16 81.8 -> 83.6; 32
#: value heads at 32 84.5 -> 81.6, 48 113.8 -> 109.6; 8 drafts at 32 207.2 -> 207.8 (level).
#: 2-byte read copies (verify programs of 64 rows x 2 warps) were timed only against 32 x 1 programs
#: with the refresh launch, two changes at once, so they keep the branch: tp16_hi32, 64 value heads,
#: batch 32, 2 drafts 81.2 -> 77.7, 8 drafts 210.3 -> 195.4; batch 48, 4 drafts 171.2 -> 160.2;
#: batch 16 77.9 -> 79.2; 32 value heads at 32 79.3 -> 76.9, 48 111.3 -> 101.9.
SPLIT_BESIDE_MIN_BATCH = 32
SPLIT_BESIDE_MIN_T = 4


#: Steps of at most FUSED_MAX_T tokens over at most FUSED_MAX_BATCH batch rows run as one launch
#: (``StepShape.fused``, FUSED_SHAPE), where a step is launch latency (H200, one run, staggered, us
#: per step, launches -> one launch of 32 rows x 2 warps: batch 1 decode GDN s32_rs 7.5 -> 6.6,
#: tp16_hi32 7.7 -> 7.1, Mamba-2 s32_rs 5.8 -> 5.4, tp16_hi32 5.7 -> 5.1; verify of 2 drafts at
#: 4 warps GDN s32_rs 17.3 -> 15.8, Mamba-2 13.9 -> 13.6, at 2 warps 13.2; batch 2 decode GDN 9.3 ->
#: 9.3, Mamba-2 7.1 -> 6.8, tp16_hi32 6.9 -> 6.2; slower at batch 4: GDN 15.0 -> 16.1, Mamba-2
#: 9.6 -> 11.8; at batch 8 and 32 far slower, since every program repeats its head's shared work
#: and the refresh branch sets every program's registers). Two warps, not four: GDN's refresh
#: solved by a 4-warp program gave other anchor bits than the solve launch on the GPU (max 2.4e-7,
#: ``benchmarks/refresh_bits.py``), by a 2-warp one then the same. With the solve's present
#: products the 2-warp program's anchors were up to 2.4e-7 from the launches' while the keys' norms
#: were ``tl.sum``s, in the order of each launch's layout (the scores launch's at 1 warp,
#: ``SCORES_WARPS``); as tensor-core products (``window._square_norm``) they are the same bits in
#: every launch, and the anchors of 2-warp programs the launches' (H200, ``refresh_bits.py``, decode
#: and verify of 4 drafts; at no measurable cost: batch 256 GDN s32_rs decode 356.1 -> 356.9, verify
#: of 4 drafts 621.0 -> 617.1, one run). Those figures were timed while GDN's
#: in-program solve held a whole [16, 128] tile of keys (0.5 KB of spills); with ``gdn.triton._gram``
#: (none), H100, one run, batch 1, launches -> one launch: decode GDN s32_rs 7.6 -> 6.7, tp16_hi32
#: 7.8 -> 7.0, Mamba-2 5.9 -> 5.6, 5.8 -> 5.3; verify of 2 drafts GDN 17.7 -> 17.4, Mamba-2 14.8 ->
#: 13.7; the anchors the same bits as the launches' (decode and verify, both layer kinds). Verify
#: of 4 drafts keeps the launches (H100, one run): batch 1 GDN s32_rs 26.3 -> 31.5 (row reductions
#: in place of the launches' tensor-core products), Mamba-2 19.5 -> 18.9 at 4 warps, but batch 2
#: 22.4 -> 29.1.
FUSED_MAX_BATCH = 2
FUSED_MAX_T = 2
FUSED_SHAPE = dict(rows=32, warps=2, fused=True, output_dot=False, maxnreg=0)
FUSED_ARCHS = ("mamba2", "gdn")
#: Verify rounds of up to FUSED_VERIFY_MAX_T drafts from fp32 and 2-byte read copies are one launch
#: too, GDN's taking its read-copy products on tensor cores from FUSED_DOT_MIN_T drafts on (streamed,
#: 2 chunks in flight, from the keys and queries each program prepares). H200, one run, staggered, us
#: per round, launches -> one launch: batch 1, 3 drafts, GDN s32_rs 16.5 -> 15.0, Mamba-2 12.1 ->
#: 10.2; 4 drafts GDN 21.6 -> 17.9, tp16_hi32 20.4 -> 17.8, Mamba-2 15.1 -> 13.2, tp16_hi32 15.0 ->
#: 12.9; batch 2, 3 drafts GDN 21.0 -> 18.0, Mamba-2 14.5 -> 12.4; 4 drafts GDN 26.6 -> 21.5,
#: tp16_hi32 25.7 -> 21.4, Mamba-2 17.8 -> 15.5; but batch 4, GDN 4 drafts 35.6 -> 38.2; GDN's verify of
#: 2 drafts at batch 1 keeps row reductions (11.5 against 12.2 streamed). The anchors are the
#: launches' bits (``refresh_bits.py``, 4 drafts, both layer kinds; a 4-warp program, Mamba-2's
#: the same bits and 13.6 us, GDN's other bits). fp8 and NVFP4 read copies are not timed so.
FUSED_VERIFY_MAX_T = 4
FUSED_VERIFY_FORMATS = ("fp32", "fp16", "bf16")
FUSED_DOT_MIN_T = 3
#: Mamba-2's one launch from fp32 and 2-byte read copies runs 4-warp programs where they are fewest:
#: at batch 1, and decode at batch 2 (H100, one run, staggered, us, 2 -> 4 warps: batch 1 s32_rs
#: decode 4.9 -> 4.8, verify of 2 drafts 7.7 -> 7.3, of 4 11.4 -> 11.4; tp16_hi32 4.7 -> 4.7, 7.6 ->
#: 7.3, 11.4 -> 11.0; batch 2 s32_rs decode 7.7 -> 7.2, but verify of 2 drafts 9.9 -> 10.3, of 4 14.0
#: -> 20.0). Its anchors are the 2-warp programs' bits (``refresh_bits.py``, decode and 2 drafts).
FUSED_WIDE_WARPS = 4


def step_shape(cache, arch: str, T: int = 1, batch: int = SPLIT_MIN_BATCH) -> StepShape:
    """The launch shape of a step of T tokens over ``batch`` rows of ``cache`` (``SHAPES``; below
    SPLIT_MIN_BATCH rows ``SMALL_BATCH_SHAPES`` over it, the refresh a branch, the slots due first
    (``DUE_FIRST_ARCHS``) or, at larger batches of ``SIDE_STREAM_ARCHS``, beside the others where a
    step expects one (``DUE_FIRST_MAX_BATCH``; GDN's fp32 and 2-byte decode then solving in the
    refreshing programs where the others' step is short, ``SOLVE_HERE_MAX_HEAD_ROWS``, and its fp32
    verify rounds of the larger of those batches refreshing in a launch of their own,
    ``SPLIT_BESIDE_MIN_BATCH``); one launch for the smallest steps, ``FUSED_MAX_BATCH``; ``TUNING``
    over it). Rows are a multiple of FOLD_ROWS that divides dv,
    or the cache's row block (gcd(dv, 32), a power of two: 16 for dv = 80, 8 for dv = 8 or 24)
    where dv is not a multiple of FOLD_ROWS or is at most FOLD_ROWS: a program owns whole NVFP4
    global-scale blocks (``formats.global_scale_index``), one or several."""
    fmt = cache.precision.read_format.name
    found, small = BASE_SHAPE, {}
    for least, fields in SHAPES[(arch, fmt)]:
        if T >= least:
            found = BASE_SHAPE._replace(**fields)
    found = found._replace(scores_warps=SCORES_WARPS[arch])
    if batch < SPLIT_MIN_BATCH:
        for least, fields in SMALL_BATCH_SHAPES.get((arch, fmt), ()):
            if T >= least:
                small = fields
        found = found._replace(**small)
        first = arch in DUE_FIRST_ARCHS and (arch not in SIDE_STREAM_ARCHS or (
            batch <= DUE_FIRST_MAX_BATCH and batch * T <= 2 * cache.window))
        found = found._replace(split=False, due_first=first,
                               beside=arch in SIDE_STREAM_ARCHS and batch * T >= cache.window and not first)
        found = found._replace(solve_here=found.beside and arch == "gdn" and fmt in SOLVE_HERE_FORMATS and T == 1
                               and batch * cache.nheads <= SOLVE_HERE_MAX_HEAD_ROWS)
        found = found._replace(split=found.beside and arch == "gdn" and fmt == "fp32" and T >= SPLIT_BESIDE_MIN_T
                               and batch >= SPLIT_BESIDE_MIN_BATCH)
    most = FUSED_VERIFY_MAX_T if fmt in FUSED_VERIFY_FORMATS else FUSED_MAX_T
    if batch <= FUSED_MAX_BATCH and T <= most and arch in FUSED_ARCHS:
        dot = arch == "gdn" and T >= FUSED_DOT_MIN_T
        wide = arch == "mamba2" and fmt in FUSED_VERIFY_FORMATS and (batch == 1 or T == 1)
        found = found._replace(**dict(FUSED_SHAPE, output_dot=dot, stream=2 if dot else 0,
                                      warps=FUSED_WIDE_WARPS if wide else FUSED_SHAPE["warps"]))
    if fmt == "nvfp4" and cache.precision.anchor.name != "fp32":  # NVFP4's cap is for fp32 anchors only
        found = found._replace(refresh_maxnreg=0)
    # TUNING also holds launch options that are no shape field ("pdl", ``programmatic``)
    found = found._replace(**{key: value for key, value in TUNING.items() if key in StepShape._fields})
    if found.fused:  # GDN's may take its products on tensor cores (``TUNING``), from the keys it prepares
        found = found._replace(split=False, beside=False, output_dot=found.output_dot and arch == "gdn",
                               due_first=False)
    rows = found.rows
    if cache.dv <= FOLD_ROWS or cache.dv % FOLD_ROWS:
        rows = cache.row_block
    elif rows % FOLD_ROWS or rows > cache.dv or cache.dv % rows:
        rows = FOLD_ROWS
    stream = (found.stream or 2) if found.output_dot else 0
    return found._replace(rows=rows, stream=stream)


def parse_shape(text: str) -> dict:
    """``TUNING`` overrides from a sweep label: "RxW" = R rows per program, W warps; then optional
    "v" and the pinned elements per thread, "o" (outputs' products on tensor cores), "k" and the
    chunks in flight of a streamed read copy (2 if none given), "s" (a refresh launch of its own,
    optionally with its warps) or "f" (the refresh a branch of the step), "b" (the slots due beside
    the others, ``StepShape.beside``; "fb": with the refresh a branch of their step), "u" (the whole
    step in one launch, ``StepShape.fused``), "h" (GDN: each refreshing program solves its own system,
    ``StepShape.solve_here``), "n" and the fold's pipeline stages, "r" and a register cap. E.g. "32x1",
    "32x1v16", "64x4ok3", "32x1v16s2n3", "32x1f", "32x1u", "64x2ok3h"."""
    m = re.fullmatch(r"(\d+)x(\d+)(?:v(\d+))?(o)?(?:k(\d*))?(?:s(\d*)|(f))?(b)?(u)?(h)?(?:n(\d+))?(?:r(\d+))?", text)
    if not m:
        raise ValueError(f"cannot read the shape label {text!r} (e.g. '32x1', '32x1v16', '64x4ok3')")
    rows, warps, pin, dot, stream, split, branch, beside, fused, here, stages, maxnreg = m.groups()
    out = dict(rows=int(rows), warps=int(warps))
    if here:
        out["solve_here"] = True
    if beside:
        out["beside"] = True
    if fused:
        out["fused"] = True
    if branch:
        out["split"] = False
    if split is not None:
        out["split"] = True
        if split:
            out["refresh_warps"] = int(split)
    if stages is not None:
        out["stages"] = int(stages)
    if maxnreg is not None:
        out["maxnreg"] = int(maxnreg)
    if pin is not None:
        out["pin"] = int(pin)
    if dot:
        out["output_dot"] = True
    if stream is not None:
        out["stream"] = int(stream or 2)
    return out


#: Columns of the state a refresh folds and encodes at a time (``refresh_columns``).
REFRESH_COLUMNS = 32

#: ``refresh_columns`` by (architecture, anchor format) where it is not REFRESH_COLUMNS: a Mamba-2
#: refresh from a 2-byte anchor in 32-column passes ran at 17% of DRAM bandwidth on an H200, in
#: 64-column passes at the bandwidth of an fp32 one. Keyed by the anchor's format, so presets that
#: share an anchor format fold it alike.
REFRESH_COLUMNS_BY_ANCHOR = {("mamba2", "fp16"): 64, ("mamba2", "bf16"): 64}


def refresh_columns(cache, arch: str) -> int:
    """Columns per pass of a refresh's fold and encode: a program loads, folds and encodes a
    [FOLD_ROWS, columns] slice at a time, so the slice, the products' operands and accumulators
    fit in registers together. A multiple of 32 (one fp8 scale block) or the padded row
    (``column_pad``: dk < 32), or the whole padded row with NVFP4, whose global scale spans the
    row block; the last pass is masked from dk on. The column count never changes a fold's bits
    (each element's product sums over the window, whatever the slice)."""
    if _uses_nvfp4(cache) and not read_copy_after_fold(cache):
        return column_pad(cache)
    return min(column_pad(cache), REFRESH_COLUMNS_BY_ANCHOR.get((arch, cache.precision.anchor.name), REFRESH_COLUMNS))


def read_copy_after_fold(cache) -> bool:
    """Whether a refresh encodes the read copy after the fold, from the fp32 anchor rows it has just
    stored (the unrounded state, bit for bit), instead of beside the anchor slice by slice: for an
    NVFP4 read copy of an fp32 anchor, whose global scale spans whole rows. The fold then runs the
    same column slices as every other fp32-anchored preset, so its anchor bits are theirs (folding
    whole rows at once gave other bits on an H200)."""
    p = cache.precision
    return not p.shared and p.read_format.name == "nvfp4" and p.anchor.name == "fp32"
