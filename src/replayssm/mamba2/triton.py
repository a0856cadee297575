"""Mamba-2 ReplaySSM Triton kernels: output-only decode/verify with the refresh as a branch.

A step is two launches (``_triton/launch.py``): ``_mamba2_scores_kernel`` (the input
preparation dt = softplus(dt + dt_bias), A dt; B_j . C_s over the window, times each head's
decays and step sizes into the step's weights; for slots whose window is full, the fold weights)
and ``_mamba2_step_kernel`` (one program per block of state rows, head and batch row; one of a
batch row's programs also writes the shared buffer fields and moves the cursors,
``launch.advance_row``). Where the launch policy puts the slots due beside the others
(``launch.StepShape.beside``), a step launch over them only runs on a side stream beside the step
launch over the other slots (after their refresh launch, where the shape splits it). The smallest
steps are one launch (``launch.StepShape.fused``): each step program does the scores launch's work
for its own head (``_prepared_tokens``) and computes its refresh's fold weights itself.

A program whose slot's committed history plus the T new tokens overflows the window first folds
the committed entries into a new checkpoint from the anchor,

    S = gamma_h S_anchor + sum_{j<h} w_j x_j B_j^T,   w_j = gamma_{j+1:h} dt_j,

as one 3-pass-tf32 tensor-core product per [32 rows, columns] slice, casts S independently into
anchor and read copy, and stores both. Then every program computes, from the read copy in its own
format,

    y_s = gamma_t (S_read C_s) + sum_{j <= t} gamma_{j+1:t} dt_j (B_j . C_s) x_j,   t = h + s

(the output-only form) as fp32 row reductions: the products are matrix-vector, so IEEE fp32
keeps parity with the float64 reference. The weights gamma_{j+1:t} dt_j (B_j . C_s) and gamma_t
come from the scores launch, once per head for all its step programs. The new tokens' x rows are
stored here. For a draft tree the sums over j <= t run over the committed entries and draft s's
ancestors only (the weights are zero elsewhere and the decays run along the draft's path).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import launch
from .._triton.launch import advance_row, after_previous_launch
from .._triton.decay import ordered_row_sums, path_decays, softplus
from .._triton.window import (ancestor_bits, committed_head_window, committed_window, draft_paths, due_slot,
                              fused_item, head_window, list_due, new_rows, pending_tree, program_item, slot_cursor,
                              whole_window, window_rows)
from .._triton.formats import (as_query, as_stored, column, global_scale_index, load_query, load_read, load_tile,
                               matvec, pin_vector_width, read_copy_from_anchor, streamed_products, within,
                               write_checkpoint)


@triton.jit
def _fold_weights(bla_ptr, bdt_ptr, row, heads, mine, h, H, L: tl.constexpr, LP: tl.constexpr):
    """A refresh's per-token scalars for heads ``heads`` [R] (``mine``: the real ones) of a slot of
    h committed entries: the fold weights w_j = gamma_{j+1:h} dt_j [R, LP] (zero past h) and the
    history decay gamma_{1:h} [R]. Sums in k order (``decay.ordered_row_sums``), so the scores
    launch (a group's heads) and a refreshing program of a step of one launch (its own head) fold
    the same bits."""
    j = tl.arange(0, LP)
    old = mine[:, None] & (j < h)[None, :]
    entry = (row * L + j[None, :]) * H + heads[:, None]  # [R, LP]
    la_c = tl.load(bla_ptr + entry, mask=old, other=0.0)
    k3 = j[None, None, :]
    later = (k3 > j[None, :, None]) & (k3 < h)  # entries after j in the history
    w = tl.exp(ordered_row_sums(tl.where(later, la_c[:, None, :], 0.0))) * tl.load(bdt_ptr + entry, mask=old,
                                                                                   other=0.0)
    every = ordered_row_sums(tl.broadcast_to(la_c[:, None, :], (la_c.shape[0], LP, LP)))  # each row: the sum
    return w, tl.exp(tl.sum(tl.where(j[None, :] == 0, every, 0.0), 1))


@triton.jit
def _mamba2_scores_kernel(slots_ptr, committed_ptr, cursors_ptr, bB_ptr, bdt_ptr, bla_ptr, B_ptr, sBb: tl.constexpr,
                          sBt: tl.constexpr, sBh: tl.constexpr, sBe: tl.constexpr, C_ptr, sCb: tl.constexpr,
                          sCt: tl.constexpr, sCh: tl.constexpr, sCe: tl.constexpr, scores_ptr, fold_w_ptr,
                          fold_decay_ptr, dt_ptr, sdb: tl.constexpr, sdt: tl.constexpr, sdh: tl.constexpr, bias_ptr,
                          s_bias: tl.constexpr, A_ptr, s_A, dtn_ptr, la_ptr, gammas_ptr, due_ptr, parents_ptr, gaps_ptr,
                          SCRATCH, B, H, G, T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, DK: tl.constexpr,
                          DKP: tl.constexpr, HG: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                          DUE_CH: tl.constexpr, DUE_PASSES: tl.constexpr, TREE: tl.constexpr, MAXD: tl.constexpr,
                          PDL: tl.constexpr):
    """Once per (batch row, group): the T new tokens' step sizes of the group's heads prepared in
    fp32 into dtn = softplus(dt + dt_bias) and la = A * dtn [b, T, H] for the other launches; the
    batch row's committed count into ``cursors`` [b]; for each head of the group the step launch's
    weights scores[b, head, s, j] = gamma_{j+1:t} dt_j (B_j . C_s) over the entries j a query sees
    (committed + new, zero elsewhere) and gammas[b, head, s] = gamma_t, the decay from the
    checkpoint to t = h + s: the step launch's programs, several per head, share them instead of
    each summing them; and for a slot due to refresh, each head's fold weights w_j = gamma_{j+1:h}
    dt_j [b, H, LP] (zero past h) and history decay gamma_{1:h} [b, H]. DUE_CH > 0: the grid has
    one more row of programs, b, whose first lists the slots due (``window.list_due``) beside the
    others' work, for the launches that read the list. TREE: the batch row's draft tree,
    ``parents`` [b, T]: draft s's weights and decay run along its own path (its ancestors,
    ``window.draft_view``), so the step launch needs no tree of its own; the slot's pending tree
    goes into ``cache.draft_gaps`` (``window.pending_tree``). The caller's B, C, dt, dt_bias and A
    are read through their strides (s*: ``launch.token_strides``, ``launch.head_stride``)."""
    after_previous_launch(PDL)
    pid_b, group = tl.program_id(0), tl.program_id(1)
    if pid_b == B:  # the grid's extra row (DUE_CH > 0): its first program lists the slots due
        if group == 0:
            list_due(slots_ptr, committed_ptr, due_ptr, B, T, L, DUE_CH, DUE_PASSES)
    else:
        heads = group * (H // G) + tl.arange(0, HG)
        mine = tl.arange(0, HG) < H // G
        ck = tl.arange(0, DKP)  # columns from DK on are zero
        # the loads that wait for nothing first, then the slot's: a load written after a store waits
        # for it (they may alias), and the slot id, its committed count and its window are a chain
        A = tl.load(A_ptr + heads * s_A, mask=mine, other=0.0).to(tl.float32)
        raw, queries = (), ()
        for s in tl.static_range(T):
            d = tl.load(dt_ptr + pid_b * sdb + s * sdt + heads * sdh, mask=mine, other=0.0).to(tl.float32)
            if HAS_BIAS:
                d += tl.load(bias_ptr + heads * s_bias, mask=mine, other=0.0).to(tl.float32)
            raw = raw + (d,)
            queries = queries + (tl.load(C_ptr + pid_b * sCb + s * sCt + group * sCh + ck * sCe, mask=within(ck, DK),
                                         other=0.0).to(tl.float32),)
        valid, row, h, need = slot_cursor(slots_ptr, committed_ptr, pid_b, SCRATCH, T, L)
        steps, log_decays = (), ()
        for s in tl.static_range(T):
            at = (pid_b * T + s) * H + heads
            d = raw[s]
            if SOFTPLUS:
                d = softplus(d)
            steps, log_decays = steps + (d,), log_decays + (A * d,)
            tl.store(dtn_ptr + at, d, mask=mine)
            tl.store(la_ptr + at, log_decays[s], mask=mine)
        if group == 0:
            tl.store(cursors_ptr + pid_b, h)
            if TREE:
                pending_tree(parents_ptr, gaps_ptr, pid_b, valid, row, T, MAXD)
        j = tl.arange(0, LP)
        if need:  # the refresh's per-token scalars of the group's heads
            w, decay = _fold_weights(bla_ptr, bdt_ptr, row, heads, mine, h, H, L, LP)
            tl.store(fold_w_ptr + (pid_b * H + heads[:, None]) * LP + j[None, :], w, mask=mine[:, None])
            tl.store(fold_decay_ptr + pid_b * H + heads, decay, mask=mine)
        h = tl.where(need, 0, h)  # a refreshing slot sees only its new tokens
        K = window_rows(bB_ptr, B_ptr, sBb, sBt, sBh, sBe, row, pid_b, h, group, G, ck, DK, T, L, LP)
        # the group's heads' log decays and step sizes over the window [HG, LP], the decays one entry on too
        LA = head_window(bla_ptr, la_ptr, 0, 0, 0, log_decays, row, pid_b, h, j, heads, mine, H, T, L, True)
        LA_next = head_window(bla_ptr, la_ptr, 0, 0, 0, log_decays, row, pid_b, h, j + 1, heads, mine, H, T, L, True)
        DT = head_window(bdt_ptr, dtn_ptr, 0, 0, 0, steps, row, pid_b, h, j, heads, mine, H, T, L, True)
        anc = ancestor_bits(parents_ptr, pid_b, valid, T) if TREE else 0
        for s in tl.static_range(T):
            path, path_next = draft_paths(anc, h, s, LP, TREE)  # j <= h + s for a chain
            decay, gamma = path_decays(LA, LA_next, path, path_next)
            at = (pid_b * H + heads) * T + s  # [HG]
            weights = decay * DT * tl.sum(K * queries[s][None, :], 1)[None, :]
            tl.store(scores_ptr + at[:, None] * LP + j[None, :], weights, mask=mine[:, None])
            tl.store(gammas_ptr + at, gamma, mask=mine)


@triton.jit
def _mamba2_refresh_rows(pid_b, head, row, h, r0, seeds_ptr, tokens_ptr, w, decay,
                         av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, bx_ptr, bB_ptr, H, G,
                         L: tl.constexpr, LP: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
                         BV: tl.constexpr, FR: tl.constexpr, KC: tl.constexpr, A_FMT: tl.constexpr, A_SR: tl.constexpr,
                         R_FMT: tl.constexpr, R_SR: tl.constexpr, SHARED: tl.constexpr, STAGES: tl.constexpr,
                         READ_AFTER: tl.constexpr):
    """Refresh rows r0 .. r0 + BV of one head of storage row ``row`` (h committed entries): fold
    FR rows by KC columns at a time, S = gamma_h S_anchor + (x_j w_j)_j B^T, and encode them (the
    last pass masked from column DK on); w [LP], decay: the head's fold weights and history decay
    (``_fold_weights``)."""
    mat = row * H + head
    group = head // (H // G)
    j = tl.arange(0, LP)
    old = j < h
    buf_tok = row * L + j
    seed = tl.load(seeds_ptr + row)
    tokens = tl.load(tokens_ptr + row)
    for f in tl.static_range(BV // FR):
        rv = r0 + f * FR + tl.arange(0, FR)
        gidx = mat * (DV // FR) + (r0 + f * FR) // FR  # NVFP4: FR is the row block, one global scale
        X = tl.load(bx_ptr + (buf_tok[None, :] * H + head) * DV + rv[:, None], mask=old[None, :], other=0.0)
        XW = X.to(tl.float32) * w[None, :]
        for c in tl.range(0, (DK + KC - 1) // KC, num_stages=STAGES):  # a loop, not unrolled: registers
            cols = c * KC + tl.arange(0, KC)
            B_c = tl.load(bB_ptr + ((row * L + j[:, None]) * G + group) * DK + cols[None, :],
                          mask=old[:, None] & within(cols, DK)[None, :], other=0.0)
            S = load_tile(av_ptr, as_ptr, ag_ptr, mat, gidx, rv, cols, DV, DK, A_FMT) * decay
            S += tl.dot(XW, B_c.to(tl.float32), input_precision="tf32x3")
            write_checkpoint(S, av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, mat, gidx, head, rv, cols, seed,
                             tokens, DV, DK, A_FMT, A_SR, R_FMT, R_SR, SHARED or READ_AFTER)
        if READ_AFTER:
            read_copy_from_anchor(av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, mat, gidx, head, rv, seed, tokens,
                                  DV, DK, DKP, A_FMT, R_FMT, R_SR)


@triton.jit
def _mamba2_refresh_kernel(slots_ptr, cursors_ptr, tokens_ptr, seeds_ptr, fold_w_ptr, fold_decay_ptr, av_ptr, as_ptr,
                           ag_ptr, rv_ptr, rs_ptr, rg_ptr, bx_ptr, bB_ptr, due_ptr, H, G, T: tl.constexpr,
                           L: tl.constexpr, LP: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
                           FR: tl.constexpr, KC: tl.constexpr, A_FMT: tl.constexpr, A_SR: tl.constexpr,
                           R_FMT: tl.constexpr, R_SR: tl.constexpr, SHARED: tl.constexpr, STAGES: tl.constexpr,
                           READ_AFTER: tl.constexpr, ROUNDS: tl.constexpr, PDL: tl.constexpr):
    """The refresh in a launch of its own (``StepShape.split``): program (v, head, c) refreshes FR
    rows of ``head`` of the slots due of ranks c, c + n, ... in the list the scores launch made
    (``window.list_due``; n programs per tile, ``launch.refresh_grid``)."""
    after_previous_launch(PDL)
    pid_v, head, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(due_ptr)
    for it in tl.range(0, ROUNDS, num_stages=1):  # a constant trip count: the interpreter needs one
        r = c + it * tl.num_programs(2)
        if r < count:
            pid_b, row, h = due_slot(due_ptr, slots_ptr, cursors_ptr, r)
            w = tl.load(fold_w_ptr + (pid_b * H + head) * LP + tl.arange(0, LP))
            decay = tl.load(fold_decay_ptr + pid_b * H + head)
            _mamba2_refresh_rows(pid_b, head, row, h, pid_v * FR, seeds_ptr, tokens_ptr, w, decay,
                                 av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, bx_ptr, bB_ptr, H, G, L, LP, DV, DK,
                                 DKP, FR, FR, KC, A_FMT, A_SR, R_FMT, R_SR, SHARED, STAGES, READ_AFTER)


@triton.jit
def _skip_and_gate(x_ptr, sxb, sxt, sxh, sxe, D_ptr, sD, z_ptr, szb, szt, szh, sze, pid_b, s, head, rv,
                   HAS_D: tl.constexpr, HAS_Z: tl.constexpr):
    """(D, x_s [BV], z_s [BV]) of token s for the skip term D x_s and the gate z_s, fp32, zero where
    not used; the caller's x, D, z read through their strides."""
    D, xq, zq = 0.0, 0.0, 0.0
    if HAS_D:
        D = tl.load(D_ptr + head * sD).to(tl.float32)
    if HAS_D or HAS_Z:
        xq = tl.load(x_ptr + pid_b * sxb + s * sxt + head * sxh + rv * sxe).to(tl.float32)
    if HAS_Z:
        zq = tl.load(z_ptr + pid_b * szb + s * szt + head * szh + rv * sze).to(tl.float32)
    return D, xq, zq


@triton.jit
def _token_loads(x_ptr, sxb, sxt, sxh, sxe, C_ptr, sCb, sCt, sCh, sCe, D_ptr, sD, z_ptr, szb, szt, szh, sze,
                 scores_ptr, gammas_ptr, pid_b, head, group, rv, H, G, T: tl.constexpr, LP: tl.constexpr,
                 DV: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, R_FMT: tl.constexpr, HAS_D: tl.constexpr,
                 HAS_Z: tl.constexpr, OUTPUT_DOT: tl.constexpr):
    """The new tokens' inputs to a step program, all issued at once: a tuple indexed by s of
    (the scores launch's weights gamma_{j+1:t} dt_j (B_j . C_s) [LP] and gamma_t, C_s as
    ``load_query`` gives it (zeros with OUTPUT_DOT), D, x_s [BV], z_s [BV]; D, x_s and z_s zero
    where not used). x, C, D, z are the caller's, read through their strides."""
    tokens_in = ()
    for s in tl.static_range(T):
        qa, qb = 0.0, 0.0
        if not OUTPUT_DOT:
            qa, qb = load_query(C_ptr + pid_b * sCb + s * sCt + group * sCh, sCe, DK, DKP, R_FMT)
        D, xq, zq = _skip_and_gate(x_ptr, sxb, sxt, sxh, sxe, D_ptr, sD, z_ptr, szb, szt, szh, sze, pid_b, s, head, rv,
                                   HAS_D, HAS_Z)
        at = (pid_b * H + head) * T + s
        tokens_in = tokens_in + ((tl.load(scores_ptr + at * LP + tl.arange(0, LP)), tl.load(gammas_ptr + at), qa, qb,
                                  D, xq, zq),)
    return tokens_in


@triton.jit
def _fused_loads(B_ptr, sBb, sBt, sBh, sBe, C_ptr, sCb, sCt, sCh, sCe, dt_ptr, sdb, sdt, sdh, bias_ptr, s_bias, A_ptr,
                 s_A, x_ptr, sxb, sxt, sxh, sxe, D_ptr, sD, z_ptr, szb, szt, szh, sze, rv_ptr, rs_ptr, rg_ptr, bB_ptr,
                 bx_ptr, bdt_ptr, bla_ptr, pid_v, pid_b, row, head, H, G, T: tl.constexpr, L: tl.constexpr,
                 LP: tl.constexpr, BV: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
                 R_FMT: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A step of one launch (``StepShape.fused``): every load of program (pid_v, head) on batch row
    ``pid_b`` (storage row ``row``) that does not wait for the slot's committed count, issued before
    the program takes its cursor (``window.fused_item``): the read copy (``load_read``), the whole
    window of the buffered fields (``window.whole_window``), the caller's B, C [b, T, G, N], dt [b,
    T, H], dt_bias, A, x, z [b, T, H, P], D, read through their strides; any arithmetic on them
    waits for them, so it comes after (``_prepared_tokens``). A tuple: (read copy values_a,
    values_b, scale, the rest for ``_prepared_tokens``)."""
    j = tl.arange(0, LP)
    ck = tl.arange(0, DKP)
    rv = pid_v * BV + tl.arange(0, BV)
    hv = head + tl.arange(0, 1)  # the program's head, as a batch of one for the window helpers
    group = head // (H // G)
    ra, rb, rsc = load_read(rv_ptr, rs_ptr, rg_ptr, row * H + head, global_scale_index(row * H + head, pid_v * BV, BV,
                                                                                       DV), rv, DV, DK, DKP, R_FMT)
    one = tl.arange(0, 1)
    windows = (whole_window(bla_ptr, row, j, hv, one, H, 1, L), whole_window(bla_ptr, row, j + 1, hv, one, H, 1, L),
               whole_window(bdt_ptr, row, j, hv, one, H, 1, L), whole_window(bB_ptr, row, j, group + one, ck, G, DK, L),
               whole_window(bx_ptr, row, j, hv, rv, H, DV, L))
    new = (new_rows(B_ptr, sBb, sBt, sBh, sBe, pid_b, group, ck, DK, T),
           new_rows(x_ptr, sxb, sxt, sxh, sxe, pid_b, head, rv, DV, T))
    dts = ()
    for s in tl.static_range(T):
        dts = dts + (tl.load(dt_ptr + pid_b * sdb + s * sdt + hv * sdh),)
    bias = tl.load(bias_ptr + hv * s_bias) if HAS_BIAS else 0.0
    queries = ()
    for s in tl.static_range(T):
        queries = queries + (tl.load(C_ptr + pid_b * sCb + s * sCt + group * sCh + ck * sCe, mask=within(ck, DK),
                                     other=0.0),)
    skips = ()  # last: their casts wait for them
    for s in tl.static_range(T):
        skips = skips + (_skip_and_gate(x_ptr, sxb, sxt, sxh, sxe, D_ptr, sD, z_ptr, szb, szt, szh, sze, pid_b, s,
                                        head, rv, HAS_D, HAS_Z),)
    return ra, rb, rsc, (windows, new, dts, bias, tl.load(A_ptr + hv * s_A), queries, skips)


@triton.jit
def _prepared_tokens(loaded, bB_ptr, bx_ptr, bdt_ptr, bla_ptr, dtn_ptr, la_ptr, parents_ptr, pid_v, pid_b, valid, row,
                     h, need, head, H, G, T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, DK: tl.constexpr,
                     R_FMT: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, TREE: tl.constexpr):
    """A step of one launch (``StepShape.fused``): the scores launch's work for the program's own
    head, by the same operations (``_mamba2_scores_kernel``), from ``_fused_loads``' tuple
    ``loaded`` (its last field) and the cursor h; returns ``_token_loads``' tuple and the window of x
    rows [LP, BV] (``window.window_rows``' values). Programs of row block 0 store the new tokens'
    shared fields: where the slot does not refresh, straight into the buffer at h .. h + T - 1 (the
    head's step sizes and log decays; B by the group's first head), where no program of the launch
    reads them (``launch.advance_row``, DIRECT); where it does, the step sizes and log decays into
    dtn, la [b, T, H] fp32, which the batch row's last program copies into the buffer after the
    folds."""
    windows, new, dts, bias, A, raw_queries, skips = loaded
    j = tl.arange(0, LP)
    hv = head + tl.arange(0, 1)
    ck = tl.arange(0, raw_queries[0].shape[0])
    A = A.to(tl.float32)
    steps, log_decays = (), ()
    later, direct = (pid_v == 0) & need, (pid_v == 0) & valid & (need == 0)  # the fields' writers
    for s in tl.static_range(T):
        at = (pid_b * T + s) * H + hv
        d = dts[s].to(tl.float32)
        if HAS_BIAS:
            d += bias.to(tl.float32)
        if SOFTPLUS:
            d = softplus(d)
        steps, log_decays = steps + (d,), log_decays + (A * d,)
        tl.store(dtn_ptr + at, d, mask=later)
        tl.store(la_ptr + at, log_decays[s], mask=later)
        entry = row * L + h + s
        tl.store(bdt_ptr + entry * H + hv, as_stored(d, bdt_ptr.dtype.element_ty), mask=direct)
        tl.store(bla_ptr + entry * H + hv, as_stored(log_decays[s], bla_ptr.dtype.element_ty), mask=direct)
        tl.store(bB_ptr + (entry * G + head // (H // G)) * DK + ck, as_stored(new[0][s], bB_ptr.dtype.element_ty),
                 mask=direct & (head % (H // G) == 0) & within(ck, DK))
    LA = committed_head_window(windows[0], log_decays, h, j, T)
    LA_next = committed_head_window(windows[1], log_decays, h, j + 1, T)
    DT = committed_head_window(windows[2], steps, h, j, T)
    K = committed_window(bB_ptr, windows[3], new[0], h, T)
    X = committed_window(bx_ptr, windows[4], new[1], h, T)
    anc = ancestor_bits(parents_ptr, pid_b, valid, T) if TREE else 0
    tokens_in = ()
    for s in tl.static_range(T):
        q = raw_queries[s].to(tl.float32)
        path, path_next = draft_paths(anc, h, s, LP, TREE)  # j <= h + s for a chain
        decay, gamma = path_decays(LA, LA_next, path, path_next)
        w = tl.sum(decay * DT, 0) * tl.sum(K * q[None, :], 1)  # [LP]: the one head's
        qa, qb = as_query(q, R_FMT)
        D, xq, zq = skips[s]
        tokens_in = tokens_in + ((w, tl.sum(gamma, 0), qa, qb, D, xq, zq),)
    return tokens_in, X


@triton.jit
def _mamba2_step_program(
        pid_v, head, pid_b, valid, row, h, need, early,
        tokens_ptr, seeds_ptr, fold_w_ptr, fold_decay_ptr, av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr,
        bx_ptr, bB_ptr, x_ptr, sxb, sxt, sxh, sxe, C_ptr, sCb, sCt, sCh, sCe,
        D_ptr, sD, z_ptr, szb, szt, szh, sze, scores_ptr, gammas_ptr, y_ptr, H, G,
        B_ptr, sBb, sBt, sBh, sBe, dt_ptr, sdb, sdt, sdh, bias_ptr, s_bias, A_ptr, s_A, bdt_ptr, bla_ptr, dtn_ptr,
        la_ptr, parents_ptr,
        T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
        BV: tl.constexpr, FR: tl.constexpr, KC: tl.constexpr, A_FMT: tl.constexpr, A_SR: tl.constexpr,
        R_FMT: tl.constexpr, R_SR: tl.constexpr, SHARED: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
        PIN: tl.constexpr, REFRESH: tl.constexpr, STAGES: tl.constexpr, READ_AFTER: tl.constexpr,
        OUTPUT_DOT: tl.constexpr, QP: tl.constexpr, STREAM: tl.constexpr, FUSED: tl.constexpr,
        HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, TREE: tl.constexpr):
    """Rows pid_v BV .. (pid_v + 1) BV of ``head`` of batch row ``pid_b`` (storage row ``row``, h
    committed entries, ``need``: due to refresh, folded here first when REFRESH). OUTPUT_DOT: the
    read-copy products S_read C_s of every token as one tensor-core product streamed over column
    chunks (``formats.streamed_products``, STREAM chunks in flight), else row reductions. FUSED (a
    step of one launch): the program computes its refresh's scalars (``_fold_weights``) and its
    weights (``_prepared_tokens``) itself, from ``early`` (``_fused_loads``); else the scores launch's."""
    group = head // (H // G)
    mat = row * H + head
    gidx = global_scale_index(mat, pid_v * BV, BV, DV)  # NVFP4: the global scales of these rows
    rv = pid_v * BV + tl.arange(0, BV)
    ck = tl.arange(0, DKP)
    j = tl.arange(0, LP)
    buf_tok = row * L + j  # [LP] buffer token index of this slot
    if FUSED:
        ra, rb, rsc, loaded = early
    if REFRESH:
        if need:  # refresh: fold the h committed entries into a new checkpoint, from the anchor
            if FUSED:
                hv = head + tl.arange(0, 1)
                w, decay = _fold_weights(bla_ptr, bdt_ptr, row, hv, hv >= 0, h, H, L, LP)
                w, decay = tl.reshape(w, (LP,)), tl.sum(decay, 0)
            else:
                w = tl.load(fold_w_ptr + (pid_b * H + head) * LP + j)
                decay = tl.load(fold_decay_ptr + pid_b * H + head)
            _mamba2_refresh_rows(pid_b, head, row, h, pid_v * BV, seeds_ptr, tokens_ptr, w, decay,
                                 av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, bx_ptr, bB_ptr, H, G, L, LP, DV, DK,
                                 DKP, BV, FR, KC, A_FMT, A_SR, R_FMT, R_SR, SHARED, STAGES, READ_AFTER)
            tl.debug_barrier()  # the rows just stored are read back below by other threads of the program
            if FUSED:  # again, after the rows just folded: nothing loaded before is live in this branch
                ra, rb, rsc, loaded = _fused_loads(
                    B_ptr, sBb, sBt, sBh, sBe, C_ptr, sCb, sCt, sCh, sCe, dt_ptr, sdb, sdt, sdh, bias_ptr, s_bias,
                    A_ptr, s_A, x_ptr, sxb, sxt, sxh, sxe, D_ptr, sD, z_ptr, szb, szt, szh, sze, rv_ptr, rs_ptr,
                    rg_ptr, bB_ptr, bx_ptr, bdt_ptr, bla_ptr, pid_v, pid_b, row, head, H, G, T, L, LP, BV, DV, DK,
                    DKP, R_FMT, HAS_D, HAS_Z, HAS_BIAS)
    h = tl.where(need, 0, h)  # after a refresh only the new tokens are in the window
    if FUSED:
        tl.static_assert(not OUTPUT_DOT, "a step of one launch takes its read-copy products by row reductions")
        tokens_in, X = _prepared_tokens(loaded, bB_ptr, bx_ptr, bdt_ptr, bla_ptr, dtn_ptr, la_ptr, parents_ptr, pid_v,
                                        pid_b, valid, row, h, need, head, H, G, T, L, LP, DK, R_FMT, HAS_BIAS,
                                        SOFTPLUS, TREE)
    else:
        # the read copy in its own layout (the anchor itself when shared), then everything else a
        # program reads, all issued before any arithmetic so that it waits on memory once
        if OUTPUT_DOT:
            ra, rb, rsc = 0.0, 0.0, 0.0
        else:
            ra, rb, rsc = load_read(rv_ptr, rs_ptr, rg_ptr, mat, gidx, rv, DV, DK, DKP, R_FMT)
        X = window_rows(bx_ptr, x_ptr, sxb, sxt, sxh, sxe, row, pid_b, h, head, H, rv, DV, T, L, LP)
        tokens_in = _token_loads(x_ptr, sxb, sxt, sxh, sxe, C_ptr, sCb, sCt, sCh, sCe, D_ptr, sD, z_ptr, szb, szt,
                                 szh, sze, scores_ptr, gammas_ptr, pid_b, head, group, rv, H, G, T, LP, DV, DK, DKP,
                                 R_FMT, HAS_D, HAS_Z, OUTPUT_DOT)
    if PIN:
        pin_vector_width(rv_ptr, mat, rv, ck, h < 0, DV, DK, PIN)
    new = (j >= h) & (j < h + T)
    if OUTPUT_DOT:  # column s: S_read C_s
        KB: tl.constexpr = 32 if DKP >= 32 else DKP  # one fp8 scale block (two NVFP4 ones), or the padded row
        SC = streamed_products(rv_ptr, rs_ptr, rg_ptr, mat, gidx, rv, C_ptr, C_ptr, pid_b, group, sCb, sCt, sCh, sCe,
                               T, T, DV, DK, R_FMT, QP, KB, STREAM)
    for s in tl.static_range(T):  # y_s = gamma_t S_read q + sum_j gamma_{j+1:t} dt_j (k_j . q) x_j
        q_tok = pid_b * T + s
        w, gamma, qa, qb, D, xq, zq = tokens_in[s]  # the scores launch's weights [LP] and gamma_t
        if OUTPUT_DOT:
            y = gamma * column(SC, s)
        else:
            y = gamma * matvec(ra, rb, rsc, qa, qb, R_FMT)
        y += tl.sum(X * w[:, None], 0)
        if HAS_D:
            y += D * xq
        if HAS_Z:
            y *= zq * tl.sigmoid(zq)
        tl.store(y_ptr + (q_tok * H + head) * DV + rv, tl.where(valid, y, 0.0).to(y_ptr.dtype.element_ty))
    # the new tokens' x rows (rounded to the buffer dtype): only this program reads them
    tl.store(bx_ptr + (buf_tok[:, None] * H + head) * DV + rv[None, :], X.to(bx_ptr.dtype.element_ty),
             mask=new[:, None], eviction_policy="evict_last")


@triton.jit
def _mamba2_step_kernel(slots_ptr, cursors_ptr, tokens_ptr, seeds_ptr, fold_w_ptr, fold_decay_ptr, av_ptr, as_ptr,
                        ag_ptr, rv_ptr, rs_ptr, rg_ptr, bx_ptr, bB_ptr, x_ptr, sxb: tl.constexpr,
                        sxt: tl.constexpr, sxh: tl.constexpr, sxe: tl.constexpr, C_ptr,
                        sCb: tl.constexpr, sCt: tl.constexpr, sCh: tl.constexpr, sCe: tl.constexpr, D_ptr,
                        sD: tl.constexpr, z_ptr, szb: tl.constexpr, szt: tl.constexpr, szh: tl.constexpr,
                        sze: tl.constexpr, scores_ptr, gammas_ptr, y_ptr, due_ptr, SCRATCH, H, G, B_ptr,
                        sBb: tl.constexpr, sBt: tl.constexpr, sBh: tl.constexpr, sBe: tl.constexpr, dt_ptr,
                        sdb: tl.constexpr, sdt: tl.constexpr, sdh: tl.constexpr, bias_ptr, s_bias: tl.constexpr,
                        A_ptr, s_A, bdt_ptr, bla_ptr, dtn_ptr, la_ptr, parents_ptr, gaps_ptr, committed_ptr,
                        pending_ptr, refreshes_ptr, done_ptr, s1,
                        s1b: tl.constexpr, s1t: tl.constexpr, s1h: tl.constexpr, s1e: tl.constexpr, d1, s2,
                        s2b: tl.constexpr, s2t: tl.constexpr, s2h: tl.constexpr, s2e: tl.constexpr, d2, s3,
                        s3b: tl.constexpr, s3t: tl.constexpr, s3h: tl.constexpr, s3e: tl.constexpr, d3, s4,
                        s4b: tl.constexpr, s4t: tl.constexpr, s4h: tl.constexpr, s4e: tl.constexpr, d4,
                        T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr,
                        DKP: tl.constexpr,
                        BV: tl.constexpr, FR: tl.constexpr, KC: tl.constexpr, A_FMT: tl.constexpr,
                        A_SR: tl.constexpr, R_FMT: tl.constexpr, R_SR: tl.constexpr, SHARED: tl.constexpr,
                        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, PIN: tl.constexpr, REFRESH: tl.constexpr,
                        STAGES: tl.constexpr, READ_AFTER: tl.constexpr, OUTPUT_DOT: tl.constexpr,
                        QP: tl.constexpr, STREAM: tl.constexpr, DUE: tl.constexpr, ROUNDS: tl.constexpr,
                        COMMIT: tl.constexpr, F1: tl.constexpr, F1P: tl.constexpr,
                        W1: tl.constexpr, F2: tl.constexpr, F2P: tl.constexpr, W2: tl.constexpr, F3: tl.constexpr,
                        F3P: tl.constexpr, W3: tl.constexpr, F4: tl.constexpr, F4P: tl.constexpr,
                        W4: tl.constexpr, FUSED: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                        TREE: tl.constexpr, MAXD: tl.constexpr, PDL: tl.constexpr):
    """Program (v, head, c), c a batch row or, with DUE = ``launch.DUE_ONLY``, the slots due of
    ranks c, c + n, ... (``window.step_item``). The decays of every draft, along its own path for a
    tree, are in the scores launch's weights and gammas, so a tree's step is a chain's. The
    caller's x, C, D, z are read through their strides. One program per batch row then advances it
    (``launch.advance_row``: committed ... d3, COMMIT, F*, W*). FUSED: the whole step in this one
    launch (``StepShape.fused``): c is the batch row, whose committed count every program reads
    before the row's last program to finish advances it; each program prepares its head's inputs
    from the caller's B, C, dt (dt_bias, softplus), A (strides sB*, sC*, sd*, s_bias, s_A) and
    computes its refresh's scalars; ``parents`` a draft tree (TREE; its pending tree stored by
    program (0, 0, c), ``window.pending_tree``)."""
    after_previous_launch(PDL)
    # row blocks vary fastest: programs running side by side stream one slot's contiguous state
    pid_v, head, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(due_ptr) if DUE == 2 else 0
    for it in tl.range(0, ROUNDS, num_stages=1):  # a constant trip count: the interpreter needs one
        if FUSED:  # every load that needs the storage row only, before the cursor (``window.fused_item``)
            valid, row, committed = fused_item(slots_ptr, committed_ptr, c, SCRATCH)
            early = _fused_loads(B_ptr, sBb, sBt, sBh, sBe, C_ptr, sCb, sCt, sCh, sCe, dt_ptr, sdb, sdt, sdh, bias_ptr,
                                 s_bias, A_ptr, s_A, x_ptr, sxb, sxt, sxh, sxe, D_ptr, sD, z_ptr, szb, szt, szh, sze,
                                 rv_ptr, rs_ptr, rg_ptr, bB_ptr, bx_ptr, bdt_ptr, bla_ptr, pid_v, c, row, head, H, G,
                                 T, L, LP, BV, DV, DK, DKP, R_FMT, HAS_D, HAS_Z, HAS_BIAS)
        else:
            valid, row, committed, early = False, 0, 0, 0
        active, pid_b, valid, row, h, need = program_item(due_ptr, slots_ptr, cursors_ptr, valid, row, committed,
                                                          parents_ptr, gaps_ptr, c, it, count,
                                                          (pid_v == 0) & (head == 0), SCRATCH, T, L, DUE, FUSED,
                                                          TREE, MAXD)
        if active:
            _mamba2_step_program(
                pid_v, head, pid_b, valid, row, h, need, early, tokens_ptr, seeds_ptr, fold_w_ptr, fold_decay_ptr,
                av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, bx_ptr, bB_ptr, x_ptr, sxb, sxt, sxh, sxe,
                C_ptr, sCb, sCt, sCh, sCe, D_ptr, sD, z_ptr, szb, szt, szh, sze, scores_ptr, gammas_ptr,
                y_ptr, H, G, B_ptr, sBb, sBt, sBh, sBe, dt_ptr, sdb, sdt, sdh, bias_ptr, s_bias, A_ptr, s_A, bdt_ptr,
                bla_ptr, dtn_ptr, la_ptr, parents_ptr, T, L, LP, DV, DK, DKP, BV, FR, KC, A_FMT, A_SR, R_FMT, R_SR,
                SHARED, HAS_D, HAS_Z, PIN, REFRESH, STAGES, READ_AFTER, OUTPUT_DOT, QP, STREAM, FUSED, HAS_BIAS,
                SOFTPLUS, TREE)
            counted = need & REFRESH
            if FUSED:  # the last program advances, after every program of the row has read its cursor
                counted = valid
            advance_row(pid_b, valid, row, tl.where(need, 0, h), need, (pid_v == 0) & (head == 0), counted,
                        tokens_ptr, committed_ptr, pending_ptr, refreshes_ptr, done_ptr, s1, s1b, s1t, s1h, s1e, d1,
                        s2, s2b, s2t, s2h, s2e, d2, s3, s3b, s3t, s3h, s3e, d3, s4, s4b, s4t, s4h, s4e, d4, T, L,
                        COMMIT, F1, F1P, W1, F2, F2P, W2, F3, F3P, W3, F4, F4P, W4, FUSED)


def step(cache, slots, x, dt, A, B, C, D, z, dt_bias, dt_softplus: bool, commit: bool, y, parents=None):
    """One Mamba-2 decode (T = 1) or verify step on the Triton backend.

    parents int32/int64 [b, T] (a draft tree, T <= 32) or None (a chain); x [b, T, H, P]; dt [b, T, H]
    raw (dt_bias [H] added and softplus applied here when given); A [H]; B, C [b, T, G, N]; D [H];
    z [b, T, H, P]; any float dtypes, any strides (views of packed tensors are read in place,
    ``launch.token_strides``). Writes the outputs into y [b, T, H, P] (contiguous, fp32/fp16/bf16;
    pads zero). The input preparation happens inside the first launch.
    """
    b, T, H, P = x.shape
    G, N = cache.ngroups, cache.dstate
    dev = x.device
    anchor, read, consts = launch.format_args(cache)
    strides = launch.token_strides
    shape = launch.step_shape(cache, "mamba2", T, b)
    buf = cache.buffer
    LP, DKP = launch.window_pad(cache), launch.column_pad(cache)
    cursors = torch.empty(b, dtype=cache.committed.dtype, device=dev)
    dt_in, dt = dt, torch.empty(b, T, H, dtype=torch.float32, device=dev)
    log_alpha = torch.empty_like(dt)
    tree = cursors if parents is None else parents.contiguous()
    FR, KC = min(launch.FOLD_ROWS, shape.rows), launch.refresh_columns(cache, "mamba2")
    read_after = launch.read_copy_after_fold(cache)
    advanced, advance_consts = launch.advance_args(cache, commit, {"dt": dt, "log_alpha": log_alpha, "B": B})
    inputs_consts = dict(HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus), TREE=parents is not None,
                         MAXD=cache.max_draft)
    step_consts = dict(T=T, L=cache.window, LP=LP, DV=P, DK=N, DKP=DKP, BV=shape.rows, FR=FR, KC=KC,
                       HAS_D=D is not None, HAS_Z=z is not None, PIN=shape.pin, STAGES=shape.stages,
                       READ_AFTER=read_after, OUTPUT_DOT=shape.output_dot, QP=max(16, triton.next_power_of_2(T)),
                       STREAM=shape.stream, num_warps=shape.warps, **consts, **advance_consts)
    extra = launch.register_cap(shape.maxnreg)
    step_inputs = (x, *strides(x), C, *strides(C), x if D is None else D, launch.head_stride(D),
                   x if z is None else z, *strides(x if z is None else z))
    if shape.fused:  # one launch: every program prepares its own head's inputs and refresh scalars
        unused = cursors  # the scores launch's results: never read
        step_args = (slots, unused, cache.tokens, cache.seeds, unused, unused, *anchor, *read, buf["x"], buf["B"],
                     *step_inputs, unused, unused, y, unused, cache.scratch_row, H, G, B, *strides(B), dt_in,
                     *strides(dt_in)[:3], A if dt_bias is None else dt_bias, launch.head_stride(dt_bias), A,
                     launch.head_stride(A), buf["dt"], buf["log_alpha"], dt, log_alpha, tree, cache.draft_gaps,
                     *advanced)
        assert not shape.output_dot and not shape.beside and not shape.split
        launch.run(_mamba2_step_kernel, (P // shape.rows, H, b), *step_args, REFRESH=True, DUE=launch.EVERY_SLOT,
                   ROUNDS=1, FUSED=True, **extra, **step_consts, **inputs_consts)
        return y
    scores = torch.empty(b, H, T, LP, dtype=torch.float32, device=dev)
    gammas = torch.empty(b, H, T, dtype=torch.float32, device=dev)
    fold_w = torch.empty(b, H, LP, dtype=torch.float32, device=dev)
    fold_decay = torch.empty(b, H, dtype=torch.float32, device=dev)
    listed = shape.split or shape.beside or shape.due_first  # a launch reads the list of slots due
    due = torch.empty(b + 1 if listed else 1, dtype=torch.int32, device=dev)
    launch.run(_mamba2_scores_kernel, (b + 1 if listed else b, G), slots, cache.committed, cursors, buf["B"], buf["dt"],
               buf["log_alpha"], B, *strides(B), C, *strides(C), scores, fold_w, fold_decay, dt_in, *strides(dt_in)[:3],
               A if dt_bias is None else dt_bias, launch.head_stride(dt_bias), A, launch.head_stride(A), dt,
               log_alpha, gammas, due, tree, cache.draft_gaps, cache.scratch_row, b, H, G, T=T,
               L=cache.window, LP=LP, DK=N, DKP=DKP, HG=triton.next_power_of_2(H // G), num_warps=shape.scores_warps,
               **inputs_consts, **launch.due_scan(b, listed))
    programs, rounds = launch.refresh_grid(b, T, cache.window)
    refresh = (slots, cursors, cache.tokens, cache.seeds, fold_w, fold_decay, *anchor, *read,
               buf["x"], buf["B"], due, H, G)
    refresh_consts = dict(T=T, L=cache.window, LP=LP, DV=P, DK=N, DKP=DKP, FR=FR, KC=KC, STAGES=shape.stages,
                          READ_AFTER=read_after, ROUNDS=rounds, num_warps=shape.refresh_warps, **consts,
                          **launch.register_cap(shape.refresh_maxnreg))
    # the fused-only inputs unused (zero strides: one compile)
    step_args = (slots, cursors, cache.tokens, cache.seeds, fold_w, fold_decay, *anchor, *read, buf["x"], buf["B"],
                 *step_inputs, scores, gammas, y, due, cache.scratch_row, H, G, B, 0, 0, 0, 0, B, 0, 0, 0, B, 0, B, 0,
                 B, B, B, B, B, B, *advanced)
    due_work = [(_mamba2_refresh_kernel, (P // FR, H, programs), refresh, refresh_consts)] if shape.split else []
    launch.step_launches(_mamba2_step_kernel, (P // shape.rows, H), b, shape, programs, rounds, step_args,
                         dict(step_consts, FUSED=False, HAS_BIAS=False, SOFTPLUS=False, TREE=False, MAXD=1), extra,
                         due_work)
    return y
