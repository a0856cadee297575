"""Gated DeltaNet ReplaySSM Triton kernels: output-only decode/verify.

A step is three launches (``_triton/launch.py``): ``_gdn_scores_kernel`` (the input preparation
— L2 norms, query scale, fp32 casts — and k_j . q_s, k_j . k_s over the window, once per batch row
and key head, times each value head's decays into the step's weights; the list of slots due to
refresh), ``_gdn_solve_kernel`` (for the slots due only: the decays and the inverse of the residual
system) and ``_gdn_step_kernel`` (one program per block of state rows, value head and batch row;
GDN's residuals are separable over state rows; one of a batch row's programs also writes the
shared buffer fields k, k_scale, g, beta and moves the cursors, ``launch.advance_row``). Where the
launch policy puts the slots due beside the others (``launch.StepShape.beside``), their solve and
a step launch over them only, each program refreshing its rows first, run on a side stream beside
the step launch over the other slots. With ``launch.StepShape.solve_here`` each refreshing
program solves its head's system itself (``_solve_here``) and there is no solve launch. The
smallest steps are one launch (``launch.StepShape.fused``): each step program does the scores
launch's work for its own value head (``_prepared_tokens``) and, where its slot is due, the
solve's (``_solve_here``).

A program whose slot is due re-solves the committed residuals from the *anchor*. With c_j the log
decay from the checkpoint through entry j and g(i, j] the one between entries, the residuals solve
the unit lower-triangular system

    u_j + sum_{i<j} beta_j e^{g(i, j]} (k_i . k_j) u_i = beta_j (v_j - e^{c_j} S_anchor k_j),

so U = R (I + M)^{-T} with the [L, L] inverse from the solve launch, and

    S_new = e^{c_h} S_anchor + sum_j e^{g(j, h)} u_j k_j^T.

S_anchor K^T, R (I + M)^{-T} and the rank-h update are fp32-accurate tensor-core products over
32-row sub-tiles: the two with the keys take them as buffered (16-bit inputs are exact tensor-core
operands, so the fp32 side is split into two single-pass products, ``formats.exact_b_products``)
and apply their normalizing factors to the other side; everything else is element-wise, so no
reduction's order depends on the tile layout and the anchor's bits are the same for every read
format. S_new is cast independently into
anchor and read copy. Outputs solve only the new tokens' residuals against the read copy, reusing
the cached read-path residuals of committed entries:

    u_s = beta_s (v_s - gamma_t S_read k_s - sum_{j < t} gamma_{j+1:t} (k_j . k_s) u_j)
    o_s = gamma_t S_read q_s + sum_{j <= t} gamma_{j+1:t} (k_j . q_s) u_j,   t = h + s

— no per-token [V, K] state anywhere. The weights gamma_{j+1:t} (k_j . k_s), gamma_{j+1:t}
(k_j . q_s) and gamma_t come from the scores launch, once per value head for all its step
programs. The new tokens' v and u rows are stored here. For a draft tree the sums over j < t and
j <= t run over the committed entries and draft s's ancestors only (the weights are zero
elsewhere and the decays run along the draft's path), so u_s is the residual of its own chain.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import launch
from .._triton.launch import advance_row, after_previous_launch
from .._triton.solve import unit_lower_inverse
from .._triton.decay import ordered_row_sums, path_decays, softplus
from .._triton.window import (ancestor_bits, committed_head_window, draft_paths, due_slot, fused_item, head_window,
                              key_query_norms, list_due, new_key_query, pending_tree, program_item, slot_cursor,
                              whole_window, window_key_scales, window_keys, window_raw_keys)
from .._triton.formats import (as_query, as_stored, column, exact_b_products, global_scale_index, load_query,
                               load_read, load_tile, matvec, pin_vector_width, read_copy_from_anchor,
                               streamed_products, within, write_checkpoint)


@triton.jit
def _window_gates(bg_ptr, bbeta_ptr, row, vh, mine, h, HV, L: tl.constexpr, LP: tl.constexpr):
    """The committed entries' log decays g and betas [RP, LP] of value heads ``vh`` [RP] (``mine``:
    the real ones), zero from entry h on: ``_residual_inverses``' inputs, loaded before the keys'
    products so that their round trip is not one more after them."""
    j = tl.arange(0, LP)
    entry = (row * L + j[None, :]) * HV + vh[:, None]  # [RP, LP]
    ok = mine[:, None] & (j < h)[None, :]
    return tl.load(bg_ptr + entry, mask=ok, other=0.0), tl.load(bbeta_ptr + entry, mask=ok, other=0.0)


@triton.jit
def _residual_inverses(g_c, beta_c, h, gram, LP: tl.constexpr, LEVELS: tl.constexpr):
    """For the value heads of ``_window_gates``' g_c, beta_c [RP, LP] of a slot due to refresh (h
    committed entries), at once: ((I + M)^{-1} [RP, LP, LP], e^{c_j} [RP, LP], e^{g(j, h)} [RP, LP], e^{c_h}
    [RP]), the vectors zero past h. M[j, i] = beta_j e^{g(i, j]} gram[j, i] for i < j < h is
    strictly lower triangular; (I + M)^{-1} from its diagonal blocks doubled (LEVELS = log2(LP) -
    1): a few small products instead of LP dependent substitution steps, batched over the heads
    so that a refreshing program's chain of products is one head long (``solve.unit_lower_inverse``:
    3-pass tf32). The segment sums g(i, j] = (lower-triangular g) x (strict upper ones) and the
    decays' sums are IEEE fp32 products (FMAs): sums of the segment's own terms, exact where a
    split product would lose low bits of large log decays."""
    j = tl.arange(0, LP)
    old = j < h
    jr = j[None, :, None]  # row (entry j)
    ic = j[None, None, :]  # column (entry i, or the summed entry k)
    RP: tl.constexpr = g_c.shape[0]
    through = tl.where(ic <= jr, g_c[:, None, :], 0.0)  # [r, j, k]: g_k for k <= j
    after = tl.where((ic > jr) & (ic < h), g_c[:, None, :], 0.0)  # [r, j, k]: g_k for j < k < h
    upper = tl.broadcast_to(tl.where(jr > ic, 1.0, 0.0), (RP, LP, LP))  # [r, k, i]: k > i
    # every sum in k order (IEEE products), whatever the program's layout: the same bits from the
    # solve launch and from a refreshing program of a step of one launch
    seg = tl.dot(through, upper, input_precision="ieee")  # [r, j, i]: g(i, j]
    prefix = ordered_row_sums(through)  # [r, j]: c_j
    suffix = ordered_row_sums(after)  # [r, j]: g(j, h)
    ec = tl.where(old[None, :], tl.exp(prefix), 0.0)
    es = tl.where(old[None, :], tl.exp(suffix), 0.0)
    total = tl.where(j[None, :] == LP - 1, prefix, 0.0)  # c_h: g_c is zero from h on
    lower = (ic < jr) & (jr < h)
    M = tl.where(lower, beta_c[:, :, None] * tl.exp(tl.where(lower, seg, 0.0)) * gram[None, :, :], 0.0)
    return unit_lower_inverse(M, LEVELS, "tf32x3"), ec, es, tl.exp(tl.sum(total, 1))


@triton.jit
def _gdn_scores_kernel(slots_ptr, committed_ptr, cursors_ptr, bk_ptr, bks_ptr, k_ptr, skb: tl.constexpr,
                       skt: tl.constexpr, skh: tl.constexpr, ske: tl.constexpr, q_ptr, sqb: tl.constexpr,
                       sqt: tl.constexpr, sqh: tl.constexpr, sqe: tl.constexpr, kn_ptr, ks_ptr, qn_ptr, scores_ptr,
                       a_ptr, sab: tl.constexpr, sat: tl.constexpr, sah: tl.constexpr, b_ptr, sbb: tl.constexpr,
                       sbt: tl.constexpr, sbh: tl.constexpr, alog_ptr, s_alog: tl.constexpr, dtb_ptr,
                       s_dtb: tl.constexpr, gn_ptr, betan_ptr, bg_ptr, g_ptr, sgb: tl.constexpr, sgt: tl.constexpr,
                       sgh: tl.constexpr, gammas_ptr, due_ptr, parents_ptr, gaps_ptr, scale, SCRATCH, B, HK, HV,
                       T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
                       RATIO: tl.constexpr, NORM: tl.constexpr, GATE: tl.constexpr, HAS_DTB: tl.constexpr,
                       RP: tl.constexpr, DUE_CH: tl.constexpr, DUE_PASSES: tl.constexpr, TREE: tl.constexpr,
                       MAXD: tl.constexpr, PDL: tl.constexpr):
    """Once per (batch row, key head): the T new keys and queries prepared in fp32 (L2-normalized
    when NORM, as flash-linear-attention's l2norm, queries times ``scale``) into kn, qn [b, T, HK, K]
    for the other launches, and each key's normalizing factor into ks [b, T, HK] for the buffer
    (which holds the keys as given: the key is computed from the value the buffer will hold, so a
    replay gives it back bit for bit); the batch row's committed count into ``cursors`` [b]; then,
    for each value head vh of the key head, the step launch's weights over the entries j of the window
    (committed + new): scores[b, vh, 0, s, j] = e^{g(j, t]} (k_j . q_s) for the entries draft s
    sees (j <= t = h + s for a chain), scores[b, vh, 1, s, j] = e^{g(j, t]} (k_j . k_s) for those
    before it, zero elsewhere, and gammas[b, vh, s] = e^{c_t}, the decay from the checkpoint to t:
    the step launch's programs, several per value head, share them instead of each summing them.
    GATE: the new tokens' gates of the key head's value heads from the raw inputs, as
    flash-linear-attention's gated delta rule takes them: g = -exp(A_log) softplus(a + dt_bias) and
    beta = sigmoid(b) into gn, betan [b, T, HV] fp32 for the other launches (g is then gn). Program
    (0, 0) also lists the slots due to refresh for the solve and refresh launches
    (``window.list_due``). TREE: the batch row's draft tree, ``parents`` [b, T]: draft s's weights
    and decay run along its own path (its ancestors, ``window.draft_view``), so the step launch
    needs no tree of its own; the slot's pending tree goes into ``cache.draft_gaps``
    (``window.pending_tree``). The caller's k, q, g, a, b, A_log and dt_bias are read through
    their strides (s*: ``launch.token_strides``, ``launch.head_stride``)."""
    after_previous_launch(PDL)
    pid_b, khead = tl.program_id(0), tl.program_id(1)
    if (pid_b == 0) & (khead == 0):
        list_due(slots_ptr, committed_ptr, due_ptr, B, T, L, DUE_CH, DUE_PASSES)
    ck = tl.arange(0, DKP)  # columns from DK on are zero
    cols = within(ck, DK)
    vh = khead * RATIO + tl.arange(0, RP)  # the key head's value heads (``mine``: the real ones)
    mine = tl.arange(0, RP) < RATIO
    gates = ()
    if GATE:
        decay_rate = tl.exp(tl.load(alog_ptr + vh * s_alog, mask=mine, other=0.0).to(tl.float32))
        for s in tl.static_range(T):
            at = (pid_b * T + s) * HV + vh
            x = tl.load(a_ptr + pid_b * sab + s * sat + vh * sah, mask=mine, other=0.0).to(tl.float32)
            if HAS_DTB:
                x += tl.load(dtb_ptr + vh * s_dtb, mask=mine, other=0.0).to(tl.float32)
            gates = gates + (-decay_rate * softplus(x),)
            tl.store(gn_ptr + at, gates[s], mask=mine)
            beta = tl.load(b_ptr + pid_b * sbb + s * sbt + vh * sbh, mask=mine, other=0.0).to(tl.float32)
            tl.store(betan_ptr + at, tl.sigmoid(beta), mask=mine)
    valid, row, h, need = slot_cursor(slots_ptr, committed_ptr, pid_b, SCRATCH, T, L)
    if khead == 0:
        tl.store(cursors_ptr + pid_b, h)
        if TREE:
            pending_tree(parents_ptr, gaps_ptr, pid_b, valid, row, T, MAXD)
    anc = ancestor_bits(parents_ptr, pid_b, valid, T) if TREE else 0
    j = tl.arange(0, LP)
    seen = tl.where(need, 0, h)  # committed entries the new tokens see: none after a refresh
    K_old = window_keys(bk_ptr, bks_ptr, row, khead, seen, ck, HK, DK, L, LP)
    # the key head's value heads' log decays over the window [RP, LP], and the same one entry on
    G = head_window(bg_ptr, g_ptr, sgb, sgt, sgh, gates, row, pid_b, seen, j, vh, mine, HV, T, L, GATE)
    G_next = head_window(bg_ptr, g_ptr, sgb, sgt, sgh, gates, row, pid_b, seen, j + 1, vh, mine, HV, T, L, GATE)
    # the new keys and queries, prepared in registers: the window's new entries are scored from
    # here, not read back from kn / qn
    keys, queries = (), ()
    for s in tl.static_range(T):
        at = ((pid_b * T + s) * HK + khead) * DK + ck
        k, k_scale, q = new_key_query(k_ptr, skb, skt, skh, ske, q_ptr, sqb, sqt, sqh, sqe, pid_b, s, khead, ck, DK,
                                      bk_ptr.dtype.element_ty, NORM)
        k = k * k_scale
        q = q * scale
        tl.store(kn_ptr + at, k, mask=cols)
        tl.store(qn_ptr + at, q, mask=cols)
        tl.store(ks_ptr + (pid_b * T + s) * HK + khead, k_scale)
        keys = keys + (k,)
        queries = queries + (q,)
    K = K_old  # the window: committed entries, then the new ones at positions seen + n
    for n in tl.static_range(T):
        K = tl.where((j == seen + n)[:, None], keys[n][None, :], K)
    for s in tl.static_range(T):
        t = seen + s
        path, path_next = draft_paths(anc, seen, s, LP, TREE)  # j <= t for a chain
        decay, gamma = path_decays(G, G_next, path, path_next)
        to_q = decay * tl.sum(K * queries[s][None, :], 1)[None, :]
        to_k = tl.where((j < t)[None, :], decay, 0.0) * tl.sum(K * keys[s][None, :], 1)[None, :]
        at = ((pid_b * HV + vh) * 2 * T + s) * LP  # [RP]
        tl.store(scores_ptr + at[:, None] + j[None, :], to_q, mask=mine[:, None])
        tl.store(scores_ptr + at[:, None] + T * LP + j[None, :], to_k, mask=mine[:, None])
        tl.store(gammas_ptr + (pid_b * HV + vh) * T + s, gamma, mask=mine)


@triton.jit
def _gram(bk_ptr, bks_ptr, row, khead, h, HK, DK: tl.constexpr, DKP: tl.constexpr, L: tl.constexpr,
          LP: tl.constexpr):
    """k_j . k_i [LP, LP] of the h committed keys as the recurrence uses them (``window.window_keys``):
    the products of the keys as buffered on tensor cores, times both normalizing factors. 16-bit
    keys (inputs kept as given) are exact tf32 operands whose products are exact in fp32, so one
    single-pass product is fp32-accurate; fp32 keys take 3-pass tf32. 32 columns at a time into one
    accumulator: a [LP, DK] tile of keys and its transpose held at once made a step of one launch
    spill."""
    KCH: tl.constexpr = 32 if DKP >= 32 else DKP
    PRECISION: tl.constexpr = "tf32x3" if bk_ptr.dtype.element_ty == tl.float32 else "tf32"
    k_scale = window_key_scales(bks_ptr, row, khead, h, HK, L, LP)
    raw = tl.zeros((LP, LP), tl.float32)
    # a pipelined loop whose stages hold every chunk: their loads are issued at once instead of each
    # after the previous chunk's product (a round trip apiece: the chain of a step at batch 1)
    for c in tl.range(0, DKP // KCH, num_stages=DKP // KCH):
        K_c = window_raw_keys(bk_ptr, row, khead, h, c * KCH + tl.arange(0, KCH), HK, DK, L, LP).to(tl.float32)
        raw = tl.dot(K_c, tl.trans(K_c), raw, input_precision=PRECISION)
    return raw * k_scale[:, None] * k_scale[None, :]


@triton.jit
def _gdn_solve_kernel(slots_ptr, cursors_ptr, due_ptr, bk_ptr, bks_ptr, bg_ptr, bbeta_ptr, tinv_ptr, decays_ptr, HK, HV,
                      L: tl.constexpr, LP: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, RATIO: tl.constexpr,
                      RP: tl.constexpr, LEVELS: tl.constexpr, ROUNDS: tl.constexpr, PDL: tl.constexpr):
    """The refresh's solve, for the slots due only (the scores launch's list, ``window.list_due``):
    program (key head, c) takes the slots of ranks c, c + n, ... and writes, per value head of the
    key head, tinv[b, vh] = (I + M)^{-T} [LP, LP] and decays[b, vh] = (e^{c_j}, e^{g(j, h)}, e^{c_h}
    at 2, 0). A launch of its own, always at ``SOLVE_WARPS``: its registers would otherwise hold
    the scores launch at a third of its occupancy, and one shape for every preset and batch keeps
    the anchor's bits independent of both."""
    after_previous_launch(PDL)
    khead, c = tl.program_id(0), tl.program_id(1)
    j = tl.arange(0, LP)
    vh = khead * RATIO + tl.arange(0, RP)  # the key head's value heads (``mine``: the real ones)
    mine = tl.arange(0, RP) < RATIO
    count = tl.load(due_ptr)
    for it in tl.range(0, ROUNDS, num_stages=1):  # a constant trip count: the interpreter needs one
        r = c + it * tl.num_programs(1)
        if r < count:
            pid_b, row, h = due_slot(due_ptr, slots_ptr, cursors_ptr, r)
            g_c, beta_c = _window_gates(bg_ptr, bbeta_ptr, row, vh, mine, h, HV, L, LP)
            gram = _gram(bk_ptr, bks_ptr, row, khead, h, HK, DK, DKP, L, LP)
            X, ec, es, total = _residual_inverses(g_c, beta_c, h, gram, LP, LEVELS)
            base = (pid_b * HV + vh) * LP  # [RP]
            tl.store(tinv_ptr + (base[:, None, None] + j[None, None, :]) * LP + j[None, :, None], X,
                     mask=mine[:, None, None])  # [i, j] = X[j, i]
            tl.store(decays_ptr + base[:, None] * 3 + j[None, :], ec, mask=mine[:, None])
            tl.store(decays_ptr + base[:, None] * 3 + LP + j[None, :], es, mask=mine[:, None])
            tl.store(decays_ptr + base[:, None] * 3 + 2 * LP + j[None, :],
                     tl.where(j[None, :] == 0, total[:, None], 0.0), mask=mine[:, None])


@triton.jit
def _solved(tinv_ptr, decays_ptr, pid_b, head, HV, LP: tl.constexpr):
    """The solve launch's results for value head ``head`` of batch row ``pid_b``: ((I + M)^{-T}
    [LP, LP], e^{c_j} [LP], e^{g(j, h)} [LP], e^{c_h})."""
    j = tl.arange(0, LP)
    base = (pid_b * HV + head) * LP
    return (tl.load(tinv_ptr + (base + j[:, None]) * LP + j[None, :]), tl.load(decays_ptr + base * 3 + j),
            tl.load(decays_ptr + base * 3 + LP + j), tl.load(decays_ptr + base * 3 + 2 * LP))


@triton.jit
def _solve_here(bk_ptr, bks_ptr, bg_ptr, bbeta_ptr, row, khead, head, h, HK, HV, L: tl.constexpr, LP: tl.constexpr,
                DK: tl.constexpr, DKP: tl.constexpr, LEVELS: tl.constexpr):
    """What ``_solved`` loads, computed by the refreshing program itself (a step of one launch,
    ``StepShape.fused``) for its value head, by the solve launch's operations. The segment sums are
    IEEE products, whose order no layout changes, and the keys' normalizing factors tensor-core
    products (``window._square_norm``): a 2-warp program gives the launches' anchor bits on the GPU,
    a 4-warp one other bits (``launch.FUSED_SHAPE``)."""
    vh = head + tl.arange(0, 1)  # one head
    g_c, beta_c = _window_gates(bg_ptr, bbeta_ptr, row, vh, vh >= 0, h, HV, L, LP)
    gram = _gram(bk_ptr, bks_ptr, row, khead, h, HK, DK, DKP, L, LP)
    X, ec, es, total = _residual_inverses(g_c, beta_c, h, gram, LP, LEVELS)
    return tl.trans(tl.reshape(X, (LP, LP))), tl.reshape(ec, (LP,)), tl.reshape(es, (LP,)), tl.sum(total, 0)


@triton.jit
def _gdn_refresh_rows(pid_b, head, khead, row, h, r0, seeds_ptr, tokens_ptr, Tinv, ec, es, total,
                      av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, bk_ptr, bks_ptr, bv_ptr, bbeta_ptr, HV, HK,
                      L: tl.constexpr, LP: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
                      BV: tl.constexpr, FR: tl.constexpr, KC: tl.constexpr, A_FMT: tl.constexpr, A_SR: tl.constexpr,
                      R_FMT: tl.constexpr, R_SR: tl.constexpr, SHARED: tl.constexpr, STAGES: tl.constexpr,
                      READ_AFTER: tl.constexpr):
    """Refresh rows r0 .. r0 + BV of value head ``head`` of storage row ``row`` (h committed
    entries, batch row ``pid_b``), FR rows at a time: the residual solve and fold of the module
    docstring, then the encode of KC columns at a time (the last pass of each masked from column
    DK on). Tinv, ec, es, total: the head's solve (``_solved`` or ``_solve_here``)."""
    mat = row * HV + head
    j = tl.arange(0, LP)
    old = j < h
    buf_tok = row * L + j
    beta_c = tl.load(bbeta_ptr + buf_tok * HV + head, mask=old, other=0.0)
    seed = tl.load(seeds_ptr + row)
    tokens = tl.load(tokens_ptr + row)
    SKC: tl.constexpr = 32 if DKP >= 32 else DKP
    for f in tl.static_range(BV // FR):
        rv = r0 + f * FR + tl.arange(0, FR)
        gidx = mat * (DV // FR) + (r0 + f * FR) // FR  # NVFP4: FR is the row block, one global scale
        V_c = tl.load(bv_ptr + (buf_tok[None, :] * HV + head) * DV + rv[:, None], mask=old[None, :],
                      other=0.0).to(tl.float32)  # [FR, LP]
        # products with the keys as buffered (exact tensor-core operands when 16-bit,
        # ``exact_b_products``), their normalizing factors applied to the other side
        SK = tl.zeros((FR, LP), dtype=tl.float32)  # S_anchor k_j / k_scale_j
        for c in tl.range(0, (DK + SKC - 1) // SKC, num_stages=STAGES):  # a loop, not unrolled: registers
            cols = c * SKC + tl.arange(0, SKC)
            K_part = window_raw_keys(bk_ptr, row, khead, h, cols, HK, DK, L, LP)
            S_part = load_tile(av_ptr, as_ptr, ag_ptr, mat, gidx, rv, cols, DV, DK, A_FMT)
            SK = exact_b_products(S_part, tl.trans(K_part), SK)
        k_scale = window_key_scales(bks_ptr, row, khead, h, HK, L, LP)  # loaded here, not held: registers
        R = tl.where(old[None, :], beta_c[None, :] * (V_c - ec[None, :] * (SK * k_scale[None, :])), 0.0)
        # residuals, decayed to the end and times their keys' normalizing factors
        U = tl.dot(R, Tinv, input_precision="tf32x3") * (es * k_scale)[None, :]
        for c in tl.range(0, (DK + KC - 1) // KC, num_stages=STAGES):  # a loop, not unrolled: registers
            cols = c * KC + tl.arange(0, KC)
            K_part = window_raw_keys(bk_ptr, row, khead, h, cols, HK, DK, L, LP)
            S = load_tile(av_ptr, as_ptr, ag_ptr, mat, gidx, rv, cols, DV, DK, A_FMT) * total
            S = exact_b_products(U, K_part, S)
            write_checkpoint(S, av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, mat, gidx, head, rv, cols, seed,
                             tokens, DV, DK, A_FMT, A_SR, R_FMT, R_SR, SHARED or READ_AFTER)
        if READ_AFTER:
            read_copy_from_anchor(av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, mat, gidx, head, rv, seed, tokens,
                                  DV, DK, DKP, A_FMT, R_FMT, R_SR)


@triton.jit
def _gdn_refresh_kernel(slots_ptr, cursors_ptr, tokens_ptr, seeds_ptr, tinv_ptr, decays_ptr, av_ptr, as_ptr, ag_ptr,
                        rv_ptr, rs_ptr, rg_ptr, bk_ptr, bks_ptr, bv_ptr, bbeta_ptr, bg_ptr, due_ptr, HV, HK,
                        T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr,
                        DKP: tl.constexpr, FR: tl.constexpr, KC: tl.constexpr, A_FMT: tl.constexpr, A_SR: tl.constexpr,
                        R_FMT: tl.constexpr, R_SR: tl.constexpr, SHARED: tl.constexpr, STAGES: tl.constexpr,
                        READ_AFTER: tl.constexpr, ROUNDS: tl.constexpr, SOLVE_HERE: tl.constexpr,
                        LEVELS: tl.constexpr, PDL: tl.constexpr):
    """The refresh in a launch of its own (``StepShape.split``): program (v, head, c) refreshes FR
    rows of value head ``head`` of the slots due of ranks c, c + n, ... in the list the scores launch
    made (``window.list_due``; n programs per tile, ``launch.refresh_grid``). SOLVE_HERE: each
    program solves its head's system itself (``_solve_here``), with no solve launch before."""
    after_previous_launch(PDL)
    pid_v, head, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(due_ptr)
    for it in tl.range(0, ROUNDS, num_stages=1):  # a constant trip count: the interpreter needs one
        r = c + it * tl.num_programs(2)
        if r < count:
            pid_b, row, h = due_slot(due_ptr, slots_ptr, cursors_ptr, r)
            khead = head // (HV // HK)
            if SOLVE_HERE:
                Tinv, ec, es, total = _solve_here(bk_ptr, bks_ptr, bg_ptr, bbeta_ptr, row, khead, head, h, HK, HV, L,
                                                  LP, DK, DKP, LEVELS)
            else:
                Tinv, ec, es, total = _solved(tinv_ptr, decays_ptr, pid_b, head, HV, LP)
            _gdn_refresh_rows(pid_b, head, khead, row, h, pid_v * FR, seeds_ptr, tokens_ptr, Tinv, ec,
                              es, total, av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, bk_ptr, bks_ptr, bv_ptr,
                              bbeta_ptr, HV, HK, L, LP, DV, DK, DKP, FR, FR, KC, A_FMT, A_SR, R_FMT, R_SR, SHARED,
                              STAGES, READ_AFTER)


@triton.jit
def _token_loads(q_ptr, k_ptr, v_ptr, svb, svt, svh, sve, beta_ptr, sbb, sbt, sbh, scores_ptr, bv_ptr, pid_b, head,
                 khead, rv, HV, HK, T: tl.constexpr, LP: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr,
                 DKP: tl.constexpr, R_FMT: tl.constexpr, OUTPUT_DOT: tl.constexpr):
    """The new tokens' inputs to a step program, all issued at once: a tuple indexed by s of (v_s
    rounded to the buffer dtype [BV], beta_s, the scores launch's weights on the window for k_s [LP]
    and for q_s [LP] (value head ``head`` of HV), then k_s and q_s (key head ``khead`` of HK) as
    ``load_query`` gives them, zeros with OUTPUT_DOT). v [b, T, HV, DV] and beta [b, T, HV] of
    strides sv*, sb*; q, k the prepared, contiguous ones [b, T, HK, DK]."""
    j = tl.arange(0, LP)
    tokens_in = ()
    for s in tl.static_range(T):
        tok_in = pid_b * T + s
        base = ((pid_b * HV + head) * 2 * T + s) * LP
        ka, kb, qa, qb = 0.0, 0.0, 0.0, 0.0
        if not OUTPUT_DOT:
            ka, kb = load_query(k_ptr + (tok_in * HK + khead) * DK, 1, DK, DKP, R_FMT)
            qa, qb = load_query(q_ptr + (tok_in * HK + khead) * DK, 1, DK, DKP, R_FMT)
        v_s = as_stored(tl.load(v_ptr + pid_b * svb + s * svt + head * svh + rv * sve),
                        bv_ptr.dtype.element_ty)
        tokens_in = tokens_in + ((v_s, tl.load(beta_ptr + pid_b * sbb + s * sbt + head * sbh),
                                  tl.load(scores_ptr + base + T * LP + j),
                                  tl.load(scores_ptr + base + j), ka, kb, qa, qb),)
    return tokens_in


@triton.jit
def _fused_loads(q_ptr, sqb, sqt, sqh, sqe, k_ptr, skb, skt, skh, ske, v_ptr, svb, svt, svh, sve, beta_ptr, sbb,
                 sbt, sbh, g_ptr, sgb, sgt, sgh, alog_ptr, s_alog, dtb_ptr, s_dtb, rv_ptr, rs_ptr, rg_ptr, bk_ptr,
                 bks_ptr, bg_ptr, bu_ptr, pid_v, pid_b, row, head, HV, HK, T: tl.constexpr, L: tl.constexpr,
                 LP: tl.constexpr, BV: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
                 R_FMT: tl.constexpr, OUTPUT_DOT: tl.constexpr, GATE: tl.constexpr, HAS_DTB: tl.constexpr):
    """A step of one launch (``StepShape.fused``): every load of program (pid_v, value head ``head``)
    on batch row ``pid_b`` (storage row ``row``) that does not wait for the slot's committed count,
    issued before the program takes its cursor (``window.fused_item``): the read copy
    (``load_read``; none when its products are streamed), the whole window of the buffered fields
    (``window.whole_window``; the residuals as [BV, LP]), the caller's q, k [b, T, HK, K], v [b, T,
    HV, V], g, beta [b, T, HV] (GATE: a, b, A_log, dt_bias) read through their strides; any
    arithmetic on them waits for them, so it comes after (``_prepared_tokens``). A tuple: (read
    copy values_a, values_b, scale, the rest for ``_prepared_tokens``)."""
    j = tl.arange(0, LP)
    ck = tl.arange(0, DKP)
    rv = pid_v * BV + tl.arange(0, BV)
    vh = head + tl.arange(0, 1)  # the program's value head, as a batch of one for the window helpers
    khead = head // (HV // HK)
    kh = khead + tl.arange(0, 1)
    one = tl.arange(0, 1)
    mat = row * HV + head
    if OUTPUT_DOT:
        ra, rb, rsc = 0.0, 0.0, 0.0
    else:
        ra, rb, rsc = load_read(rv_ptr, rs_ptr, rg_ptr, mat, global_scale_index(mat, pid_v * BV, BV, DV), rv, DV, DK,
                                DKP, R_FMT)
    U = tl.load(bu_ptr + ((row * L + j[None, :]) * HV + head) * DV + rv[:, None], mask=(j < L)[None, :], other=0.0)
    windows = (whole_window(bk_ptr, row, j, kh, ck, HK, DK, L), whole_window(bks_ptr, row, j, kh, one, HK, 1, L),
               whole_window(bg_ptr, row, j, vh, one, HV, 1, L), whole_window(bg_ptr, row, j + 1, vh, one, HV, 1, L))
    values, gates, betas, keys, queries = (), (), (), (), ()
    for s in tl.static_range(T):
        values = values + (tl.load(v_ptr + pid_b * svb + s * svt + head * svh + rv * sve),)
        gates = gates + (tl.load(g_ptr + pid_b * sgb + s * sgt + vh * sgh),)
        betas = betas + (tl.load(beta_ptr + pid_b * sbb + s * sbt + head * sbh),)
    for s in tl.static_range(T):
        cols = within(ck, DK)
        keys = keys + (tl.load(k_ptr + pid_b * skb + s * skt + khead * skh + ck * ske, mask=cols, other=0.0),)
        queries = queries + (tl.load(q_ptr + pid_b * sqb + s * sqt + khead * sqh + ck * sqe, mask=cols, other=0.0),)
    gating = 0.0, 0.0
    if GATE:
        gating = tl.load(alog_ptr + vh * s_alog), tl.load(dtb_ptr + vh * s_dtb) if HAS_DTB else 0.0
    return ra, rb, rsc, (U, windows, values, gates, betas, keys, queries, gating)


@triton.jit
def _prepared_tokens(loaded, bk_ptr, bks_ptr, bg_ptr, bbeta_ptr, bv_ptr, ks_ptr, gn_ptr, betan_ptr, kn_ptr, qn_ptr,
                     parents_ptr, scale, pid_v, pid_b, valid, row, h, need, head, khead, HV, HK, T: tl.constexpr,
                     L: tl.constexpr, LP: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, R_FMT: tl.constexpr,
                     NORM: tl.constexpr, GATE: tl.constexpr, HAS_DTB: tl.constexpr, TREE: tl.constexpr,
                     OUTPUT_DOT: tl.constexpr):
    """A step of one launch (``StepShape.fused``): the scores launch's work for the program's own
    value head, by the same operations (``_gdn_scores_kernel``), from ``_fused_loads``' tuple
    ``loaded`` (its last field) and the cursor h. Returns ``_token_loads``' tuple, the gammas
    e^{c_t} by token and the window's residuals [BV, LP] (zero from entry h on). Programs of row
    block 0 also store the new tokens' shared fields (keys and their normalizing factors by the
    first value head of each key head, gates and betas by each): where the slot does not refresh,
    straight into the buffer at h .. h + T - 1, where no program of the launch reads them
    (``launch.advance_row``, DIRECT); where it does, what the batch row's last program copies into
    the buffer after the folds: each key's normalizing factor into ks [b, T, HK], and with GATE
    the gates into gn, betan [b, T, HV] fp32. OUTPUT_DOT: the
    prepared keys and queries go to kn, qn [b, T, HK, DK] fp32 for ``streamed_products`` (every
    program of a key head stores the same bits; the caller waits on its threads' stores), and
    the tuple's keys and queries are zeros."""
    U, windows, raw_values, raw_gates, raw_betas, raw_keys, raw_queries, gating = loaded
    j = tl.arange(0, LP)
    ck = tl.arange(0, DKP)
    vh = head + tl.arange(0, 1)
    later, direct = (pid_v == 0) & need, (pid_v == 0) & valid & (need == 0)  # the fields' writers
    first = head % (HV // HK) == 0  # of its key head
    U = tl.where((j < h)[None, :], U, 0.0)
    values, gates, betas = (), (), ()
    for s in tl.static_range(T):
        values = values + (as_stored(raw_values[s], bv_ptr.dtype.element_ty),)
        tok = pid_b * T + s
        if GATE:
            x = raw_gates[s].to(tl.float32)
            if HAS_DTB:
                x += gating[1].to(tl.float32)
            gate = -tl.exp(gating[0].to(tl.float32)) * softplus(x)
            beta = tl.sigmoid(raw_betas[s].to(tl.float32))
            tl.store(gn_ptr + tok * HV + vh, gate, mask=later)
            tl.store(betan_ptr + tok * HV + head, beta, mask=later)
            stored_gate, stored_beta = gate, beta
        else:
            gate = raw_gates[s].to(tl.float32)
            beta = raw_betas[s]
            stored_gate, stored_beta = raw_gates[s], beta
        entry = row * L + h + s
        tl.store(bg_ptr + entry * HV + vh, as_stored(stored_gate, bg_ptr.dtype.element_ty), mask=direct)
        tl.store(bbeta_ptr + entry * HV + head, as_stored(stored_beta, bbeta_ptr.dtype.element_ty), mask=direct)
        tl.store(bk_ptr + (entry * HK + khead) * DK + ck, as_stored(raw_keys[s], bk_ptr.dtype.element_ty),
                 mask=direct & first & (ck < DK))
        gates = gates + (gate,)
        betas = betas + (beta,)
    G = committed_head_window(windows[2], gates, h, j, T)
    G_next = committed_head_window(windows[3], gates, h, j + 1, T)
    keys, queries = (), ()
    for s in tl.static_range(T):
        tok = pid_b * T + s
        k, k_scale, q = key_query_norms(as_stored(raw_keys[s], bk_ptr.dtype.element_ty).to(tl.float32),
                                        raw_queries[s].to(tl.float32), bk_ptr.dtype.element_ty, NORM)
        tl.store(ks_ptr + tok * HK + khead, k_scale, mask=later & first)
        tl.store(bks_ptr + (row * L + h + s) * HK + khead, as_stored(k_scale, bks_ptr.dtype.element_ty),
                 mask=direct & first)
        k, q = k * k_scale, q * scale
        if OUTPUT_DOT:
            tl.store(kn_ptr + (tok * HK + khead) * DK + ck, k, mask=ck < DK)
            tl.store(qn_ptr + (tok * HK + khead) * DK + ck, q, mask=ck < DK)
        keys = keys + (k,)
        queries = queries + (q,)
    # ``window_keys``: the buffered keys times their normalizing factors, the committed ones
    old = (j < h)[:, None]
    K = tl.where(old, tl.reshape(windows[0], (LP, DKP)), 0.0).to(tl.float32) * tl.where(
        old, tl.reshape(windows[1], (LP, 1)), 0.0)
    for n in tl.static_range(T):  # the new keys at positions h + n
        K = tl.where((j == h + n)[:, None], keys[n][None, :], K)
    anc = ancestor_bits(parents_ptr, pid_b, valid, T) if TREE else 0
    tokens_in, gammas = (), ()
    for s in tl.static_range(T):
        path, path_next = draft_paths(anc, h, s, LP, TREE)  # j <= h + s for a chain
        decay, gamma = path_decays(G, G_next, path, path_next)
        decay = tl.sum(decay, 0)  # [LP]: the one head's
        to_q = decay * tl.sum(K * queries[s][None, :], 1)
        to_k = tl.where(j < h + s, decay, 0.0) * tl.sum(K * keys[s][None, :], 1)
        ka, kb, qa, qb = 0.0, 0.0, 0.0, 0.0
        if not OUTPUT_DOT:
            ka, kb = as_query(keys[s], R_FMT)
            qa, qb = as_query(queries[s], R_FMT)
        tokens_in = tokens_in + ((values[s], betas[s], to_k, to_q, ka, kb, qa, qb),)
        gammas = gammas + (tl.sum(gamma, 0),)
    return tokens_in, gammas, U


@triton.jit
def _new_tokens(tokens_in, gammas, U, rv_ptr, rs_ptr, rg_ptr, ra, rb, rsc, k_ptr, q_ptr, o_ptr, bv_ptr, bu_ptr, mat, gidx,
                rv, pid_b, valid, row, h, head, khead, HV, HK, T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr,
                DV: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, R_FMT: tl.constexpr, OUTPUT_DOT: tl.constexpr,
                QP: tl.constexpr, STREAM: tl.constexpr, PIN: tl.constexpr, DECAYED: tl.constexpr):
    """The read path of a step program over rows ``rv`` of value head ``head`` (GDN's and KDA's):
    each new token's residual and output from the read copy (``ra, rb, rsc`` as ``load_read`` gave
    them, or with OUTPUT_DOT streamed through tensor-core products with k, q [b, T, HK, DK] of key
    head ``khead``) and the window's residuals U [BV, LP] (h committed), in token order; the
    outputs into o [b, T, HV, DV], v_s and u_s into the buffer. ``tokens_in``: ``_token_loads``'
    tuple; DECAYED: the read-copy products times ``gammas`` (GDN's e^{c_t}; KDA's decays are in
    its prepared keys and queries)."""
    j = tl.arange(0, LP)
    if PIN:
        pin_vector_width(rv_ptr, mat, rv, tl.arange(0, DKP), h < 0, DV, DK, PIN)
    if OUTPUT_DOT:  # every S_read k_s and S_read q_s of the step in one product; columns k_0..k_{T-1}, q_0..q_{T-1}
        KB: tl.constexpr = 32 if DKP >= 32 else DKP  # one fp8 scale block (two NVFP4 ones), or the padded row
        SQ = streamed_products(rv_ptr, rs_ptr, rg_ptr, mat, gidx, rv, k_ptr, q_ptr, pid_b, khead,
                               T * HK * DK, HK * DK, DK, 1, T, 2 * T, DV, DK, R_FMT, QP, KB, STREAM)
    for s in tl.static_range(T):
        t = h + s
        tok_in = pid_b * T + s
        tok_buf = row * L + t
        v_s, beta_s, to_k, to_q, ka, kb, qa, qb = tokens_in[s]
        # residual u_s = beta_s (v_s - alpha_s S_{t-1} k_s), with S_{t-1} (the parent's state) never formed
        if OUTPUT_DOT:
            Sk_read = column(SQ, s)
        else:
            Sk_read = matvec(ra, rb, rsc, ka, kb, R_FMT)
        if DECAYED:
            Sk_read = gammas[s] * Sk_read
        u_s = beta_s * (v_s.to(tl.float32) - Sk_read - tl.sum(U * to_k[None, :], 1))
        U = tl.where(j[None, :] == t, u_s[:, None], U)
        # output o_s = S_t q_s = gamma_t S_read q_s + sum_{j <= t} gamma_{j+1:t} (k_j . q_s) u_j
        if OUTPUT_DOT:
            Sq_read = column(SQ, T + s)
        else:
            Sq_read = matvec(ra, rb, rsc, qa, qb, R_FMT)
        if DECAYED:
            Sq_read = gammas[s] * Sq_read
        o = Sq_read + tl.sum(U * to_q[None, :], 1)
        tl.store(o_ptr + (tok_in * HV + head) * DV + rv, tl.where(valid, o, 0.0).to(o_ptr.dtype.element_ty))
        tl.store(bv_ptr + (tok_buf * HV + head) * DV + rv, v_s)  # rows only this program reads
        tl.store(bu_ptr + (tok_buf * HV + head) * DV + rv, u_s)


@triton.jit
def _gdn_step_program(
        pid_v, head, pid_b, valid, row, h, need, early,
        slots_ptr, cursors_ptr, tokens_ptr, seeds_ptr, tinv_ptr, decays_ptr,
        av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr,
        bk_ptr, bks_ptr, bv_ptr, bbeta_ptr, bu_ptr,
        q_ptr, k_ptr, v_ptr, svb, svt, svh, sve, beta_ptr, sbb, sbt, sbh, scores_ptr, gammas_ptr, o_ptr, HV, HK,
        sqb, sqt, sqh, sqe, skb, skt, skh, ske, g_ptr, sgb, sgt, sgh, alog_ptr, s_alog, dtb_ptr, s_dtb, bg_ptr,
        ks_ptr, gn_ptr, betan_ptr, kn_ptr, qn_ptr, parents_ptr, scale,
        T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr,
        DV: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, BV: tl.constexpr, FR: tl.constexpr,
        KC: tl.constexpr, A_FMT: tl.constexpr, A_SR: tl.constexpr, R_FMT: tl.constexpr, R_SR: tl.constexpr,
        SHARED: tl.constexpr, OUTPUT_DOT: tl.constexpr, QP: tl.constexpr, STREAM: tl.constexpr,
        PIN: tl.constexpr, REFRESH: tl.constexpr, STAGES: tl.constexpr, READ_AFTER: tl.constexpr,
        FUSED: tl.constexpr, NORM: tl.constexpr, GATE: tl.constexpr, HAS_DTB: tl.constexpr, TREE: tl.constexpr,
        LEVELS: tl.constexpr, SOLVE_HERE: tl.constexpr):
    """Rows pid_v BV .. (pid_v + 1) BV of value head ``head`` of batch row ``pid_b`` (storage row
    ``row``, h committed entries, ``need``: due to refresh, folded here first when REFRESH). FUSED
    (a step of one launch): the program solves its own refresh (``_solve_here``) and prepares its
    own inputs (``_prepared_tokens``: q, k, g, beta the caller's, of strides sq*, sk*, sg*, sb*, from
    ``early``, ``_fused_loads``);
    else the solve and scores launches' results (``_solved``, ``_token_loads``: q, k prepared)."""
    khead = head // (HV // HK)
    mat = row * HV + head
    gidx = global_scale_index(mat, pid_v * BV, BV, DV)  # NVFP4: the global scales of these rows
    rv = pid_v * BV + tl.arange(0, BV)
    j = tl.arange(0, LP)
    if FUSED:
        ra, rb, rsc, loaded = early
    if REFRESH:
        if need:  # refresh: re-solve the committed residuals from the anchor, fold, encode
            if FUSED or SOLVE_HERE:
                Tinv, ec, es, total = _solve_here(bk_ptr, bks_ptr, bg_ptr, bbeta_ptr, row, khead, head, h, HK, HV, L,
                                                  LP, DK, DKP, LEVELS)
            else:
                Tinv, ec, es, total = _solved(tinv_ptr, decays_ptr, pid_b, head, HV, LP)
            _gdn_refresh_rows(pid_b, head, khead, row, h, pid_v * BV, seeds_ptr, tokens_ptr, Tinv, ec, es, total,
                              av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, bk_ptr, bks_ptr, bv_ptr, bbeta_ptr, HV,
                              HK, L, LP, DV, DK, DKP, BV, FR, KC, A_FMT, A_SR, R_FMT, R_SR, SHARED, STAGES, READ_AFTER)
            tl.debug_barrier()  # the rows just stored are read back below by other threads of the program
            if FUSED:  # again, after the rows just folded: nothing loaded before is live in this branch
                ra, rb, rsc, loaded = _fused_loads(
                    q_ptr, sqb, sqt, sqh, sqe, k_ptr, skb, skt, skh, ske, v_ptr, svb, svt, svh, sve, beta_ptr, sbb,
                    sbt, sbh, g_ptr, sgb, sgt, sgh, alog_ptr, s_alog, dtb_ptr, s_dtb, rv_ptr, rs_ptr, rg_ptr, bk_ptr,
                    bks_ptr, bg_ptr, bu_ptr, pid_v, pid_b, row, head, HV, HK, T, L, LP, BV, DV, DK, DKP, R_FMT,
                    OUTPUT_DOT, GATE, HAS_DTB)
    h = tl.where(need, 0, h)  # after a refresh only the new tokens are in the window
    if FUSED:
        tokens_in, gammas, U = _prepared_tokens(loaded, bk_ptr, bks_ptr, bg_ptr, bbeta_ptr, bv_ptr, ks_ptr, gn_ptr,
                                                betan_ptr, kn_ptr, qn_ptr, parents_ptr, scale, pid_v, pid_b, valid, row,
                                                h, need, head, khead, HV, HK, T, L, LP, DK, DKP, R_FMT, NORM, GATE,
                                                HAS_DTB, TREE, OUTPUT_DOT)
        if OUTPUT_DOT:  # the products read the keys and queries just stored, by other threads too
            tl.debug_barrier()
            k_ptr, q_ptr = kn_ptr, qn_ptr
    else:
        # the read copy in its own layout (the anchor itself when shared; never whole when its products
        # are streamed), then everything else a program reads, all issued before any arithmetic
        if OUTPUT_DOT:
            ra, rb, rsc = 0.0, 0.0, 0.0
        else:
            ra, rb, rsc = load_read(rv_ptr, rs_ptr, rg_ptr, mat, gidx, rv, DV, DK, DKP, R_FMT)
        # the window's cached read-path residuals [BV, LP]
        U = tl.load(bu_ptr + ((row * L + j[None, :]) * HV + head) * DV + rv[:, None], mask=(j < h)[None, :],
                    other=0.0)
        tokens_in = _token_loads(q_ptr, k_ptr, v_ptr, svb, svt, svh, sve, beta_ptr, sbb, sbt, sbh, scores_ptr,
                                 bv_ptr, pid_b, head, khead, rv, HV, HK, T, LP, DV, DK, DKP, R_FMT, OUTPUT_DOT)
        gammas = ()
        for s in tl.static_range(T):
            gammas = gammas + (tl.load(gammas_ptr + (pid_b * HV + head) * T + s),)
    _new_tokens(tokens_in, gammas, U, rv_ptr, rs_ptr, rg_ptr, ra, rb, rsc, k_ptr, q_ptr, o_ptr, bv_ptr, bu_ptr, mat,
                gidx, rv, pid_b, valid, row, h, head, khead, HV, HK, T, L, LP, DV, DK, DKP, R_FMT, OUTPUT_DOT, QP,
                STREAM, PIN, True)


@triton.jit
def _gdn_step_kernel(slots_ptr, cursors_ptr, tokens_ptr, seeds_ptr, tinv_ptr, decays_ptr, av_ptr, as_ptr, ag_ptr,
                     rv_ptr, rs_ptr, rg_ptr, bk_ptr, bks_ptr, bv_ptr, bbeta_ptr, bu_ptr, q_ptr, k_ptr, v_ptr,
                     svb: tl.constexpr, svt: tl.constexpr, svh: tl.constexpr, sve: tl.constexpr, beta_ptr,
                     sbb: tl.constexpr, sbt: tl.constexpr, sbh: tl.constexpr, scores_ptr, gammas_ptr, o_ptr, due_ptr,
                     SCRATCH, HV, HK, sqb: tl.constexpr, sqt: tl.constexpr, sqh: tl.constexpr, sqe: tl.constexpr,
                     skb: tl.constexpr, skt: tl.constexpr, skh: tl.constexpr, ske: tl.constexpr, g_ptr,
                     sgb: tl.constexpr, sgt: tl.constexpr, sgh: tl.constexpr, alog_ptr, s_alog: tl.constexpr, dtb_ptr,
                     s_dtb: tl.constexpr, bg_ptr, ks_ptr, gn_ptr, betan_ptr, kn_ptr, qn_ptr, parents_ptr, gaps_ptr,
                     scale,
                     committed_ptr, pending_ptr, refreshes_ptr, done_ptr, s1,
                     s1b: tl.constexpr, s1t: tl.constexpr, s1h: tl.constexpr, s1e: tl.constexpr, d1, s2,
                     s2b: tl.constexpr, s2t: tl.constexpr, s2h: tl.constexpr, s2e: tl.constexpr, d2, s3,
                     s3b: tl.constexpr, s3t: tl.constexpr, s3h: tl.constexpr, s3e: tl.constexpr, d3, s4,
                     s4b: tl.constexpr, s4t: tl.constexpr, s4h: tl.constexpr, s4e: tl.constexpr, d4,
                     T: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr,
                     DKP: tl.constexpr, BV: tl.constexpr, FR: tl.constexpr, KC: tl.constexpr,
                     A_FMT: tl.constexpr, A_SR: tl.constexpr, R_FMT: tl.constexpr, R_SR: tl.constexpr,
                     SHARED: tl.constexpr, OUTPUT_DOT: tl.constexpr, QP: tl.constexpr, STREAM: tl.constexpr,
                     PIN: tl.constexpr, REFRESH: tl.constexpr, STAGES: tl.constexpr, READ_AFTER: tl.constexpr,
                     DUE: tl.constexpr, ROUNDS: tl.constexpr, COMMIT: tl.constexpr, F1: tl.constexpr, F1P: tl.constexpr,
                     W1: tl.constexpr, F2: tl.constexpr, F2P: tl.constexpr, W2: tl.constexpr, F3: tl.constexpr,
                     F3P: tl.constexpr, W3: tl.constexpr, F4: tl.constexpr, F4P: tl.constexpr,
                     W4: tl.constexpr, FUSED: tl.constexpr, NORM: tl.constexpr, GATE: tl.constexpr,
                     HAS_DTB: tl.constexpr, TREE: tl.constexpr, MAXD: tl.constexpr, LEVELS: tl.constexpr,
                     SOLVE_HERE: tl.constexpr,
                     PDL: tl.constexpr):
    """Program (v, head, c). FUSED: the whole step in this one launch (``StepShape.fused``): c is
    the batch row, whose committed count every program reads before the row's last program to
    finish advances it (``advance_row``), each program solving its refresh and preparing its inputs
    itself (``_gdn_step_program``): q, k, g, beta (GATE: a, b, A_log, dt_bias) are the caller's,
    read through their strides (sq*, sk*, sg*, sb*, s_alog, s_dtb), ``parents`` a draft tree
    (TREE; its pending tree stored by program (0, 0, c), ``window.pending_tree``). Otherwise DUE =
    ``launch.EVERY_SLOT``: c is the batch row; ``launch.DUE_FIRST``: batch row due[1 + c], the
    slots due first (``window.list_due``); ``launch.NOT_DUE``:
    the same, but a slot due to refresh is left to a ``launch.DUE_ONLY`` launch; DUE_ONLY: c takes
    the slots due of ranks c, c + n, ... (``window.list_due``, n programs per tile), each refreshed
    (REFRESH) and stepped. The decays of every draft, along its own path for a tree, are in the
    scores launch's weights and gammas, so a tree's step is a chain's. v and beta (the caller's,
    or the scores launch's gates) are read through their strides; q, k are the scores launch's."""
    after_previous_launch(PDL)
    # row blocks vary fastest: programs running side by side stream one slot's contiguous state
    pid_v, head, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(due_ptr) if DUE == 2 else 0
    for it in tl.range(0, ROUNDS, num_stages=1):  # a constant trip count: the interpreter needs one
        if FUSED:  # every load that needs the storage row only, before the cursor (``window.fused_item``)
            valid, row, committed = fused_item(slots_ptr, committed_ptr, c, SCRATCH)
            early = _fused_loads(q_ptr, sqb, sqt, sqh, sqe, k_ptr, skb, skt, skh, ske, v_ptr, svb, svt, svh, sve,
                                 beta_ptr, sbb, sbt, sbh, g_ptr, sgb, sgt, sgh, alog_ptr, s_alog, dtb_ptr, s_dtb,
                                 rv_ptr, rs_ptr, rg_ptr, bk_ptr, bks_ptr, bg_ptr, bu_ptr, pid_v, c, row, head, HV, HK,
                                 T, L, LP, BV, DV, DK, DKP, R_FMT, OUTPUT_DOT, GATE, HAS_DTB)
        else:
            valid, row, committed, early = False, 0, 0, 0
        active, pid_b, valid, row, h, need = program_item(due_ptr, slots_ptr, cursors_ptr, valid, row, committed,
                                                          parents_ptr, gaps_ptr, c, it, count,
                                                          (pid_v == 0) & (head == 0), SCRATCH, T, L, DUE, FUSED,
                                                          TREE, MAXD)
        if active:
            _gdn_step_program(
                pid_v, head, pid_b, valid, row, h, need, early, slots_ptr, cursors_ptr, tokens_ptr, seeds_ptr, tinv_ptr,
                decays_ptr, av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr, bk_ptr, bks_ptr, bv_ptr, bbeta_ptr, bu_ptr,
                q_ptr, k_ptr, v_ptr, svb, svt, svh, sve, beta_ptr, sbb, sbt, sbh, scores_ptr, gammas_ptr, o_ptr, HV, HK,
                sqb, sqt, sqh, sqe, skb, skt, skh, ske, g_ptr, sgb, sgt, sgh, alog_ptr, s_alog, dtb_ptr, s_dtb, bg_ptr,
                ks_ptr, gn_ptr, betan_ptr, kn_ptr, qn_ptr, parents_ptr, scale, T, L, LP, DV, DK, DKP, BV, FR, KC,
                A_FMT, A_SR, R_FMT,
                R_SR, SHARED, OUTPUT_DOT, QP, STREAM, PIN, REFRESH, STAGES, READ_AFTER, FUSED, NORM, GATE, HAS_DTB,
                TREE, LEVELS, SOLVE_HERE)
            counted = need & REFRESH
            if FUSED:  # the last program advances, after every program of the row has read its cursor
                counted = valid
            advance_row(pid_b, valid, row, tl.where(need, 0, h), need, (pid_v == 0) & (head == 0), counted, tokens_ptr,
                        committed_ptr, pending_ptr, refreshes_ptr, done_ptr,
                        s1, s1b, s1t, s1h, s1e, d1, s2, s2b, s2t, s2h, s2e, d2, s3, s3b, s3t, s3h, s3e, d3, s4, s4b,
                        s4t, s4h, s4e, d4, T, L, COMMIT, F1, F1P, W1, F2, F2P, W2, F3, F3P, W3, F4, F4P, W4, FUSED)

#: Warps of every solve launch (``_gdn_solve_kernel``): one shape for every preset and batch.
SOLVE_WARPS = 4


def step(cache, slots, q, k, v, g, beta, scale: float, normalize: bool, commit: bool, o, gate=None, parents=None):
    """One GDN decode (T = 1) or verify step on the Triton backend.

    parents int32/int64 [b, T] (a draft tree, T <= 32) or None (a chain).
    q, k [b, T, HK, K] as given to the public call (L2-normalized here when ``normalize``; q
    times ``scale``); v [b, T, HV, V]; g, beta [b, T, HV]; any float dtypes, any strides (views of
    a packed projection are read in place, ``launch.token_strides``). Writes the outputs
    into o [b, T, HV, V] (contiguous, fp32/fp16/bf16; pads zero). The input preparation happens
    inside the first launch. ``gate``: (a, b [b, T, HV], A_log [HV], dt_bias [HV] or None) instead
    of g and beta (both None), the gates computed in the first launch.
    """
    b, T, HV, V = v.shape
    HK, K = cache.num_k_heads, cache.head_k_dim
    dev = v.device
    anchor, read, consts = launch.format_args(cache)
    strides, head_stride = launch.token_strides, launch.head_stride
    if gate is not None:
        a, bg, A_log, dt_bias = gate
        g = torch.empty(a.shape, dtype=torch.float32, device=dev)
        beta = torch.empty_like(g)
        gate_args = (a, *strides(a)[:3], bg, *strides(bg)[:3], A_log, head_stride(A_log),
                     A_log if dt_bias is None else dt_bias, head_stride(dt_bias), g, beta)
    else:  # never read (GATE off)
        gate_args = (g, *strides(g)[:3], beta, *strides(beta)[:3], g, 0, g, 0, g, beta)
    shape = launch.step_shape(cache, "gdn", T, b)
    buf = cache.buffer
    LP, DKP = launch.window_pad(cache), launch.column_pad(cache)
    k_scale = torch.empty(q.shape[:3], dtype=torch.float32, device=dev)
    cursors = torch.empty(b, dtype=cache.committed.dtype, device=dev)
    tree = cursors if parents is None else parents.contiguous()
    FR, KC = min(launch.FOLD_ROWS, shape.rows), launch.refresh_columns(cache, "gdn")
    read_after = launch.read_copy_after_fold(cache)
    advanced, advance_consts = launch.advance_args(cache, commit, {"k": k, "k_scale": k_scale, "g": g, "beta": beta})
    tokens_consts = dict(NORM=normalize, GATE=gate is not None, HAS_DTB=gate is not None and gate[3] is not None,
                         TREE=parents is not None, MAXD=cache.max_draft)
    step_consts = dict(T=T, L=cache.window, LP=LP, DV=V, DK=K, DKP=DKP, BV=shape.rows, FR=FR, KC=KC,
                       OUTPUT_DOT=shape.output_dot, QP=max(16, triton.next_power_of_2(2 * T)), STREAM=shape.stream,
                       PIN=shape.pin, STAGES=shape.stages, READ_AFTER=read_after,
                       LEVELS=launch.inverse_levels(LP), SOLVE_HERE=shape.solve_here,
                       num_warps=shape.warps, **consts, **advance_consts, **tokens_consts)
    extra = launch.register_cap(shape.maxnreg)
    if shape.fused:  # one launch: every program prepares its own inputs, and solves its own refresh
        if gate is not None:  # the raw gates in place of g and beta; g and beta are the advance's copies
            g_in, beta_in, alog, dtb = a, bg, A_log, dt_bias
        else:
            g_in, beta_in, alog, dtb = g, beta, None, None
        unused = cursors  # the other launches' results: never read
        # with output_dot, the prepared keys and queries that the programs' products read back
        kn, qn = (torch.empty(q.shape, dtype=torch.float32, device=dev) for _ in range(2)) if shape.output_dot \
            else (unused, unused)
        step_args = (slots, unused, cache.tokens, cache.seeds, unused, unused, *anchor, *read, buf["k"], buf["k_scale"],
                     buf["v"], buf["beta"], buf["u"], q, k, v, *strides(v), beta_in, *strides(beta_in)[:3], unused,
                     unused, o, unused, cache.scratch_row, HV, HK, *strides(q), *strides(k), g_in, *strides(g_in)[:3],
                     g_in if alog is None else alog, head_stride(alog), g_in if dtb is None else dtb, head_stride(dtb),
                     buf["g"], k_scale, g, beta, kn, qn, tree, cache.draft_gaps, float(scale), *advanced)
        assert not shape.beside and not shape.split
        launch.run(_gdn_step_kernel, (V // shape.rows, HV, b), *step_args, REFRESH=True, DUE=launch.EVERY_SLOT,
                   ROUNDS=1, FUSED=True, **extra, **step_consts)
        return o
    scores = torch.empty(b, HV, 2, T, LP, dtype=torch.float32, device=dev)
    gammas = torch.empty(b, HV, T, dtype=torch.float32, device=dev)
    kn = torch.empty(q.shape, dtype=torch.float32, device=dev)
    qn = torch.empty_like(kn)
    tinv = torch.empty(b, HV, LP, LP, dtype=torch.float32, device=dev)
    decays = torch.empty(b, HV, 3, LP, dtype=torch.float32, device=dev)
    due = torch.empty(b + 1, dtype=torch.int32, device=dev)
    launch.run(_gdn_scores_kernel, (b, HK), slots, cache.committed, cursors, buf["k"], buf["k_scale"], k, *strides(k),
               q, *strides(q), kn, k_scale, qn, scores, *gate_args, buf["g"], g, *strides(g)[:3], gammas, due, tree,
               cache.draft_gaps, float(scale), cache.scratch_row, b, HK, HV, T=T, L=cache.window, LP=LP, DK=K,
               DKP=DKP, RATIO=HV // HK, RP=triton.next_power_of_2(HV // HK), num_warps=shape.scores_warps,
               **tokens_consts, **launch.due_scan(b, True))
    programs, rounds = launch.refresh_grid(b, T, cache.window)
    solve = (slots, cursors, due, buf["k"], buf["k_scale"], buf["g"], buf["beta"], tinv, decays, HK, HV)
    solve_consts = dict(L=cache.window, LP=LP, DK=K, DKP=DKP, RATIO=HV // HK, RP=triton.next_power_of_2(HV // HK),
                        LEVELS=launch.inverse_levels(LP), ROUNDS=rounds, num_warps=SOLVE_WARPS)
    refresh_args = (slots, cursors, cache.tokens, cache.seeds, tinv, decays, *anchor, *read,
                    buf["k"], buf["k_scale"], buf["v"], buf["beta"], buf["g"], due, HV, HK)
    refresh_consts = dict(T=T, L=cache.window, LP=LP, DV=V, DK=K, DKP=DKP, FR=FR, KC=KC, STAGES=shape.stages,
                          READ_AFTER=read_after, ROUNDS=rounds, SOLVE_HERE=shape.solve_here,
                          LEVELS=launch.inverse_levels(LP), num_warps=shape.refresh_warps, **consts,
                          **launch.register_cap(shape.refresh_maxnreg))
    # the scores launch's prepared q, k; the fused-only inputs unused (zero strides: one compile)
    step_args = (slots, cursors, cache.tokens, cache.seeds, tinv, decays, *anchor, *read, buf["k"], buf["k_scale"],
                 buf["v"], buf["beta"], buf["u"], qn, kn, v, *strides(v), beta, *strides(beta)[:3], scores, gammas, o,
                 due, cache.scratch_row, HV, HK, *[0] * 8, g, 0, 0, 0, g, 0, g, 0, buf["g"], k_scale, g, beta, kn, qn,
                 tree, cache.draft_gaps, float(scale), *advanced)
    due_work = [] if shape.solve_here else [(_gdn_solve_kernel, (HK, programs), solve, solve_consts)]
    if shape.split:
        due_work.append((_gdn_refresh_kernel, (V // FR, HV, programs), refresh_args, refresh_consts))
    launch.step_launches(_gdn_step_kernel, (V // shape.rows, HV), b, shape, programs, rounds, step_args,
                         dict(step_consts, FUSED=False, NORM=False, GATE=False, HAS_DTB=False, TREE=False, MAXD=1),
                         extra, due_work)
    return o
