"""A slot's window inside kernels: its cursor, and the per-token entries a step reads.

Entry j of the window is committed (j < h, read from the replay buffer) or one of the T new
tokens (h <= j < h + T, read from the call's inputs and rounded to the buffer dtype exactly as a
later replay will read them back); other positions are zero. A refreshing slot has h = 0 here.
"""
import triton
import triton.language as tl

from .formats import INTERPRETED, as_stored, within


@triton.jit
def slot_row(slots_ptr, pid_b, SCRATCH):
    """(valid, storage row) of batch row ``pid_b``; a pad (-1) maps to the scratch row."""
    slot = tl.load(slots_ptr + pid_b)
    valid = slot >= 0
    return valid, tl.where(valid, slot, SCRATCH).to(tl.int64)


@triton.jit
def cursor(committed_ptr, valid, row, T: tl.constexpr, L: tl.constexpr):
    """(committed count h, refresh due) of a storage row; a pad has h = 0 and never refreshes."""
    return committed_cursor(tl.load(committed_ptr + row), valid, T, L)


@triton.jit
def committed_cursor(committed, valid, T: tl.constexpr, L: tl.constexpr):
    """``cursor`` from the storage row's committed count as loaded."""
    h = tl.where(valid, committed, 0)
    return h, valid & (h + T > L)


@triton.jit
def step_cursor(cursors_ptr, pid_b, valid, T: tl.constexpr, L: tl.constexpr):
    """(committed count h, refresh due) of batch row ``pid_b`` in the step kernel, from the copy
    the scores launch made (``cursors`` [b]): a load that does not wait for the slot id, so the
    read copy and window loads wait on one round trip instead of two. A pad never refreshes."""
    h = tl.where(valid, tl.load(cursors_ptr + pid_b), 0)
    return h, valid & (h + T > L)


@triton.jit
def list_due(slots_ptr, committed_ptr, due_ptr, B, T: tl.constexpr, L: tl.constexpr, CH: tl.constexpr,
             PASSES: tl.constexpr):
    """The batch rows whose slots are due to refresh, in batch order, CH rows at a time: due[0] =
    their count n, due[1 .. n] the rows, and the other rows from the end back, due[B], due[B - 1],
    ... (``due`` int32 [b + 1]: due[1 ..] orders every row, the slots due first); PASSES =
    ceil(B / CH). Run by one program of a scores launch (committed counts change only in the step
    launch, after it): a refresh launch of its own then needs a program per tile of the slots due
    only, where a launch over every slot spends most of its time on programs that load a cursor
    and exit; a launch over every slot with ``launch.DUE_FIRST`` takes the rows in this order."""
    count = tl.full((), 0, tl.int32)
    others = tl.full((), 0, tl.int32)
    for p in tl.static_range(PASSES):
        i = p * CH + tl.arange(0, CH)
        slot = tl.load(slots_ptr + i, mask=i < B, other=-1)
        h = tl.load(committed_ptr + slot, mask=slot >= 0, other=0)
        due = ((slot >= 0) & (h + T > L)).to(tl.int32)
        rank = count + tl.cumsum(due, 0) - due
        tl.store(due_ptr + 1 + rank, i, mask=due > 0)
        count += tl.sum(due, 0)
        rest = ((due == 0) & (i < B)).to(tl.int32)
        tl.store(due_ptr + B - (others + tl.cumsum(rest, 0) - rest), i, mask=rest > 0)
        others += tl.sum(rest, 0)
    tl.store(due_ptr, count)


@triton.jit
def due_slot(due_ptr, slots_ptr, cursors_ptr, rank):
    """(batch row, storage row int64, committed count h) of the slot due of ``rank`` in the list
    ``list_due`` made (rank < due[0]): what a program of a launch over the slots due works on."""
    pid_b = tl.load(due_ptr + 1 + rank)
    return pid_b, tl.load(slots_ptr + pid_b).to(tl.int64), tl.load(cursors_ptr + pid_b)


@triton.jit
def step_item(due_ptr, slots_ptr, cursors_ptr, c, it, count, SCRATCH, T: tl.constexpr, L: tl.constexpr,
              DUE: tl.constexpr):
    """(active, batch row, valid, storage row, committed count h, refresh due) of round ``it`` of a
    step program whose grid index over batch rows is ``c``, by the launch's ``DUE``
    (``launch.EVERY_SLOT`` 0, ``NOT_DUE`` 1, ``DUE_ONLY`` 2, ``DUE_FIRST`` 3): batch row c (with
    NOT_DUE inactive where its slot is due, left to a DUE_ONLY launch), the slot due of rank c + it
    n (DUE_ONLY; n the grid's extent there, ``count`` = due[0]; inactive past the last), or with
    DUE_FIRST batch row due[1 + c] (``list_due``'s order of every row: the slots due first)."""
    if DUE == 2:
        r = c + it * tl.num_programs(2)
        pid_b, row, h = due_slot(due_ptr, slots_ptr, cursors_ptr, tl.minimum(r, count - 1))
        return r < count, pid_b, True, row, h, True
    else:
        pid_b = tl.load(due_ptr + 1 + c) if DUE == 3 else c
        valid, row = slot_row(slots_ptr, pid_b, SCRATCH)
        h, need = step_cursor(cursors_ptr, pid_b, valid, T, L)
        return (need == 0) if DUE == 1 else True, pid_b, valid, row, h, need


@triton.jit
def slot_cursor(slots_ptr, committed_ptr, pid_b, SCRATCH, T: tl.constexpr, L: tl.constexpr):
    """(valid, storage row, committed count h, refresh due) of batch row ``pid_b``."""
    valid, row = slot_row(slots_ptr, pid_b, SCRATCH)
    h, need = cursor(committed_ptr, valid, row, T, L)
    return valid, row, h, need


@triton.jit
def window_rows(buf_ptr, in_ptr, sb, st, sh, se, row, pid_b, h, head, NH, cols, WIDTH: tl.constexpr,
                T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr):
    """[LP, len(cols)] fp32 window of a per-token vector field: buffer [rows, L, NH, WIDTH],
    inputs [b, T, NH, WIDTH] of strides (sb, st, sh, se) (``launch.token_strides``), columns
    ``cols`` of head ``head`` (a tile of them, zero from WIDTH on). The buffer's entries are read
    again next step: L2 keeps them last (the read copy streamed beside them goes first)."""
    j = tl.arange(0, LP)
    ok = within(cols, WIDTH)[None, :]
    old = j < h
    new = (j >= h) & (j < h + T)
    a = tl.load(buf_ptr + ((row * L + j[:, None]) * NH + head) * WIDTH + cols[None, :],
                mask=old[:, None] & ok, other=0.0, eviction_policy="evict_last")
    b = tl.load(in_ptr + pid_b * sb + (j - h)[:, None] * st + head * sh + cols[None, :] * se,
                mask=new[:, None] & ok, other=0.0)
    return a.to(tl.float32) + as_stored(b, buf_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def whole_window(buf_ptr, row, at, heads, cols, NH, WIDTH: tl.constexpr, L: tl.constexpr):
    """Every entry of storage row ``row``'s window at positions ``at`` [LP] of a buffer [rows, L, NH,
    WIDTH] (a per-head scalar field: WIDTH = 1, ``cols`` = [0]), heads ``heads`` [RP], [RP, LP,
    len(cols)] in the buffer's dtype, zero from position L and column WIDTH on. Loaded whatever the
    committed count, so that the load waits for the slot id only; ``committed_window`` and
    ``committed_head_window`` keep the committed entries (a step of one launch: at batch 1 a step is
    a chain of round trips to memory). The buffer's entries are read again next step: L2 keeps them
    last."""
    ok = (at < L)[None, :, None] & within(cols, WIDTH)[None, None, :]
    return tl.load(buf_ptr + ((row * L + at[None, :, None]) * NH + heads[:, None, None]) * WIDTH
                   + cols[None, None, :], mask=ok, other=0.0, eviction_policy="evict_last")


@triton.jit
def new_rows(in_ptr, sb, st, sh, se, pid_b, head, cols, WIDTH: tl.constexpr, T: tl.constexpr):
    """The T new tokens' rows of a per-token vector field, columns ``cols`` of head ``head`` of the
    inputs [b, T, NH, WIDTH] of strides (sb, st, sh, se): a tuple of [len(cols)] in their dtype, zero
    from WIDTH on."""
    rows = ()
    for s in tl.static_range(T):
        rows = rows + (tl.load(in_ptr + pid_b * sb + s * st + head * sh + cols * se, mask=within(cols, WIDTH),
                               other=0.0),)
    return rows


@triton.jit
def committed_window(buf_ptr, A, new, h, T: tl.constexpr):
    """``window_rows`` from ``whole_window``'s [1, LP, W] tile A of the buffer ``buf_ptr`` and
    ``new_rows``' tuple ``new``: the committed entries (j < h) of A and the new tokens at h .. h + T
    - 1, rounded to the buffer dtype; the same values, bit for bit."""
    LP: tl.constexpr = A.shape[1]
    j = tl.arange(0, LP)[:, None]
    a = tl.where(j < h, tl.reshape(A, (LP, A.shape[2])), 0.0)
    b = tl.zeros((LP, A.shape[2]), new[0].dtype)
    for s in tl.static_range(T):
        b = tl.where(j == h + s, new[s][None, :], b)
    return a.to(tl.float32) + as_stored(b, buf_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def committed_head_window(A, new, h, at, T: tl.constexpr):
    """``head_window`` (IN_REGISTERS) from ``whole_window``'s [RP, LP, 1] tile A: the committed
    entries (at < h) of A, the values ``new`` (a tuple of [RP] by token) at h .. h + T - 1, fp32."""
    X = tl.where((at < h)[None, :], tl.reshape(A, (A.shape[0], A.shape[1])).to(tl.float32), 0.0)
    for s in tl.static_range(T):
        X = tl.where((at == h + s)[None, :], new[s][:, None], X)
    return X


@triton.jit
def window_raw_keys(bk_ptr, row, khead, h, ck, HK, DK: tl.constexpr, L: tl.constexpr, LP: tl.constexpr):
    """The committed keys of key head ``khead`` as buffered (bk [rows, L, HK, DK], the dtype of the
    caller's keys), [LP, len(ck)], columns ``ck`` (zero from DK on), entries j < h (zero after)."""
    j = tl.arange(0, LP)
    return tl.load(bk_ptr + ((row * L + j[:, None]) * HK + khead) * DK + ck[None, :],
                   mask=(j < h)[:, None] & within(ck, DK)[None, :], other=0.0)


@triton.jit
def window_key_scales(bks_ptr, row, khead, h, HK, L: tl.constexpr, LP: tl.constexpr):
    """The normalizing factors [LP] fp32 of those keys (bks [rows, L, HK]), zero from entry h on."""
    j = tl.arange(0, LP)
    return tl.load(bks_ptr + (row * L + j) * HK + khead, mask=j < h, other=0.0)


@triton.jit
def window_keys(bk_ptr, bks_ptr, row, khead, h, ck, HK, DK: tl.constexpr, L: tl.constexpr, LP: tl.constexpr):
    """[LP, len(ck)] fp32 committed keys of key head ``khead``, as the recurrence uses them: the
    buffered keys times their normalizing factors."""
    k = window_raw_keys(bk_ptr, row, khead, h, ck, HK, DK, L, LP).to(tl.float32)
    return k * window_key_scales(bks_ptr, row, khead, h, HK, L, LP)[:, None]


@triton.jit
def _draft_parent(parents_ptr, pid_b, valid, s: tl.constexpr, T: tl.constexpr):
    """The parent of draft s of batch row ``pid_b`` (-1: the last committed token), clamped into
    [-1, s) (unchecked inputs); s - 1 (a chain) for a pad row."""
    p = tl.load(parents_ptr + pid_b * T + s).to(tl.int32)
    return tl.where(valid, tl.minimum(tl.maximum(p, -1), s - 1), s - 1)


@triton.jit
def ancestor_bits(parents_ptr, pid_b, valid, T: tl.constexpr):
    """[32] int32: entry s has bit n set when draft n is draft s or one of its ancestors (T <= 32),
    from ``parents`` [b, T] (``_draft_parent``); in registers, for a launch whose programs each need
    the whole tree."""
    n = tl.arange(0, 32)  # a bit per draft
    anc = tl.zeros((32,), tl.int32)
    for s in tl.static_range(T):
        p = _draft_parent(parents_ptr, pid_b, valid, s, T)
        above = tl.sum(tl.where(n == p, anc, 0), 0)  # 0 for a child of the last committed token
        anc = tl.where(n == s, above | (tl.full((), 1, tl.int32) << s), anc)
    return anc


@triton.jit
def pending_tree(parents_ptr, gaps_ptr, pid_b, valid, row, T: tl.constexpr, MAXD: tl.constexpr):
    """Store the draft tree of batch row ``pid_b``, for a real slot, as its pending tree
    ``cache.draft_gaps`` (int32 [rows, MAXD]: s - 1 - parent) against which accept checks a path.
    parents [b, T] int32 or int64, -1 the last committed token; values outside [-1, s) (unchecked
    inputs) are clamped into it, as ``ancestor_bits`` clamps them, so no path names a later draft."""
    for s in tl.static_range(T):
        tl.store(gaps_ptr + row * MAXD + s, s - 1 - _draft_parent(parents_ptr, pid_b, valid, s, T), mask=valid)


@triton.jit
def draft_bits(anc, s: tl.constexpr, TREE: tl.constexpr):
    """Draft s's mask out of ``ancestor_bits``' vector (0, never read, for a chain)."""
    if TREE:
        return tl.sum(tl.where(tl.arange(0, 32) == s, anc, 0), 0)
    return 0


@triton.jit
def draft_view(anc, h, s: tl.constexpr, LP: tl.constexpr, TREE: tl.constexpr):
    """[LP] bool: the window positions that draft s (at h + s) sees, the committed entries j < h
    and, among the drafts at h + n, its ancestors and itself (``anc``: bit n, ``draft_bits``);
    every draft n <= s for a chain (not TREE), i.e. j <= h + s."""
    j = tl.arange(0, LP)
    rel = j - h
    on = (rel >= 0) & (rel <= s)
    if TREE:
        on = on & (((anc >> tl.where(on, rel, 0)) & 1) != 0)
    return (j < h) | on


@triton.jit
def head_window(buf_ptr, in_ptr, sb, st, sh, new, row, pid_b, h, at, heads, mine, NH, T: tl.constexpr,
                L: tl.constexpr, IN_REGISTERS: tl.constexpr):
    """[RP, LP] fp32 window of a per-token, per-head scalar field for heads ``heads`` [RP]
    (``mine``: the real ones) at positions ``at`` [LP]: committed entries (at < h) from the buffer
    [rows, L, NH], the new ones from the inputs [b, T, NH] of strides (sb, st, sh) or, with
    IN_REGISTERS, from ``new`` (a tuple of [RP] by token, computed by the launch); zero elsewhere."""
    X = tl.load(buf_ptr + (row * L + at[None, :]) * NH + heads[:, None], mask=mine[:, None] & (at < h)[None, :],
                other=0.0).to(tl.float32)
    if IN_REGISTERS:
        for s in tl.static_range(T):
            X = tl.where((at == h + s)[None, :], new[s][:, None], X)
    else:
        X += tl.load(in_ptr + pid_b * sb + (at - h)[None, :] * st + heads[:, None] * sh,
                     mask=mine[:, None] & ((at >= h) & (at < h + T))[None, :], other=0.0).to(tl.float32)
    return X


@triton.jit
def draft_paths(anc, h, s: tl.constexpr, LP: tl.constexpr, TREE: tl.constexpr):
    """Draft s's path over the window (``draft_view``) and the same one entry on, for
    ``decay.path_decays``; ``anc``: ``ancestor_bits``' vector (0 for a chain)."""
    bits = draft_bits(anc, s, TREE)
    return draft_view(bits, h, s, LP, TREE), draft_view(bits, h - 1, s, LP, TREE)


@triton.jit
def new_key_query(k_ptr, skb, skt, skh, ske, q_ptr, sqb, sqt, sqh, sqe, pid_b, s, head, ck, DK: tl.constexpr,
                  STORED: tl.constexpr, NORM: tl.constexpr):
    """New token s's key and query of key head ``head``, columns ``ck`` (zero from DK on), from the
    caller's k, q [b, T, heads, DK] of strides sk*, sq*: (k as the buffer of dtype STORED will hold
    it, fp32; its normalizing factor, 1/sqrt(k . k + 1e-6) when NORM, else 1; q fp32, L2-normalized
    when NORM). The key is taken from the value the buffer holds, so a replay
    (``window_keys``) gives the same k_scale * k bit for bit."""
    k, q = load_key_query(k_ptr, skb, skt, skh, ske, q_ptr, sqb, sqt, sqh, sqe, pid_b, s, head, ck, DK, STORED)
    return key_query_norms(k, q, STORED, NORM)


@triton.jit
def load_key_query(k_ptr, skb, skt, skh, ske, q_ptr, sqb, sqt, sqh, sqe, pid_b, s, head, ck, DK: tl.constexpr,
                   STORED: tl.constexpr):
    """``new_key_query``'s loads: (k as the buffer of dtype STORED will hold it, q), fp32 [len(ck)]."""
    cols = within(ck, DK)
    k = tl.load(k_ptr + pid_b * skb + s * skt + head * skh + ck * ske, mask=cols, other=0.0)
    q = tl.load(q_ptr + pid_b * sqb + s * sqt + head * sqh + ck * sqe, mask=cols, other=0.0).to(tl.float32)
    return as_stored(k, STORED).to(tl.float32), q


@triton.jit
def key_query_norms(k, q, STORED: tl.constexpr, NORM: tl.constexpr):
    """``new_key_query``'s arithmetic on ``load_key_query``'s (k, q): (k, its normalizing factor, q
    normalized)."""
    if NORM:
        return k, 1.0 / tl.sqrt(_square_norm(k, STORED) + 1e-6), q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
    return k, 1.0, q


@triton.jit
def _square_norm(x, STORED: tl.constexpr):
    """x . x for x [N] fp32 (N >= 16) holding values of dtype STORED, as a tensor-core product: its
    bits are the same in programs of any warp count, where a ``tl.sum``'s order follows the layout,
    so every launch that prepares a key buffers the same normalizing factor, which the refresh
    reads. A 16-bit x multiplies in its own dtype (exact products, fp32 sums), an fp32 one in
    3-pass tf32."""
    if STORED == tl.float32:
        X = tl.broadcast_to(x[None, :], (16, x.shape[0]))
        P = tl.dot(X, tl.trans(X), input_precision="tf32x3")
    else:
        X = tl.broadcast_to(x.to(STORED)[None, :], (16, x.shape[0]))
        if INTERPRETED:  # the interpreter's products do not take 16-bit operands; fp32 holds them exactly
            X = X.to(tl.float32)
        P = tl.dot(X, tl.trans(X), out_dtype=tl.float32)
    i = tl.arange(0, 16)
    return tl.sum(tl.sum(tl.where((i[:, None] == 0) & (i[None, :] == 0), P, 0.0), 1), 0)  # P[0, 0], exactly


@triton.jit
def fused_item(slots_ptr, committed_ptr, c, SCRATCH):
    """(valid, storage row, committed count as loaded) of batch row c in a step of one launch, read
    from the committed counts themselves (the row's last program advances them). Nothing waits on
    the count yet: the program issues every load that needs the storage row only first
    (``whole_window``), then takes its cursor (``fused_cursor``), since at batch 1 a step is a chain
    of round trips to memory and a branch on the count waits for it."""
    valid, row = slot_row(slots_ptr, c, SCRATCH)
    return valid, row, tl.load(committed_ptr + row)


@triton.jit
def fused_cursor(committed, valid, row, parents_ptr, gaps_ptr, c, first, T: tl.constexpr, L: tl.constexpr,
                 TREE: tl.constexpr, MAXD: tl.constexpr):
    """(committed count h, refresh due) of ``fused_item``'s batch row c; the ``first`` program of the
    row also stores its draft tree (TREE, ``pending_tree``)."""
    h, need = committed_cursor(committed, valid, T, L)
    if TREE:
        if first:
            pending_tree(parents_ptr, gaps_ptr, c, valid, row, T, MAXD)
    return h, need


@triton.jit
def program_item(due_ptr, slots_ptr, cursors_ptr, valid, row, committed, parents_ptr, gaps_ptr, c, it, count, first,
                 SCRATCH, T: tl.constexpr, L: tl.constexpr, DUE: tl.constexpr, FUSED: tl.constexpr,
                 TREE: tl.constexpr, MAXD: tl.constexpr):
    """(active, batch row, valid, storage row, committed count h, refresh due) of round ``it`` of a
    step program of grid index ``c`` over batch rows: in a step of one launch (FUSED) from
    ``fused_item``'s (valid, row, committed) after the program's loads, which a barrier keeps
    before the branch on the cursor (the compiler would sink them past it), by ``fused_cursor``
    (``first``: the row's first program); else ``step_item``."""
    if FUSED:
        tl.debug_barrier()
        h, need = fused_cursor(committed, valid, row, parents_ptr, gaps_ptr, c, first, T, L, TREE, MAXD)
        return True, c, valid, row, h, need
    else:
        return step_item(due_ptr, slots_ptr, cursors_ptr, c, it, count, SCRATCH, T, L, DUE)
