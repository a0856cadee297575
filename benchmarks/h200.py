"""A one-command GPU check of a tree: correctness of every preset against the float64 recurrence
at the model geometries at batch 256 (both backends for s32_rs), bit-identity of a 48-step
CUDA-graph replay with eager execution, and a timing table against the conventional kernels.
Writes DIR/h200.json and DIR/h200.log. ``replayssm bench`` makes the published figures; this
script answers "is this tree correct on this GPU, and roughly how fast" in one go.

    PYTHONPATH=src python3 benchmarks/h200.py [--parts correct,graph,time] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

from replayssm.bench import suite
from replayssm.bench.measure import bench_one, correctness, graph_check
from replayssm.bench.suite import Problem
from replayssm.geometry import GEOMETRIES
from replayssm.precision import PRESET_NAMES

DEV = os.environ.get("RS_DEVICE", "cuda")
PRESETS = ["s32_rs", "tp16_hi32", "tp8_hi32", "tp4_hi32", "tp4_hi16_sr", "f4_sr_rs"]
LOG = []


def say(*a):
    line = " ".join(str(x) for x in a)
    print(line, flush=True)
    LOG.append(line)
    if os.environ.get("OUT"):  # keep the log on disk as it grows: a cut-off run still reports
        with open(os.path.join(os.environ["OUT"], "h200.log"), "a") as f:
            f.write(line + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", default="correct,graph,time")
    ap.add_argument("--batches", default="1,8,32,64,128,256,512")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--sweep-presets", default="s32_rs,tp16_hi32,tp8_hi32,tp4_hi16_sr",
                    help="presets timed at batches other than 256")
    ap.add_argument("--check-presets", default=",".join(PRESET_NAMES))
    args = ap.parse_args()
    parts = args.parts.split(",")
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "rows": []}
    t0 = time.time()
    geos = ["nemotron3-super", "qwen35-122b"]
    presets = args.presets.split(",")
    if "correct" in parts:
        say("== correctness vs float64 (batch 256, bf16 buffers, 20 decode steps + 6 verify rounds T=4) ==")
        for geo in geos:
            arch, dims = GEOMETRIES[geo].arch, GEOMETRIES[geo].geometry
            for preset in args.check_presets.split(","):
                for backend in (["triton", "torch"] if preset == "s32_rs" else ["triton"]):
                    p = Problem(arch, dims, 256, 1)
                    try:
                        e, rel, se = correctness(p, preset, DEV, backend)
                        say(f"{geo:16s} {preset:12s} {backend:6s} max_abs {e:.3e} rel {rel:.3e} state {se:.3e}")
                        res["rows"].append(dict(kind="correct", geo=geo, preset=preset, backend=backend,
                                                max_abs=e, rel=rel, state=se))
                    except Exception as exc:
                        say(f"{geo} {preset} {backend} FAILED: {exc!r}")
                        traceback.print_exc()
        say(f"[{time.time() - t0:.0f}s]")
    if "graph" in parts:
        for geo in geos:
            arch, dims = GEOMETRIES[geo].arch, GEOMETRIES[geo].geometry
            try:
                ok = graph_check(Problem(arch, dims, 256, 1), device=DEV)
                say(f"cuda-graph 48-step replay == eager ({geo}): {ok}")
                res["rows"].append(dict(kind="graph", geo=geo, ok=ok))
            except Exception as exc:
                say(f"graph check {geo} FAILED: {exc!r}")
                traceback.print_exc()
        say(f"[{time.time() - t0:.0f}s]")
    if "time" in parts:
        bw = suite.copy_bandwidth()
        res["copy_bw"] = bw
        say(f"copy bandwidth {bw / 1e12:.2f} TB/s")
        batches = [int(x) for x in args.batches.split(",")]
        for geo in geos:
            arch, dims = GEOMETRIES[geo].arch, GEOMETRIES[geo].geometry
            for T in (1, 4):
                for b in batches:
                    if T == 4 and b not in (8, 256):
                        continue
                    p = Problem(arch, dims, b, T)
                    try:
                        (tc, sc), _ = bench_one(p, None, "aligned", device=DEV)
                    except Exception as exc:
                        say(f"{geo} conventional b={b} FAILED {exc!r}")
                        traceback.print_exc()
                        continue
                    conv_bytes = p.batch * p.state_elems * 4 * (2 if T == 1 else 1 + T)
                    say(f"{geo:16s} T={T} b={b:4d} conventional {tc:9.1f} us  {conv_bytes / tc / 1e6:6.2f} TB/s "
                        f"({conv_bytes / tc / 1e6 / (bw / 1e12) * 100:4.0f}% of copy)")
                    res["rows"].append(dict(kind="time", geo=geo, T=T, batch=b, preset="conventional",
                                            mode="-", us=tc, spread=sc, bytes=conv_bytes))
                    ext = "mamba_ssm" if arch == "mamba2" else "fla"
                    why = suite.baseline_available(ext)
                    if T == 1 and why is None:
                        try:
                            (te, se_), _ = bench_one(p, None, "aligned", baseline=ext, device=DEV)
                            say(f"{geo:16s} T={T} b={b:4d} {ext:12s} {te:9.1f} us  {conv_bytes / te / 1e6:6.2f} TB/s  "
                                f"(ours/theirs time {tc / te:4.2f})")
                            res["rows"].append(dict(kind="time", geo=geo, T=T, batch=b, preset=ext, mode="-",
                                                    us=te, spread=se_, bytes=conv_bytes))
                        except Exception as exc:
                            say(f"{ext} b={b} FAILED {exc!r}")
                    elif T == 1:
                        say(f"{ext} skipped: {why}")
                    for preset in (presets if b == 256 else args.sweep_presets.split(",")):
                        modes = ["staggered", "aligned", "refresh"] if b in (256,) else ["staggered"]
                        for mode in modes:
                            try:
                                (t, s), tr = bench_one(p, preset, mode, device=DEV)
                            except Exception as exc:
                                say(f"{geo} {preset} {mode} b={b} FAILED {exc!r}")
                                traceback.print_exc()
                                continue
                            ratio = (tc / t) if mode != "refresh" else (tc / t)
                            bwx = tr["replay"] / t / 1e6
                            say(f"{geo:16s} T={T} b={b:4d} {preset:12s} {mode:9s} {t:9.1f} us  x{ratio:5.2f}  "
                                f"model {tr['replay'] / 1e6:8.2f} MB  {bwx:5.2f} TB/s ({bwx / (bw / 1e12) * 100:3.0f}%)")
                            res["rows"].append(dict(kind="time", geo=geo, T=T, batch=b, preset=preset, mode=mode,
                                                    us=t, spread=s, speedup=ratio, bytes=tr["replay"]))
                    say(f"[{time.time() - t0:.0f}s]")
    with open(os.path.join(args.out, "h200.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
