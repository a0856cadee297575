"""Registers, spills and stack of every kernel of a ReplaySSM step, compiled for an H100/H200
(sm_90a) on a machine without a GPU: the launches of one step on a CPU cache are recorded instead of
run, compiled by Triton for the GPU target, and assembled by the ptxas that ships in triton's wheel.

    PYTHONPATH=src python3 benchmarks/ptxas_report.py [--arch mamba2,gdn,kda] [--presets s32_rs,tp8_hi32] [--shapes 32x1,64x4ok3] [--draft 4] [--tree] [--dims 24,48]

High register counts mean few programs per multiprocessor (65536 registers per SM); spills go to
local memory. ``sass`` counts the kernel's machine instructions (nvdisasm; the kernels unroll their
loops, so this is close to what a refreshing program's threads issue) and ``shfl`` the
warp shuffles among them. None of these is a timing: BENCHMARKS.md has the timings.
"""
from __future__ import annotations

import argparse
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
            "gdn": dict(num_k_heads=16, num_v_heads=64, head_k_dim=128, head_v_dim=128, buffer_dtype=torch.bfloat16),
            "kda": dict(num_k_heads=32, num_v_heads=32, head_k_dim=128, head_v_dim=128, buffer_dtype=torch.bfloat16)}


#: The head dims (dv, dk) of each geometry, which ``--dims`` replaces.
HEAD_DIMS = {"mamba2": ("headdim", "dstate"), "gdn": ("head_v_dim", "head_k_dim"), "kda": ("head_v_dim", "head_k_dim")}


def record_step(arch: str, preset: str, T: int = 1, tree: bool = False, dims=None, activations=torch.bfloat16,
                slots: int = 2):
    """The (kernel, args, kwargs) of one decode (T = 1) or verify step over ``slots`` slots (1 or
    2), recorded, not run; with
    ``tree``, a verify of a draft tree (every draft a child of the root's first child); ``dims``:
    (dv, dk) in place of the geometry's; ``activations``: the per-token inputs' dtype (the
    benchmarks' bf16 by default; gates and per-head constants stay fp32)."""
    geometry = dict(GEOMETRY[arch], **({} if dims is None else dict(zip(HEAD_DIMS[arch], dims))))
    calls = []
    launch.LAUNCHER = lambda kernel, grid, args, kwargs: calls.append((kernel, args, kwargs))
    try:
        g = torch.Generator().manual_seed(0)
        r = lambda *s: torch.randn(*s, generator=g).to(activations)  # noqa: E731
        b, slots = slots, torch.arange(slots)
        parents = dict(parents=torch.tensor([[-1] + [0] * (T - 1)] * b)) if tree else {}
        if arch == "mamba2":
            c = rs.Mamba2Cache(2, window=16, max_draft=max(4, T), precision=preset, **geometry)
            H, P, N, G = c.nheads, c.dv, c.dk, c.ngroups
            dt = torch.randn(b, T, H, generator=g)
            args = (r(b, T, H, P), dt, -torch.rand(H), r(b, T, G, N), r(b, T, G, N), torch.randn(H, generator=g),
                    r(b, T, H, P), torch.zeros(H), True)
            (rs.mamba2_verify if T > 1 else rs.mamba2_decode)(
                c, slots, *(a[:, 0] if T == 1 and a.dim() > 1 else a for a in args[:-1]), args[-1], backend="triton",
                **parents)
        else:
            cache_type, decode, verify = {"gdn": (rs.GDNCache, rs.gdn_decode, rs.gdn_verify),
                                          "kda": (rs.KDACache, rs.kda_decode, rs.kda_verify)}[arch]
            c = cache_type(2, window=16, max_draft=max(4, T), precision=preset, **geometry)
            HK, HV, K, V = c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim
            decay = (b, T, HV, K) if arch == "kda" else (b, T, HV)  # KDA: one per key channel
            args = (r(b, T, HK, K), r(b, T, HK, K), r(b, T, HV, V), -torch.rand(*decay),
                    torch.rand(b, T, HV).to(activations))
            (verify if T > 1 else decode)(
                c, slots, *(a[:, 0] if T == 1 else a for a in args), use_qk_l2norm=True, backend="triton", **parents)
    finally:
        launch.LAUNCHER = launch._launch
    return calls


def compile_sm90(kernel, args, kwargs):
    """Compile one recorded launch for sm_90a (Triton's compiled kernel: ``.asm`` has ttgir, ptx,
    cubin), specialized as Triton's launcher specializes it on the GPU: pointers and integers that
    are multiples of 16 carry that fact (``tt.divisibility``), which widens vector accesses and so
    changes layouts, and integers equal to 1 become constants. Without it, the compiled code is not
    the device's."""
    names = kernel.arg_names
    constexprs = {k: v for k, v in kwargs.items() if k in names}
    # constexpr parameters passed by position (the input strides) are compile-time values too
    constexprs.update({p.name: v for p, v in zip(kernel.params, args) if p.is_constexpr})
    signature, attrs = {}, {}
    for i, (name, value) in enumerate(zip(names, list(args) + [None] * (len(names) - len(args)))):
        if name in constexprs:
            signature[name] = "constexpr"
        elif not isinstance(value, torch.Tensor) and not isinstance(value, float) and int(value) == 1:
            signature[name] = "constexpr"  # the launcher folds integers equal to 1 (unit strides) into the code
            constexprs[name] = 1
            continue
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
    if kwargs.get("maxnreg"):
        options["maxnreg"] = kwargs["maxnreg"]
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
    return {"shared": compiled.metadata.shared, "registers": grab(r"Used (\d+) registers"), "listing": sass,
            "spill_stores": grab(r"(\d+) bytes spill stores"), "spill_loads": grab(r"(\d+) bytes spill loads"),
            "stack": grab(r"(\d+) bytes stack frame"), "sass": len(ops),
            "shfl": sum(op.startswith("SHFL") for op in ops)}


FLOAT = re.compile(r"x(?:f16|bf16|f32|f64|f8\w*)[,>]|: (?:f16|bf16|f32)\b")


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


def kernel_label(kernel, kwargs) -> str:
    """The kernel's name, with ":due" for a step launch over the slots due only
    (``launch.DUE_ONLY``, ``StepShape.beside``), which compiles apart from the launch over the others."""
    return kernel.fn.__name__ + (":due" if kwargs.get("DUE") == launch.DUE_ONLY else "")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="mamba2,gdn,kda")
    ap.add_argument("--presets", default="s32_rs,tp16_hi32,tp8_hi32,tp4_hi16_sr,f4_sr_rs")
    ap.add_argument("--shapes", default="default",
                    help="default, or labels as launch.parse_shape reads them, e.g. 32x1,64x4ok3")
    ap.add_argument("--draft", type=int, default=1, help="tokens per step (1 = decode)")
    ap.add_argument("--tree", action="store_true", help="a verify of a draft tree (mamba2, gdn; --draft > 1)")
    ap.add_argument("--instructions", metavar="DIR",
                    help="instead: write each step and refresh kernel's PTX instructions (``instructions``) to "
                         "DIR/<arch>_<preset>_T<draft>_<kernel>.txt, to diff against another source tree's")
    ap.add_argument("--tuning", action="append", default=[], metavar="KEY=INT",
                    help="a launch.TUNING entry for every compile, e.g. pin=0 (repeatable)")
    ap.add_argument("--dims", metavar="DV,DK", help="head dims in place of the real geometries' (e.g. 24,48)")
    ap.add_argument("--activations", default="bf16", choices=("bf16", "fp16", "fp32"),
                    help="dtype of the per-token inputs (the benchmarks pass bf16)")
    ap.add_argument("--sass", metavar="DIR",
                    help="also write each step kernel's machine code (nvdisasm) to "
                         "DIR/<arch>_<preset>_<shape>_T<draft>.sass")
    ap.add_argument("--batch", type=int, default=256,
                    help="the batch whose default launches to compile (steps are recorded on two slots, or one "
                         "for batch 1)")
    args = ap.parse_args(argv)
    if args.batch >= launch.SPLIT_MIN_BATCH:
        launch.SPLIT_MIN_BATCH = 1  # the two recorded slots take the launches of a large batch
    if args.batch > launch.FUSED_MAX_BATCH:
        launch.FUSED_MAX_BATCH = 0  # ... and not the one launch of the smallest
    extra = {key: int(value) for key, _, value in (item.partition("=") for item in args.tuning)}
    launch.TUNING.update(extra)
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
                dims = None if args.dims is None else tuple(int(d) for d in args.dims.split(","))
                activations = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.activations]
                for kernel, a, kw in record_step(arch, preset, args.draft, args.tree, dims, activations,
                                                   min(args.batch, 2)):
                    if not any(part in kernel.fn.__name__ for part in ("step", "refresh", "scores", "solve")):
                        continue
                    label = kernel_label(kernel, kw)
                    if args.instructions:
                        os.makedirs(args.instructions, exist_ok=True)
                        name = f"{arch}_{preset}_T{args.draft}_{label.strip('_').replace(':', '_')}.txt"
                        with open(os.path.join(args.instructions, name), "w") as f:
                            f.write("\n".join(instructions(compile_sm90(kernel, a, kw))) + "\n")
                        continue
                    res = assemble(kernel, a, kw)
                    if args.sass and label.endswith("step_kernel"):
                        os.makedirs(args.sass, exist_ok=True)
                        with open(os.path.join(args.sass, f"{arch}_{preset}_{shape}_T{args.draft}.sass"), "w") as f:
                            f.write(res["listing"])
                    shown = f"{kw.get('BV', kw.get('FR', '-'))}x{kw.get('num_warps', 4)}"
                    print(f"{arch:7s} {preset:12s} {shown:8s} {label:24s} {res['registers']:4d} "
                          f"{res['spill_stores']:5d}/{res['spill_loads']:<5d} {res['stack']:5d} {res['shared']:6d} "
                          f"{res['sass']:6d} {res['shfl']:5d}",
                          flush=True)
    launch.TUNING.clear()


if __name__ == "__main__":
    main()
