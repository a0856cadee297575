"""Conventional decode kernels, the baselines ReplaySSM is measured against.

Each reads the full fp32 state of a (slot, head), applies one token (or T drafts), and writes the
state back (or, speculative, writes one state per draft, as vLLM/SGLang do for rollback). Written
to sit at the memory roof: one program per block of state rows, coalesced row loads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton.decay import softplus

#: Rows of a head per program and warps per program, the fastest measured on an H200 at batch
#: 256 (94% and 91% of the copy bandwidth); a sweep sets SHAPE["override"] = (rows, warps).
SHAPE = {"mamba2": (16, 1), "gdn": (8, 1), "kda": (8, 1)}  # KDA: GDN's, not swept on its own


@triton.jit
def _parent_state(S, state_ptr, inter_ptr, parents_ptr, off, slot, pid_b, s: tl.constexpr, head, rv, ck, H,
                  T: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr):
    """A draft tree's state before draft s: S (draft s - 1's) when s follows s - 1, else the slot's
    state (a child of the root, parents = -1) or the parent draft's state as this program stored
    it (the same thread wrote each element it loads, so the store is visible without a barrier)."""
    par = tl.load(parents_ptr + pid_b * T + s)
    if par < 0:
        S = tl.load(state_ptr + off)
    elif par != s - 1:
        S = tl.load(inter_ptr + ((slot * T + par) * H + head) * DV * DK + rv[:, None] * DK + ck[None, :])
    return S


@triton.jit
def _mamba2_conv_kernel(state_ptr, inter_ptr, slots_ptr, parents_ptr, x_ptr, dt_ptr, bias_ptr, A_ptr, B_ptr, C_ptr,
                        D_ptr, z_ptr, y_ptr, H, G, T: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr,
                        BV: tl.constexpr, SPEC: tl.constexpr, TREE: tl.constexpr, HAS_Z: tl.constexpr):
    """Mamba-2's conventional step, its inputs prepared here as a serving engine's kernel does:
    dt = softplus(dt + dt_bias), the output times silu(z) (HAS_Z)."""
    pid_v, head, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # row blocks fastest
    slot = tl.load(slots_ptr + pid_b).to(tl.int64)
    rv = pid_v * BV + tl.arange(0, BV)
    ck = tl.arange(0, DK)
    group = head // (H // G)
    off = ((slot * H + head) * DV + rv[:, None]) * DK + ck[None, :]
    S = tl.load(state_ptr + off)
    A = tl.load(A_ptr + head)
    D = tl.load(D_ptr + head)
    bias = tl.load(bias_ptr + head)
    for s in tl.static_range(T):
        tok = pid_b * T + s
        dt = softplus(tl.load(dt_ptr + tok * H + head).to(tl.float32) + bias)
        x = tl.load(x_ptr + (tok * H + head) * DV + rv).to(tl.float32)
        Bv = tl.load(B_ptr + (tok * G + group) * DK + ck).to(tl.float32)
        Cv = tl.load(C_ptr + (tok * G + group) * DK + ck).to(tl.float32)
        if TREE:
            S = _parent_state(S, state_ptr, inter_ptr, parents_ptr, off, slot, pid_b, s, head, rv, ck, H, T, DV, DK)
        S = S * tl.exp(A * dt) + (dt * x)[:, None] * Bv[None, :]
        y = tl.sum(S * Cv[None, :], 1) + D * x
        if HAS_Z:
            z = tl.load(z_ptr + (tok * H + head) * DV + rv).to(tl.float32)
            y *= z * tl.sigmoid(z)
        tl.store(y_ptr + (tok * H + head) * DV + rv, y)
        if SPEC:  # one state per draft, kept for rollback
            tl.store(inter_ptr + ((slot * T + s) * H + head) * DV * DK + rv[:, None] * DK + ck[None, :], S)
    if not SPEC:
        tl.store(state_ptr + off, S)


def mamba2_conventional(state, slots, x, dt, A, B, C, D, dt_bias, z=None, inter=None, parents=None):
    """state fp32 [pool, H, P, N] updated in place (or, with ``inter`` [pool, T, H, P, N], one
    state per draft written there); x, z [b, T, H, P] (z None: no gate); dt [b, T, H] (before
    softplus); A, D, dt_bias fp32 [H]; B, C [b, T, G, N]; ``parents`` int32 [b, T] (with
    ``inter``: a draft tree, each draft's state from its parent's) or None (a chain); every input
    contiguous. Returns y fp32 [b, T, H, P]: one launch, no other kernel."""
    b, T, H, P = x.shape
    N, G = state.shape[-1], B.shape[2]
    y = torch.empty(b, T, H, P, device=x.device, dtype=torch.float32)
    block_rows, warps = SHAPE.get("override", SHAPE["mamba2"])
    block_rows = min(block_rows, P)
    _mamba2_conv_kernel[(P // block_rows, H, b)](
        state, state if inter is None else inter, slots, slots if parents is None else parents, x, dt, dt_bias, A, B,
        C, D, x if z is None else z, y, H, G, T=T, DV=P, DK=N, BV=block_rows, SPEC=inter is not None,
        TREE=parents is not None, HAS_Z=z is not None, num_warps=warps)
    return y


@triton.jit
def _gdn_conv_kernel(state_ptr, inter_ptr, slots_ptr, parents_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
                     scale, HV, HK, T: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr,
                     SPEC: tl.constexpr, TREE: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """GDN's conventional step, q and k L2-normalized here (flash-linear-attention's l2norm, eps
    1e-6) and q times ``scale``, as a serving engine's kernel does; PER_CHANNEL (KDA): one decay per
    key channel, g [b, T, HV, DK], the state's columns decaying by exp(g) before the delta-rule
    write."""
    pid_v, head, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # row blocks fastest
    slot = tl.load(slots_ptr + pid_b).to(tl.int64)
    rv = pid_v * BV + tl.arange(0, BV)
    ck = tl.arange(0, DK)
    khead = head // (HV // HK)
    off = ((slot * HV + head) * DV + rv[:, None]) * DK + ck[None, :]
    S = tl.load(state_ptr + off)
    for s in tl.static_range(T):
        tok = pid_b * T + s
        q = tl.load(q_ptr + (tok * HK + khead) * DK + ck).to(tl.float32)
        k = tl.load(k_ptr + (tok * HK + khead) * DK + ck).to(tl.float32)
        q = q * (tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        v = tl.load(v_ptr + (tok * HV + head) * DV + rv).to(tl.float32)
        if PER_CHANNEL:
            decay = tl.exp(tl.load(g_ptr + (tok * HV + head) * DK + ck).to(tl.float32))[None, :]
        else:
            decay = tl.exp(tl.load(g_ptr + tok * HV + head))
        beta = tl.load(beta_ptr + tok * HV + head).to(tl.float32)
        if TREE:
            S = _parent_state(S, state_ptr, inter_ptr, parents_ptr, off, slot, pid_b, s, head, rv, ck, HV, T, DV, DK)
        S = S * decay
        u = beta * (v - tl.sum(S * k[None, :], 1))
        S = S + u[:, None] * k[None, :]
        tl.store(o_ptr + (tok * HV + head) * DV + rv, tl.sum(S * q[None, :], 1))
        if SPEC:
            tl.store(inter_ptr + ((slot * T + s) * HV + head) * DV * DK + rv[:, None] * DK + ck[None, :], S)
    if not SPEC:
        tl.store(state_ptr + off, S)


def gdn_conventional(state, slots, q, k, v, g, beta, scale, inter=None, parents=None):
    """state fp32 [pool, HV, V, K] in place (or one state per draft into ``inter``); q, k
    [b, T, HK, K] (normalized in the kernel, q times ``scale``); v [b, T, HV, V]; g fp32, beta
    [b, T, HV]; ``parents`` int32 [b, T] (with ``inter``: a draft tree) or None (a chain); every
    input contiguous. Returns o fp32 [b, T, HV, V]: one launch, no other kernel."""
    b, T, HV, V = v.shape
    K, HK = state.shape[-1], q.shape[2]
    o = torch.empty(b, T, HV, V, device=v.device, dtype=torch.float32)
    block_rows, warps = SHAPE.get("override", SHAPE["gdn"])
    block_rows = min(block_rows, V)
    _gdn_conv_kernel[(V // block_rows, HV, b)](
        state, state if inter is None else inter, slots, slots if parents is None else parents, q, k, v, g, beta, o,
        float(scale), HV, HK, T=T, DV=V, DK=K, BV=block_rows, SPEC=inter is not None, TREE=parents is not None,
        PER_CHANNEL=False, num_warps=warps)
    return o


def kda_conventional(state, slots, q, k, v, g, beta, scale, inter=None):
    """state fp32 [pool, HV, V, K] in place (or one state per draft into ``inter``); q, k
    [b, T, HK, K] (normalized in the kernel, q times ``scale``); v [b, T, HV, V]; g fp32
    [b, T, HV, K] (per-channel log decay); beta [b, T, HV]; every input contiguous. Returns o fp32
    [b, T, HV, V]."""
    b, T, HV, V = v.shape
    K, HK = state.shape[-1], q.shape[2]
    o = torch.empty(b, T, HV, V, device=v.device, dtype=torch.float32)
    block_rows, warps = SHAPE.get("override", SHAPE["kda"])
    block_rows = min(block_rows, V)
    _gdn_conv_kernel[(V // block_rows, HV, b)](
        state, state if inter is None else inter, slots, slots, q, k, v, g, beta, o, float(scale), HV, HK, T=T, DV=V,
        DK=K, BV=block_rows, SPEC=inter is not None, TREE=False, PER_CHANNEL=True, num_warps=warps)
    return o


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=i < n), mask=i < n)


def device_copy(src, dst, block=1024):
    """dst[:] = src[:] (contiguous, same dtype) by a plain streaming kernel: the copy ceiling."""
    n = src.numel()
    _copy_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block, num_warps=4)
