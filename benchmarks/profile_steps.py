"""Run a few eager steps of each kernel at batch 256 (staggered windows; ``--batch N`` first for
another batch), for a profiler to capture.

    ncu --clock-control none -k regex:"step_kernel|conv_kernel" \
        python3 benchmarks/profile_steps.py [--batch N] mamba2:s32_rs gdn:conv ...

Each argument is ``arch:preset[:mode[:shape[:T]]]`` (``conv`` = the conventional kernel; mode
``staggered``, the default, or ``refresh``: every slot refreshes in every step; shape as
``launch.parse_shape`` reads it, empty for the defaults; T > 1: verify rounds of T drafts, all
accepted, with staggered windows again 1/L of the slots refresh per accepted token). Nothing is
timed here.
"""
from __future__ import annotations

import sys

import torch

from replayssm._triton import launch
from replayssm.bench import suite
from replayssm.bench.suite import Problem
from replayssm.geometry import DEFAULT_MODEL, GEOMETRIES



def main(argv):
    dev = "cuda"
    batch = 256
    if argv[:1] == ["--batch"]:
        batch, argv = int(argv[1]), argv[2:]
    gen = torch.Generator(device=dev).manual_seed(0)
    for spec in argv:
        arch, preset, mode, shape, T = (spec.split(":") + [""] * 3)[:5]
        mode, T = mode or "staggered", int(T or 1)
        p = Problem(arch, GEOMETRIES[DEFAULT_MODEL[arch]].geometry, batch, T)
        prm = suite.make_params(p, dev, gen)
        inp = suite.make_inputs(p, dev, gen)
        slots = torch.arange(p.batch, device=dev)
        if preset == "conv":
            state = torch.randn(p.batch, *suite.state_shape(p), device=dev, generator=gen) * 0.1
            inter = torch.empty(p.batch, T, *suite.state_shape(p), device=dev) if T > 1 else None
            for _ in range(3):
                suite.conventional_call(p, state, slots, inp, prm, inter)
        else:
            cache = suite.make_cache(p, p.batch, preset, 16, max(T, 4), dev)
            cache.load_state(slots, torch.randn(p.batch, *cache.state_shape, device=dev, generator=gen) * 0.1)
            for buf in cache.buffer.values():
                buf.copy_(torch.randn(buf.shape, device=dev, generator=gen) * 0.1)
            # staggered: slot i holds 1 + i mod 16 committed entries, so T/16 of the slots refresh
            staggered = torch.arange(cache.committed.numel(), device=dev) % 16 + 1
            accepted = torch.full((p.batch,), T, device=dev)
            cache.check_values = False
            launch.TUNING.clear()
            launch.TUNING.update(launch.parse_shape(shape) if shape else {})
            for _ in range(3):
                cache.committed.copy_(staggered if mode == "staggered" else torch.full_like(staggered, 16))
                suite.replay_call(p, cache, slots, inp, prm, T > 1)
                if T > 1:
                    cache.accept(slots, accepted)
            launch.TUNING.clear()
        torch.cuda.synchronize()
        print("ran", spec, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
