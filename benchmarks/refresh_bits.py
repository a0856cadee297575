"""Is the anchor after a refresh the same bits for every read format and launch shape? On the GPU,
at real geometries: run a window of decode steps (or verify rounds, all accepted) and then a
refresh of every slot, once per configuration (a preset, optionally under a ``launch.parse_shape``
label), and compare the anchor bits with the first configuration's. The kernels fold 32-row
sub-tiles with tensor-core products and take the refresh's per-token scalars from the scores
launch, so this holds by construction; this is the check on the device. One line per configuration.

    PYTHONPATH=src python3 benchmarks/refresh_bits.py [--arch mamba2,gdn,kda] [--draft 4] \
        [--configs s32_rs,tp16_hi32,tp8_hi32,tp4_hi32,s32_rs@64x4] [--small]
"""
from __future__ import annotations

import argparse

import torch

from replayssm._triton import launch
from replayssm.bench import suite
from replayssm.bench.suite import Problem

GEO = {"mamba2": "nemotron3-super", "gdn": "qwen35-122b", "kda": "kimi-linear-48b"}
DRAFT = 1  # tokens per step (--draft)
SMALL = {"mamba2": (2, 64, 128, 1), "gdn": (2, 128, 128, 1), "kda": (2, 128, 128, 1)}  # H,P,N,G; --small: a CPU smoke run (TRITON_INTERPRET=1)


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
    launch.TUNING.update(tuning)
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
    ap.add_argument("--arch", default="mamba2,gdn,kda")
    ap.add_argument("--configs", default="s32_rs,tp16_hi32,tpbf16_hi32,tp8_hi32,tp4_hi32,s32_rs@64x4",
                    help="presets with the same anchor format, each optionally @ a launch.parse_shape label")
    ap.add_argument("--draft", type=int, default=1,
                    help="verify rounds of this many tokens, all accepted, instead of decode steps (a divisor "
                         "of the window)")
    ap.add_argument("--small", action="store_true", help="tiny geometries (a CPU smoke run, TRITON_INTERPRET=1)")
    args = ap.parse_args()
    global DRAFT
    DRAFT = args.draft
    device = "cpu" if args.small else "cuda"
    for arch in args.arch.split(","):
        dims = SMALL[arch] if args.small else suite.GEOMETRIES[GEO[arch]][1]
        configs = [c.partition("@") for c in args.configs.split(",")]
        states = [(f"{p}@{label}" if label else p, run(arch, p, launch.parse_shape(label) if label else {}, dims,
                                                        device)[1]) for p, _, label in configs]
        (name0, sd0), rest = states[0], states[1:]
        for name, sd in rest:
            a0, a = sd0["anchor.values"], sd["anchor.values"]
            same = torch.equal(a0, a)
            worst = 0.0 if same else (a0.double() - a.double()).abs().max().item()
            print(f"anchor {arch:6s} T={DRAFT} {name0} vs {name:16s} "
                  f"{'same' if same else f'DIFFER (max {worst:.1e}, {(a0 != a).sum().item()} of {a.numel()})'}",
                  flush=True)


if __name__ == "__main__":
    main()
