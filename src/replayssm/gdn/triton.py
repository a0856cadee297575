"""Gated DeltaNet ReplaySSM Triton kernels: refresh + output-only decode/verify.

A step is four launches, no host synchronization and no PyTorch work between them:
``_gdn_scores_kernel`` (the input preparation — L2 norms, query scale, fp32 casts — and k_j . q_s,
k_j . k_s over the window, once per batch row and key head), ``_gdn_refresh_kernel`` (the slots
whose window is full; other programs exit), ``_gdn_step_kernel`` (one program per block of state
rows, value head and batch row; GDN's residuals are separable over state rows), and
``launch.advance`` (shared buffer fields k, g, beta and the cursors). Below
``launch.SPLIT_MIN_BATCH`` batch rows (per architecture) the step kernel refreshes itself (three launches).

At a refresh the program re-solves the committed residuals from the *anchor* (DESIGN §2's
triangular system): by forward substitution on [rows, L] values, with S_anchor K^T and the
rank-h update as tensor-core products (``_refresh_by_substitution``, faster but off: its bits
depend on the tile shape, see ``launch.SHAPES``), or by the conventional recurrence token by
token (``_fold_tokens``, the default); then it casts S independently into anchor and read copy.
Outputs solve only the new tokens' residuals against the read copy, reusing the cached
read-path residuals of committed entries:

    u_s = beta_s (v_s - gamma_t S_read k_s - sum_{j < t} gamma_{j+1:t} (k_j . k_s) u_j)
    o_s = gamma_t S_read q_s + sum_{j <= t} gamma_{j+1:t} (k_j . q_s) u_j,   t = h + s

— no per-token [V, K] state anywhere. The new tokens' v and u rows are stored here.
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
from .._triton.formats import (anchor_rows, column, pin_vector_width, load_query, load_read, load_tile, matvec,
                               products_on_tensor_cores, streamed_products, write_checkpoint)



@triton.jit
def _gdn_scores_kernel(slots_ptr, committed_ptr, cursors_ptr, bk_ptr, k_ptr, q_ptr, kn_ptr, qn_ptr, scores_ptr,
                       gram_ptr, scale, SCRATCH, HK, T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr,
                       DK: tl.constexpr, NORM: tl.constexpr, EARLY_CURSOR: tl.constexpr, GRAM: tl.constexpr,
                       PDL: tl.constexpr):
    """Once per (batch row, key head): the T new keys and queries prepared in fp32 (L2-normalized
    when NORM, as flash-linear-attention's l2norm, queries times ``scale``) into kn, qn [b, T, HK, K]
    for the other launches; then scores[b, kh, 0, s, j] = k_j . q_s and scores[b, kh, 1, s, j] =
    k_j . k_s over the entries of the window (committed + new). GRAM: for a slot that refreshes,
    also gram[b, kh, i, j] = k_i . k_j over its committed entries, for the refresh's solve."""
    after_previous_launch(PDL)
    pid_b, khead = tl.program_id(0), tl.program_id(1)
    ck = tl.arange(0, DK)
    for s in tl.static_range(T):
        at = ((pid_b * T + s) * HK + khead) * DK + ck
        k = tl.load(k_ptr + at).to(tl.float32)
        q = tl.load(q_ptr + at).to(tl.float32)
        if NORM:
            k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
            q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
        tl.store(kn_ptr + at, k)
        tl.store(qn_ptr + at, q * scale)
    tl.debug_barrier()  # the rows just written are read back by other threads of the program
    _, row, h, need = slot_cursor(slots_ptr, committed_ptr, pid_b, SCRATCH, T, L)
    if EARLY_CURSOR and khead == 0:  # for the later launches of this step (window.early_cursor)
        tl.store(cursors_ptr + pid_b, h)
    j = tl.arange(0, LP)
    if GRAM:
        if need:  # row by row: IEEE fp32 reductions, zero past h
            K_c = tl.load(bk_ptr + ((row * L + j[:, None]) * HK + khead) * DK + ck[None, :], mask=(j < h)[:, None],
                          other=0.0).to(tl.float32)
            for i in tl.static_range(L):
                k_i = tl.load(bk_ptr + ((row * L + i) * HK + khead) * DK + ck, mask=(i < h) & (ck < DK),
                              other=0.0).to(tl.float32)
                tl.store(gram_ptr + ((pid_b * HK + khead) * LP + i) * LP + j, tl.sum(K_c * k_i[None, :], 1))
    h = tl.where(need, 0, h)  # a refreshing slot sees only its new tokens
    K = window_rows(bk_ptr, kn_ptr, row, pid_b, h, khead, HK, ck, DK, T, L, LP)
    for s in tl.static_range(T):
        tok = pid_b * T + s
        q = tl.load(qn_ptr + (tok * HK + khead) * DK + ck)
        k = tl.load(kn_ptr + (tok * HK + khead) * DK + ck).to(bk_ptr.dtype.element_ty).to(tl.float32)
        base = ((pid_b * HK + khead) * 2 * T + s) * LP
        tl.store(scores_ptr + base + j, tl.sum(K * q[None, :], 1))
        tl.store(scores_ptr + base + T * LP + j, tl.sum(K * k[None, :], 1))


@triton.jit
def _fold_tokens(S, bk_ptr, bv_ptr, bg_ptr, bbeta_ptr, row, head, khead, h, rv, HV, HK, L: tl.constexpr,
                 DV: tl.constexpr, DK: tl.constexpr):
    """The new checkpoint's unrounded rows ``rv`` [BV, DK] from anchor rows S by the conventional
    recurrence over the h committed tokens (S = alpha S; u = beta (v - S k); S += u k^T),
    unrolled so that every token's buffer loads are independent of S. Its [BV, DK] row
    reductions form a chain of L dependent steps and make it issue-bound (about 1e9 warp
    instructions for a full refresh of Qwen3.5-122B's state at batch 256, ncu)."""
    ck = tl.arange(0, DK)
    for jj in tl.static_range(L):
        tok_j = row * L + jj
        m = jj < h
        kr = tl.load(bk_ptr + (tok_j * HK + khead) * DK + ck, mask=m & (ck < DK), other=0.0).to(tl.float32)
        vr = tl.load(bv_ptr + (tok_j * HV + head) * DV + rv, mask=m & (rv < DV), other=0.0).to(tl.float32)
        S = S * tl.exp(tl.load(bg_ptr + tok_j * HV + head, mask=m, other=0.0))
        u = tl.load(bbeta_ptr + tok_j * HV + head, mask=m, other=0.0) * (vr - tl.sum(S * kr[None, :], 1))
        S += u[:, None] * kr[None, :]
    return S


@triton.jit
def _refresh_by_substitution(pid_b, row, head, khead, h, rv, mat, gidx, seed, tokens, gram_ptr,
                             av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, bk_ptr, bv_ptr, bg_ptr, bbeta_ptr,
                             HV, HK, L: tl.constexpr, LP: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr,
                             KC: tl.constexpr, A_FMT: tl.constexpr, A_SR: tl.constexpr, R_FMT: tl.constexpr,
                             R_SR: tl.constexpr, SHARED: tl.constexpr):
    """The refresh of rows ``rv`` without the token chain: DESIGN §2's triangular system for the
    committed residuals, solved by forward substitution on [BV, LP] values. With c_j the log
    decay from the checkpoint through entry j and g(i, j] the one between entries,

        u_j = beta_j (v_j - e^{c_j} (S k_j) - sum_{i<j} e^{g(i, j]} (k_i . k_j) u_i),
        S_new = e^{c_h} S + sum_j e^{g(j, h)} u_j k_j^T.

    S K^T and the final rank-h update are 3-pass-tf32 tensor-core products over KC columns of
    the anchor at a time (loaded twice; the second load is a cache hit), the Gram matrix comes
    from the scores launch, and the L substitution steps touch only [BV, LP] values."""
    j = tl.arange(0, LP)
    old = j < h
    buf_tok = row * L + j
    g_c = tl.load(bg_ptr + buf_tok * HV + head, mask=old, other=0.0)
    beta_c = tl.load(bbeta_ptr + buf_tok * HV + head, mask=old, other=0.0)  # 0 past h: u = 0 there
    V_c = tl.load(bv_ptr + (buf_tok[None, :] * HV + head) * DV + rv[:, None], mask=old[None, :],
                  other=0.0).to(tl.float32)  # [BV, LP]
    SK = tl.zeros((rv.shape[0], LP), dtype=tl.float32)  # S_anchor k_j
    SKC: tl.constexpr = 32 if DK >= 32 else DK  # not KC: the same sums whatever the write slices
    for c in tl.static_range(DK // SKC):
        cols = c * SKC + tl.arange(0, SKC)
        K_part = tl.load(bk_ptr + (buf_tok[:, None] * HK + khead) * DK + cols[None, :], mask=old[:, None],
                         other=0.0).to(tl.float32)
        S_part = load_tile(av_ptr, as_ptr, ag_ptr, mat, gidx, rv, cols, DV, DK, A_FMT)
        SK += tl.dot(S_part, tl.trans(K_part), input_precision="tf32x3")
    c_j = tl.sum(tl.where(j[None, :] <= j[:, None], g_c[None, :], 0.0), 1)  # log decay through entry j
    R = V_c - tl.exp(c_j)[None, :] * SK
    U = tl.zeros((rv.shape[0], LP), dtype=tl.float32)
    for jj in tl.static_range(L):  # u_jj from the residuals solved before it
        before = tl.where(j < jj, tl.exp(tl.where(j < jj, segment_to(g_c, jj), 0.0)), 0.0) * \
            tl.load(gram_ptr + ((pid_b * HK + khead) * LP + jj) * LP + j)
        u = tl.sum(tl.where(j[None, :] == jj, R, -(U * before[None, :])), 1) * \
            tl.sum(tl.where(j == jj, beta_c, 0.0), 0)
        U = tl.where(j[None, :] == jj, u[:, None], U)
    U = U * tl.exp(suffix_sums(g_c, h))[None, :]  # decay from each entry to the end of the history
    decay = tl.exp(tl.sum(g_c, 0))
    for c in tl.static_range(DK // KC):
        cols = c * KC + tl.arange(0, KC)
        K_part = tl.load(bk_ptr + (buf_tok[:, None] * HK + khead) * DK + cols[None, :], mask=old[:, None],
                         other=0.0).to(tl.float32)
        S = load_tile(av_ptr, as_ptr, ag_ptr, mat, gidx, rv, cols, DV, DK, A_FMT) * decay
        S += tl.dot(U, K_part, input_precision="tf32x3")
        write_checkpoint(S, av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, mat, gidx, head, rv, cols, seed, tokens,
                         DV, DK, A_FMT, A_SR, R_FMT, R_SR, SHARED)


@triton.jit
def _gdn_refresh_rows(pid_v, head, pid_b, row, h, seeds_ptr, tokens_ptr, gram_ptr, av_ptr, as_ptr, ag_ptr, rv_ptr,
                      rs_ptr, rg_ptr, bk_ptr, bv_ptr, bg_ptr, bbeta_ptr, ra, HV, HK, L: tl.constexpr,
                      LP: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
                      A_FMT: tl.constexpr, A_SR: tl.constexpr, R_FMT: tl.constexpr, R_SR: tl.constexpr,
                      SHARED: tl.constexpr, REFRESH_DOT: tl.constexpr, FROM_READ: tl.constexpr,
                      PIN: tl.constexpr = False):
    """Refresh rows pid_v * BV ... of one head of storage row ``row`` (h committed entries,
    batch row ``pid_b``): by substitution on tensor cores (REFRESH_DOT) or token by token. FROM_READ:
    the step kernel's read-copy rows ``ra`` serve as the anchor's where they are the same values
    (``anchor_rows``), saving the token loop a load; otherwise ``ra`` is unused."""
    mat = row * HV + head
    gidx = mat * (DV // BV) + pid_v
    rv = pid_v * BV + tl.arange(0, BV)
    khead = head // (HV // HK)
    if REFRESH_DOT:
        seed = tl.load(seeds_ptr + row)
        tokens = tl.load(tokens_ptr + row)
        _refresh_by_substitution(pid_b, row, head, khead, h, rv, mat, gidx, seed, tokens, gram_ptr, av_ptr, as_ptr,
                                 ag_ptr, rv_ptr, rs_ptr, rg_ptr, bk_ptr, bv_ptr, bg_ptr, bbeta_ptr, HV, HK, L, LP, DV,
                                 DK, KC, A_FMT, A_SR, R_FMT, R_SR, SHARED)
    else:
        ck = tl.arange(0, DK)
        if FROM_READ:
            S = anchor_rows(ra, av_ptr, as_ptr, ag_ptr, mat, gidx, rv, ck, DV, DK, A_FMT, R_FMT, SHARED)
        else:
            S = load_tile(av_ptr, as_ptr, ag_ptr, mat, gidx, rv, ck, DV, DK, A_FMT)
        if PIN:
            pin_vector_width(av_ptr, mat, rv, ck, h < 0, DV, DK)
        S = _fold_tokens(S, bk_ptr, bv_ptr, bg_ptr, bbeta_ptr, row, head, khead, h, rv, HV, HK, L, DV, DK)
        # the seed and counter loaded after the fold: loaded before it, NVFP4 steps measured 10% slower
        write_checkpoint(S, av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, mat, gidx, head, rv, ck,
                         tl.load(seeds_ptr + row), tl.load(tokens_ptr + row), DV, DK, A_FMT, A_SR, R_FMT, R_SR,
                         SHARED)


@triton.jit
def _gdn_refresh_kernel(
        slots_ptr, committed_ptr, cursors_ptr, tokens_ptr, seeds_ptr, gram_ptr,
        av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr,
        bk_ptr, bv_ptr, bg_ptr, bbeta_ptr, SCRATCH, HV, HK, B,
        T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr,
        BV: tl.constexpr, KC: tl.constexpr, A_FMT: tl.constexpr, A_SR: tl.constexpr, R_FMT: tl.constexpr,
        R_SR: tl.constexpr, SHARED: tl.constexpr, EARLY_CURSOR: tl.constexpr, REFRESH_DOT: tl.constexpr,
        PERSISTENT: tl.constexpr, BP: tl.constexpr, PDL: tl.constexpr, PIN: tl.constexpr = False,
        COMPACT: tl.constexpr = False, FIRST=0):
    """The refresh alone (the step kernel then runs with FUSED_REFRESH=False), in one of the
    launches of ``launch.refresh_launches``. PERSISTENT: a fixed number of programs loop over the
    row blocks of the refreshing slots only, from the FIRST-th refreshing slot on. COMPACT: one
    program per (row block, head) of the first FIRST refreshing slots, in the order of the batch.
    Otherwise one program per (row block, head, batch row), and those of slots that do not
    refresh exit after two loads."""
    after_previous_launch(PDL)
    if PERSISTENT:
        need, ordinal, count = refresh_plan(slots_ptr, committed_ptr, cursors_ptr, B, BP, T, L, EARLY_CURSOR)
        w = tl.program_id(0) + FIRST * HV * (DV // BV)
        while w < count * HV * (DV // BV):  # a while loop: the interpreter's range needs host ints
            pid_v, head, pid_b, row, h = refresh_item(need, ordinal, w, slots_ptr, committed_ptr, SCRATCH, DV // BV,
                                                      HV)
            _gdn_refresh_rows(pid_v, head, pid_b, row, h, seeds_ptr, tokens_ptr, gram_ptr, av_ptr, as_ptr, ag_ptr,
                              rv_ptr, rs_ptr, rg_ptr, bk_ptr, bv_ptr, bg_ptr, bbeta_ptr, 0.0, HV, HK, L, LP, DV, DK, BV,
                              KC, A_FMT, A_SR, R_FMT, R_SR, SHARED, REFRESH_DOT, False, PIN)
            w += tl.num_programs(0)
    else:
        pid_v, head, pid_b, row, h, need = refresh_program(slots_ptr, committed_ptr, cursors_ptr, SCRATCH, B, BP, T,
                                                           L, EARLY_CURSOR, COMPACT)
        if need:
            _gdn_refresh_rows(pid_v, head, pid_b, row, h, seeds_ptr, tokens_ptr, gram_ptr, av_ptr, as_ptr, ag_ptr,
                              rv_ptr, rs_ptr, rg_ptr, bk_ptr, bv_ptr, bg_ptr, bbeta_ptr, 0.0, HV, HK, L, LP, DV, DK, BV,
                              KC, A_FMT, A_SR, R_FMT, R_SR, SHARED, REFRESH_DOT, False, PIN)


@triton.jit
def _window_loads(bg_ptr, bu_ptr, g_ptr, q_ptr, k_ptr, row, pid_b, head, khead, h, rv, HV, HK, T: tl.constexpr,
                  L: tl.constexpr, LP: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr, OUTPUT_DOT: tl.constexpr,
                  QP: tl.constexpr):
    """What a step program reads of a window of h committed entries: (log decays g [LP], cached
    residuals U [BV, LP], and with OUTPUT_DOT the step's keys and queries Q [QP, DK], else 0)."""
    j = tl.arange(0, LP)
    g = window_scalars(bg_ptr, g_ptr, row, pid_b, h, head, HV, T, L, LP)
    U = tl.load(bu_ptr + ((row * L + j[None, :]) * HV + head) * DV + rv[:, None], mask=(j < h)[None, :], other=0.0)
    Q = 0.0
    if OUTPUT_DOT:
        r = tl.arange(0, QP)[:, None]
        at = ((pid_b * T + r % T) * HK + khead) * DK + tl.arange(0, DK)[None, :]
        Q = tl.where(r < T, tl.load(k_ptr + at, mask=r < 2 * T, other=0.0), tl.load(q_ptr + at, mask=r < 2 * T, other=0.0))
    return g, U, Q


@triton.jit
def _token_loads(q_ptr, k_ptr, v_ptr, beta_ptr, scores_ptr, bv_ptr, pid_b, head, khead, rv, HV, HK, T: tl.constexpr,
                 LP: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr, R_FMT: tl.constexpr, OUTPUT_DOT: tl.constexpr):
    """The new tokens' inputs to a step program, all issued at once (load orders 1 and 2): a tuple
    indexed by s of (v_s rounded to the buffer dtype [BV], beta_s, k_j . k_s [LP], k_j . q_s [LP],
    then k_s and q_s as ``load_query`` gives them, zeros with OUTPUT_DOT). Order 0 loads the same
    values where the step kernel first uses them."""
    j = tl.arange(0, LP)
    tokens_in = ()
    for s in tl.static_range(T):
        tok_in = pid_b * T + s
        base = ((pid_b * HK + khead) * 2 * T + s) * LP
        ka, kb, qa, qb = 0.0, 0.0, 0.0, 0.0
        if not OUTPUT_DOT:
            ka, kb = load_query(k_ptr + (tok_in * HK + khead) * DK, DK, R_FMT)
            qa, qb = load_query(q_ptr + (tok_in * HK + khead) * DK, DK, R_FMT)
        tokens_in = tokens_in + ((tl.load(v_ptr + (tok_in * HV + head) * DV + rv).to(bv_ptr.dtype.element_ty),
                                  tl.load(beta_ptr + tok_in * HV + head), tl.load(scores_ptr + base + T * LP + j),
                                  tl.load(scores_ptr + base + j), ka, kb, qa, qb),)
    return tokens_in


@triton.jit
def _gdn_step_kernel(
        slots_ptr, committed_ptr, cursors_ptr, tokens_ptr, seeds_ptr, gram_ptr,
        av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr,
        bk_ptr, bv_ptr, bg_ptr, bbeta_ptr, bu_ptr,
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, scores_ptr, o_ptr,
        SCRATCH, HV, HK,
        T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr,
        DV: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
        A_FMT: tl.constexpr, A_SR: tl.constexpr, R_FMT: tl.constexpr, R_SR: tl.constexpr,
        SHARED: tl.constexpr, FUSED_REFRESH: tl.constexpr, EARLY_CURSOR: tl.constexpr, OUTPUT_DOT: tl.constexpr,
        QP: tl.constexpr, REFRESH_DOT: tl.constexpr, PDL: tl.constexpr, STEP_PIN: tl.constexpr = 0,
        LOADS: tl.constexpr = 0, STREAM: tl.constexpr = 0):
    after_previous_launch(PDL)
    # row blocks vary fastest: programs running side by side stream one slot's contiguous state
    pid_v, head, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h_early = early_cursor(cursors_ptr, pid_b, EARLY_CURSOR)
    valid, row = slot_row(slots_ptr, pid_b, SCRATCH)
    khead = head // (HV // HK)
    mat = row * HV + head
    gidx = mat * (DV // BV) + pid_v  # NVFP4 global-scale block of these rows
    rv = pid_v * BV + tl.arange(0, BV)
    ck = tl.arange(0, DK)
    j = tl.arange(0, LP)
    # the read copy in its own layout (the anchor itself when shared), issued before the cursor
    # load so that the two latencies overlap; a refreshing program replaces it below. STREAM
    # (launch.stream_stages): never whole, its products stream through streamed_products
    QLOAD: tl.constexpr = OUTPUT_DOT and not STREAM
    if STREAM:
        ra, rb, rsc = 0.0, 0.0, 0.0
    else:
        ra, rb, rsc = load_read(rv_ptr, rs_ptr, rg_ptr, mat, gidx, rv, DV, DK, R_FMT)
    h, need = cursor_of(committed_ptr, h_early, valid, row, T, L, EARLY_CURSOR)
    h_win = tl.where(need, 0, h)  # after a refresh only the new tokens are in the window
    if LOADS == 2:  # issued with the read copy's loads (launch.LOAD_ORDERS)
        g, U, Q = _window_loads(bg_ptr, bu_ptr, g_ptr, q_ptr, k_ptr, row, pid_b, head, khead, h_win, rv, HV, HK, T, L,
                                LP, DV, DK, QLOAD, QP)
        tokens_in = _token_loads(q_ptr, k_ptr, v_ptr, beta_ptr, scores_ptr, bv_ptr, pid_b, head, khead, rv, HV, HK,
                                 T, LP, DV, DK, R_FMT, OUTPUT_DOT)
    if STEP_PIN:
        pin_vector_width(rv_ptr, mat, rv, ck, h < 0, DV, DK, STEP_PIN)

    if FUSED_REFRESH:
        if need:  # refresh: re-solve the committed residuals from the anchor
            _gdn_refresh_rows(pid_v, head, pid_b, row, h, seeds_ptr, tokens_ptr, gram_ptr, av_ptr, as_ptr, ag_ptr,
                              rv_ptr, rs_ptr, rg_ptr, bk_ptr, bv_ptr, bg_ptr, bbeta_ptr, ra, HV, HK, L, LP, DV, DK, BV,
                              KC, A_FMT, A_SR, R_FMT, R_SR, SHARED, REFRESH_DOT, True)
            tl.debug_barrier()  # read back, as after a split refresh (write_checkpoint says why)
            ra, rb, rsc = load_read(rv_ptr, rs_ptr, rg_ptr, mat, gidx, rv, DV, DK, R_FMT)
    h = h_win
    if LOADS < 2:
        g, U, Q = _window_loads(bg_ptr, bu_ptr, g_ptr, q_ptr, k_ptr, row, pid_b, head, khead, h, rv, HV, HK, T, L,
                                LP, DV, DK, QLOAD, QP)
    if LOADS == 1:
        tokens_in = _token_loads(q_ptr, k_ptr, v_ptr, beta_ptr, scores_ptr, bv_ptr, pid_b, head, khead, rv, HV, HK,
                                 T, LP, DV, DK, R_FMT, OUTPUT_DOT)
    if OUTPUT_DOT:  # every S_read k_s and S_read q_s of the step in one product (launch.output_dot)
        if STREAM:  # columns: k_0..k_{T-1}, q_0..q_{T-1}
            SQ = streamed_products(rv_ptr, rs_ptr, mat, rv, k_ptr, q_ptr, pid_b, HK, khead, T, 2 * T, DV, DK, R_FMT,
                                   QP, 32, STREAM)
        else:
            SQ = products_on_tensor_cores(ra, rb, rsc, Q, R_FMT)
    for s in tl.static_range(T):
        t = h + s
        tok_in = pid_b * T + s
        tok_buf = row * L + t
        if LOADS > 0:
            v_s, beta_s, k_scores, q_scores, ka, kb, qa, qb = tokens_in[s]
        c_t = tl.sum(tl.where(j <= t, g, 0.0), 0)  # log decay from the checkpoint to t
        seg = segment_to(g, t)  # log decay from entry j to t
        base = ((pid_b * HK + khead) * 2 * T + s) * LP
        if LOADS == 0:  # each input where it is first used
            v_s = tl.load(v_ptr + (tok_in * HV + head) * DV + rv).to(bv_ptr.dtype.element_ty)
            k_scores = tl.load(scores_ptr + base + T * LP + j)
        # residual u_s = beta_s (v_s - alpha_s S_{t-1} k_s), with S_{t-1} never formed
        before = tl.where(j < t, tl.exp(tl.where(j < t, seg, float("-inf"))), 0.0) * k_scores
        if OUTPUT_DOT:
            Sk_read = column(SQ, s)
        else:
            if LOADS == 0:
                ka, kb = load_query(k_ptr + (tok_in * HK + khead) * DK, DK, R_FMT)
            Sk_read = matvec(ra, rb, rsc, ka, kb, R_FMT)
        Sk = tl.exp(c_t) * Sk_read + tl.sum(U * before[None, :], 1)
        if LOADS == 0:
            beta_s = tl.load(beta_ptr + tok_in * HV + head)
        u_s = beta_s * (v_s.to(tl.float32) - Sk)
        U = tl.where(j[None, :] == t, u_s[:, None], U)
        # output o_s = S_t q_s = gamma_t S_read q_s + sum_{j <= t} gamma_{j+1:t} (k_j . q_s) u_j
        if OUTPUT_DOT:
            Sq_read = column(SQ, T + s)
        else:
            if LOADS == 0:
                qa, qb = load_query(q_ptr + (tok_in * HK + khead) * DK, DK, R_FMT)
            Sq_read = matvec(ra, rb, rsc, qa, qb, R_FMT)
        if LOADS == 0:
            q_scores = tl.load(scores_ptr + base + j)
        upto = tl.where(j <= t, tl.exp(tl.where(j <= t, seg, float("-inf"))), 0.0) * q_scores
        o = tl.exp(c_t) * Sq_read + tl.sum(U * upto[None, :], 1)
        tl.store(o_ptr + (tok_in * HV + head) * DV + rv, tl.where(valid, o, 0.0))
        tl.store(bv_ptr + (tok_buf * HV + head) * DV + rv, v_s)  # rows only this program reads
        tl.store(bu_ptr + (tok_buf * HV + head) * DV + rv, u_s)


def step(cache, slots, q, k, v, g, beta, scale: float, normalize: bool, commit: bool):
    """One GDN decode (T = 1) or verify step on the Triton backend.

    q, k [b, T, HK, K] as given to the public call (L2-normalized here when ``normalize``; q
    times ``scale``); v [b, T, HV, V]; g, beta [b, T, HV]; any float dtypes. Returns o fp32
    [b, T, HV, V] (pads zero). The input preparation happens inside the first launch.
    """
    launch.check_geometry(cache)
    b, T, HV, V = v.shape
    anchor, read, consts = launch.format_args(cache)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    o = torch.empty(b, T, HV, V, dtype=torch.float32, device=v.device)
    bv, warps, refresh_dot, pin, loads = launch.launch_shape(cache, "gdn", T)
    split = launch.split_refresh("gdn", b, T)
    buf = cache.buffer
    LP = max(16, triton.next_power_of_2(cache.window))
    HK = cache.num_k_heads
    scores = torch.empty(b, HK, 2, T, LP, dtype=torch.float32, device=v.device)
    kn = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    qn = torch.empty_like(kn)
    cursors, early = launch.cursor_args(cache, slots)
    gram = torch.empty(b, HK, LP, LP, dtype=torch.float32, device=v.device) if refresh_dot else scores
    launch.run(_gdn_scores_kernel, (b, HK), slots, cache.committed, cursors, buf["k"], k, q, kn, qn, scores, gram,
               float(scale), cache.scratch_row, HK, T=T, L=cache.window, LP=LP, DK=cache.head_k_dim, NORM=normalize,
               EARLY_CURSOR=early, GRAM=refresh_dot)
    kc = launch.refresh_columns(cache, "gdn")
    q, k = qn, kn
    grid = (V // bv, HV, b)
    if split:
        rbv, rwarps = launch.refresh_shape(cache, "gdn", bv, warps, T)
        for rgrid, tier in launch.refresh_launches(v.device, (V // rbv, HV, b), T, cache.window):
            launch.run(_gdn_refresh_kernel, rgrid, slots, cache.committed, cursors, cache.tokens,
                       cache.seeds, gram, *anchor, *read, buf["k"], buf["v"], buf["g"], buf["beta"], cache.scratch_row,
                       HV, HK, b, T=T, L=cache.window, LP=LP, DV=V, DK=cache.head_k_dim, BV=rbv, KC=kc,
                       EARLY_CURSOR=early, REFRESH_DOT=refresh_dot, BP=triton.next_power_of_2(b), num_warps=rwarps,
                       PIN=launch.pin_vector_width(), **tier, **consts)
    launch.run(
        _gdn_step_kernel, grid,
        slots, cache.committed, cursors, cache.tokens, cache.seeds, gram, *anchor, *read,
        buf["k"], buf["v"], buf["g"], buf["beta"], buf["u"],
        q, k, v, g, beta, scores, o, cache.scratch_row, HV, HK,
        T=T, L=cache.window, LP=LP, DV=V,
        DK=cache.head_k_dim, BV=bv, KC=kc, FUSED_REFRESH=not split, EARLY_CURSOR=early,
        OUTPUT_DOT=launch.output_dot(cache, "gdn", T), QP=max(16, triton.next_power_of_2(2 * T)),
        REFRESH_DOT=refresh_dot, STEP_PIN=pin, LOADS=loads, STREAM=launch.stream_stages(cache, "gdn", T, split),
        num_warps=warps, **consts)
    launch.advance(cache, slots, T, commit, {"k": k, "g": g, "beta": beta})
    return o
