"""Mamba-2 ReplaySSM Triton kernels: refresh + output-only decode/verify.

A step is four launches, no host synchronization and no PyTorch work between them:
``_mamba2_scores_kernel`` (the input preparation dt = softplus(dt + dt_bias), A dt, and B_j . C_s
for the window, once per batch row and group), ``_mamba2_refresh_kernel`` (the slots whose window
is full; other programs exit), ``_mamba2_step_kernel`` (one program per block of state rows, head
and batch row), and ``launch.advance`` (shared buffer fields and cursors). Below
``launch.SPLIT_MIN_BATCH`` batch rows (per architecture) the step kernel refreshes itself (three launches).

If the slot's committed history plus the T new tokens overflows the window, the program first
folds the committed entries into the anchor (S = gamma_h S_anchor + sum_j w_j x_j B_j^T, one
tensor-core product, or one rank-1 update per token), casts S independently into anchor and read
copy, and stores both; the anchor is read nowhere else. Then, from the read copy in its own format,

    y_s = gamma_t (S_read C_s) + sum_{j <= t} gamma_{j+1:t} dt_j (B_j . C_s) x_j,   t = h + s

(DESIGN §2) as fp32 row reductions: the products are matrix-vector, so no tensor cores, and
IEEE fp32 keeps parity with the float64 reference. The new tokens' x rows are stored here.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import launch
from .._triton.launch import after_previous_launch
from .._triton.decay import segment_to, suffix_sums
from .._triton.window import (cursor_of, early_cursor, refresh_item, refresh_plan,
                              refresh_program, slot_cursor, slot_row, window_rows, window_scalars)
from .._triton.formats import (column, load_query, load_read, load_tile, matvec, pin_vector_width,
                               products_on_tensor_cores, streamed_products, write_checkpoint)



@triton.jit
def _mamba2_scores_kernel(slots_ptr, committed_ptr, cursors_ptr, bB_ptr, B_ptr, C_ptr, scores_ptr,
                          dt_ptr, bias_ptr, A_ptr, dtn_ptr, la_ptr, SCRATCH, H, G,
                          T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, DK: tl.constexpr,
                          HG: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                          EARLY_CURSOR: tl.constexpr, PDL: tl.constexpr):
    """Once per (batch row, group): the T new tokens' step sizes of the group's heads prepared in
    fp32 into dtn = softplus(dt + dt_bias) and la = A * dtn [b, T, H] for the other launches; then
    scores[b, g, s, j] = B_j . C_s over the entries a query sees (committed + new), so the
    per-row programs of the step kernel never load the B tile."""
    after_previous_launch(PDL)
    pid_b, group = tl.program_id(0), tl.program_id(1)
    heads = group * (H // G) + tl.arange(0, HG)
    mine = tl.arange(0, HG) < H // G
    A = tl.load(A_ptr + heads, mask=mine, other=0.0).to(tl.float32)
    for s in tl.static_range(T):
        at = (pid_b * T + s) * H + heads
        d = tl.load(dt_ptr + at, mask=mine, other=0.0).to(tl.float32)
        if HAS_BIAS:
            d += tl.load(bias_ptr + heads, mask=mine, other=0.0).to(tl.float32)
        if SOFTPLUS:  # torch's softplus (threshold 20), with log1p(e) by Kahan's correction
            e = tl.exp(tl.minimum(d, 20.0))
            u = 1.0 + e
            d = tl.where(d > 20.0, d, tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0))))
        tl.store(dtn_ptr + at, d, mask=mine)
        tl.store(la_ptr + at, A * d, mask=mine)
    _, row, h, need = slot_cursor(slots_ptr, committed_ptr, pid_b, SCRATCH, T, L)
    if EARLY_CURSOR and group == 0:  # for the later launches of this step (window.early_cursor)
        tl.store(cursors_ptr + pid_b, h)
    h = tl.where(need, 0, h)  # a refreshing slot sees only its new tokens
    j = tl.arange(0, LP)
    ck = tl.arange(0, DK)
    K = window_rows(bB_ptr, B_ptr, row, pid_b, h, group, G, ck, DK, T, L, LP)
    for s in tl.static_range(T):
        q = tl.load(C_ptr + ((pid_b * T + s) * G + group) * DK + ck).to(tl.float32)
        tl.store(scores_ptr + ((pid_b * G + group) * T + s) * LP + j, tl.sum(K * q[None, :], 1))


@triton.jit
def _fold_weights(bx_ptr, bdt_ptr, bla_ptr, row, head, h, rv, H, L: tl.constexpr, LP: tl.constexpr,
                  DV: tl.constexpr):
    """(log decay of the whole history, XW [BV, LP]) for a refresh of rows ``rv`` from the h
    committed buffer entries: XW[:, j] = w_j x_j with w_j = gamma_{j+1:h} dt_j, zero past h."""
    j = tl.arange(0, LP)
    buf_tok = row * L + j
    old = j < h
    la_c = tl.load(bla_ptr + buf_tok * H + head, mask=old, other=0.0)
    w = tl.exp(suffix_sums(la_c, h)) * tl.load(bdt_ptr + buf_tok * H + head, mask=old, other=0.0)
    X = tl.load(bx_ptr + (buf_tok[None, :] * H + head) * DV + rv[:, None], mask=old[None, :], other=0.0)
    return tl.sum(la_c, 0), X.to(tl.float32) * w[None, :]


@triton.jit
def _fold(S, la_sum, XW, bB_ptr, row, group, h, cols, G, L: tl.constexpr, LP: tl.constexpr, DK: tl.constexpr,
          DOT: tl.constexpr):
    """Columns ``cols`` of the new checkpoint's unrounded rows, gamma_h S + sum_{j<h} w_j x_j B_j^T,
    from the same columns S [BV, KC] of the anchor and ``_fold_weights``."""
    j = tl.arange(0, LP)
    S = S * tl.exp(la_sum)
    if DOT:  # one [BV, LP] x [LP, KC] tensor-core product (3-pass tf32)
        B_c = tl.load(bB_ptr + ((row * L + j[:, None]) * G + group) * DK + cols[None, :], mask=(j < h)[:, None],
                      other=0.0)
        S += tl.dot(XW, B_c.to(tl.float32), input_precision="tf32x3")
    else:  # one rank-1 update per committed token (XW is zero past h); unrolled
        for jj in tl.static_range(L):
            m = jj < h
            kr = tl.load(bB_ptr + ((row * L + jj) * G + group) * DK + cols, mask=m & (cols < DK), other=0.0)
            S += tl.sum(tl.where(j[None, :] == jj, XW, 0.0), 1)[:, None] * kr.to(tl.float32)[None, :]
    return S


@triton.jit
def _mamba2_refresh_rows(pid_v, head, row, h, seeds_ptr, tokens_ptr, av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr,
                         bx_ptr, bdt_ptr, bla_ptr, bB_ptr, H, G, L: tl.constexpr, LP: tl.constexpr,
                         DV: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
                         A_FMT: tl.constexpr, A_SR: tl.constexpr, R_FMT: tl.constexpr, R_SR: tl.constexpr,
                         SHARED: tl.constexpr, REFRESH_DOT: tl.constexpr):
    """Refresh rows pid_v * BV ... of one head of storage row ``row`` (h committed entries): fold
    and encode KC columns at a time (``launch.refresh_columns``), so that a program holds a
    [BV, KC] slice of the state and of the product operands instead of whole rows."""
    mat = row * H + head
    gidx = mat * (DV // BV) + pid_v
    rv = pid_v * BV + tl.arange(0, BV)
    la_sum, XW = _fold_weights(bx_ptr, bdt_ptr, bla_ptr, row, head, h, rv, H, L, LP, DV)
    seed = tl.load(seeds_ptr + row)
    tokens = tl.load(tokens_ptr + row)
    for c in tl.static_range(DK // KC):
        cols = c * KC + tl.arange(0, KC)
        S = load_tile(av_ptr, as_ptr, ag_ptr, mat, gidx, rv, cols, DV, DK, A_FMT)
        S = _fold(S, la_sum, XW, bB_ptr, row, head // (H // G), h, cols, G, L, LP, DK, REFRESH_DOT)
        write_checkpoint(S, av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, mat, gidx, head, rv, cols, seed, tokens,
                         DV, DK, A_FMT, A_SR, R_FMT, R_SR, SHARED)


@triton.jit
def _mamba2_refresh_kernel(
        slots_ptr, committed_ptr, cursors_ptr, tokens_ptr, seeds_ptr,
        av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr,
        bx_ptr, bdt_ptr, bla_ptr, bB_ptr, SCRATCH, H, G, B,
        T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr,
        DV: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
        A_FMT: tl.constexpr, A_SR: tl.constexpr, R_FMT: tl.constexpr, R_SR: tl.constexpr,
        SHARED: tl.constexpr, REFRESH_DOT: tl.constexpr, EARLY_CURSOR: tl.constexpr,
        PERSISTENT: tl.constexpr, BP: tl.constexpr, PDL: tl.constexpr, COMPACT: tl.constexpr = False, FIRST=0):
    """The refresh alone (the step kernel then runs with FUSED_REFRESH=False); PERSISTENT,
    COMPACT and FIRST as in ``_gdn_refresh_kernel``."""
    after_previous_launch(PDL)
    if PERSISTENT:
        need, ordinal, count = refresh_plan(slots_ptr, committed_ptr, cursors_ptr, B, BP, T, L, EARLY_CURSOR)
        w = tl.program_id(0) + FIRST * H * (DV // BV)
        while w < count * H * (DV // BV):  # a while loop: the interpreter's range needs host ints
            pid_v, head, _, row, h = refresh_item(need, ordinal, w, slots_ptr, committed_ptr, SCRATCH, DV // BV, H)
            _mamba2_refresh_rows(pid_v, head, row, h, seeds_ptr, tokens_ptr, av_ptr,
                                 as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, bx_ptr, bdt_ptr, bla_ptr, bB_ptr, H, G, L,
                                 LP, DV, DK, BV, KC, A_FMT, A_SR, R_FMT, R_SR, SHARED, REFRESH_DOT)
            w += tl.num_programs(0)
    else:
        pid_v, head, pid_b, row, h, need = refresh_program(slots_ptr, committed_ptr, cursors_ptr, SCRATCH, B, BP, T,
                                                           L, EARLY_CURSOR, COMPACT)
        if need:
            _mamba2_refresh_rows(pid_v, head, row, h, seeds_ptr, tokens_ptr, av_ptr, as_ptr, ag_ptr, rv_ptr,
                                 rs_ptr, rg_ptr, bx_ptr, bdt_ptr, bla_ptr, bB_ptr, H, G, L, LP, DV, DK, BV, KC,
                                 A_FMT, A_SR, R_FMT, R_SR, SHARED, REFRESH_DOT)


@triton.jit
def _window_loads(bx_ptr, bdt_ptr, bla_ptr, x_ptr, dt_ptr, la_ptr, C_ptr, row, pid_b, head, group, h, rv, H, G,
                  T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr,
                  OUTPUT_DOT: tl.constexpr, QP: tl.constexpr):
    """What a step program reads of a window of h committed entries: (log decays [LP], step sizes
    [LP], x rows X [LP, BV], and with OUTPUT_DOT the step's queries Q [QP, DK], else 0)."""
    la = window_scalars(bla_ptr, la_ptr, row, pid_b, h, head, H, T, L, LP)
    dt = window_scalars(bdt_ptr, dt_ptr, row, pid_b, h, head, H, T, L, LP)
    X = window_rows(bx_ptr, x_ptr, row, pid_b, h, head, H, rv, DV, T, L, LP)
    Q = 0.0
    if OUTPUT_DOT:
        r = tl.arange(0, QP)
        Q = tl.load(C_ptr + ((pid_b * T + r[:, None]) * G + group) * DK + tl.arange(0, DK)[None, :],
                    mask=(r < T)[:, None], other=0.0).to(tl.float32)
    return la, dt, X, Q


@triton.jit
def _token_loads(x_ptr, C_ptr, D_ptr, z_ptr, scores_ptr, pid_b, head, group, rv, H, G, T: tl.constexpr,
                 LP: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr, R_FMT: tl.constexpr, HAS_D: tl.constexpr,
                 HAS_Z: tl.constexpr, OUTPUT_DOT: tl.constexpr):
    """The new tokens' inputs to a step program, all issued at once (load orders 1 and 2): a tuple
    indexed by s of (B_j . C_s [LP], C_s as ``load_query`` gives it (zeros with OUTPUT_DOT), D,
    x_s [BV], z_s [BV]; D, x_s and z_s zero where not used). Order 0 loads the same values where
    the step kernel first uses them."""
    tokens_in = ()
    for s in tl.static_range(T):
        q_tok = pid_b * T + s
        qa, qb = 0.0, 0.0
        if not OUTPUT_DOT:
            qa, qb = load_query(C_ptr + (q_tok * G + group) * DK, DK, R_FMT)
        D, xq, zq = 0.0, 0.0, 0.0
        if HAS_D:
            D = tl.load(D_ptr + head).to(tl.float32)
        if HAS_D or HAS_Z:
            xq = tl.load(x_ptr + (q_tok * H + head) * DV + rv).to(tl.float32)
        if HAS_Z:
            zq = tl.load(z_ptr + (q_tok * H + head) * DV + rv).to(tl.float32)
        tokens_in = tokens_in + ((tl.load(scores_ptr + ((pid_b * G + group) * T + s) * LP + tl.arange(0, LP)),
                                  qa, qb, D, xq, zq),)
    return tokens_in


@triton.jit
def _mamba2_step_kernel(
        slots_ptr, committed_ptr, cursors_ptr, tokens_ptr, seeds_ptr,
        av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr,
        bx_ptr, bdt_ptr, bla_ptr, bB_ptr,
        x_ptr, dt_ptr, la_ptr, C_ptr, D_ptr, z_ptr, scores_ptr, y_ptr,
        SCRATCH, H, G,
        T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr,
        DV: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
        A_FMT: tl.constexpr, A_SR: tl.constexpr, R_FMT: tl.constexpr, R_SR: tl.constexpr,
        SHARED: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, REFRESH_DOT: tl.constexpr,
        FUSED_REFRESH: tl.constexpr, EARLY_CURSOR: tl.constexpr, OUTPUT_DOT: tl.constexpr, QP: tl.constexpr,
        PDL: tl.constexpr, STEP_PIN: tl.constexpr = 0, LOADS: tl.constexpr = 0, STREAM: tl.constexpr = 0):
    after_previous_launch(PDL)
    # row blocks vary fastest: programs running side by side stream one slot's contiguous state
    pid_v, head, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h_early = early_cursor(cursors_ptr, pid_b, EARLY_CURSOR)
    valid, row = slot_row(slots_ptr, pid_b, SCRATCH)
    group = head // (H // G)
    mat = row * H + head
    gidx = mat * (DV // BV) + pid_v  # NVFP4 global-scale block of these rows
    rv = pid_v * BV + tl.arange(0, BV)
    ck = tl.arange(0, DK)
    j = tl.arange(0, LP)
    buf_tok = row * L + j  # [LP] buffer token index of this slot
    # the read copy in its own layout (the anchor itself when shared), issued before the cursor
    # load so that the two latencies overlap; a refreshing program replaces it below. STREAM
    # (launch.stream_stages): never whole, its products stream through streamed_products
    QLOAD: tl.constexpr = OUTPUT_DOT and not STREAM
    if STREAM:
        ra, rb, rsc = 0.0, 0.0, 0.0
    else:
        ra, rb, rsc = load_read(rv_ptr, rs_ptr, rg_ptr, mat, gidx, rv, DV, DK, R_FMT)
    h, need = cursor_of(committed_ptr, h_early, valid, row, T, L, EARLY_CURSOR)
    if LOADS == 2:  # issued with the read copy's loads (launch.LOAD_ORDERS)
        la, dt, X, Q = _window_loads(bx_ptr, bdt_ptr, bla_ptr, x_ptr, dt_ptr, la_ptr, C_ptr, row, pid_b, head, group,
                                     tl.where(need, 0, h), rv, H, G, T, L, LP, DV, DK, QLOAD, QP)
        tokens_in = _token_loads(x_ptr, C_ptr, D_ptr, z_ptr, scores_ptr, pid_b, head, group, rv, H, G, T, LP, DV,
                                 DK, R_FMT, HAS_D, HAS_Z, OUTPUT_DOT)
    if STEP_PIN:
        pin_vector_width(rv_ptr, mat, rv, ck, h < 0, DV, DK, STEP_PIN)

    if FUSED_REFRESH:
        if need:  # refresh: fold the h committed entries into a new checkpoint, from the anchor
            _mamba2_refresh_rows(pid_v, head, row, h, seeds_ptr, tokens_ptr, av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr,
                                 rg_ptr, bx_ptr, bdt_ptr, bla_ptr, bB_ptr, H, G, L, LP, DV, DK, BV, KC, A_FMT, A_SR,
                                 R_FMT, R_SR, SHARED, REFRESH_DOT)
            tl.debug_barrier()  # read back, as after a split refresh (write_checkpoint says why)
            ra, rb, rsc = load_read(rv_ptr, rs_ptr, rg_ptr, mat, gidx, rv, DV, DK, R_FMT)
    h = tl.where(need, 0, h)  # after a refresh only the new tokens are in the window

    # the window's entries: committed ones from the buffer, the T new ones from the inputs
    new = (j >= h) & (j < h + T)
    if LOADS < 2:
        la, dt, X, Q = _window_loads(bx_ptr, bdt_ptr, bla_ptr, x_ptr, dt_ptr, la_ptr, C_ptr, row, pid_b, head, group,
                                     h, rv, H, G, T, L, LP, DV, DK, QLOAD, QP)
    if LOADS == 1:
        tokens_in = _token_loads(x_ptr, C_ptr, D_ptr, z_ptr, scores_ptr, pid_b, head, group, rv, H, G, T, LP, DV,
                                 DK, R_FMT, HAS_D, HAS_Z, OUTPUT_DOT)
    if OUTPUT_DOT:  # every S_read C_s of the step in one tensor-core product (launch.output_dot)
        if STREAM:
            SQ = streamed_products(rv_ptr, rs_ptr, mat, rv, C_ptr, C_ptr, pid_b, G, group, T, T, DV, DK, R_FMT, QP,
                                   32, STREAM)
        else:
            SQ = products_on_tensor_cores(ra, rb, rsc, Q, R_FMT)
    for s in tl.static_range(T):  # y_s = gamma_t S_read q + sum_j gamma_{j+1:t} dt_j (k_j . q) x_j
        t = h + s
        q_tok = pid_b * T + s
        if LOADS > 0:
            scores, qa, qb, D, xq, zq = tokens_in[s]
        if OUTPUT_DOT:
            sq = column(SQ, s)
        else:
            if LOADS == 0:  # each input where it is first used
                qa, qb = load_query(C_ptr + (q_tok * G + group) * DK, DK, R_FMT)
            sq = matvec(ra, rb, rsc, qa, qb, R_FMT)
        seen = j <= t
        decay = tl.exp(tl.where(seen, segment_to(la, t), float("-inf")))  # masked before exp
        if LOADS == 0:
            scores = tl.load(scores_ptr + ((pid_b * G + group) * T + s) * LP + j)
        w = decay * dt * scores  # [LP]
        y = tl.exp(tl.sum(tl.where(seen, la, 0.0), 0)) * sq
        y += tl.sum(X * w[:, None], 0)
        out = (q_tok * H + head) * DV + rv
        if HAS_D or HAS_Z:
            if LOADS == 0:
                xq = tl.load(x_ptr + out).to(tl.float32)
            if HAS_D:
                if LOADS == 0:
                    D = tl.load(D_ptr + head).to(tl.float32)
                y += D * xq
            if HAS_Z:
                if LOADS == 0:
                    zq = tl.load(z_ptr + out).to(tl.float32)
                y *= zq * tl.sigmoid(zq)
        tl.store(y_ptr + out, tl.where(valid, y, 0.0))
    # the new tokens' x rows (rounded to the buffer dtype): only this program reads them
    tl.store(bx_ptr + (buf_tok[:, None] * H + head) * DV + rv[None, :], X.to(bx_ptr.dtype.element_ty),
             mask=new[:, None])


def step(cache, slots, x, dt, A, B, C, D, z, dt_bias, dt_softplus: bool, commit: bool):
    """One Mamba-2 decode (T = 1) or verify step on the Triton backend.

    x [b, T, H, P]; dt [b, T, H] raw (dt_bias [H] added and softplus applied here when given);
    A [H]; B, C [b, T, G, N]; D [H]; z [b, T, H, P]; any float dtypes. Returns y fp32
    [b, T, H, P] (pads zero). The input preparation happens inside the first launch.
    """
    launch.check_geometry(cache)
    b, T, H, P = x.shape
    anchor, read, consts = launch.format_args(cache)
    x, dt, A, B, C = (t.contiguous() for t in (x, dt, A, B, C))
    z = None if z is None else z.contiguous()
    y = torch.empty(b, T, H, P, dtype=torch.float32, device=x.device)
    bv, warps, refresh_dot, pin, loads = launch.launch_shape(cache, "mamba2", T)
    split = launch.split_refresh("mamba2", b, T)
    kc = launch.refresh_columns(cache, "mamba2")
    buf = cache.buffer
    LP = max(16, triton.next_power_of_2(cache.window))
    scores = torch.empty(b, cache.ngroups, T, LP, dtype=torch.float32, device=x.device)
    G = cache.ngroups
    dt_in, dt = dt, torch.empty(b, T, H, dtype=torch.float32, device=x.device)
    log_alpha = torch.empty_like(dt)
    cursors, early = launch.cursor_args(cache, slots)
    launch.run(_mamba2_scores_kernel, (b, G), slots, cache.committed, cursors, buf["B"], B, C, scores,
               dt_in, dt_in if dt_bias is None else dt_bias.contiguous(), A, dt, log_alpha, cache.scratch_row, H, G,
               T=T, L=cache.window, LP=LP, DK=cache.dstate, HG=triton.next_power_of_2(H // G),
               HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus), EARLY_CURSOR=early)
    grid = (P // bv, H, b)
    if split:
        rbv, rwarps = launch.refresh_shape(cache, "mamba2", bv, warps, T)
        for rgrid, tier in launch.refresh_launches(x.device, (P // rbv, H, b), T, cache.window):
            launch.run(_mamba2_refresh_kernel, rgrid, slots, cache.committed, cursors, cache.tokens,
                       cache.seeds, *anchor, *read, buf["x"], buf["dt"], buf["log_alpha"], buf["B"], cache.scratch_row,
                       H, cache.ngroups, b,
                       T=T, L=cache.window, LP=LP, DV=P, DK=cache.dstate, BV=rbv, KC=kc, REFRESH_DOT=refresh_dot,
                       EARLY_CURSOR=early, BP=triton.next_power_of_2(b), num_warps=rwarps, **tier, **consts)
    launch.run(
        _mamba2_step_kernel, grid,
        slots, cache.committed, cursors, cache.tokens, cache.seeds, *anchor, *read,
        buf["x"], buf["dt"], buf["log_alpha"], buf["B"],
        x, dt, log_alpha, C, x if D is None else D, x if z is None else z, scores, y,
        cache.scratch_row, H, cache.ngroups,
        T=T, L=cache.window, LP=LP, DV=P,
        DK=cache.dstate, BV=bv, KC=kc, HAS_D=D is not None, HAS_Z=z is not None,
        REFRESH_DOT=refresh_dot, FUSED_REFRESH=not split, EARLY_CURSOR=early,
        OUTPUT_DOT=launch.output_dot(cache, "mamba2", T), QP=max(16, triton.next_power_of_2(T)),
        STEP_PIN=pin, LOADS=loads, STREAM=launch.stream_stages(cache, "mamba2", T, split), num_warps=warps,
        **consts)
    launch.advance(cache, slots, T, commit, {"dt": dt, "log_alpha": log_alpha, "B": B})
    return y
