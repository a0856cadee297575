"""Registers, spills and stack of every kernel of a ReplaySSM step, compiled for an H100/H200
(sm_90a) on a machine without a GPU: the launches of one step on a CPU cache are recorded instead of
run, compiled by Triton for the GPU target, and assembled by the ptxas that ships in triton's wheel.

    PYTHONPATH=src python3 benchmarks/ptxas_report.py [--presets s32_rs,tp8_hi32] [--shapes 16x2ds,32x4s]
    PYTHONPATH=src python3 benchmarks/ptxas_report.py --anchor-ops --presets s32_rs,tp16_hi32,tp8_hi32

High register counts mean few programs per multiprocessor (65536 registers per SM); spills go to
local memory. ``sass`` counts the kernel's machine instructions (nvdisasm; the kernels unroll their
token loops, so for a refresh program this is close to what each thread issues) and ``shfl`` the
warp shuffles among them. None of these is a timing: BENCHMARKS.md has the timings.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import replayssm as rs
from replayssm._triton import launch

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
NVDISASM = os.path.join(os.path.dirname(PTXAS), "nvdisasm")
TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float8_e4m3fn: "*fp8e4nv",
         torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64"}
# the real geometries (two slots) with the benchmarks' bf16 buffers: the head counts and
# element types decide the compiler's alignment facts, hence vector widths and layouts
GEOMETRY = {"mamba2": dict(nheads=128, headdim=64, dstate=128, ngroups=8, buffer_dtype=torch.bfloat16),
            "gdn": dict(num_k_heads=16, num_v_heads=64, head_k_dim=128, head_v_dim=128, buffer_dtype=torch.bfloat16)}


def record_step(arch: str, preset: str, T: int = 1):
    """The (kernel, args, kwargs) of one decode (T = 1) or verify step, recorded, not run."""
    calls = []
    launch.LAUNCHER = lambda kernel, grid, args, kwargs: calls.append((kernel, args, kwargs))
    try:
        g = torch.Generator().manual_seed(0)
        r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
        b, slots = 2, torch.arange(2)
        if arch == "mamba2":
            c = rs.Mamba2Cache(2, window=16, max_draft=4, precision=preset, **GEOMETRY[arch])
            H, P, N, G = c.nheads, c.dv, c.dk, c.ngroups
            args = (r(b, T, H, P), r(b, T, H), -torch.rand(H), r(b, T, G, N), r(b, T, G, N), r(H), r(b, T, H, P),
                    torch.zeros(H), True)
            (rs.mamba2_verify if T > 1 else rs.mamba2_decode)(
                c, slots, *(a[:, 0] if T == 1 and a.dim() > 1 else a for a in args[:-1]), args[-1], backend="triton")
        else:
            c = rs.GDNCache(2, window=16, max_draft=4, precision=preset, **GEOMETRY[arch])
            HK, HV, K, V = c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim
            args = (r(b, T, HK, K), r(b, T, HK, K), r(b, T, HV, V), -torch.rand(b, T, HV), torch.rand(b, T, HV))
            (rs.gdn_verify if T > 1 else rs.gdn_decode)(
                c, slots, *(a[:, 0] if T == 1 else a for a in args), use_qk_l2norm=True, backend="triton")
    finally:
        launch.LAUNCHER = launch._launch
    return calls


def compile_sm90(kernel, args, kwargs):
    """Compile one recorded launch for sm_90a (Triton's compiled kernel: ``.asm`` has ttgir, ptx,
    cubin), specialized as Triton's launcher specializes it on the GPU: pointers and integers that
    are multiples of 16 carry that fact (``tt.divisibility``), which widens vector accesses and so
    changes layouts. Without it, the TTGIR compared by ``anchor_slice`` is not the device's."""
    names = kernel.arg_names
    constexprs = {k: v for k, v in kwargs.items() if k in names}
    signature, attrs = {}, {}
    for i, (name, value) in enumerate(zip(names, list(args) + [None] * (len(names) - len(args)))):
        if name in constexprs:
            signature[name] = "constexpr"
        elif isinstance(value, torch.Tensor):
            signature[name] = TYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        else:
            signature[name] = "i64" if abs(int(value)) >= 2**31 else "i32"
            aligned = int(value) % 16 == 0
        if name not in constexprs and aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    options = {"num_warps": kwargs.get("num_warps", 4)}
    if "enable_fp_fusion" in kwargs:
        options["enable_fp_fusion"] = kwargs["enable_fp_fusion"]
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def assemble(kernel, args, kwargs) -> dict:
    """Compile one recorded launch for sm_90a; ptxas's resource counts."""
    compiled = compile_sm90(kernel, args, kwargs)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    log = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
    os.unlink(f.name)
    grab = lambda pattern: int(re.search(pattern, log).group(1))  # noqa: E731
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    sass = subprocess.run([NVDISASM, f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    return {"shared": compiled.metadata.shared, "registers": grab(r"Used (\d+) registers"),
            "spill_stores": grab(r"(\d+) bytes spill stores"), "spill_loads": grab(r"(\d+) bytes spill loads"),
            "stack": grab(r"(\d+) bytes stack frame"), "sass": len(ops),
            "shfl": sum(op.startswith("SHFL") for op in ops)}


FLOAT = re.compile(r"x(?:f16|bf16|f32|f64|f8\w*)[,>]|: (?:f16|bf16|f32)\b")


def anchor_slice(compiled, values_only: bool = False, anchor_arg: str = "av_ptr") -> list[str]:
    """The TTGIR operations that the kernel's stores to ``anchor_arg`` depend on (their backward
    data-flow slice, pointers and values), one line each in program order, with value names and
    source locations dropped: what the anchor is computed from, comparable across compilations.
    A layout (how a tensor's elements are spread over threads) decides bits only where elements
    are combined: reductions and dot products carry their layouts spelled out (#blocked3 in one
    kernel is #blocked1 in another); other operations carry none, and layout conversions, which
    move values unchanged, are left out. ``values_only``: only the operations with floating-point
    results (loads, arithmetic, reductions) and the stores, not the address arithmetic."""
    ttgir = compiled.asm["ttgir"]
    layouts = dict(re.findall(r"^(#(?:blocked|shared|mma|linear)\w*) = (.*)$", ttgir, re.M))
    alias = re.compile("|".join(sorted(map(re.escape, layouts), key=len, reverse=True)) + r"\b") if layouts else None
    lines = [re.sub(r"loc\([^)]*\)", "", line).strip() for line in ttgir.splitlines()]
    value = re.compile(r"%[A-Za-z_0-9]+")
    defs, args = {}, set(value.findall(next(line for line in lines if "tt.func" in line)))
    for i, line in enumerate(lines):
        m = re.match(r"((?:%[\w]+(?::\d+)?(?:, )?)+) = ", line)
        if m:
            for name in value.findall(m.group(1)):
                defs[name] = i
    wanted, stack = set(), []
    reaches = {}

    def from_anchor(name, seen=()):  # does this value derive from the anchor pointer argument?
        if name == "%" + anchor_arg:
            return True
        if name not in reaches:
            i = defs.get(name)
            reaches[name] = i is not None and name not in seen and any(
                from_anchor(u, (*seen, name)) for u in value.findall(lines[i].split(" = ", 1)[1]))
        return reaches[name]

    for i, line in enumerate(lines):
        if line.startswith("tt.store ") and from_anchor(value.findall(line)[0]):
            wanted.add(i)
            stack += value.findall(line)
    while stack:
        i = defs.get(stack.pop())
        if i is not None and i not in wanted:
            wanted.add(i)
            stack += value.findall(lines[i].split(" = ", 1)[1])
    ops, constants = [], []
    for i in sorted(wanted):
        line = lines[i]
        if line.endswith("({"):  # a reduction: its operand and result types close its region
            line += " " + next(close for close in lines[i + 1:] if close.startswith("})"))
        if "ttg.convert_layout" in line:
            continue
        line = value.sub(lambda m: m.group(0) if m.group(0) in args else "%v", line)
        combines = "tt.reduce" in line or "dot" in line.split(" : ", 1)[0]
        if alias:
            line = alias.sub(lambda m: layouts[m.group(0)] if combines else "#layout", line)
        if values_only and not (line.startswith("tt.store") or FLOAT.search(line.rsplit(" : ", 1)[-1])):
            continue
        (constants if "arith.constant" in line else ops).append(line)
    # program order is the scheduler's (a hoisted address computation moves everything after
    # it), not the data flow's: compare the operations as a multiset
    return sorted(constants) + sorted(ops)


def anchor_ops(arch: str, presets: list[str]) -> dict:
    """Whether each preset computes its anchor from exactly the operations of the first preset
    (``anchor_slice``: the floating-point ones, with the layouts of reductions and products), in
    the split refresh kernel and, where the defaults ever fuse the refresh (Mamba-2 below
    ``launch.SPLIT_MIN_BATCH``), in the step kernel with the refresh fused: a compile-level check
    of DESIGN §3 (the read precision leaves the anchor bit-identical) for presets with the same
    anchor format, each refresh at the first preset's tile (``launch.REFRESH_SHAPES`` picks the
    tile by read format: that the fold gives the same bits at each of those tiles is a GPU fact,
    refresh_bits.py --split-only). The bits themselves are checked on the GPU (refresh_bits.py
    --anchors). Prints and returns {(kernel, preset): same}."""
    found = {}
    tuning = dict(launch.TUNING)  # --tuning, kept for every recording
    kinds = [(True, "refresh_kernel", True)]
    if not launch.split_refresh(arch, 1):  # the defaults fuse the refresh at some batch
        kinds.append((False, "step_kernel", True))
    for split, name, values_only in kinds:
        launch.TUNING.update(tuning, split_refresh=split)
        try:
            first = next((k, a, kw) for k, a, kw in record_step(arch, presets[0]) if name in k.fn.__name__)
            if split:  # every preset at the first one's refresh tile (launch.REFRESH_SHAPES varies it by format)
                launch.TUNING.setdefault("refresh_rows", first[2]["BV"])
                launch.TUNING.setdefault("refresh_warps", first[2]["num_warps"])
            kernels = {p: next((k, a, kw) for k, a, kw in record_step(arch, p) if name in k.fn.__name__)
                       for p in presets}
        finally:
            launch.TUNING.clear()
            launch.TUNING.update(tuning)
        ref = anchor_slice(compile_sm90(*kernels[presets[0]]), values_only)
        for preset in presets[1:]:
            ops = anchor_slice(compile_sm90(*kernels[preset]), values_only)
            codes = difflib.SequenceMatcher(None, ref, ops, autojunk=False).get_opcodes()
            changed = sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in codes if tag != "equal")
            found[(name, preset)] = changed == 0
            verdict = "same" if changed == 0 else f"DIFFER in {changed}"
            print(f"anchor-ops {arch:6s} {name:14s} {presets[0]} vs {preset:12s} {verdict} ({len(ref)} operations)",
                  flush=True)
    return found


def instructions(compiled) -> list[str]:
    """The PTX instructions of a compiled kernel as a sorted multiset, register names masked,
    labels and debug lines dropped: two builds that list the same lines run the same operations, in an order
    the scheduler may still change. Written by ``--instructions`` to compare source trees (e.g.
    that a refactor leaves a kernel's code as it was: run once per tree, then ``diff -r``)."""
    code = compiled.asm["ptx"].split(".section", 1)[0]
    lines = [line.strip() for line in code.splitlines()]
    keep = [line for line in lines
            if line and not line.endswith(":") and not line.startswith(("//", ".loc", ".file", ".b8", ".b32", ".b64"))]
    return sorted(re.sub(r"%[a-z]+[0-9]+", "%r", re.sub(r"\$L__\w+", "L", line)) for line in keep)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="mamba2,gdn")
    ap.add_argument("--presets", default="s32_rs,tp16_hi32,tp8_hi32,tp4_hi16_sr,f4_sr_rs")
    ap.add_argument("--shapes", default="default",
                    help="default, or labels as launch.parse_shape reads them, e.g. 16x2ds,32x4s")
    ap.add_argument("--draft", type=int, default=1, help="tokens per step (1 = decode)")
    ap.add_argument("--batch", type=int, default=256,
                    help="batch whose default launches to compile (split or fused refresh)")
    ap.add_argument("--anchor-ops", action="store_true",
                    help="instead: compare the operations behind the split refresh kernels' anchor stores with "
                         "the first preset's (anchor_ops)")
    ap.add_argument("--instructions", metavar="DIR",
                    help="instead: write each step and refresh kernel's PTX instructions (``instructions``) to "
                         "DIR/<arch>_<preset>_T<draft>_<kernel>.txt, to diff against another source tree's")
    ap.add_argument("--tuning", action="append", default=[], metavar="KEY=INT",
                    help="a launch.TUNING entry for every compile, e.g. pin_vector_width=0 (repeatable)")
    args = ap.parse_args(argv)
    extra = {key: int(value) for key, _, value in (item.partition("=") for item in args.tuning)}
    launch.TUNING.update(extra)
    if args.anchor_ops:
        for arch in args.arch.split(","):
            anchor_ops(arch, args.presets.split(","))
        return
    if not args.instructions:
        print(f"{'arch':7s} {'preset':12s} {'shape':8s} {'kernel':24s} {'regs':>4s} {'spill st/ld':>11s} {'stack':>5s} "
              f"{'smem':>6s} {'sass':>6s} {'shfl':>5s}")
    for arch in args.arch.split(","):
        for preset in args.presets.split(","):
            for shape in args.shapes.split(","):
                launch.TUNING.clear()
                launch.TUNING.update(extra)
                if shape != "default":
                    launch.TUNING.update(launch.parse_shape(shape))
                else:  # the steps are recorded at batch 2; compile the launches of --batch
                    launch.TUNING["split_refresh"] = launch.split_refresh(arch, args.batch, args.draft)
                for kernel, a, kw in record_step(arch, preset, args.draft):
                    if "step" not in kernel.fn.__name__ and "refresh" not in kernel.fn.__name__:
                        continue
                    if args.instructions:
                        os.makedirs(args.instructions, exist_ok=True)
                        name = f"{arch}_{preset}_T{args.draft}_{kernel.fn.__name__.strip('_')}.txt"
                        with open(os.path.join(args.instructions, name), "w") as f:
                            f.write("\n".join(instructions(compile_sm90(kernel, a, kw))) + "\n")
                        continue
                    res = assemble(kernel, a, kw)
                    shown = f"{kw['BV']}x{kw['num_warps']}"
                    print(f"{arch:7s} {preset:12s} {shown:8s} {kernel.fn.__name__:24s} {res['registers']:4d} "
                          f"{res['spill_stores']:5d}/{res['spill_loads']:<5d} {res['stack']:5d} {res['shared']:6d} "
                          f"{res['sass']:6d} {res['shfl']:5d}",
                          flush=True)
    launch.TUNING.clear()


if __name__ == "__main__":
    main()
