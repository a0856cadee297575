"""Kimi Delta Attention ReplaySSM Triton kernels: output-only decode/verify, GDN's design with a
decay per key channel (docs/design.md, section 2).

A step is GDN's launches (``_triton/launch.py``):

- ``_kda_scores_kernel``, once per (batch row, key head): the input preparation (L2 norms, query
  scale, fp32 casts) into kn, qn; then, per value head of the key head, the decay-weighted scalar
  products of the window's keys with the new tokens (t = h + s)

      scores[b, vh, 0, s, j] = <k_j, q_s>_{j:t} = sum_c k_jc q_sc e^{g(j, t]_c}   (j <= t, else 0)
      scores[b, vh, 1, s, j] = <k_j, k_s>_{j:t}                                    (j < t, else 0)

  with every segment sum g(j, t]_c = sum_{j < m <= t} g_mc a sum of the segment's own terms, never
  a difference of prefix sums, masked before the exponent: the committed entries' segments to the
  last of them, g(j, h - 1], as a masked 0/1 product once per step, times e^{g(h - 1, t]} (two
  decays in (0, 1]); each draft's own path terms added one at a time in entry order (a chain given
  as a tree, the same bits); and the new keys and queries decayed since the checkpoint,
  kd_s = e^{G_t} * k_s and qd_s = e^{G_t} * q_s [b, T, HV, K], so that the step kernel reads the
  read copy with plain matvecs. For a slot due to refresh, per value head and at this launch's one
  shape for every preset: tinv = (I + M)^{-T} [LP, LP] with M[j, i] = beta_j <k_i, k_j>_{i:j}
  (i < j < h), the right-hand side's keys rk_j = e^{G_j} * k_j and the fold's keys
  fk_j = e^{g(j, h)} * k_j [LP, K] (zero past h), and e^{G_h} [K];
- the refresh, a branch of ``_kda_step_kernel`` or a launch of its own (``_kda_refresh_kernel``,
  ``StepShape.split``, over the slots due that the scores launch lists, ``window.list_due``), over
  FOLD_ROWS-row sub-tiles with 3-pass-tf32 products:

      U = beta (V - S_anchor RK^T) (I + M)^{-T},    S_new = S_anchor Diag(e^{G_h}) + U FK,

  everything else element-wise, so no reduction's order depends on the tile and the anchor's bits
  are the same for every read format; S_new is cast independently into anchor and read copy;
- ``_kda_step_kernel``: GDN's inner loop, the decays already inside the scores:

      u_s = beta_s (v_s - S_read kd_s - sum_{j < t} scores[1, s, j] u_j)
      o_s = S_read qd_s + sum_{j <= t} scores[0, s, j] u_j

  reusing the cached read-path residuals u_j of committed entries; the new tokens' v and u rows
  are stored here, and one program per batch row writes the shared buffer fields k, k_scale,
  g [HV, K], beta and moves the cursors (``launch.advance_row``).

The refresh's per-step vectors rk and fk take b * HV * LP * K fp32 each (written and read only for
slots that refresh).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import launch
from .._triton.formats import (
    as_stored,
    global_scale_index,
    load_read,
    load_tile,
    read_copy_from_anchor,
    within,
    write_checkpoint,
)
from .._triton.launch import advance_row, after_previous_launch
from .._triton.solve import unit_lower_inverse
from .._triton.window import (ancestor_bits, draft_bits, draft_view, due_slot, list_due, new_key_query, pending_tree,
                              slot_cursor, slot_row, step_cursor, window_keys, window_rows)
from ..gdn.triton import (
    SOLVE_WARPS,
    _new_tokens,  # the read path, with KDA's decays already in its prepared keys and queries
    _token_loads,  # the new tokens' inputs, laid out per value head as GDN's per key head
)


@triton.jit
def _log_decays(bg_ptr, g_ptr, sgb, sgt, sgh, sge, row, pid_b, h, vhead, HV, T: tl.constexpr, L: tl.constexpr,
                LP: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr):
    """[LP, DKP] fp32 per-channel log decays of value head ``vhead``: committed entries j < h from
    the buffer g [rows, L, HV, K], the T new tokens (h <= j < h + T) from the inputs g
    [b, T, HV, K] of strides sg*, zero elsewhere (T = 0: the committed entries only; channels from
    DK on)."""
    return window_rows(bg_ptr, g_ptr, sgb, sgt, sgh, sge, row, pid_b, h, vhead, HV, tl.arange(0, DKP), DK, T, L, LP)


@triton.jit
def _segments_along(G, seen):
    """[LP, DK] sums of G [LP, DK] over the entries m > j that ``seen`` [LP] holds, for every entry
    j and channel (seen = m < h: the log decay from entry j to the last committed one), each
    segment summed directly (0/1 weights, IEEE fp32: the FMAs run over the entries in order)."""
    j = tl.arange(0, G.shape[0])
    inside = tl.where((j[:, None] < j[None, :]) & seen[None, :], 1.0, 0.0)
    return tl.dot(inside, G, input_precision="ieee")


@triton.jit
def _refresh_scalars(bk_ptr, bks_ptr, bg_ptr, g_ptr, bbeta_ptr, tinv_ptr, rk_ptr, fk_ptr, total_ptr, K_c, row, pid_b,
                     khead, vhead, h, HK, HV, L: tl.constexpr, LP: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
                     LEVELS: tl.constexpr):
    """For value head ``vhead`` of a slot due to refresh (h committed entries with keys K_c
    [LP, DKP], zero past h and from column DK on): tinv[b, vh] = (I + M)^{-T}, rk[b, vh],
    fk[b, vh] [LP, DK] and total[b, vh] = e^{G_h} [DK] (module docstring). IEEE fp32 throughout."""
    j = tl.arange(0, LP)
    ck = tl.arange(0, DKP)
    cols = within(ck, DK)
    old = j < h
    G_c = _log_decays(bg_ptr, g_ptr, 0, HV * DK, DK, 1, row, pid_b, h, vhead, HV, 0, L, LP, DK, DKP)  # no new token
    beta_c = tl.load(bbeta_ptr + (row * L + j) * HV + vhead, mask=old, other=0.0)
    # M[j, i] = beta_j sum_c k_ic k_jc e^{g(i, j]_c}: one row j at a time (the decay is inside the
    # sum over channels, so the rows are no Gram matrix times decays); row 0 couples to nothing,
    # rows from h on are zero (beta_c). The segments g(i, j] grow by entry j's log decay per row, in
    # entry order (the sums of a 0/1 product's FMAs); entry j's key and decays are loaded as rows,
    # not taken out of the tiles (a reduction across warps)
    M = tl.zeros((LP, LP), dtype=tl.float32)
    seg = tl.zeros((LP, DKP), dtype=tl.float32)
    for jj in tl.range(1, LP):
        before = (j < jj)[:, None]
        here = (jj < h) & cols
        entry = (row * L + jj) * HK + khead
        k_j = tl.load(bk_ptr + entry * DK + ck, mask=here, other=0.0).to(tl.float32) * tl.load(
            bks_ptr + entry, mask=jj < h, other=0.0)
        seg += tl.where(before, tl.load(bg_ptr + ((row * L + jj) * HV + vhead) * DK + ck, mask=here,
                                        other=0.0).to(tl.float32)[None, :], 0.0)
        E = tl.where(before, tl.exp(tl.where(before, seg, float("-inf"))), 0.0)
        M = tl.where(j[:, None] == jj, tl.sum(K_c * E * k_j[None, :], 1)[None, :], M)
    X = unit_lower_inverse(beta_c[:, None] * M, LEVELS, "ieee")
    through = tl.dot(tl.where(j[None, :] <= j[:, None], 1.0, 0.0), G_c, input_precision="ieee")  # [j, c]: G_j
    after = _segments_along(G_c, j < h)  # [j, c]: g(j, h)
    base = (pid_b * HV + vhead) * LP
    at = (base + j[:, None]) * DK + ck[None, :]
    tl.store(tinv_ptr + (base + j[None, :]) * LP + j[:, None], X)  # transposed: [i, j] = X[j, i]
    tl.store(rk_ptr + at, tl.where(old[:, None], tl.exp(through) * K_c, 0.0), mask=cols[None, :])
    tl.store(fk_ptr + at, tl.where(old[:, None], tl.exp(after) * K_c, 0.0), mask=cols[None, :])
    tl.store(total_ptr + (pid_b * HV + vhead) * DK + ck, tl.exp(tl.sum(G_c, 0)), mask=cols)


@triton.jit
def _kda_scores_kernel(slots_ptr, committed_ptr, cursors_ptr, bk_ptr, bks_ptr, bg_ptr, k_ptr, skb: tl.constexpr,
                       skt: tl.constexpr, skh: tl.constexpr, ske: tl.constexpr, q_ptr, sqb: tl.constexpr,
                       sqt: tl.constexpr, sqh: tl.constexpr, sqe: tl.constexpr, g_ptr, sgb: tl.constexpr,
                       sgt: tl.constexpr, sgh: tl.constexpr, sge: tl.constexpr, kn_ptr, ks_ptr, qn_ptr, kd_ptr, qd_ptr,
                       scores_ptr, due_ptr, parents_ptr, gaps_ptr, scale, SCRATCH, B, HK, HV, T: tl.constexpr,
                       L: tl.constexpr, LP: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, RATIO: tl.constexpr,
                       NORM: tl.constexpr, DUE_CH: tl.constexpr, DUE_PASSES: tl.constexpr, TREE: tl.constexpr,
                       MAXD: tl.constexpr, TP: tl.constexpr, PDL: tl.constexpr):
    """Once per (batch row, key head): the T new keys and queries prepared in fp32 (L2-normalized
    when NORM, as flash-linear-attention's l2norm; queries times ``scale``) into kn, qn
    [b, T, HK, K], each key's normalizing factor into ks [b, T, HK] for the buffer (the key is
    computed from the value the buffer will hold, as GDN's); the batch row's committed count into
    ``cursors`` [b]; then per value head of the key head the decay-weighted scores [b, HV, 2, T, LP]
    and kd, qd [b, T, HV, K]. Program (0, 0) also lists the slots due to refresh for the solve and
    refresh launches (``window.list_due``). The caller's k, q, g are read through their strides (s*,
    ``launch.token_strides``). TREE: the batch row's draft tree ``parents`` [b, T]; draft s's
    scores, segment decays and e^{G_t} run along its own path (its ancestors,
    ``window.draft_view``), so the step kernel needs no tree of its own; program (b, 0) stores the
    slot's pending tree (``window.pending_tree``: ``cache.draft_gaps`` for accept)."""
    after_previous_launch(PDL)
    pid_b, khead = tl.program_id(0), tl.program_id(1)
    if (pid_b == 0) & (khead == 0):
        list_due(slots_ptr, committed_ptr, due_ptr, B, T, L, DUE_CH, DUE_PASSES)
    ck = tl.arange(0, DKP)  # channels from DK on are zero
    cols = within(ck, DK)
    for s in tl.static_range(T):
        at = ((pid_b * T + s) * HK + khead) * DK + ck
        k, k_scale, q = new_key_query(k_ptr, skb, skt, skh, ske, q_ptr, sqb, sqt, sqh, sqe, pid_b, s, khead, ck, DK,
                                      bk_ptr.dtype.element_ty, NORM)
        tl.store(kn_ptr + at, k * k_scale, mask=cols)
        tl.store(ks_ptr + (pid_b * T + s) * HK + khead, k_scale)
        tl.store(qn_ptr + at, q * scale, mask=cols)
    tl.debug_barrier()  # the rows just written are read back by other threads of the program
    valid, row, h, need = slot_cursor(slots_ptr, committed_ptr, pid_b, SCRATCH, T, L)
    if khead == 0:
        tl.store(cursors_ptr + pid_b, h)
        if TREE:
            pending_tree(parents_ptr, gaps_ptr, pid_b, valid, row, T, MAXD)
    anc = ancestor_bits(parents_ptr, pid_b, valid, T) if TREE else 0
    j = tl.arange(0, LP)
    h = tl.where(need, 0, h)  # a refreshing slot sees only its new tokens
    # the window: the committed keys [LP, DKP] (zero from h on) and the new ones [TP, DKP], scored
    # apart: the committed entries' decays to the last of them once, then each draft's own terms
    n = tl.arange(0, TP)
    old = j < h
    K = window_keys(bk_ptr, bks_ptr, row, khead, h, ck, HK, DK, L, LP)
    K_new = tl.load(kn_ptr + ((pid_b * T + n)[:, None] * HK + khead) * DK + ck[None, :],
                    mask=(n < T)[:, None] & cols[None, :], other=0.0)
    for vv in tl.range(0, RATIO):
        vhead = khead * RATIO + vv
        G = _log_decays(bg_ptr, g_ptr, sgb, sgt, sgh, sge, row, pid_b, h, vhead, HV, 0, L, LP, DK, DKP)
        KE_old = K * tl.where(old[:, None], tl.exp(tl.where(old[:, None], _segments_along(G, old), float("-inf"))),
                              0.0)  # k_j e^{g(j, h - 1]} for j < h
        G_old = tl.sum(G, 0)  # G_{h-1}, from the checkpoint
        g_new = ()  # the new tokens' log decays, as the buffer will hold them
        for s in tl.static_range(T):
            g_s = tl.load(g_ptr + pid_b * sgb + s * sgt + vhead * sgh + ck * sge, mask=cols, other=0.0)
            g_new = g_new + (as_stored(g_s, bg_ptr.dtype.element_ty).to(tl.float32),)
        for s in tl.static_range(T):
            tok = pid_b * T + s
            q = tl.load(qn_ptr + (tok * HK + khead) * DK + ck, mask=cols, other=0.0)
            k = tl.load(kn_ptr + (tok * HK + khead) * DK + ck, mask=cols, other=0.0)
            bits = draft_bits(anc, s, TREE)
            path = draft_view(bits, 0, s, TP, TREE)  # the new entries draft s sees: itself and its ancestors
            # g(h - 1, t] and, for the path's entries h + n, g(h + n, t]: the path's terms one at a
            # time in entry order (sums of the segments' own terms; a chain given as a tree, the same)
            G_path = tl.zeros((DKP,), tl.float32)
            A = tl.zeros((TP, DKP), tl.float32)
            for m in tl.static_range(s + 1):
                g_m = g_new[m]
                if TREE:
                    g_m = tl.where(((bits >> m) & 1) != 0, g_m, 0.0)
                G_path += g_m
                A += tl.where((n < m)[:, None], g_m[None, :], 0.0)
            KE_new = K_new * tl.where(path[:, None], tl.exp(A), 0.0)
            decayed = tl.exp(G_path)  # e^{g(h - 1, t]}, applied to the draft's key and query
            base = ((pid_b * HV + vhead) * 2 * T + s) * LP
            outside = old | (j >= h + T)  # the new entries' positions get the second stores
            tl.store(scores_ptr + base + j, tl.sum(KE_old * (q * decayed)[None, :], 1), mask=outside)
            tl.store(scores_ptr + base + h + n, tl.sum(KE_new * q[None, :], 1), mask=n < T)
            tl.store(scores_ptr + base + T * LP + j, tl.sum(KE_old * (k * decayed)[None, :], 1), mask=outside)
            tl.store(scores_ptr + base + T * LP + h + n, tl.where(n < s, tl.sum(KE_new * k[None, :], 1), 0.0),
                     mask=n < T)
            decay = tl.exp(G_old + G_path)  # e^{G_t}
            tl.store(kd_ptr + (tok * HV + vhead) * DK + ck, decay * k, mask=cols)
            tl.store(qd_ptr + (tok * HV + vhead) * DK + ck, decay * q, mask=cols)


@triton.jit
def _kda_solve_kernel(slots_ptr, cursors_ptr, due_ptr, bk_ptr, bks_ptr, bg_ptr, g_ptr, bbeta_ptr, tinv_ptr, rk_ptr,
                      fk_ptr, total_ptr, HK, HV, L: tl.constexpr, LP: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
                      RATIO: tl.constexpr, LEVELS: tl.constexpr, ROUNDS: tl.constexpr, PDL: tl.constexpr):
    """The refresh's scalars (``_refresh_scalars``) for the slots due only (the scores launch's
    list, ``window.list_due``): program (key head, c) takes the slots of ranks c, c + n, ... and
    its key head's value heads. A launch of its own at ``SOLVE_WARPS`` (GDN's) for every preset
    and batch, as GDN's: in the scores launch its registers would hold every scores program at
    a fraction of the occupancy."""
    after_previous_launch(PDL)
    khead, c = tl.program_id(0), tl.program_id(1)
    ck = tl.arange(0, DKP)
    count = tl.load(due_ptr)
    for it in tl.range(0, ROUNDS, num_stages=1):  # a constant trip count: the interpreter needs one
        r = c + it * tl.num_programs(1)
        if r < count:
            pid_b, row, h = due_slot(due_ptr, slots_ptr, cursors_ptr, r)
            K_c = window_keys(bk_ptr, bks_ptr, row, khead, h, ck, HK, DK, L, LP)
            for vv in tl.range(0, RATIO):  # a loop, not unrolled: registers
                _refresh_scalars(bk_ptr, bks_ptr, bg_ptr, g_ptr, bbeta_ptr, tinv_ptr, rk_ptr, fk_ptr, total_ptr, K_c,
                                 row, pid_b, khead, khead * RATIO + vv, h, HK, HV, L, LP, DK, DKP, LEVELS)


@triton.jit
def _kda_refresh_rows(pid_b, head, row, h, r0, seeds_ptr, tokens_ptr, tinv_ptr, rk_ptr, fk_ptr, total_ptr,
                      av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, bv_ptr, bbeta_ptr, HV,
                      L: tl.constexpr, LP: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
                      BV: tl.constexpr, FR: tl.constexpr, KC: tl.constexpr, A_FMT: tl.constexpr, A_SR: tl.constexpr,
                      R_FMT: tl.constexpr, R_SR: tl.constexpr, SHARED: tl.constexpr, STAGES: tl.constexpr,
                      READ_AFTER: tl.constexpr):
    """Refresh rows r0 .. r0 + BV of value head ``head`` of storage row ``row`` (h committed
    entries, batch row ``pid_b``), FR rows at a time: the residual solve and fold of the module
    docstring, then the encode of KC columns at a time (the last pass of each masked from column
    DK on)."""
    mat = row * HV + head
    j = tl.arange(0, LP)
    old = j < h
    buf_tok = row * L + j
    base = (pid_b * HV + head) * LP
    Tinv = tl.load(tinv_ptr + (base + j[:, None]) * LP + j[None, :])
    beta_c = tl.load(bbeta_ptr + buf_tok * HV + head, mask=old, other=0.0)
    seed = tl.load(seeds_ptr + row)
    tokens = tl.load(tokens_ptr + row)
    SKC: tl.constexpr = 32 if DKP >= 32 else DKP
    for f in tl.static_range(BV // FR):
        rv = r0 + f * FR + tl.arange(0, FR)
        gidx = mat * (DV // FR) + (r0 + f * FR) // FR  # NVFP4: FR is the row block, one global scale
        V_c = tl.load(bv_ptr + (buf_tok[None, :] * HV + head) * DV + rv[:, None], mask=old[None, :],
                      other=0.0).to(tl.float32)  # [FR, LP]
        SK = tl.zeros((FR, LP), dtype=tl.float32)  # S_anchor (e^{G_j} * k_j)
        for c in tl.range(0, (DK + SKC - 1) // SKC, num_stages=STAGES):  # a loop, not unrolled: registers
            cols = c * SKC + tl.arange(0, SKC)
            RK = tl.load(rk_ptr + (base + j[:, None]) * DK + cols[None, :], mask=within(cols, DK)[None, :], other=0.0)
            S_part = load_tile(av_ptr, as_ptr, ag_ptr, mat, gidx, rv, cols, DV, DK, A_FMT)
            SK += tl.dot(S_part, tl.trans(RK), input_precision="tf32x3")
        R = tl.where(old[None, :], beta_c[None, :] * (V_c - SK), 0.0)
        U = tl.dot(R, Tinv, input_precision="tf32x3")  # residuals u_j
        for c in tl.range(0, (DK + KC - 1) // KC, num_stages=STAGES):  # a loop, not unrolled: registers
            cols = c * KC + tl.arange(0, KC)
            FK = tl.load(fk_ptr + (base + j[:, None]) * DK + cols[None, :], mask=within(cols, DK)[None, :], other=0.0)
            total = tl.load(total_ptr + (pid_b * HV + head) * DK + cols, mask=within(cols, DK), other=0.0)
            S = load_tile(av_ptr, as_ptr, ag_ptr, mat, gidx, rv, cols, DV, DK, A_FMT) * total[None, :]
            S += tl.dot(U, FK, input_precision="tf32x3")
            write_checkpoint(S, av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, mat, gidx, head, rv, cols, seed,
                             tokens, DV, DK, A_FMT, A_SR, R_FMT, R_SR, SHARED or READ_AFTER)
        if READ_AFTER:
            read_copy_from_anchor(av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, mat, gidx, head, rv, seed, tokens,
                                  DV, DK, DKP, A_FMT, R_FMT, R_SR)


@triton.jit
def _kda_refresh_kernel(slots_ptr, cursors_ptr, tokens_ptr, seeds_ptr, tinv_ptr, rk_ptr, fk_ptr, total_ptr,
                        av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, bv_ptr, bbeta_ptr, due_ptr, HV,
                        T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr,
                        DKP: tl.constexpr, FR: tl.constexpr, KC: tl.constexpr, A_FMT: tl.constexpr, A_SR: tl.constexpr,
                        R_FMT: tl.constexpr, R_SR: tl.constexpr, SHARED: tl.constexpr, STAGES: tl.constexpr,
                        READ_AFTER: tl.constexpr, ROUNDS: tl.constexpr, PDL: tl.constexpr):
    """The refresh in a launch of its own (``StepShape.split``): program (v, head, c) refreshes FR
    rows of value head ``head`` of the slots due of ranks c, c + n, ... in the list the scores launch
    made (``window.list_due``; n programs per tile, ``launch.refresh_grid``)."""
    after_previous_launch(PDL)
    pid_v, head, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(due_ptr)
    for it in tl.range(0, ROUNDS, num_stages=1):  # a constant trip count: the interpreter needs one
        r = c + it * tl.num_programs(2)
        if r < count:
            pid_b, row, h = due_slot(due_ptr, slots_ptr, cursors_ptr, r)
            _kda_refresh_rows(pid_b, head, row, h, pid_v * FR, seeds_ptr, tokens_ptr, tinv_ptr, rk_ptr, fk_ptr,
                              total_ptr, av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, bv_ptr, bbeta_ptr, HV, L, LP,
                              DV, DK, DKP, FR, FR, KC, A_FMT, A_SR, R_FMT, R_SR, SHARED, STAGES, READ_AFTER)


@triton.jit
def _kda_step_kernel(slots_ptr, cursors_ptr, tokens_ptr, seeds_ptr, tinv_ptr, rk_ptr, fk_ptr, total_ptr, av_ptr, as_ptr,
                     ag_ptr, rv_ptr, rs_ptr, rg_ptr, bv_ptr, bbeta_ptr, bu_ptr, qd_ptr, kd_ptr, v_ptr,
                     svb: tl.constexpr, svt: tl.constexpr, svh: tl.constexpr, sve: tl.constexpr, beta_ptr,
                     sbb: tl.constexpr, sbt: tl.constexpr, sbh: tl.constexpr, scores_ptr, o_ptr, SCRATCH, HV,
                     committed_ptr, pending_ptr, refreshes_ptr, done_ptr, s1,
                     s1b: tl.constexpr, s1t: tl.constexpr, s1h: tl.constexpr, s1e: tl.constexpr, d1, s2,
                     s2b: tl.constexpr, s2t: tl.constexpr, s2h: tl.constexpr, s2e: tl.constexpr, d2, s3,
                     s3b: tl.constexpr, s3t: tl.constexpr, s3h: tl.constexpr, s3e: tl.constexpr, d3, s4,
                     s4b: tl.constexpr, s4t: tl.constexpr, s4h: tl.constexpr, s4e: tl.constexpr, d4,
                     T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr,
                     DKP: tl.constexpr, BV: tl.constexpr, FR: tl.constexpr, KC: tl.constexpr, A_FMT: tl.constexpr,
                     A_SR: tl.constexpr, R_FMT: tl.constexpr, R_SR: tl.constexpr, SHARED: tl.constexpr,
                     OUTPUT_DOT: tl.constexpr, QP: tl.constexpr, STREAM: tl.constexpr, PIN: tl.constexpr,
                     REFRESH: tl.constexpr, STAGES: tl.constexpr, READ_AFTER: tl.constexpr,
                     COMMIT: tl.constexpr, F1: tl.constexpr, F1P: tl.constexpr,
                     W1: tl.constexpr, F2: tl.constexpr, F2P: tl.constexpr, W2: tl.constexpr, F3: tl.constexpr,
                     F3P: tl.constexpr, W3: tl.constexpr, F4: tl.constexpr, F4P: tl.constexpr,
                     W4: tl.constexpr, PDL: tl.constexpr):
    after_previous_launch(PDL)
    # row blocks vary fastest: programs running side by side stream one slot's contiguous state
    pid_v, head, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    valid, row = slot_row(slots_ptr, pid_b, SCRATCH)
    h, need = step_cursor(cursors_ptr, pid_b, valid, T, L)
    mat = row * HV + head
    gidx = global_scale_index(mat, pid_v * BV, BV, DV)  # NVFP4: the global scales of these rows
    rv = pid_v * BV + tl.arange(0, BV)
    j = tl.arange(0, LP)
    if REFRESH:
        if need:  # refresh: re-solve the committed residuals from the anchor, fold, encode
            _kda_refresh_rows(pid_b, head, row, h, pid_v * BV, seeds_ptr, tokens_ptr, tinv_ptr, rk_ptr, fk_ptr,
                              total_ptr, av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, bv_ptr, bbeta_ptr, HV, L, LP,
                              DV, DK, DKP, BV, FR, KC, A_FMT, A_SR, R_FMT, R_SR, SHARED, STAGES, READ_AFTER)
            tl.debug_barrier()  # the rows just stored are read back below by other threads of the program
    h = tl.where(need, 0, h)  # after a refresh only the new tokens are in the window
    # the read copy in its own layout (the anchor itself when shared; never whole when its products
    # are streamed), then everything else a program reads, all issued before any arithmetic
    if OUTPUT_DOT:
        ra, rb, rsc = 0.0, 0.0, 0.0
    else:
        ra, rb, rsc = load_read(rv_ptr, rs_ptr, rg_ptr, mat, gidx, rv, DV, DK, DKP, R_FMT)
    U = tl.load(bu_ptr + ((row * L + j[None, :]) * HV + head) * DV + rv[:, None], mask=(j < h)[None, :], other=0.0)
    tokens_in = _token_loads(qd_ptr, kd_ptr, v_ptr, svb, svt, svh, sve, beta_ptr, sbb, sbt, sbh, scores_ptr, bv_ptr,
                             pid_b, head, head, rv, HV, HV, T, LP, DV, DK, DKP, R_FMT, OUTPUT_DOT)
    _new_tokens(tokens_in, (), U, rv_ptr, rs_ptr, rg_ptr, ra, rb, rsc, kd_ptr, qd_ptr, o_ptr, bv_ptr, bu_ptr, mat,
                gidx, rv, pid_b, valid, row, h, head, head, HV, HV, T, L, LP, DV, DK, DKP, R_FMT, OUTPUT_DOT, QP,
                STREAM, PIN, False)
    advance_row(pid_b, valid, row, tl.where(need, 0, h), need, (pid_v == 0) & (head == 0), need & REFRESH,
                tokens_ptr, committed_ptr, pending_ptr, refreshes_ptr, done_ptr, s1, s1b, s1t, s1h, s1e, d1,
                s2, s2b, s2t, s2h, s2e, d2, s3, s3b, s3t, s3h, s3e, d3, s4, s4b, s4t, s4h, s4e, d4, T, L,
                COMMIT, F1, F1P, W1, F2, F2P, W2, F3, F3P, W3, F4, F4P, W4, False)


def step(cache, slots, q, k, v, g, beta, scale: float, normalize: bool, commit: bool, o, parents=None):
    """One KDA decode (T = 1) or verify step on the Triton backend.

    parents int32/int64 [b, T] (a draft tree, T <= 32) or None (a chain).
    q, k [b, T, HK, K] as given to the public call (L2-normalized here when ``normalize``; q
    times ``scale``); v [b, T, HV, V]; g [b, T, HV, K] (per-channel log decay); beta [b, T, HV];
    any float dtypes, any strides (views of a packed projection are read in place,
    ``launch.token_strides``). Writes the outputs into o [b, T, HV, V] (contiguous fp32; pads zero)
    and returns it. The input preparation happens inside the first launch.
    """
    b, T, HV, V = v.shape
    HK, K = cache.num_k_heads, cache.head_k_dim
    dev = v.device
    anchor, read, consts = launch.format_args(cache)
    strides = launch.token_strides
    shape = launch.step_shape(cache, "kda", T, b)
    buf = cache.buffer
    LP, DKP = launch.window_pad(cache), launch.column_pad(cache)
    f32 = torch.float32
    scores = torch.empty(b, HV, 2, T, LP, dtype=f32, device=dev)
    kn = torch.empty(q.shape, dtype=f32, device=dev)
    k_scale = torch.empty(q.shape[:3], dtype=f32, device=dev)
    qn = torch.empty_like(kn)
    kd = torch.empty(b, T, HV, K, dtype=f32, device=dev)
    qd = torch.empty_like(kd)
    tinv = torch.empty(b, HV, LP, LP, dtype=f32, device=dev)
    rk = torch.empty(b, HV, LP, K, dtype=f32, device=dev)
    fk = torch.empty_like(rk)
    total = torch.empty(b, HV, K, dtype=f32, device=dev)
    cursors = torch.empty(b, dtype=cache.committed.dtype, device=dev)
    refresh = (tinv, rk, fk, total)
    due = torch.empty(b + 1, dtype=torch.int32, device=dev)
    launch.run(_kda_scores_kernel, (b, HK), slots, cache.committed, cursors, buf["k"], buf["k_scale"], buf["g"], k,
               *strides(k), q, *strides(q), g, *strides(g), kn, k_scale, qn, kd, qd, scores, due,
               due if parents is None else parents, cache.draft_gaps, float(scale), cache.scratch_row, b, HK, HV, T=T,
               L=cache.window, LP=LP, DK=K, DKP=DKP, RATIO=HV // HK, NORM=normalize, **launch.due_scan(b, True),
               TREE=parents is not None, MAXD=cache.max_draft, TP=triton.next_power_of_2(T),
               num_warps=shape.scores_warps)
    n, rounds = launch.refresh_grid(b, T, cache.window)
    launch.run(_kda_solve_kernel, (HK, n), slots, cursors, due, buf["k"], buf["k_scale"], buf["g"], g, buf["beta"],
               *refresh, HK, HV, L=cache.window, LP=LP, DK=K, DKP=DKP, RATIO=HV // HK,
               LEVELS=launch.inverse_levels(LP), ROUNDS=rounds, num_warps=SOLVE_WARPS)
    FR, KC = min(launch.FOLD_ROWS, shape.rows), launch.refresh_columns(cache, "kda")
    read_after = launch.read_copy_after_fold(cache)
    if shape.split:
        launch.run(_kda_refresh_kernel, (V // FR, HV, n), slots, cursors, cache.tokens, cache.seeds, *refresh,
                   *anchor, *read, buf["v"], buf["beta"], due, HV, T=T, L=cache.window, LP=LP, DV=V, DK=K, DKP=DKP,
                   FR=FR,
                   KC=KC, STAGES=shape.stages, READ_AFTER=read_after, ROUNDS=rounds, num_warps=shape.refresh_warps,
                   **consts, **launch.register_cap(shape.refresh_maxnreg))
    extra = launch.register_cap(shape.maxnreg)
    advanced, advance_consts = launch.advance_args(cache, commit, {"k": k, "k_scale": k_scale, "g": g, "beta": beta})
    launch.run(
        _kda_step_kernel, (V // shape.rows, HV, b),
        slots, cursors, cache.tokens, cache.seeds, *refresh, *anchor, *read,
        buf["v"], buf["beta"], buf["u"], qd, kd, v, *strides(v), beta, *strides(beta)[:3], scores, o, cache.scratch_row,
        HV, *advanced,
        T=T, L=cache.window, LP=LP, DV=V, DK=K, DKP=DKP, BV=shape.rows, FR=FR, KC=KC, OUTPUT_DOT=shape.output_dot,
        QP=max(16, triton.next_power_of_2(2 * T)), STREAM=shape.stream, PIN=shape.pin, REFRESH=not shape.split,
        STAGES=shape.stages, READ_AFTER=read_after, num_warps=shape.warps, **extra, **consts, **advance_consts)
    return o
