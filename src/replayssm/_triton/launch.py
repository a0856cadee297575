"""Launch plumbing shared by the Mamba-2 and GDN kernels.

A step is a fixed sequence of launches with no host synchronization in between:

1. the architecture's scores kernel, one program per (batch row, group or key head): the input
   preparation and the dot products of the window's keys with the new queries;
2. the refresh kernel (batch >= ``SPLIT_MIN_BATCH[arch]``; below, it is fused into 3): for
   the rows of slots whose window is full, fold, write anchor and read copy; other programs exit;
3. the step kernel, one program per (block of state rows, head, batch row): outputs, and the
   new tokens' per-row buffer fields (x rows for Mamba-2; v and u rows for GDN);
4. ``advance_kernel``, one program per batch row: the new tokens' *shared* buffer fields (read by
   several programs of launch 3: B or k per group, dt/log decay/beta per head) and the cursors.

Launch 4 must follow launch 3 because a refreshing slot writes its new tokens at positions 0..T-1,
which, with the refresh fused, other programs of launch 3 are still folding. Every launch goes
through ``run``; at small batches (``programmatic``) each one is scheduled while the one before it
drains, and waits for it before its first memory access (``after_previous_launch``).
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .formats import FMT_IDS


@triton.jit
def after_previous_launch(PDL: tl.constexpr):
    """First statement of every kernel of a step. With PDL (programmatic dependent launch,
    ``programmatic``), a launch may start before the one before it has finished: wait here until
    it has, and its writes are visible, then let the next launch start too. Only the launch
    latency and the block scheduling overlap, never memory accesses, so the results are the same."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _copy_field(src_ptr, dst_ptr, pid, row, start, T: tl.constexpr, TP: tl.constexpr,
                L: tl.constexpr, F: tl.constexpr, F_PAD: tl.constexpr):
    """dst[row, start + s, :F] = src[pid, s, :F] for s < T (src [b, T, F], dst [rows, L, F])."""
    s = tl.arange(0, TP)[:, None]
    f = tl.arange(0, F_PAD)[None, :]
    m = (f < F) & (s < T)
    vals = tl.load(src_ptr + (pid * T + s) * F + f, mask=m)
    tl.store(dst_ptr + (row * L + start + s) * F + f, vals.to(dst_ptr.dtype.element_ty), mask=m)


@triton.jit
def advance_kernel(slots_ptr, committed_ptr, pending_ptr, tokens_ptr, refreshes_ptr,
                   s1, d1, s2, d2, s3, d3,
                   SCRATCH, T: tl.constexpr, TP: tl.constexpr, L: tl.constexpr, COMMIT: tl.constexpr,
                   F1: tl.constexpr, F1P: tl.constexpr, F2: tl.constexpr, F2P: tl.constexpr,
                   F3: tl.constexpr, F3P: tl.constexpr, PDL: tl.constexpr):
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    slot = tl.load(slots_ptr + pid)
    if slot >= 0:
        h = tl.load(committed_ptr + slot)
        need = h + T > L
        start = tl.where(need, 0, h)
        _copy_field(s1, d1, pid, slot, start, T, TP, L, F1, F1P)
        _copy_field(s2, d2, pid, slot, start, T, TP, L, F2, F2P)
        _copy_field(s3, d3, pid, slot, start, T, TP, L, F3, F3P)
        if need:
            tl.store(refreshes_ptr + slot, tl.load(refreshes_ptr + slot) + 1)
        if COMMIT:
            tl.store(committed_ptr + slot, start + T)
            tl.store(tokens_ptr + slot, tl.load(tokens_ptr + slot) + T)
            tl.store(pending_ptr + slot, 0)
        else:
            tl.store(committed_ptr + slot, start)
            tl.store(pending_ptr + slot, T)


@triton.jit
def accept_kernel(slots_ptr, accepted_ptr, committed_ptr, pending_ptr, tokens_ptr, B,
                  BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``cache.accept`` in one launch: for each real slot of a block of batch rows, n = the
    accepted count clamped to [0, pending]; committed += n, tokens += n, pending = 0. Pads (-1)
    are skipped; slot ids do not repeat, so no two programs touch one slot."""
    after_previous_launch(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + i, mask=i < B, other=-1)
    real = slot >= 0
    pending = tl.load(pending_ptr + slot, mask=real, other=0)
    n = tl.minimum(tl.maximum(tl.load(accepted_ptr + i, mask=real, other=0), 0), pending)
    tl.store(committed_ptr + slot, tl.load(committed_ptr + slot, mask=real) + n.to(committed_ptr.dtype.element_ty),
             mask=real)
    tl.store(tokens_ptr + slot, tl.load(tokens_ptr + slot, mask=real) + n.to(tokens_ptr.dtype.element_ty), mask=real)
    tl.store(pending_ptr + slot, tl.zeros_like(pending), mask=real)


#: Batch rows per program of ``accept_kernel``.
ACCEPT_BLOCK = 128


def accept(cache, slots, num_accepted):
    """Launch ``accept_kernel`` (a verify round's commit): one launch where the PyTorch form is
    about twenty small ones (40-60 µs of a batch-256 round on an H200, ncu). Arguments already
    validated by ``cache.accept``."""
    b = slots.shape[0]
    if b:
        run(accept_kernel, (triton.cdiv(b, ACCEPT_BLOCK),), slots, num_accepted, cache.committed, cache.pending,
            cache.tokens, b, BLOCK=ACCEPT_BLOCK)


def _launch(kernel, grid, args, kwargs):
    kernel[grid](*args, **kwargs)


#: How ``run`` launches; ``benchmarks/ptxas_report.py`` swaps in a recorder to compile the
#: kernels of a step for a GPU target on a machine without one.
LAUNCHER = _launch


#: Largest batch whose steps use programmatic dependent launch (``programmatic``). H200, µs per
#: step without -> with, CUDA graphs, s32_rs / tp8_hi32 (BENCHMARKS.md, sixth session): batch 1
#: Mamba-2 7.7 -> 6.0 / 8.1 -> 6.3, GDN 9.7 -> 8.0 / 9.0 -> 7.2; batch 8 Mamba-2 18.2 -> 16.4, GDN
#: 30.8 -> 28.3; batch 16 Mamba-2 36.5 -> 34.2 / 32.6 -> 30.4, GDN (split) 51.9 -> 49.6; but batch
#: 32 GDN 80.7 -> 82.4 / 67.3 -> 71.6, batch 64 Mamba-2 102.4 -> 104.7, batch 256 Mamba-2 353.8 ->
#: 377.8, GDN 478.2 -> 517.2.
PROGRAMMATIC_MAX_BATCH = 16


def programmatic(slots) -> bool:
    """Whether the launches of a step over batch rows ``slots`` use programmatic dependent launch
    (Hopper and later): each launch may be scheduled while the one before it drains, and waits
    for it in ``after_previous_launch``, which hides most of the gap between launches where the
    launches are short. ``TUNING["pdl"]`` overrides the choice by batch size."""
    if slots.device.type != "cuda" or not _hopper_or_later(slots.device):
        return False
    return TUNING.get("pdl", slots.shape[0] <= PROGRAMMATIC_MAX_BATCH)


@functools.lru_cache(maxsize=None)
def _hopper_or_later(device) -> bool:
    """Whether the GPU has programmatic dependent launch (compute capability >= 9); asked once
    per device rather than on every launch."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def run(kernel, grid, *args, **kwargs):
    """Launch ``kernel[grid](*args, **kwargs)``: every launch of a step goes through here. Sets the
    kernel's PDL constexpr (``after_previous_launch``) by ``programmatic`` of the first argument
    (the slot ids)."""
    kwargs["PDL"] = programmatic(args[0])
    if kwargs["PDL"]:
        kwargs["launch_pdl"] = True
    if "fp_fusion" in TUNING:  # an experiment: the compiler's contraction of a * b + c into one fma
        kwargs["enable_fp_fusion"] = TUNING["fp_fusion"]
    LAUNCHER(kernel, grid, args, kwargs)


def advance(cache, slots, T: int, commit: bool, shared_fields: dict):
    """Launch ``advance_kernel``: write the shared buffer fields (name -> input [b, T, ...]) of
    the new tokens and move the cursors."""
    b = slots.shape[0]
    args, consts = [], []
    for name, src in shared_fields.items():
        F = src[0, 0].numel()
        args += [src.contiguous(), cache.buffer[name]]
        consts += [F, triton.next_power_of_2(F)]
    run(advance_kernel, (b,), slots, cache.committed, cache.pending, cache.tokens, cache.refreshes, *args,
                         cache.scratch_row, T, triton.next_power_of_2(T), cache.window, commit, *consts)


def format_args(cache):
    """Pointer triples and constexprs describing the anchor and read copy of ``cache``."""
    p = cache.precision
    dummy = cache.committed  # never dereferenced: the format does not have that part

    def triple(parts):
        return (parts["values"], parts.get("scales", dummy), parts.get("global_scale", dummy))

    anchor = triple(cache.anchor)
    read = anchor if cache.read_copy is None else triple(cache.read_copy)
    consts = dict(A_FMT=FMT_IDS[p.anchor.name], A_SR=p.anchor_rounding == "stochastic",
                  R_FMT=FMT_IDS[p.read_format.name], R_SR=p.read_rounding_used == "stochastic",
                  SHARED=p.shared)
    return anchor, read, consts


def check_geometry(cache):
    """The kernels tile whole rows of a head: dv, dk powers of two >= 16 (dk >= 32 with fp8)."""
    for name, n in (("dv", cache.dv), ("dk", cache.dk)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"backend='triton' needs {name} to be a power of two >= 16, got {n}; "
                             "use backend='torch' for this geometry")
    fmts = {cache.precision.anchor.name, cache.precision.read_format.name}
    if "fp8_e4m3" in fmts and cache.dk < 32:
        raise ValueError("backend='triton' with an fp8 format needs dk >= 32")


#: Launch-shape overrides, for benchmark sweeps: {"block_rows": int, "num_warps": int,
#: "refresh_dot": bool, "split_refresh": bool, "early_cursor": bool, "output_dot": bool,
#: "refresh_rows": int, "refresh_warps": int, "persistent_refresh": bool, "refresh_columns": int,
#: "pdl": bool, "fp_fusion": bool, "pin_vector_width": bool, "step_pin": int, "loads": int,
#: "refresh_programs": int, "stream": int, "two_tier_refresh": bool};
#: ``parse_shape`` reads them from a label. Each default is the faster one measured
#: (BENCHMARKS.md) among those that keep the anchor's bits: ``early_cursor`` on (``cursor_args``),
#: ``output_dot`` by draft length (``OUTPUT_DOT_MIN_DRAFT``), ``refresh_dot`` off for GDN
#: (``SHAPES``), ``persistent_refresh`` off (``refresh_grid``), ``two_tier_refresh`` off
#: (``refresh_launches``).
TUNING: dict = {}

#: (rows of a head per program, warps per program, refresh fold on tensor cores, elements per
#: thread pinned on the step's read-copy load, load order) by architecture and read-copy format: the fastest
#: measured on an H200 at batch 256, staggered windows, real geometries, split refresh
#: (benchmarks/sweep_shapes.py; BENCHMARKS.md has the sweeps), among folds whose anchor bits do
#: not depend on the read format (DESIGN §3: changing the read precision leaves the anchor
#: bit-identical; the GPU checks it, BENCHMARKS.md). Mamba-2 folds with one tensor-core product
#: per 32 columns (same anchor bits for every preset on the H200). GDN runs the token loop: its
#: substitution form on tensor cores (``gdn.triton._refresh_by_substitution``,
#: ``TUNING["refresh_dot"]``) is faster for element-wise read copies (staggered s32_rs 477 -> 442
#: us, tp8_hi32 435 -> 409), but its anchor bits depend on the tile shape on the GPU, and an NVFP4
#: read copy forces 32-row tiles: tp4_hi32's anchor then differed from s32_rs's by up to 1.9e-7.
#: NVFP4 rows are one row block, at 4 warps: one warp cannot hide the nibble decoding (32x4 ->
#: 32x1, tp4_hi16_sr: Mamba-2 443.7 -> 851.5 us, GDN 554.4 -> 997.4).
#:
#: Other steps run one warp per 32 rows: row reductions then stay inside a warp, and a verify step's T
#: output passes no longer convert layouts across warps (H200, batch 256, staggered, us per step
#: or round, Mamba-2 32x2 -> 32x1: T=1 s32_rs 358.3 -> 347.1, tp16_hi32 261.1 -> 251.6, tp8_hi32
#: 270.4 -> 246.0; T=4 944 -> 770, 925 -> 693, 918 -> 738; GDN 64x4 -> 32x1: s32_rs 462.0 ->
#: 447.1 pinned, tp16_hi32 486.5 -> 418.3 pinned, tp8_hi32 435.8 -> 364.4).
#:
#: The pin (``formats.pin_vector_width``; 0 = none) exists because Triton loads an fp32 tile 4
#: elements per thread and an fp16 tile 8, spreading a 128-wide row over a whole warp, so every
#: row reduction of a read-copy product ends in 5 rounds of shuffles; at 16 per thread, 3 (ptxas,
#: Mamba-2 T=4 s32_rs step: 3552 -> 2240 SASS instructions, 760 -> 216 shuffles). H200, batch 256,
#: us, unpinned -> pinned: Mamba-2 tp16_hi32 252.0 -> 243.0, tpbf16_hi32 251.3 -> 244.5, but
#: s32_rs 345.1 -> 356.2 (decode: its verify steps pin, ``DRAFT_SHAPES``); GDN 32x1 s32_rs 480.6
#: -> 447.1, tp16_hi32 422.9 -> 418.3 (8; 16: 430.3), tpbf16_hi32 421.2 -> 414.9. fp8 and NVFP4
#: read copies load in shapes of their own, which the pin does not touch.
SHAPES = {("mamba2", "fp32"): (32, 1, True, 0, 0), ("mamba2", "fp16"): (32, 1, True, 16, 0),
          ("mamba2", "bf16"): (32, 1, True, 16, 0), ("mamba2", "fp8_e4m3"): (32, 1, True, 0, 0),
          ("mamba2", "nvfp4"): (32, 4, True, 0, 0),
          ("gdn", "fp32"): (32, 1, False, 16, 2), ("gdn", "fp16"): (32, 1, False, 8, 2),
          ("gdn", "bf16"): (32, 1, False, 16, 2), ("gdn", "fp8_e4m3"): (32, 1, False, 0, 2),
          ("gdn", "nvfp4"): (32, 4, False, 0, 0)}

#: Where a step program issues its loads other than the read copy's (the last field of ``SHAPES``
#: and ``DRAFT_SHAPES``; ``TUNING["loads"]``): 0 = each new token's inputs where the kernel first
#: uses them, the window's before the output loop (the eighth session's kernels: for Mamba-2 the
#: same PTX); 1 = all of them before the output loop; 2 = all of them right after the read copy's,
#: before the pin and any refresh, so that the program waits on memory once. ncu of the GDN decode
#: step (batch 256, s32_rs, 32x1): before, three dependent rounds of loads after the read copy,
#: 64% of the warps' time waiting on them, 313.6 us at 77% of DRAM bandwidth; at 2, one round,
#: 281.7 us at 86%. Whole steps, H200, batch 256, staggered, us (BENCHMARKS.md, ninth session),
#: the eighth session's kernels in the same call -> order 1 -> order 2: GDN T=1 s32_rs 446.5 ->
#: 426.8 -> 417.8, tp16_hi32 417.6 -> 405.2 -> 389.4; GDN T=2 s32_rs 534.5 at 2 against 584.0 for
#: a draft of order 0. Mamba-2 steps never take 2: with the refresh fused (batch <
#: ``SPLIT_MIN_BATCH``) their outputs then differed in the last bits from the split launch's
#: (refresh_bits.py: tp16_hi32 decode, s32_rs at T=2), so results would depend on the batch size;
#: at T=1 order 2 gained at most 2.4% (tp16_hi32 246.1 -> 240.6). GDN refreshes in a launch of its
#: own at every batch.
LOAD_ORDERS = (0, 1, 2)


def parse_shape(text: str) -> dict:
    """``TUNING`` overrides from a benchmark's shape label: "32x4" = 32 rows per program, 4 warps;
    suffix ``d`` = refresh fold on tensor cores (else the token loop), ``s`` = split refresh (else
    fused), ``e`` = early cursor, ``o`` = outputs' read-copy products on tensor cores, ``p`` =
    persistent refresh launch, ``t`` = two-tier refresh launches (``refresh_launches``), ``l`` =
    programmatic dependent launch (``programmatic``), ``n`` = no
    contraction of a * b + c into fma by the compiler (``enable_fp_fusion=False``), ``u`` = GDN
    refresh unpinned (``pin_vector_width``); then "k" and a number: the step streams its read copy with that many
    chunks in flight (``stream_stages``; "k" alone: 2); then "v" and a number: the step's read-copy load
    pinned to that many elements per thread ("v0": unpinned; without "v", the pin of ``SHAPES``
    or ``DRAFT_SHAPES`` for the preset and draft length); then "f" and a number: the step's load
    order (``LOAD_ORDERS``; without "f", the tables'; "f" alone: 2); after "/",
    the refresh launch's rows x warps; after "@", the columns a Mamba-2 refresh folds at a time;
    after "#", a persistent refresh launch's programs (``refresh_grid``). E.g. "32x4dsep/16x2",
    "32x2dse@64", "32x2dsel", "32x1sev16/16x2", "32x1dsev16f1", "32x1se/16x2#0"."""
    text, hash_, programs = text.partition("#")
    text, _, columns = text.partition("@")
    text, _, refresh = text.partition("/")
    text, f, loads = text.partition("f")
    text, _, step_pin = text.partition("v")
    text, k, stages = text.partition("k")
    base = text.rstrip("dseoplnut")
    rows, warps = map(int, base.split("x"))
    flags = text[len(base):]
    out = dict(block_rows=rows, num_warps=warps, refresh_dot="d" in flags, split_refresh="s" in flags,
               early_cursor="e" in flags, output_dot="o" in flags, persistent_refresh="p" in flags,
               pdl="l" in flags)
    if "n" in flags:
        out["fp_fusion"] = False
    if "u" in flags:
        out["pin_vector_width"] = False
    if "t" in flags:
        out["two_tier_refresh"] = True
    if step_pin:  # "32x1dsev16": the step kernel's read-copy tile loads >= 16 elements per thread
        out["step_pin"] = int(step_pin)
    if k:  # "64x4seok3": the read copy streamed through tensor-core products, 3 chunks in flight
        out["stream"] = int(stages or 2)
    if f:  # "32x1dsef1": the step program's other loads before its output loop (LOAD_ORDERS); "f" alone: 2
        out["loads"] = int(loads or 2)
    if refresh:  # "64x4s/16x2": the split refresh launch at 16 rows x 2 warps
        out["refresh_rows"], out["refresh_warps"] = map(int, refresh.split("x"))
    if columns:  # "32x2dse@64": a Mamba-2 refresh folds 64 columns at a time
        out["refresh_columns"] = int(columns)
    if hash_:  # "32x1dse#16": persistent refresh, 16 programs per multiprocessor ("#0": by slots)
        out["persistent_refresh"], out["refresh_programs"] = True, int(programs)
    return out


def cursor_args(cache, slots) -> tuple:
    """(cursors tensor, EARLY_CURSOR) for the kernels of one step. By default the scores launch
    copies each batch row's committed count into a [b] scratch that the refresh and step kernels
    read by batch row, so their state and window loads wait on the slot id alone instead of slot
    id then cursor: 1-3% faster steps on an H200 (batch 256: Mamba-2 s32_rs 387.7 -> 381.2 us,
    GDN 510.3 -> 501.8). ``TUNING["early_cursor"] = False`` loads the cursor in every kernel. The
    same counts either way, so the same bits (tested)."""
    if TUNING.get("early_cursor", True):
        return torch.empty(slots.shape[0], dtype=cache.committed.dtype, device=slots.device), True
    return cache.committed, False  # never read through this argument


def _uses_nvfp4(cache) -> bool:
    return "nvfp4" in {cache.precision.anchor.name, cache.precision.read_format.name}


def _tile_rows(cache, rows: int) -> int:
    """``rows`` if a program can own that many rows of a head, else the cache's row block: a
    program must own whole NVFP4 global-scale blocks to encode its rows alone at a refresh (so
    with NVFP4 the rows are exactly one row block), and tl.dot needs >= 16 rows."""
    if _uses_nvfp4(cache) or rows < 16 or rows > cache.dv or cache.dv % rows:
        return cache.row_block
    return rows


#: Step shapes of verify steps where they differ from ``SHAPES``: (arch, read format) -> entries
#: (least draft length, rows, warps, pin, load order), by increasing least draft length; a step of
#: T tokens takes the last entry whose least length is <= T. The rows and warps apply only where
#: the refresh is split (GDN: always, ``SPLIT_MIN_BATCH``), so a step's shape never touches the
#: anchor. The pin applies at any batch: with it the fused and split refreshes still give the same
#: bits (H200, benchmarks/refresh_bits.py --draft 4). H200, batch 256, us per round: GDN T=4 reads
#: through tensor cores (``output_dot``) and is fastest at 64x4 unpinned (s32_rs 1078.9, tp16_hi32
#: 1131.3 against 1144.4 pinned), fp8 at 32x2 (64x4 -> 32x2: 1315.9 -> 1135.6); Mamba-2 s32_rs
#: pinned at 16: T=2 480.4 -> 461.5, T=4 780.0 -> 700.5, T=8 1407.5 -> 1207.8. Load orders
#: (``LOAD_ORDERS``), ninth session: Mamba-2 T=4, the eighth session's kernels -> order 1 (same
#: call): s32_rs 690.7 -> 582.4, tp16_hi32 681.4 -> 587.4, tp8_hi32 740.7 -> 642.8; orders 1 / 2 in
#: another call: s32_rs T=2 412.8 / 405.8, T=8 1140.7 / 1271.9, tpbf16_hi32 T=4 563.7 / 577.5;
#: tp8_hi32 T=8 1443.7 at order 1 against 1271.7 for a draft of order 0, hence 0 from T=8. GDN T=4
#: keeps order 0 (162 registers at 64x4; orders 1 and 2 took 217 and lost 6-11%). GDN steps of
#: T >= 4 stream their read copy (``STREAM_STAGES``), with shapes measured streamed (tenth
#: session, us per round at T=4 / T=8): fp32 64x4 933.9 (32x1 968.3, 32x2 955.1, 32x4 1223.3) /
#: 1426.6; fp16 32x1 987.5 (32x2 1053.0, 64x4 1072.9), bf16 32x1 994.8 (32x2 1047.2-1056.7, 64x4
#: 1079.3); fp8 32x1 937.9 (32x2 1021.1, 64x4 1094.2) / 64x4 1716.6 (32x1 1782.1).
DRAFT_SHAPES = {("mamba2", "fp32"): ((2, 32, 1, 16, 1),),
                ("mamba2", "fp16"): ((2, 32, 1, 16, 1),), ("mamba2", "bf16"): ((2, 32, 1, 16, 1),),
                ("mamba2", "fp8_e4m3"): ((2, 32, 1, 0, 1), (8, 32, 1, 0, 0)),
                ("gdn", "fp32"): ((4, 64, 4, 0, 0),), ("gdn", "fp16"): ((4, 32, 1, 0, 0),),
                ("gdn", "bf16"): ((4, 32, 1, 0, 0),), ("gdn", "fp8_e4m3"): ((4, 32, 1, 0, 0), (8, 64, 4, 0, 0))}


def by_draft(entries, T: int, default):
    """How the tables by draft length are read (``DRAFT_SHAPES``, ``REFRESH_SHAPES``,
    ``STREAM_STAGES``): the fields after the least draft length of the last entry whose least
    length is <= T (entries by increasing least length), else ``default``."""
    found = default
    for least, *fields in entries:
        if T >= least:
            found = tuple(fields)
    return found


def launch_shape(cache, arch: str, T: int = 1) -> tuple[int, int, bool, int, int]:
    """(rows of a head per program, warps per program, refresh on tensor cores, elements per
    thread pinned on the step's read-copy load or 0, load order of ``LOAD_ORDERS``) for a step of
    T tokens of ``cache`` (``SHAPES``, ``DRAFT_SHAPES``, ``TUNING`` over them, rows as
    ``_tile_rows`` allows)."""
    fmt = cache.precision.read_format.name
    rows, warps, dot, pin, loads = SHAPES[(arch, fmt)]
    draft = by_draft(DRAFT_SHAPES.get((arch, fmt), ()), T, None)
    if draft:
        draft_rows, draft_warps, pin, loads = draft
        if split_refresh(arch, 1, T):
            rows, warps = draft_rows, draft_warps
    rows = _tile_rows(cache, TUNING.get("block_rows", rows))
    return (rows, TUNING.get("num_warps", warps), TUNING.get("refresh_dot", dot), TUNING.get("step_pin", pin),
            TUNING.get("loads", loads))


#: (rows, warps) per program of the split refresh launch where it differs from the step kernel's:
#: (arch, read format) -> entries (least draft length, rows, warps), by increasing least length; a
#: step of T tokens takes the last entry whose least length is <= T. A refresh shape is only
#: allowed where the GPU gives the fold the same bits at every shape in use, or results would
#: depend on the format, the draft length or the batch size (below SPLIT_MIN_BATCH the step kernel
#: refreshes at its own shape): checked by benchmarks/refresh_bits.py on the H200 (``--split-only``:
#: GDN's token loop gives the same outputs and state at 16x2, 32x2, 32x4 and 64x4, not at 32x1;
#: Mamba-2's chunked fold at 32x1, 32x2, 64x1 and 64x2; ``--anchors``: the same GDN anchor for
#: every read format). An empty refresh launch (no slot due) costs an H200 40 us for Mamba-2's
#: 65536 programs and 80 us for GDN's 131072 at batch 256 (at most 32 resident programs per
#: multiprocessor, each waiting on its slot id), so larger tiles help the staggered steps where the
#: fold's registers allow (eleventh session, us per step, batch 256, staggered, GDN 16x2 -> the
#: entry: s32_rs 416.6 -> 405.6 (32x2; every slot refreshing 1491.6 -> 1530.3), tp16_hi32 364.5 ->
#: 353.1 (32x4); tp8_hi32 339.8 at 16x2, 339.4 at 32x4; Mamba-2 tp8_hi32 32x1 -> 32x2 232.8 ->
#: 220.8, while s32_rs (344.0; 64x1 342.8) and tp16_hi32 (234.1; 32x2 235.9) keep the step's).
#: GDN T = 4 rounds, tenth session: s32_rs 933.9 -> 896.9 at 32x2, tp8_hi32 936.5 -> 986.5.
REFRESH_SHAPES = {("gdn", "fp32"): ((1, 32, 2),), ("gdn", "fp16"): ((1, 32, 4),), ("gdn", "bf16"): ((1, 32, 4),),
                  ("gdn", "fp8_e4m3"): ((1, 16, 2),), ("mamba2", "fp8_e4m3"): ((1, 32, 2),)}


def refresh_shape(cache, arch: str, rows: int, warps: int, T: int = 1) -> tuple[int, int]:
    """(rows, warps) per program of the split refresh launch of a step of T tokens, given the
    step kernel's: ``REFRESH_SHAPES`` or the step's, ``TUNING["refresh_rows"]`` /
    ``["refresh_warps"]`` over that, rows as ``_tile_rows`` allows."""
    if not _uses_nvfp4(cache):  # NVFP4 programs own one scale block of rows: the step's shape
        rows, warps = by_draft(REFRESH_SHAPES.get((arch, cache.precision.read_format.name), ()), T, (rows, warps))
    return _tile_rows(cache, TUNING.get("refresh_rows", rows)), TUNING.get("refresh_warps", warps)


#: Columns of the state a refresh folds and encodes at a time (``refresh_columns``).
REFRESH_COLUMNS = 32

#: ``refresh_columns`` by (architecture, anchor format) where it is not REFRESH_COLUMNS. A Mamba-2
#: refresh from a 2-byte anchor in 32-column passes ran at 17% of DRAM bandwidth (ncu, every slot
#: refreshing, 33.7 cycles per issued instruction against 16.3 from an fp32 anchor); in 64-column
#: passes it takes 224 registers, no spills. H200, batch 256, us per step, 32 -> 64 (128, whole
#: rows, spills 64 registers) columns, thirteenth session: fp16_rs staggered 276.2 -> 225.4
#: (225.6), every slot refreshing 1585.1 -> 684.3 (631.3); s32_rs is slower at 64 (344.1 ->
#: 353.6), so are tp16_hi32 (232.8 -> 241.2) and tp8_hi32 (220.0 -> 258.9), and GDN fp16_rs and
#: bf16_rs gain nothing (348.0 -> 347.7, 336.2 -> 335.1). Keyed by the anchor's format, so
#: presets that share an anchor format fold it alike.
REFRESH_COLUMNS_BY_ANCHOR = {("mamba2", "fp16"): 64, ("mamba2", "bf16"): 64}


def refresh_columns(cache, arch: str) -> int:
    """Columns per pass of a refresh (``mamba2.triton._mamba2_refresh_rows``, the GDN refresh's
    encode): a program loads, folds and encodes a [rows, columns] slice at a time, so the state
    slice, the tensor-core product's operands and its accumulator fit in registers together
    (whole fp32 rows at once took 249-255 registers and spilled, ptxas). A multiple of 32 (one
    fp8 scale block), or the whole row with NVFP4, whose global scale spans the row block.
    ``REFRESH_COLUMNS_BY_ANCHOR`` or REFRESH_COLUMNS; ``TUNING["refresh_columns"]`` overrides
    it. The fused and split refreshes use the same value, so the same bits."""
    if _uses_nvfp4(cache):
        return cache.dk
    default = REFRESH_COLUMNS_BY_ANCHOR.get((arch, cache.precision.anchor.name), REFRESH_COLUMNS)
    return min(cache.dk, TUNING.get("refresh_columns", default))


#: Smallest draft length T whose step computes the read-copy products of all its queries as one
#: tensor-core product, by architecture (``output_dot``); None = never. H200, batch 256, µs per
#: round, cross-thread reductions -> one product: GDN T=4 s32_rs 1540 -> 1239, tp8_hi32 1768 ->
#: 1410; T=8 2997 -> 2453, 3517 -> 2266; but T=2 844 -> 880, 810 -> 960, T=1 502 -> 655; Mamba-2
#: T=4 s32_rs 1017 -> 1190 and slower at T=1 too. BENCHMARKS.md has the sweeps.
OUTPUT_DOT_MIN_DRAFT = {"mamba2": None, "gdn": 4}


def output_dot(cache, arch: str, T: int) -> bool:
    """Whether a step of T tokens runs the read-copy products on tensor cores (3-pass tf32, which
    changes output bits at the 1e-7 level, never the anchor); ``TUNING["output_dot"]`` overrides.
    Not for an NVFP4 read copy: the decoded tile is not a measured win there (GDN T=4
    tp4_hi16_sr 1968 -> 2326 us per round; BENCHMARKS.md)."""
    least = OUTPUT_DOT_MIN_DRAFT[arch]
    default = least is not None and T >= least and cache.precision.read_format.name != "nvfp4"
    return TUNING.get("output_dot", default)


#: Chunks in flight of a step that streams its read copy (``stream_stages``), by architecture:
#: entries (least draft length, stages), the last applicable wins; none = never. H200, batch 256,
#: staggered, us per round with the whole tile in registers -> streamed at 3 chunks
#: (BENCHMARKS.md, tenth session): GDN T=4 s32_rs 1086.1 -> 933.9 (64x4; 162 -> 92 registers,
#: ptxas), tp16_hi32 1152.0 -> 987.5 (32x1), tp8_hi32 1157.2 -> 937.9 (32x1); T=8 s32_rs
#: 2252.8 -> 1426.6, tp8_hi32 2123.2 -> 1716.6 (64x4); but GDN T=2 s32_rs 535.5 -> 601.8 and
#: decode 415.8 -> 551.3 (against their row reductions), and Mamba-2 T=4, whose products are
#: row reductions, s32_rs 594.2 -> 777.0 at best.
STREAM_STAGES = {"mamba2": (), "gdn": ((4, 3),)}


def stream_stages(cache, arch: str, T: int, split: bool) -> int:
    """Chunks in flight when a step streams its read copy through ``formats.streamed_products``
    (its read-copy products on tensor cores, 32 columns at a time in a software-pipelined loop
    through shared memory, so the program never holds the whole [rows, K] tile: fewer registers,
    more programs per multiprocessor), or 0: the tile is loaded whole (``formats.load_read``).
    Only with the outputs' products on tensor cores (``output_dot``), an element-wise or fp8 read
    copy, and the refresh in its own launch (a fused refresh folds from the loaded tile).
    ``STREAM_STAGES`` by draft length; ``TUNING["stream"]`` overrides it (0 = off)."""
    stages = TUNING.get("stream", by_draft(STREAM_STAGES[arch], T, (0,))[0])
    if not (stages and split and output_dot(cache, arch, T)) or cache.precision.read_format.name == "nvfp4":
        return 0
    return stages


#: Programs per multiprocessor of a persistent refresh launch (``refresh_grid``).
REFRESH_PROGRAMS_PER_SM = 8


def refresh_grid(device, grid: tuple, T: int = 1, L: int = 16) -> tuple[tuple, bool]:
    """(grid, PERSISTENT) of the split refresh launch, given the one-program-per-tile grid (row
    blocks, heads, batch rows) of a step of T tokens in windows of L. Persistent
    (``TUNING["persistent_refresh"]``, off by default): a fixed number of programs loop over the
    tiles of the slots that refresh, found on the device (``window.refresh_plan``): no host sync,
    and no programs for the slots that do not refresh. ``TUNING["refresh_programs"]`` sets how
    many: n > 0 = n per multiprocessor (default REFRESH_PROGRAMS_PER_SM; 3 in all on the CPU, so
    the interpreter tests run programs that loop over several tiles); 0 = one per tile of
    ceil(b T / L) slots, the share of a batch at staggered positions that refreshes in one step
    (each program then takes one tile when the slots are staggered, and L / T in turn when they
    all refresh together). Measured on an H200 at batch 256 (us per step, one program per tile
    -> persistent at 8 per multiprocessor): faster for Mamba-2 decode (s32_rs 379.8 -> 373.6,
    tp8_hi32 308.8 -> 278.9), slower elsewhere (Mamba-2 T=4 1031 -> 1126, tp4_hi16_sr 435 -> 460;
    GDN tp8_hi32 451 -> 481, T=4 1483 -> 1555, every slot refreshing 1903 -> 2285). With the
    Mamba-2 refresh in column slices (fifth session): s32_rs 356.7 -> 350.0, tp8_hi32 269.2 ->
    251.7, but tp16_hi32 259.6 -> 280.0 and T=4 978 -> 1012; ninth session s32_rs 344.5 -> 336.9
    but every slot refreshing 875.9 -> 1025.5."""
    if not TUNING.get("persistent_refresh", False):
        return grid, False
    return _persistent_grid(device, grid, T, L), True


def _persistent_grid(device, grid: tuple, T: int, L: int) -> tuple:
    """The grid of a persistent refresh launch (``refresh_grid``'s program counts)."""
    per_sm = TUNING.get("refresh_programs", REFRESH_PROGRAMS_PER_SM)
    if per_sm == 0:
        programs = grid[0] * grid[1] * -(-grid[2] * T // L)
    elif device.type == "cuda":
        programs = torch.cuda.get_device_properties(device).multi_processor_count * per_sm
    else:
        programs = 3
    return (max(1, min(programs, grid[0] * grid[1] * grid[2])),)


#: The first launch of a two-tier refresh (``refresh_launches``) serves this many times the
#: share of a batch at staggered window positions that refreshes in one step, b T / L.
TWO_TIER_SLACK = 1.25


def refresh_launches(device, grid: tuple, T: int = 1, L: int = 16) -> list[tuple[tuple, dict]]:
    """The launches of a split refresh, each (grid, the refresh kernel's PERSISTENT, COMPACT and
    FIRST), given the one-program-per-tile grid (row blocks, heads, batch rows) of a step of T
    tokens in windows of L. Two-tier (``TUNING["two_tier_refresh"]``): a COMPACT launch with one
    program per tile of the first FIRST = ceil(TWO_TIER_SLACK b T / L) refreshing slots, found on
    the device (``window.refresh_plan``), so that in staggered windows no program waits on a slot
    that does not refresh; then a persistent launch for the refreshing slots after those (in
    aligned windows, when every slot refreshes at once). Each tile is folded by the same code as
    in a one-program-per-tile launch, so the bits are the same (H200, every preset). Otherwise one
    launch (``refresh_grid``). Off by default: measured on an H200 at batch 256 (twelfth session,
    us per step, one launch -> two tiers), staggered decode is faster (Mamba-2 s32_rs 347.9 ->
    336.7, tp16_hi32 233.5 -> 221.7, tp8_hi32 219.7 -> 204.3; GDN s32_rs 407.5 -> 399.0, tp8_hi32
    335.6 -> 305.1) but GDN tp16_hi32 is slower (352.5 -> 369.3: its first tier took 128
    registers, not 96; 106 since its programs share ``window.refresh_program``, untimed), T = 4 gains nothing (593.5 -> 590.6, 894.9 -> 909.0), and the step in
    which every slot refreshes is much slower (876.7 -> 1024.1, 1504.1 -> 2010.9). The persistent tier
    runs REFRESH_PROGRAMS_PER_SM programs per multiprocessor whatever the kernel's occupancy."""
    first = min(grid[2], math.ceil(TWO_TIER_SLACK * grid[2] * T / L))
    if TUNING.get("two_tier_refresh", False) and first < grid[2]:
        return [((grid[0], grid[1], first), dict(PERSISTENT=False, COMPACT=True, FIRST=first)),
                (_persistent_grid(device, grid, T, L), dict(PERSISTENT=True, COMPACT=False, FIRST=first))]
    one, persistent = refresh_grid(device, grid, T, L)
    return [(one, dict(PERSISTENT=persistent, COMPACT=False, FIRST=0))]


#: Smallest batch that gets the refresh in a launch of its own, by architecture. Smaller batches
#: are bound by launch latency and save a launch by refreshing inside the step kernel. H200,
#: s32_rs, µs per step split -> fused, with programmatic launch (sixth session, BENCHMARKS.md):
#: batch 1 Mamba-2 7.1 -> 5.9, GDN 8.5 -> 7.9; batch 8 Mamba-2 18.3 -> 16.1 (tp8_hi32 18.3 -> 15.8),
#: GDN 26.9 -> 28.5 but tp16_hi32 26.1 -> 23.1, tp8_hi32 24.4 -> 21.6; batch 16 GDN fused 58.8
#: against split 49.6 (tp8_hi32 38.3 against 41.0). GDN refreshes in its own launch at every batch:
#: only that kernel pins its fold's layout (``pin_vector_width``), so the anchor's bits do not
#: depend on the read format, and a fused refresh would fold in another layout than the split one.
SPLIT_MIN_BATCH = {"mamba2": 16, "gdn": 1}

#: Smallest draft length whose verify steps refresh in a launch of their own at any batch, by
#: architecture (None: by batch only). GDN had 4 (H200, T = 4 round, fused -> split: batch 1
#: s32_rs 53.2 -> 49.0, tp8_hi32 49.1 -> 46.9; batch 8 122.7 -> 92.9, 106.7 -> 93.4, 101.9 -> 92.1)
#: until it split at every batch (``SPLIT_MIN_BATCH``).
SPLIT_MIN_DRAFT = {"mamba2": None, "gdn": None}


def pin_vector_width() -> bool:
    """Whether the GDN refresh kernel pins the vector width of its anchor load
    (``formats.pin_vector_width``): Triton's coalescing otherwise widens that load to match the
    read copy's accesses in the same kernel (fp32 4, fp16 8, fp8 16 elements per thread), the
    token-loop fold follows that layout, and its row reductions sum in a read-format-dependent
    order: on the H200 the anchors of s32_rs and tp16_hi32 differed by 1 ulp in a quarter of their
    elements (BENCHMARKS.md, seventh session). Pinned, every format folds at 16 per thread, which
    ptxas counts as fewer instructions too (s32_rs refresh at 16x2: 4248 -> 2808 SASS instructions,
    640 -> 96 shuffles, 80 -> 96 registers). ``TUNING["pin_vector_width"] = False`` unpins."""
    return TUNING.get("pin_vector_width", True)


def split_refresh(arch: str, batch: int, T: int = 1) -> bool:
    """Refresh in a launch of its own before the step kernel (batch >= SPLIT_MIN_BATCH, or a
    verify step of T >= SPLIT_MIN_DRAFT drafts): the step kernel then carries no refresh code and
    needs far fewer registers (72-167 against 167-255 fused, from benchmarks/ptxas_report.py),
    which measured 1.1-2.1x faster steps at batch 256 on an H200, for the price of one launch and
    a re-read of the refreshed rows' read copy. The two forms run the same fold and encoding code
    and are tested to give the same bits, so the choice by batch size and draft length does not
    make results depend on them. ``TUNING["split_refresh"]`` overrides it."""
    least_draft = SPLIT_MIN_DRAFT[arch]
    by_draft = least_draft is not None and T >= least_draft
    return TUNING.get("split_refresh", batch >= SPLIT_MIN_BATCH[arch] or by_draft)
