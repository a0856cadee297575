"""One device call: correctness at real geometries against float64, CUDA-graph replay check, and
the timing table (ReplaySSM vs the conventional kernel measured in the same run).

    PYTHONPATH=src python3 benchmarks/h200.py [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

import replayssm as rs
from replayssm.bench import suite
from replayssm.bench.suite import Problem

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


# ---------------------------------------------------------------------------------- correctness
def reference_step(p, state, inp, prm, t):
    if p.arch == "mamba2":
        g = lambda k: inp[k][:, t]  # noqa: E731
        return rs.mamba2_reference_step(state, g("x"), g("dt"), prm["A"], g("B"), g("C"), prm["D"], g("z"),
                                        prm["dt_bias"], True)
    g = lambda k: inp[k][:, t]  # noqa: E731
    return rs.gdn_reference_step(state, g("q"), g("k"), g("v"), g("g"), g("beta"), use_qk_l2norm=True)


def correctness(p0: Problem, preset, backend, steps=20, rounds=6, T=4, seed=0):
    """Decode `steps` tokens, then `rounds` verify/accept rounds (random accept counts), with pad
    slots and staggered positions; compare every output and the final committed state with the
    float64 recurrence. Returns (max abs err, relative err of outputs, max state err)."""
    dev = DEV
    gen = torch.Generator(device=dev).manual_seed(seed)
    b = p0.batch
    cache = suite.make_cache(p0, b + 8, preset, 16, T, dev, buffer_dtype=torch.bfloat16)
    slots = torch.randperm(b + 8, device=dev)[:b]
    slots[::37] = -1  # pads
    valid = slots >= 0
    shape = (b,) + tuple(cache.state_shape)
    state = torch.randn(*shape, device=dev, generator=gen) * 0.1
    cache.load_state(slots, state)
    ref = state.double()
    prm = suite.make_params(p0, dev, gen)
    err = rel_num = rel_den = 0.0

    def acc(y, yr):
        nonlocal err, rel_num, rel_den
        d = (y.double() - yr)[valid]
        err = max(err, d.abs().max().item())
        rel_num += d.pow(2).sum().item()
        rel_den += yr[valid].pow(2).sum().item()
        assert torch.all(y[~valid] == 0), "pad outputs must be zero"

    # stagger: slot i first decodes i % 5 tokens
    for s in range(steps):
        p = Problem(p0.arch, p0.dims, b, 1)
        inp = suite.make_inputs(p, dev, gen)
        active = valid & (torch.arange(b, device=dev) % 5 <= s)
        sl = torch.where(active, slots, -1)
        y = suite.replay_call(p, cache, sl, inp, prm, verify=False)
        yr, new = reference_step(p, ref, inp, prm, 0)
        ref = torch.where(active.view(-1, 1, 1, 1), new, ref)
        y, yr = y[active], yr[active]
        d = y.double() - yr
        err = max(err, d.abs().max().item())
        rel_num += d.pow(2).sum().item()
        rel_den += yr.pow(2).sum().item()
    for r in range(rounds):
        p = Problem(p0.arch, p0.dims, b, T)
        inp = suite.make_inputs(p, dev, gen)
        y = suite.replay_call(p, cache, slots, inp, prm, verify=True)
        st, snaps, outs = ref, [ref], []
        for t in range(T):
            yr, st = reference_step(p, st, inp, prm, t)
            snaps.append(st)
            outs.append(yr)
        acc(y, torch.stack(outs, 1))
        n = torch.randint(0, T + 1, (b,), device=dev, generator=gen)
        cache.accept(slots, n)
        ref = torch.stack(snaps, 0)[n, torch.arange(b, device=dev)]
    mat = cache.materialize(slots)
    serr = (mat.double() - ref)[valid].abs().max().item()
    return err, (rel_num / rel_den) ** 0.5, serr


def graph_check(p0: Problem, preset="s32_rs", steps=48):
    """48 decode steps captured in one CUDA graph reproduce eager execution bit for bit."""
    dev = DEV
    gen = torch.Generator(device=dev).manual_seed(1)
    b = p0.batch
    p = Problem(p0.arch, p0.dims, b, 1)
    caches = [suite.make_cache(p, b, preset, 16, 4, dev) for _ in range(2)]
    slots = torch.arange(b, device=dev)
    state = torch.randn(b, *caches[0].state_shape, device=dev, generator=gen) * 0.1
    for c in caches:
        c.load_state(slots, state)
        c.check_values = False
    prm = suite.make_params(p, dev, gen)
    inputs = [suite.make_inputs(p, dev, gen) for _ in range(steps)]
    eager = [suite.replay_call(p, caches[0], slots, i, prm, False).clone() for i in inputs]
    g = torch.cuda.CUDAGraph()
    outs = []
    with torch.cuda.graph(g):
        for i in inputs:
            outs.append(suite.replay_call(p, caches[1], slots, i, prm, False))
    g.replay()
    torch.cuda.synchronize()
    same = all(torch.equal(a, o) for a, o in zip(eager, outs))
    same_state = torch.equal(caches[0].materialize(slots), caches[1].materialize(slots))
    return same and same_state


# ---------------------------------------------------------------------------------- timing
def bench_one(p: Problem, preset, mode, baseline="ours"):
    """Median us per step of ReplaySSM (preset) or the conventional kernel (preset=None).
    mode: 'aligned' | 'staggered' | 'refresh' (the refresh step alone)."""
    dev = DEV
    gen = torch.Generator(device=dev).manual_seed(2)
    T = p.T
    R = suite.pool_groups(p)
    b = p.batch
    pool = R * b
    prm = suite.make_params(p, dev, gen)
    rounds = 16 // T if T > 1 else 16  # one whole window per group
    inputs = [suite.make_inputs(p, dev, gen) for _ in range(min(rounds, 4))]
    groups = [torch.arange(g * b, (g + 1) * b, device=dev) for g in range(R)]
    if preset is None:
        state = torch.randn(pool, *problem_state_shape(p), device=dev, generator=gen) * 0.1
        inter = None
        if T > 1:
            inter = torch.empty(pool, T, *problem_state_shape(p), device=dev)
        if baseline == "mamba_ssm":
            call = lambda g, i: suite.mamba_ssm_call(p, state, groups[g], inputs[i % len(inputs)], prm)  # noqa: E731
        elif baseline == "fla":
            call = lambda g, i: suite.fla_call(p, state, g * b, inputs[i % len(inputs)], prm)  # noqa: E731
        else:
            call = lambda g, i: suite.conventional_call(p, state, groups[g], inputs[i % len(inputs)], prm, inter)  # noqa: E731
        fns = [lambda g=g, i=i: call(g, i) for g in range(R) for i in range(rounds)]
        return suite.time_graph(fns), None
    cache = suite.make_cache(p, pool, preset, 16, max(T, 4), dev)
    allslots = torch.arange(pool, device=dev)
    cache.load_state(allslots, torch.randn(pool, *cache.state_shape, device=dev, generator=gen) * 0.1)
    if mode == "staggered":
        p1 = Problem(p.arch, p.dims, pool, 1)
        inp1 = suite.make_inputs(p1, dev, gen)
        for k in range(15):
            sl = torch.where(allslots % 16 > k, allslots, -1)
            suite.replay_call(p1, cache, sl, inp1, prm, False)
    cache.check_values = False
    full = torch.full((b,), T, device=dev, dtype=torch.int64)

    def step(g, i):
        if T == 1:
            suite.replay_call(p, cache, groups[g], inputs[i % len(inputs)], prm, False)
        else:
            suite.replay_call(p, cache, groups[g], inputs[i % len(inputs)], prm, True)
            cache.accept(groups[g], full)

    if mode == "refresh":
        def fns_one(g):
            cache.committed.index_fill_(0, groups[g], 16 - T + 1)  # every replay refreshes
            step(g, 0)
        fns = [lambda g=g: fns_one(g) for g in range(R)]
    else:
        fns = [lambda g=g, i=i: step(g, i) for g in range(R) for i in range(rounds)]
    f = 1.0 if mode == "refresh" else 1.0 / rounds
    return suite.time_graph(fns), suite.traffic(p, cache, 16, f)


def problem_state_shape(p):
    if p.arch == "mamba2":
        H, P, N, _ = p.dims
        return (H, P, N)
    _, HV, K, V = p.dims
    return (HV, V, K)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", default="correct,graph,time")
    ap.add_argument("--batches", default="1,8,32,64,128,256,512")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--sweep-presets", default="s32_rs,tp16_hi32,tp8_hi32,tp4_hi16_sr",
                    help="presets timed at batches other than 256")
    ap.add_argument("--check-presets", default="s32_rs,tp16_hi32,tp8_hi32,tp4_hi32,tp4_hi16_sr,f4_sr_rs")
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
            arch, dims = suite.GEOMETRIES[geo]
            for preset in args.check_presets.split(","):
                for backend in (["triton", "torch"] if preset == "s32_rs" else ["triton"]):
                    p = Problem(arch, dims, 256, 1)
                    try:
                        old = os.environ.get("RS_BACKEND")
                        suite_backend(backend)
                        e, rel, se = correctness(p, preset, backend)
                        say(f"{geo:16s} {preset:12s} {backend:6s} max_abs {e:.3e} rel {rel:.3e} state {se:.3e}")
                        res["rows"].append(dict(kind="correct", geo=geo, preset=preset, backend=backend,
                                                max_abs=e, rel=rel, state=se))
                    except Exception as exc:
                        say(f"{geo} {preset} {backend} FAILED: {exc!r}")
                        traceback.print_exc()
                    finally:
                        suite_backend(None)
        say(f"[{time.time() - t0:.0f}s]")
    if "graph" in parts:
        for geo in geos:
            arch, dims = suite.GEOMETRIES[geo]
            try:
                ok = graph_check(Problem(arch, dims, 256, 1))
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
            arch, dims = suite.GEOMETRIES[geo]
            for T in (1, 4):
                for b in batches:
                    if T == 4 and b not in (8, 256):
                        continue
                    p = Problem(arch, dims, b, T)
                    try:
                        (tc, sc), _ = bench_one(p, None, "aligned")
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
                            (te, se_), _ = bench_one(p, None, "aligned", baseline=ext)
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
                                (t, s), tr = bench_one(p, preset, mode)
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


_BACKEND = [None]


def suite_backend(name):
    """Force a backend for the public calls made through suite.replay_call."""
    import replayssm.backend as B
    if name is None:
        B.pick_backend = _ORIG_PICK
    else:
        B.pick_backend = lambda cache, backend=None: name
    import replayssm.mamba2.ops as m
    import replayssm.gdn.ops as g
    m.pick_backend = B.pick_backend
    g.pick_backend = B.pick_backend


import replayssm.backend as _B  # noqa: E402

_ORIG_PICK = _B.pick_backend

if __name__ == "__main__":
    sys.exit(main())
