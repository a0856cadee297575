"""A slot's window inside kernels: its cursor, and the per-token entries a step reads.

Entry j of the window is committed (j < h, read from the replay buffer) or one of the T new
tokens (h <= j < h + T, read from the call's inputs and rounded to the buffer dtype exactly as a
later replay will read them back); other positions are zero. A refreshing slot has h = 0 here.
"""
import triton
import triton.language as tl


@triton.jit
def slot_row(slots_ptr, pid_b, SCRATCH):
    """(valid, storage row) of batch row ``pid_b``; a pad (-1) maps to the scratch row."""
    slot = tl.load(slots_ptr + pid_b)
    valid = slot >= 0
    return valid, tl.where(valid, slot, SCRATCH).to(tl.int64)


@triton.jit
def cursor(committed_ptr, valid, row, T: tl.constexpr, L: tl.constexpr):
    """(committed count h, refresh due) of a storage row; a pad has h = 0 and never refreshes."""
    h = tl.where(valid, tl.load(committed_ptr + row), 0)
    return h, valid & (h + T > L)


@triton.jit
def early_cursor(cursors_ptr, pid_b, EARLY: tl.constexpr):
    """With EARLY, batch row ``pid_b``'s committed count as the scores launch copied it: a load
    that does not wait for the slot id, so the read copy and window loads wait on one round trip
    instead of two. Otherwise a placeholder for ``cursor_of``."""
    if EARLY:
        return tl.load(cursors_ptr + pid_b)
    else:
        return 0


@triton.jit
def cursor_of(committed_ptr, h_early, valid, row, T: tl.constexpr, L: tl.constexpr, EARLY: tl.constexpr):
    """(committed count h, refresh due) of a storage row, from ``early_cursor`` or loaded here."""
    if EARLY:
        return h_early, valid & (h_early + T > L)
    else:
        return cursor(committed_ptr, valid, row, T, L)


@triton.jit
def refresh_plan(slots_ptr, committed_ptr, cursors_ptr, B, BP: tl.constexpr, T: tl.constexpr, L: tl.constexpr,
                 EARLY: tl.constexpr):
    """Which of the B batch rows refresh this step, for a persistent refresh launch: (need [BP],
    ordinal of each refreshing row among them [BP], their count). Every program computes it from
    B slot ids and cursors (a few hundred bytes, L2-resident), so no launch waits on another."""
    bi = tl.arange(0, BP)
    slot = tl.load(slots_ptr + bi, mask=bi < B, other=-1)
    valid = slot >= 0
    if EARLY:
        h = tl.load(cursors_ptr + bi, mask=bi < B, other=0)
    else:
        h = tl.load(committed_ptr + tl.where(valid, slot, 0), mask=valid, other=0)
    need = valid & (h + T > L)
    count = need.to(tl.int32)
    return need, tl.cumsum(count, 0) - 1, tl.sum(count, 0)


@triton.jit
def _refreshing_row(need, ordinal, r, slots_ptr, committed_ptr, SCRATCH):
    """(batch row, storage row, committed count h) of the r-th refreshing slot of a plan."""
    pid_b = tl.sum(tl.where(need & (ordinal == r), tl.arange(0, need.shape[0]), 0), 0)
    _, row = slot_row(slots_ptr, pid_b, SCRATCH)
    return pid_b, row, tl.load(committed_ptr + row)


@triton.jit
def refresh_item(need, ordinal, w, slots_ptr, committed_ptr, SCRATCH, NB: tl.constexpr, NH):
    """Work item w of a persistent refresh: (row block, head, batch row, storage row, committed
    count h), the row block varying fastest (neighbouring items stream one slot's contiguous state)."""
    pid_b, row, h = _refreshing_row(need, ordinal, w // (NH * NB), slots_ptr, committed_ptr, SCRATCH)
    return w % NB, (w // NB) % NH, pid_b, row, h


@triton.jit
def refresh_program(slots_ptr, committed_ptr, cursors_ptr, SCRATCH, B, BP: tl.constexpr, T: tl.constexpr,
                    L: tl.constexpr, EARLY: tl.constexpr, COMPACT: tl.constexpr):
    """A refresh kernel's program: (pid_v, head, pid_b, storage row, committed count h, refresh
    due). One program per (row block, head, batch row), whose slot may not be due; or, in a
    COMPACT launch, per (row block, head, r), serving the r-th refreshing slot of the batch
    (``refresh_plan``) and not due past the last one. Programs exit on ``need``."""
    if COMPACT:
        need, ordinal, count = refresh_plan(slots_ptr, committed_ptr, cursors_ptr, B, BP, T, L, EARLY)
        r = tl.program_id(2)
        pid_b, row, h = _refreshing_row(need, ordinal, r, slots_ptr, committed_ptr, SCRATCH)
        return tl.program_id(0), tl.program_id(1), pid_b, row, h, r < count
    else:
        pid_v, head, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        h_early = early_cursor(cursors_ptr, pid_b, EARLY)
        valid, row = slot_row(slots_ptr, pid_b, SCRATCH)
        h, need = cursor_of(committed_ptr, h_early, valid, row, T, L, EARLY)
        return pid_v, head, pid_b, row, h, need


@triton.jit
def slot_cursor(slots_ptr, committed_ptr, pid_b, SCRATCH, T: tl.constexpr, L: tl.constexpr):
    """(valid, storage row, committed count h, refresh due) of batch row ``pid_b``."""
    valid, row = slot_row(slots_ptr, pid_b, SCRATCH)
    h, need = cursor(committed_ptr, valid, row, T, L)
    return valid, row, h, need


@triton.jit
def window_rows(buf_ptr, in_ptr, row, pid_b, h, head, NH, cols, WIDTH: tl.constexpr,
                T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr):
    """[LP, len(cols)] fp32 window of a per-token vector field: buffer [rows, L, NH, WIDTH],
    inputs [b, T, NH, WIDTH], columns ``cols`` of head ``head``."""
    j = tl.arange(0, LP)
    old = j < h
    new = (j >= h) & (j < h + T)
    a = tl.load(buf_ptr + ((row * L + j[:, None]) * NH + head) * WIDTH + cols[None, :],
                mask=old[:, None], other=0.0)
    b = tl.load(in_ptr + ((pid_b * T + j - h)[:, None] * NH + head) * WIDTH + cols[None, :],
                mask=new[:, None], other=0.0)
    return a.to(tl.float32) + b.to(buf_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def window_scalars(buf_ptr, in_ptr, row, pid_b, h, head, NH, T: tl.constexpr, L: tl.constexpr,
                   LP: tl.constexpr):
    """[LP] fp32 window of a per-token, per-head scalar field (buffer [rows, L, NH], inputs [b, T, NH])."""
    j = tl.arange(0, LP)
    a = tl.load(buf_ptr + (row * L + j) * NH + head, mask=j < h, other=0.0)
    b = tl.load(in_ptr + (pid_b * T + j - h) * NH + head, mask=(j >= h) & (j < h + T), other=0.0)
    return a.to(tl.float32) + b.to(tl.float32)
