"""Device time per kernel of a ReplaySSM step on the GPU: which launch costs what. Runs the
configurations ``bench`` times (real geometries, a state pool larger than L2, staggered
windows by default), eagerly under ``torch.profiler`` instead of in a CUDA graph, and prints per
configuration each kernel's mean device time per step, its launches per step, and the shortest
and longest single launch (in aligned windows the shortest refresh launch is one with no slot due).

    PYTHONPATH=src python3 benchmarks/profile_kernels.py gdn:s32_rs mamba2:tp8_hi32:::4 \\
        gdn:s32_rs:aligned mamba2:s32_rs::32x1f mamba2:conv

Each argument is ``arch:preset[:mode[:shape[:T]]]``, as for ``profile_steps.py`` (the ncu
driver, which runs its own small setup): preset ``conv`` = our conventional kernel; mode
staggered (the default), aligned or refresh; shape a ``launch.parse_shape`` label, empty or "default" for the
tables' shapes; T > 1: verify rounds of T drafts, all accepted. Batch 256 unless ``--batch``; the
layer kind's default model unless ``--model``.
"""
from __future__ import annotations

import argparse
import collections
import sys

import torch

from replayssm._triton import launch
from replayssm.bench import measure, suite
from replayssm.bench.suite import Problem
from replayssm.geometry import DEFAULT_MODEL, GEOMETRIES



def profiled(step_fns, found: dict) -> tuple[float, float]:
    """A stand-in for ``suite.time_graph``: runs the steps once to warm up, then once under the
    profiler, and fills ``found`` with {kernel: (us per step, launches per step, min us, max us)}."""
    for fn in step_fns:
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for fn in step_fns:
            fn()
        torch.cuda.synchronize()
    times = collections.defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name].append(event.device_time_total)
    n = len(step_fns)
    found.update({name: (sum(t) / n, len(t) / n, min(t), max(t)) for name, t in times.items()})
    return 0.0, 0.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="+", metavar="ARCH:PRESET[:MODE[:SHAPE[:T]]]")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--model", default="", help="a geometry name of replayssm.geometry (default: the layer kind's)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_kernels: needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    found: dict = {}
    suite.time_graph = lambda step_fns, reps=20: profiled(step_fns, found)
    for config in args.configs:
        arch, preset, mode, label, T = (config.split(":") + [""] * 3)[:5]
        mode, T = mode or "staggered", int(T or 1)
        launch.TUNING.clear()
        launch.TUNING.update(launch.parse_shape(label) if label not in ("", "default") else {})
        found.clear()
        try:
            measure.bench_one(Problem(arch, GEOMETRIES[args.model or DEFAULT_MODEL[arch]].geometry, args.batch, T),
                              None if preset == "conv" else preset, mode)
        finally:
            launch.TUNING.clear()
        total = sum(v[0] for v in found.values())
        kernels = sorted(found.items(), key=lambda kv: -kv[1][0])
        print(f"{config}: {total:.1f} us per step: " + "; ".join(
            f"{name[:32]} {us:.1f} (x{calls:.2f}, {lo:.1f}-{hi:.1f})" for name, (us, calls, lo, hi) in kernels),
            flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
