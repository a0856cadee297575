"""Measurements behind ``replayssm bench`` and ``benchmarks/h200.py``: a correctness check against
the float64 recurrence at a given shape, a CUDA-graph replay check, and one timed configuration."""
from __future__ import annotations

import torch

from ..layers import LAYERS
from ..precision import relative_tolerance as gate_tolerance  # noqa: F401  (the gate's bound per preset)
from . import suite
from .suite import Problem


def reference_step(p: Problem, state, inp, prm, t):
    """The float64 conventional step on token ``t`` of ``inp`` (the same inputs ReplaySSM gets)."""
    return LAYERS[p.arch].reference_step(state, inp, prm, t)


def _gate_setup(p0: Problem, preset, window, max_draft, device, seed):
    """What a correctness gate starts from: (generator, a cache of b + 8 slots with bf16 buffers,
    b slot ids in random order with every 37th a pad (none at batch 1), valid [b], the loaded random states in
    float64 [b, ...], the layer's constants)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b = p0.batch
    cache = suite.make_cache(p0, b + 8, preset, window, max_draft, device, buffer_dtype=torch.bfloat16)
    slots = torch.randperm(b + 8, device=device, generator=gen)[:b]
    if b > 1:
        slots[::37] = -1  # pads
    state = torch.randn(b, *cache.state_shape, device=device, generator=gen) * 0.1
    cache.load_state(slots, state)
    return gen, cache, slots, slots >= 0, state.double(), suite.make_params(p0, device, gen)


def correctness(p0: Problem, preset, device="cuda", backend=None, steps=20, rounds=6, T=4, window=16,
                seed=0, call=None):
    """Decode ``steps`` tokens, then ``rounds`` verify/accept rounds (random accept counts), with pad
    slots and staggered positions; compare every output and the final committed state with the
    float64 recurrence. ``call`` replaces ``suite.replay_call`` (tests use it to plant a broken
    kernel). Returns (max abs err, relative err of outputs, max state err)."""
    call = call or suite.replay_call
    b = p0.batch
    gen, cache, slots, valid, ref, prm = _gate_setup(p0, preset, window, T, device, seed)
    err = rel_num = rel_den = 0.0

    def acc(y, yr, rows):
        nonlocal err, rel_num, rel_den
        d = (y.double() - yr)[rows]
        err = max(err, d.abs().max().item() if d.numel() else 0.0)  # a small batch may have no active row yet
        rel_num += d.pow(2).sum().item()
        rel_den += yr[rows].pow(2).sum().item()
        if not torch.all(y[~rows] == 0):
            raise AssertionError("pad outputs must be zero")

    for s in range(steps):  # staggered: batch row i starts decoding at step i % 5
        p = Problem(p0.arch, p0.dims, b, 1)
        inp = suite.make_inputs(p, device, gen)
        active = valid & (torch.arange(b, device=device) % 5 <= s)
        y = call(p, cache, torch.where(active, slots, -1), inp, prm, False, backend)
        yr, new = reference_step(p, ref, inp, prm, 0)
        ref = torch.where(active.view(-1, 1, 1, 1), new, ref)
        acc(y, yr, active)
    for _ in range(rounds):
        p = Problem(p0.arch, p0.dims, b, T)
        inp = suite.make_inputs(p, device, gen)
        y = call(p, cache, slots, inp, prm, True, backend)
        st, snaps, outs = ref, [ref], []
        for t in range(T):
            yr, st = reference_step(p, st, inp, prm, t)
            snaps.append(st)
            outs.append(yr)
        acc(y, torch.stack(outs, 1), valid)
        n = torch.randint(0, T + 1, (b,), device=device, generator=gen)
        cache.accept(slots, n)
        ref = torch.stack(snaps, 0)[n, torch.arange(b, device=device)]
    serr = (cache.materialize(slots).double() - ref)[valid].abs().max().item()
    return err, (rel_num / max(rel_den, 1e-300)) ** 0.5, serr


def graph_check(p0: Problem, preset="s32_rs", steps=48, device="cuda"):
    """``steps`` decode steps captured in one CUDA graph reproduce eager execution bit for bit."""
    gen = torch.Generator(device=device).manual_seed(1)
    b = p0.batch
    p = Problem(p0.arch, p0.dims, b, 1)
    caches = [suite.make_cache(p, b, preset, 16, 4, device) for _ in range(2)]
    slots = torch.arange(b, device=device)
    state = torch.randn(b, *caches[0].state_shape, device=device, generator=gen) * 0.1
    for c in caches:
        c.load_state(slots, state)
        c.check_values = False
    prm = suite.make_params(p, device, gen)
    inputs = [suite.make_inputs(p, device, gen) for _ in range(steps)]
    eager = [suite.replay_call(p, caches[0], slots, i, prm, False).clone() for i in inputs]
    g = torch.cuda.CUDAGraph()
    outs = []
    with torch.cuda.graph(g):
        for i in inputs:
            outs.append(suite.replay_call(p, caches[1], slots, i, prm, False))
    g.replay()
    torch.cuda.synchronize()
    same = all(torch.equal(a, o) for a, o in zip(eager, outs))
    return same and torch.equal(caches[0].materialize(slots), caches[1].materialize(slots))


def bench_one(p: Problem, preset, mode="staggered", baseline="ours", window=16, accept="all",
              device="cuda", tree=None):
    """Median us per step (per round of T drafts when p.T > 1) and the traffic model.

    preset None times a baseline ('ours' = the conventional kernel, 'mamba_ssm', 'fla').
    mode: 'staggered' (slot i at window position i mod L), 'aligned' (all slots refresh in the
    same step) or 'refresh' (every replay refreshes every slot). accept: 'all' | 'half' | 'none'
    or a count of drafts accepted per round. ``tree``: (parents [T], path) of one draft tree that
    every row verifies, accepting the first ``accept`` drafts of ``path`` (``tree_of``); the
    conventional baseline then writes one state per tree node, each from its parent's. Returns
    ((median, spread), traffic dict or None).
    """
    gen = torch.Generator(device=device).manual_seed(2)
    T, b = p.T, p.batch
    R = suite.pool_groups(p)
    pool = R * b
    prm = suite.make_params(p, device, gen)
    rounds = max(1, window // T)  # one whole window per group
    inputs = [suite.make_inputs(p, device, gen) for _ in range(min(rounds, 4))]
    groups = [torch.arange(g * b, (g + 1) * b, device=device) for g in range(R)]
    parents = path = None
    if tree is not None:
        parents = torch.tensor(tree[0], device=device, dtype=torch.int32).expand(b, T).contiguous()
        path = torch.tensor(tree[1] + [0] * (T - len(tree[1])), device=device).expand(b, T).contiguous()
    if preset is None:
        state = torch.randn(pool, *suite.state_shape(p), device=device, generator=gen) * 0.1
        inter = torch.empty(pool, T, *suite.state_shape(p), device=device) if T > 1 else None
        if baseline == "mamba_ssm":
            call = lambda g, i: suite.mamba_ssm_call(p, state, groups[g], inputs[i % len(inputs)], prm)  # noqa: E731
        elif baseline == "fla":
            call = lambda g, i: suite.fla_call(p, state, g * b, inputs[i % len(inputs)], prm)  # noqa: E731
        else:
            call = lambda g, i: suite.conventional_call(p, state, groups[g], inputs[i % len(inputs)], prm, inter,  # noqa: E731
                                                        parents)
        return suite.time_graph([lambda g=g, i=i: call(g, i) for g in range(R) for i in range(rounds)]), None
    cache = suite.make_cache(p, pool, preset, window, max(T, 4), device)
    allslots = torch.arange(pool, device=device)
    cache.load_state(allslots, torch.randn(pool, *cache.state_shape, device=device, generator=gen) * 0.1)
    if mode == "staggered":
        p1 = Problem(p.arch, p.dims, pool, 1)
        inp1 = suite.make_inputs(p1, device, gen)
        for k in range(window - 1):
            suite.replay_call(p1, cache, torch.where(allslots % window > k, allslots, -1), inp1, prm, False)
    cache.check_values = False
    n_acc = accept if isinstance(accept, int) else {"all": T, "half": T // 2, "none": 0}[accept]
    accepted = torch.full((b,), n_acc, device=device, dtype=torch.int64)

    def step(g, i):
        if T == 1:
            suite.replay_call(p, cache, groups[g], inputs[i % len(inputs)], prm, False)
        else:
            suite.replay_call(p, cache, groups[g], inputs[i % len(inputs)], prm, True, parents=parents)
            cache.accept(groups[g], accepted, path)

    if mode == "refresh":
        def refresh_step(g):
            cache.committed.index_fill_(0, groups[g], window - T + 1)  # every replay refreshes
            step(g, 0)
        fns = [lambda g=g: refresh_step(g) for g in range(R)]
        f = 1.0
    else:
        fns = [lambda g=g, i=i: step(g, i) for g in range(R) for i in range(rounds)]
        f = 0.0 if n_acc == 0 and T > 1 else max(n_acc, 1) / window
    return suite.time_graph(fns), suite.traffic(p, cache, window, min(f, 1.0))


def tree_of(nodes: int, arity: int = 2) -> tuple[list, list]:
    """A complete ``arity``-ary draft tree of ``nodes`` nodes in breadth-first order (EAGLE-style
    top-k drafts: ``arity`` children per node, level by level) and its deepest root path, leftmost
    first: (parents [nodes], path). 8 binary nodes are 2 + 4 + 2 (path 0, 2, 6); 14 are 2 + 4 + 8."""
    parents = [-1 if s < arity else (s - arity) // arity for s in range(nodes)]
    path = [0]
    while True:
        child = next((s for s in range(nodes) if parents[s] == path[-1]), None)
        if child is None:
            return parents, path
        path.append(child)


def tree_correctness(p0: Problem, preset, parents: list, device="cuda", backend=None, rounds=6, window=16, seed=0,
                     call=None):
    """``rounds`` tree verifies of the draft tree ``parents`` [T] on every row after a staggered
    decode, each accepting a random root path (its depth random, 0 included); every node's output
    against the float64 recurrence along that node's path, and the committed states at the end.
    ``call`` replaces ``suite.replay_call``. Returns (max abs err, relative err of outputs, max
    state err)."""
    call = call or suite.replay_call
    b, T = p0.batch, len(parents)
    gen, cache, slots, valid, ref, prm = _gate_setup(p0, preset, window, T, device, seed)
    err = num = den = 0.0
    p1 = Problem(p0.arch, p0.dims, b, 1)
    for s in range(window // 2 + 1):  # staggered: row i starts decoding at step i % 5
        inp = suite.make_inputs(p1, device, gen)
        active = valid & (torch.arange(b, device=device) % 5 <= s)
        call(p1, cache, torch.where(active, slots, -1), inp, prm, False, backend)
        ref = torch.where(active.view(-1, 1, 1, 1), reference_step(p1, ref, inp, prm, 0)[1], ref)
    p = Problem(p0.arch, p0.dims, b, T)
    par = torch.tensor(parents, device=device, dtype=torch.int32).expand(b, T).contiguous()
    for _ in range(rounds):
        inp = suite.make_inputs(p, device, gen)
        y = call(p, cache, slots, inp, prm, True, backend, parents=par).double()
        states = []
        for t in range(T):  # each node from its parent's state
            yr, st = reference_step(p, ref if parents[t] < 0 else states[parents[t]], inp, prm, t)
            states.append(st)
            d = (y[:, t] - yr)[valid]
            err = max(err, d.abs().max().item())
            num += d.pow(2).sum().item()
            den += yr[valid].pow(2).sum().item()
        leaf = int(torch.randint(0, T, (1,), generator=gen, device=device))
        path = [leaf]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        n = torch.randint(0, len(path) + 1, (b,), device=device, generator=gen)
        cache.accept(slots, n, torch.tensor(path + [0] * (T - len(path)), device=device).expand(b, T), backend=backend)
        at = torch.stack([ref] + [states[i] for i in path], 0)
        ref = at[n, torch.arange(b, device=device)]
    serr = (cache.materialize(slots).double() - ref)[valid].abs().max().item()
    return err, (num / max(den, 1e-300)) ** 0.5, serr
