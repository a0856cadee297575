"""Does the refresh's checkpoint depend on the launch shape? On the GPU, at real geometries: run a
window of decode steps and then a refresh of every slot, once per launch configuration (the step
kernel's shape with the refresh fused or split, and split refreshes at other shapes), and compare
the anchor and read-copy bits and the outputs with the first configuration's. Prints one line
per configuration. A shape whose bits differ cannot serve as the refresh shape: results would
depend on the batch size (small batches refresh inside the step kernel).

    PYTHONPATH=src python3 benchmarks/refresh_bits.py [--arch mamba2,gdn] [--refresh-shapes 16x1,16x2,32x4] \
        [--refresh-dot on] [--step-shapes 32x2del,16x2del] [--anchors --presets s32_rs,tp16_hi32,tp4_hi32] \
        [--split-only]
"""
from __future__ import annotations

import argparse

import torch

from replayssm._triton import launch
from replayssm.bench import suite
from replayssm.bench.suite import Problem

GEO = {"mamba2": "nemotron3-super", "gdn": "qwen35-122b"}
EXTRA: dict = {}  # TUNING added to every configuration (--fp-fusion)
DRAFT = 1  # tokens per step (--draft)
SMALL = {"mamba2": (2, 64, 128, 1), "gdn": (1, 2, 128, 128)}  # --small: a CPU smoke run (TRITON_INTERPRET=1)


def run(arch: str, preset: str, tuning: dict, dims, device, batch: int = 8, window: int = 16):
    """Outputs of the refreshing step and the cache's state rows after it, under ``tuning``: a
    window of decode steps, or of verify rounds of DRAFT tokens all accepted (``--draft``)."""
    gen = torch.Generator(device=device).manual_seed(4)
    T = DRAFT
    p = Problem(arch, dims, batch, T)
    prm = suite.make_params(p, device, gen)
    cache = suite.make_cache(p, batch, preset, window, 4, device)
    slots = torch.arange(batch, device=device)
    cache.load_state(slots, torch.randn(batch, *cache.state_shape, device=device, generator=gen) * 0.1)
    launch.TUNING.clear()
    launch.TUNING.update(tuning, **EXTRA)
    try:
        accepted = torch.full((batch,), T, dtype=torch.int32, device=device)
        for _ in range(window // T + 1):  # the last call refreshes every slot
            y = suite.replay_call(p, cache, slots, suite.make_inputs(p, device, gen), prm, T > 1, "triton")
            if T > 1:
                cache.accept(slots, accepted)
    finally:
        launch.TUNING.clear()
    return y, {k: v[:batch] for k, v in cache.state_dict().items() if torch.is_tensor(v)}  # not the scratch row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="mamba2,gdn")
    ap.add_argument("--presets", default="s32_rs,tp8_hi32,tp16_hi32")
    ap.add_argument("--refresh-shapes", default="16x1,16x2,32x2,32x4,64x4")
    ap.add_argument("--refresh-dot", choices=["default", "on", "off"], default="default",
                    help="the refresh fold on tensor cores (launch.SHAPES' choice by default)")
    ap.add_argument("--step-shapes", default=None, metavar="LABELS",
                    help="instead: compare whole step configurations, launch.parse_shape labels, with the first "
                         "(e.g. 32x2del,16x2del: the step kernel at another tile shape)")
    ap.add_argument("--anchors", action="store_true",
                    help="instead: the anchor after a refresh under each preset at the defaults, against the first "
                         "preset's (DESIGN §3: the read precision leaves the anchor bit-identical; give presets "
                         "with the same anchor format, e.g. s32_rs,tp16_hi32,tp8_hi32,tp4_hi32)")
    ap.add_argument("--fp-fusion", choices=["default", "off"], default="default",
                    help="off: every configuration compiled without the contraction of a * b + c into fma")
    ap.add_argument("--tuning", default="", metavar="LABEL",
                    help="--anchors: run every preset under this launch.parse_shape label instead of the defaults")
    ap.add_argument("--draft", type=int, default=1,
                    help="verify rounds of this many tokens, all accepted, instead of decode steps (a divisor "
                         "of the window)")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--split-only", action="store_true",
                    help="compare the split refresh shapes with the default split refresh, not with the fused one "
                         "(GDN's fused refresh folds in another layout)")
    args = ap.parse_args()
    global EXTRA, DRAFT
    DRAFT = args.draft
    EXTRA = {} if args.fp_fusion == "default" else {"fp_fusion": False}
    device = "cpu" if args.small else "cuda"
    if args.step_shapes:
        return compare_labels(args, device)
    if args.anchors:
        return compare_anchors(args, device)
    for arch in args.arch.split(","):
        for preset in args.presets.split(","):
            rows, warps, dot, *_ = launch.SHAPES[(arch, "fp32")]
            dot = {"default": dot, "on": True, "off": False}[args.refresh_dot]
            base = dict(block_rows=rows, num_warps=warps, refresh_dot=dot)
            # "split": at the default refresh shape (launch.REFRESH_SHAPES)
            configs = [(f"{rows}x{warps} fused", dict(base, split_refresh=False))] * (not args.split_only)
            configs += [("split", dict(base, split_refresh=True))]
            configs += [(f"split/{s}", dict(base, split_refresh=True, **dict(zip(("refresh_rows", "refresh_warps"),
                                                                             map(int, s.split("x"))))))
                        for s in args.refresh_shapes.split(",")]
            compare(arch, preset, configs, args.small, device)


def compare(arch: str, preset: str, configs: list, small: bool, device):
    """Print whether the outputs and state of each (name, tuning) configuration after ``run``
    equal the first configuration's."""
    dims = SMALL[arch] if small else suite.GEOMETRIES[GEO[arch]][1]
    first, tuning0 = configs[0]
    y0, sd0 = run(arch, preset, tuning0, dims, device)
    for name, tuning in configs[1:]:
        y, sd = run(arch, preset, tuning, dims, device)
        diff = [k for k in sd0 if not torch.equal(sd0[k], sd[k])]
        state = "same" if not diff else "DIFFER " + ",".join(diff)
        print(f"bits {arch:6s} {preset:9s} {first} vs {name:10s} outputs "
              f"{'same' if torch.equal(y0, y) else 'DIFFER'}; state {state}", flush=True)


def compare_labels(args, device):
    """``--step-shapes``: the outputs and state of each labelled configuration against the first."""
    for arch in args.arch.split(","):
        for preset in args.presets.split(","):
            compare(arch, preset, [(label, launch.parse_shape(label)) for label in args.step_shapes.split(",")],
                    args.small, device)


def compare_anchors(args, device):
    """``--anchors``: the anchor of each preset after the same steps, at the defaults, against the first's."""
    for arch in args.arch.split(","):
        dims = SMALL[arch] if args.small else suite.GEOMETRIES[GEO[arch]][1]
        presets = args.presets.split(",")
        tuning = launch.parse_shape(args.tuning) if args.tuning else {}
        states = [run(arch, p, tuning, dims, device)[1] for p in presets]
        for preset, sd in zip(presets[1:], states[1:]):
            a0, a = states[0]["anchor.values"], sd["anchor.values"]
            same = torch.equal(a0, a)
            differ = (a0 != a).sum().item()
            worst = 0.0 if same else (a0.double() - a.double()).abs().max().item()
            # the fold's other inputs: equal, or the difference is not the fold's
            inputs = [k for k in sd if k.startswith("buffer.") and k != "buffer.u" and not torch.equal(states[0][k], sd[k])]
            print(f"anchor {arch:6s} {presets[0]} vs {preset:12s} "
                  f"{'same' if same else f'DIFFER (max {worst:.1e}, {differ} of {a.numel()} elements)'}; "
                  f"buffers {'same' if not inputs else 'DIFFER ' + ','.join(inputs)}", flush=True)


if __name__ == "__main__":
    main()
