"""Gated DeltaNet ReplaySSM Triton kernel: fused refresh + output-only decode/verify.

One program per (batch row, value head, block of BV state rows); GDN's residual solve is
separable over state rows, so a block of rows needs no other. At a refresh the residuals of
the h committed entries are re-solved from the *anchor* (unit lower-triangular system of
DESIGN §2, forward substitution in registers), folded into S = gamma_h S_anchor + U diag(w) K,
and S is cast independently into anchor and read copy. Outputs then solve only the new tokens'
residuals against the read copy, reuse the cached read-path residuals of committed entries, and
form O = diag(gamma_t) (S_read Q^T) + U (W o K Q^T) — no per-token [V, K] state anywhere.
Products are tf32x3 (fp32-accurate). The per-row buffer fields (v, u) are stored here; k, g and
beta (shared by several programs) and the cursors by ``launch.advance``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import launch
from .._triton.formats import load_tile, store_tile

DOT = "tf32x3"


@triton.jit
def _substitute(U, A, RHS, j, first, COUNT: tl.constexpr):
    """Forward substitution for columns first .. first+COUNT-1 of U [BV, LP]:
    U[:, jj] = RHS[:, jj] - U @ A[jj, :] (A strictly lower triangular, [LP, LP])."""
    for s in tl.static_range(COUNT):
        jj = first + s
        a_row = tl.sum(tl.where(j[:, None] == jj, A, 0.0), 0)  # [LP]
        rhs = tl.sum(tl.where(j[None, :] == jj, RHS, 0.0), 1)  # [BV]
        u = rhs - tl.sum(U * a_row[None, :], 1)
        U = tl.where(j[None, :] == jj, u[:, None], U)
    return U


@triton.jit
def _gdn_step_kernel(
        slots_ptr, committed_ptr, tokens_ptr, seeds_ptr,
        av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr,
        bk_ptr, bv_ptr, bg_ptr, bbeta_ptr, bu_ptr,
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
        SCRATCH, HV, HK,
        T: tl.constexpr, TP: tl.constexpr, L: tl.constexpr, LP: tl.constexpr,
        DV: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr,
        A_FMT: tl.constexpr, A_SR: tl.constexpr, R_FMT: tl.constexpr, R_SR: tl.constexpr,
        SHARED: tl.constexpr):
    pid_b, head, pid_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots_ptr + pid_b)
    valid = slot >= 0
    row = tl.where(valid, slot, SCRATCH).to(tl.int64)
    h = tl.where(valid, tl.load(committed_ptr + row), 0)
    need = valid & (h + T > L)
    khead = head // (HV // HK)
    mat = row * HV + head
    rv = pid_v * BV + tl.arange(0, BV)
    ck = tl.arange(0, DK)
    j = tl.arange(0, LP)
    s = tl.arange(0, TP)
    buf_tok = row * L + j
    lower = j[None, :] < j[:, None]  # [LP, LP]: column i < row j

    if need:  # refresh: re-solve the committed residuals from the anchor and fold them
        old = j < h
        g_c = tl.load(bg_ptr + buf_tok * HV + head, mask=old, other=0.0)
        beta_c = tl.load(bbeta_ptr + buf_tok * HV + head, mask=old, other=0.0)
        K = tl.load(bk_ptr + (buf_tok[:, None] * HK + khead) * DK + ck[None, :], mask=old[:, None],
                    other=0.0).to(tl.float32)
        Vt = tl.load(bv_ptr + (buf_tok[None, :] * HV + head) * DV + rv[:, None], mask=old[None, :],
                     other=0.0).to(tl.float32)  # [BV, LP]
        S = load_tile(av_ptr, as_ptr, ag_ptr, mat, rv, ck, DV, DK, A_FMT)
        c = tl.cumsum(g_c, 0)
        total = tl.sum(g_c, 0)
        SK = tl.dot(S, tl.trans(K), input_precision=DOT)  # [BV, LP]
        KK = tl.dot(K, tl.trans(K), input_precision=DOT)  # [LP, LP]
        RHS = beta_c[None, :] * (Vt - tl.exp(c)[None, :] * SK)
        A = beta_c[:, None] * tl.exp(tl.where(lower, c[:, None] - c[None, :], float("-inf"))) * KK
        U = _substitute(tl.zeros((BV, LP), tl.float32), A, RHS, j, 0, L)
        S = S * tl.exp(total) + tl.dot(U * tl.exp(total - c)[None, :], K, input_precision=DOT)
        tok = tl.load(tokens_ptr + row)
        seed = tl.load(seeds_ptr + row)
        S_read = store_tile(S, av_ptr, as_ptr, ag_ptr, mat, head, rv, ck, seed, tok * 2,
                            DV, DK, A_FMT, A_SR)
        if not SHARED:
            S_read = store_tile(S, rv_ptr, rs_ptr, rg_ptr, mat, head, rv, ck, seed, tok * 2 + 1,
                                DV, DK, R_FMT, R_SR)
    else:
        S_read = load_tile(rv_ptr, rs_ptr, rg_ptr, mat, rv, ck, DV, DK, R_FMT)
    h = tl.where(need, 0, h)

    old = j < h
    new = (j >= h) & (j < h + T)
    inp = pid_b * T + (j - h)
    g = tl.load(bg_ptr + buf_tok * HV + head, mask=old, other=0.0) + \
        tl.load(g_ptr + inp * HV + head, mask=new, other=0.0)
    beta = tl.load(bbeta_ptr + buf_tok * HV + head, mask=old, other=0.0) + \
        tl.load(beta_ptr + inp * HV + head, mask=new, other=0.0)
    K = tl.load(bk_ptr + (buf_tok[:, None] * HK + khead) * DK + ck[None, :], mask=old[:, None], other=0.0)
    K = K.to(tl.float32) + tl.load(k_ptr + (inp[:, None] * HK + khead) * DK + ck[None, :],
                                   mask=new[:, None], other=0.0).to(bk_ptr.dtype.element_ty).to(tl.float32)
    v_new = tl.load(v_ptr + (inp[None, :] * HV + head) * DV + rv[:, None], mask=new[None, :], other=0.0)
    v_new = v_new.to(bv_ptr.dtype.element_ty)  # [BV, LP]
    U = tl.load(bu_ptr + (buf_tok[None, :] * HV + head) * DV + rv[:, None], mask=old[None, :], other=0.0)
    q_tok = pid_b * T + s
    Q = tl.load(q_ptr + (q_tok[:, None] * HK + khead) * DK + ck[None, :], mask=(s < T)[:, None],
                other=0.0).to(tl.float32)

    c = tl.cumsum(g, 0)
    SK = tl.dot(S_read, tl.trans(K), input_precision=DOT)
    KK = tl.dot(K, tl.trans(K), input_precision=DOT)
    RHS = beta[None, :] * (v_new.to(tl.float32) - tl.exp(c)[None, :] * SK)
    A = tl.where(new[:, None], beta[:, None], 0.0) * \
        tl.exp(tl.where(lower, c[:, None] - c[None, :], float("-inf"))) * KK
    U = _substitute(U, A, RHS, j, h, T)  # committed columns keep their cached residuals

    t = h + s
    c_t = tl.sum(tl.where(j[None, :] == t[:, None], c[None, :], 0.0), 1)
    causal = j[:, None] <= t[None, :]
    decay = tl.exp(tl.where(causal, c_t[None, :] - c[:, None], float("-inf")))
    W = tl.dot(K, tl.trans(Q), input_precision=DOT) * decay  # [LP, TP]
    O = tl.dot(S_read, tl.trans(Q), input_precision=DOT) * tl.exp(c_t)[None, :]
    O += tl.dot(U, W, input_precision=DOT)

    out_off = (q_tok[None, :] * HV + head) * DV + rv[:, None]
    tl.store(o_ptr + out_off, tl.where(valid, O, 0.0), mask=(s < T)[None, :] & (rv[:, None] < DV))
    row_off = (buf_tok[None, :] * HV + head) * DV + rv[:, None]  # [BV, LP]
    tl.store(bv_ptr + row_off, v_new, mask=new[None, :])
    tl.store(bu_ptr + row_off, U, mask=new[None, :])


def step(cache, slots, q, k, v, g, beta, commit: bool):
    """One GDN decode (T = 1) or verify step on the Triton backend.

    q (normalized, scaled), k (normalized) fp32 [b, T, HK, K]; v [b, T, HV, V];
    g, beta fp32 [b, T, HV]. Returns o fp32 [b, T, HV, V] (pads zero).
    """
    launch.check_geometry(cache)
    b, T, HV, V = v.shape
    anchor, read, consts = launch.format_args(cache)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    o = torch.empty(b, T, HV, V, dtype=torch.float32, device=v.device)
    bv = launch.block_rows(cache, b)
    buf = cache.buffer
    _gdn_step_kernel[(b, HV, V // bv)](
        slots, cache.committed, cache.tokens, cache.seeds, *anchor, *read,
        buf["k"], buf["v"], buf["g"], buf["beta"], buf["u"],
        q, k, v, g, beta, o, cache.scratch_row, HV, cache.num_k_heads,
        T=T, TP=max(16, triton.next_power_of_2(T)), L=cache.window,
        LP=max(16, triton.next_power_of_2(cache.window)), DV=V, DK=cache.head_k_dim, BV=bv,
        num_warps=4 if bv * cache.head_k_dim <= 4096 else 8, **consts)
    launch.advance(cache, slots, T, commit, {"k": k, "g": g, "beta": beta})
    return o
