"""Launch-shape sweep on the GPU: rows per program x warps, for the ReplaySSM step kernels and the
conventional baselines, at batch 256 with real geometries (staggered windows, CUDA graphs).
Checks the kernels against float64 first. Prints one line per configuration and writes
$OUT/sweep.json. Used to pick the defaults in ``_triton/launch.py`` and ``bench/conventional.py``.

    PYTHONPATH=src python3 benchmarks/sweep_shapes.py [--presets s32_rs,tp8_hi32] [--skip-check] \
        [--check-shapes "32x2;64x4"] [--shapes default,32x2] [--gdn-shapes default,64x4] [--drafts 1,4]
    # shapes as launch.parse_shape reads them: rows x warps, then optionally "v16" (the read-copy
    # pin), "o" (outputs' products on tensor cores), "k3" (streamed read copy); a label overrides
    # those fields of the default shape (launch.step_shape), "default" is the table's.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from replayssm._triton import launch
from replayssm.bench import conventional, suite
from replayssm.bench.measure import bench_one, correctness, graph_check
from replayssm.bench.suite import Problem
from replayssm.geometry import DEFAULT_MODEL


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="s32_rs,tp16_hi32,tp8_hi32")
    ap.add_argument("--check-presets", default="s32_rs,tp8_hi32,tp4_hi16_sr,f4_sr_rs")
    ap.add_argument("--shapes", default="default,32x2", help="Mamba-2 step kernel shapes (launch.parse_shape labels, or default)")
    ap.add_argument("--gdn-shapes", default="default,32x2", help="GDN step kernel shapes")
    ap.add_argument("--drafts", default="1,4", help="T values to time")
    ap.add_argument("--conv-shapes", default="8x1,16x1")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--arch", default="mamba2,gdn")
    ap.add_argument("--model", action="append", default=[], metavar="ARCH=NAME",
                    help="a geometry of replayssm.geometry in place of the layer kind's, e.g. gdn=qwen3-next")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--check-shapes", default="", metavar="LABELS",
                    help="also run the checks under these launch.parse_shape labels (Mamba-2 labels, then GDN "
                         "labels after ';'), e.g. '32x2;64x4'")
    ap.add_argument("--modes", default="", help="window modes to time at T=1 for every preset, e.g. "
                    "staggered,refresh (default: staggered, and refresh too for s32_rs)")
    ap.add_argument("--tuning", action="append", default=[], metavar="KEY=INT",
                    help="a launch.TUNING entry on top of every check and shape, e.g. pin=0 (repeatable)")
    args = ap.parse_args()
    extra = {key: int(value) for key, _, value in (item.partition("=") for item in args.tuning)}
    out = {"rows": [], "checks": []}
    t0 = time.time()
    for arch in args.arch.split(","):
        dims = suite.GEOMETRIES[dict(DEFAULT_MODEL, **dict(m.split("=") for m in args.model))[arch]][1]
        labels = args.check_shapes.split(";")[0 if arch == "mamba2" else -1] if args.check_shapes else ""
        for label in ([] if args.skip_check else ["default"]) + [x for x in labels.split(",") if x]:
            launch.TUNING.clear()
            launch.TUNING.update({} if label == "default" else launch.parse_shape(label), **extra)
            for preset in args.check_presets.split(","):
                e, rel, se = correctness(Problem(arch, dims, args.batch, 1), preset)
                out["checks"].append(dict(arch=arch, shape=label, preset=preset, max_abs=e, rel=rel, state=se))
                print(f"check {arch:6s} {label} {preset:12s} max abs {e:.2e} rel {rel:.2e} state {se:.2e}", flush=True)
            same = graph_check(Problem(arch, dims, args.batch, 1))
            print(f"graph {arch} {label} 48-step replay bit-identical: {same}", flush=True)
            out["checks"].append(dict(arch=arch, shape=label, graph_identical=same))
            launch.TUNING.clear()
        for T in map(int, args.drafts.split(",")):
            p = Problem(arch, dims, args.batch, T)
            for shape in filter(None, args.conv_shapes.split(",")):  # "" times none
                rows, warps = map(int, shape.split("x"))
                conventional.SHAPE["override"] = (rows, warps)
                (us, sp), _ = bench_one(p, None)
                gbs = p.batch * p.state_elems * 4 * (1 + T) / us / 1e6
                print(f"{arch:6s} T={T} conventional {shape:5s} {us:8.1f} us ±{sp:4.1f}  {gbs:.2f} TB/s", flush=True)
                out["rows"].append(dict(arch=arch, T=T, kernel="conventional", shape=shape, us=us, tbs=gbs))
            for preset in args.presets.split(","):
                for shape in (args.shapes if arch == "mamba2" else args.gdn_shapes).split(","):
                    tuning = {} if shape == "default" else launch.parse_shape(shape)
                    if T > 1 and tuning.get("rows", 0) > 64:
                        continue
                    launch.TUNING.clear()
                    launch.TUNING.update(tuning, **extra)
                    modes = ["staggered", "refresh"] if T == 1 and preset == "s32_rs" else ["staggered"]
                    if args.modes and T == 1:
                        modes = args.modes.split(",")
                    for mode in modes:
                        (us, sp), tr = bench_one(p, preset, mode)
                        print(f"{arch:6s} T={T} {preset:12s} {mode:9s} {shape:5s} {us:8.1f} us ±{sp:4.1f}  "
                              f"{tr['replay'] / us / 1e6:.2f} TB/s model", flush=True)
                        out["rows"].append(dict(arch=arch, T=T, kernel=preset, mode=mode, shape=shape, us=us,
                                                tbs=tr["replay"] / us / 1e6))
            launch.TUNING.clear()
            conventional.SHAPE.pop("override", None)
    out["copy_bandwidth"] = suite.copy_bandwidth()
    print(f"copy ceiling {out['copy_bandwidth'] / 1e12:.2f} TB/s; {time.time() - t0:.0f} s", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "sweep.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
