"""Mamba-2 ReplaySSM Triton kernel: fused refresh + output-only decode/verify.

One program per (batch row, head, block of BV state rows). If the slot's committed history plus
the T new tokens overflows the window, the program first folds the committed entries into the
anchor (S = gamma_h S_anchor + X^T diag(w) B, one small matrix product) and writes the new anchor
and read copy, cast independently from the unrounded S; the anchor is read nowhere else. Then

    Y = diag(gamma_t) (S_read C^T) + X^T (W o B C^T)      [BV, T]

over the committed entries plus the new tokens (DESIGN §2). Matrix products use tf32x3 (three-pass,
fp32-accurate), never single-pass tf32. The new tokens' per-row buffer field (x) is stored here;
the shared fields and the cursors are written by ``launch.advance`` right after.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import launch
from .._triton.formats import load_tile, store_tile

DOT = "tf32x3"


@triton.jit
def _mamba2_step_kernel(
        slots_ptr, committed_ptr, tokens_ptr, seeds_ptr,
        av_ptr, as_ptr, ag_ptr, rv_ptr, rs_ptr, rg_ptr,
        bx_ptr, bdt_ptr, bla_ptr, bB_ptr,
        x_ptr, dt_ptr, la_ptr, B_ptr, C_ptr, D_ptr, z_ptr, y_ptr,
        SCRATCH, H, G,
        T: tl.constexpr, TP: tl.constexpr, L: tl.constexpr, LP: tl.constexpr,
        DV: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr,
        A_FMT: tl.constexpr, A_SR: tl.constexpr, R_FMT: tl.constexpr, R_SR: tl.constexpr,
        SHARED: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr):
    pid_b, head, pid_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots_ptr + pid_b)
    valid = slot >= 0
    row = tl.where(valid, slot, SCRATCH).to(tl.int64)
    h = tl.where(valid, tl.load(committed_ptr + row), 0)
    need = valid & (h + T > L)
    group = head // (H // G)
    mat = row * H + head
    rv = pid_v * BV + tl.arange(0, BV)
    ck = tl.arange(0, DK)
    j = tl.arange(0, LP)
    s = tl.arange(0, TP)
    buf_tok = row * L + j  # [LP] buffer token index of this slot

    if need:  # refresh: fold the h committed entries into a new checkpoint, from the anchor
        old = j < h
        la_c = tl.load(bla_ptr + buf_tok * H + head, mask=old, other=0.0)
        dt_c = tl.load(bdt_ptr + buf_tok * H + head, mask=old, other=0.0)
        c = tl.cumsum(la_c, 0)
        total = tl.sum(la_c, 0)
        w = tl.where(old, tl.exp(total - c), 0.0) * dt_c
        X = tl.load(bx_ptr + (buf_tok[:, None] * H + head) * DV + rv[None, :], mask=old[:, None], other=0.0)
        K = tl.load(bB_ptr + (buf_tok[:, None] * G + group) * DK + ck[None, :], mask=old[:, None], other=0.0)
        S = load_tile(av_ptr, as_ptr, ag_ptr, mat, rv, ck, DV, DK, A_FMT) * tl.exp(total)
        S += tl.dot(tl.trans(X.to(tl.float32) * w[:, None]), K.to(tl.float32), input_precision=DOT)
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

    # entries: committed ones from the buffer, the T new ones from the inputs (rounded to the
    # buffer dtype, exactly as a later replay will read them)
    old = j < h
    new = (j >= h) & (j < h + T)
    inp = pid_b * T + (j - h)  # [LP] input token index of new entries
    la = tl.load(bla_ptr + buf_tok * H + head, mask=old, other=0.0) + \
        tl.load(la_ptr + inp * H + head, mask=new, other=0.0)
    dt = tl.load(bdt_ptr + buf_tok * H + head, mask=old, other=0.0) + \
        tl.load(dt_ptr + inp * H + head, mask=new, other=0.0)
    x_new = tl.load(x_ptr + (inp[:, None] * H + head) * DV + rv[None, :], mask=new[:, None], other=0.0)
    x_new = x_new.to(bx_ptr.dtype.element_ty)
    X = tl.load(bx_ptr + (buf_tok[:, None] * H + head) * DV + rv[None, :], mask=old[:, None], other=0.0)
    X = X.to(tl.float32) + x_new.to(tl.float32)
    K = tl.load(bB_ptr + (buf_tok[:, None] * G + group) * DK + ck[None, :], mask=old[:, None], other=0.0)
    K = K.to(tl.float32) + tl.load(B_ptr + (inp[:, None] * G + group) * DK + ck[None, :],
                                   mask=new[:, None], other=0.0).to(bB_ptr.dtype.element_ty).to(tl.float32)
    q_tok = pid_b * T + s  # [TP]
    Q = tl.load(C_ptr + (q_tok[:, None] * G + group) * DK + ck[None, :], mask=(s < T)[:, None], other=0.0)
    Q = Q.to(tl.float32)

    c = tl.cumsum(la, 0)  # [LP] cumulative log decay after each entry
    t = h + s  # [TP] query positions
    c_t = tl.sum(tl.where(j[None, :] == t[:, None], c[None, :], 0.0), 1)  # [TP]
    causal = j[:, None] <= t[None, :]  # [LP, TP]
    decay = tl.exp(tl.where(causal, c_t[None, :] - c[:, None], float("-inf")))  # masked before exp
    W = tl.dot(K, tl.trans(Q), input_precision=DOT) * decay * dt[:, None]  # [LP, TP]
    Y = tl.dot(S_read, tl.trans(Q), input_precision=DOT) * tl.exp(c_t)[None, :]
    Y += tl.dot(tl.trans(X), W, input_precision=DOT)  # [BV, TP]

    out_off = (q_tok[None, :] * H + head) * DV + rv[:, None]  # [BV, TP]
    qmask = (s < T)[None, :] & (rv[:, None] < DV)
    if HAS_D or HAS_Z:
        xq = tl.load(x_ptr + out_off, mask=qmask, other=0.0).to(tl.float32)
        if HAS_D:
            Y += tl.load(D_ptr + head).to(tl.float32) * xq
        if HAS_Z:
            zq = tl.load(z_ptr + out_off, mask=qmask, other=0.0).to(tl.float32)
            Y *= zq * tl.sigmoid(zq)
    tl.store(y_ptr + out_off, tl.where(valid, Y, 0.0), mask=qmask)
    # the new tokens' x rows: only this program reads them
    tl.store(bx_ptr + (buf_tok[:, None] * H + head) * DV + rv[None, :], x_new, mask=new[:, None])


def step(cache, slots, x, dt, log_alpha, B, C, D, z, commit: bool):
    """One Mamba-2 decode (T = 1) or verify step on the Triton backend.

    x [b, T, H, P]; dt, log_alpha fp32 [b, T, H]; B, C [b, T, G, N]; D [H]; z [b, T, H, P].
    Returns y fp32 [b, T, H, P] (pads zero).
    """
    launch.check_geometry(cache)
    b, T, H, P = x.shape
    anchor, read, consts = launch.format_args(cache)
    x, dt, log_alpha, B, C = (t.contiguous() for t in (x, dt, log_alpha, B, C))
    z = None if z is None else z.contiguous()
    y = torch.empty(b, T, H, P, dtype=torch.float32, device=x.device)
    bv = launch.block_rows(cache, b)
    buf = cache.buffer
    _mamba2_step_kernel[(b, H, P // bv)](
        slots, cache.committed, cache.tokens, cache.seeds, *anchor, *read,
        buf["x"], buf["dt"], buf["log_alpha"], buf["B"],
        x, dt, log_alpha, B, C, x if D is None else D, x if z is None else z, y,
        cache.scratch_row, H, cache.ngroups,
        T=T, TP=max(16, triton.next_power_of_2(T)), L=cache.window,
        LP=max(16, triton.next_power_of_2(cache.window)), DV=P, DK=cache.dstate, BV=bv,
        HAS_D=D is not None, HAS_Z=z is not None, num_warps=4 if bv * cache.dstate <= 4096 else 8,
        **consts)
    launch.advance(cache, slots, T, commit, {"dt": dt, "log_alpha": log_alpha, "B": B})
    return y
