"""The Triton backend, run by Triton's interpreter on the CPU (TRITON_INTERPRET=1, conftest),
against the float64 recurrence and against the PyTorch backend: decode across refreshes,
speculative rounds with every accept count, pad slots, slots at different window positions,
and the two-precision invariants. Geometries are the smallest the kernels tile (dims >= 16)."""
import functools
import itertools

import pytest
import torch

pytest.importorskip("triton")

import helpers  # noqa: E402
import replayssm as rs  # noqa: E402

GEOMETRY = {"mamba2": dict(nheads=4, headdim=16, dstate=32, ngroups=2),
            "gdn": dict(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=16)}


class TritonLayer:
    """A helpers layer whose public calls go to the Triton backend (``GEOMETRY`` unless given)."""

    def __init__(self, arch, seed=0, **geometry):
        self.base = helpers.make_layer(arch, seed, **(geometry or GEOMETRY[arch]))
        self.name, self.state_shape = self.base.name, self.base.state_shape

    def cache(self, num_slots, **kw):
        return self.base.cache(num_slots, **kw)

    def tokens(self, g, b, T):
        return self.base.tokens(g, b, T)

    def reference(self, state, tok):
        return self.base.reference(state, tok)

    def accept(self, cache, slots, counts):
        cache.accept(slots, counts, backend="triton")

    def run(self, cache, slots, tok, verify):
        fn = {("mamba2", False): rs.mamba2_decode, ("mamba2", True): rs.mamba2_verify,
              ("gdn", False): rs.gdn_decode, ("gdn", True): rs.gdn_verify}[(self.name, verify)]
        consts = self.base._consts() if self.name == "mamba2" else {"use_qk_l2norm": True}
        if verify:
            return fn(cache, slots, **tok, **consts, backend="triton")
        return fn(cache, slots, **{k: v[:, 0] for k, v in tok.items()}, **consts, backend="triton")[:, None]


def _two_slots(layer, seed, steps, T=1, order=(1, 0)):
    """(slot ids ``order``, their random states [2, ...], ``steps`` token batches of T tokens),
    drawn in that order from one generator: the inputs of the tests that run one schedule under
    several launch configurations and compare."""
    g = helpers.generator(seed)
    state = torch.randn(2, *layer.state_shape, generator=g)
    return torch.tensor(order), state, [layer.tokens(g, 2, T) for _ in range(steps)]


def _schedule(tr, rounds, rng):
    """Decode, then verify/accept rounds over every accept count, with a pad and staggered slots."""
    tr.load([0, 1, 2])
    for k in range(3):  # stagger: slot 2 is 3 tokens ahead of slot 0
        tr.decode([2] if k < 2 else [2, 1])
    for r in range(rounds):
        T = 1 + r % tr.cache.max_draft
        tr.verify([1, -1, 2, 0], T)
        tr.accept([r % (T + 1), 0, T, (r + 1) % (T + 1)])
        tr.decode([0, 2, -1, 1])


def _with_next_order(step, orders, *args):
    """Run a tracker step with the next of ``orders`` as ``launch.TUNING["loads"]``."""
    from replayssm._triton import launch

    launch.TUNING["loads"] = next(orders)
    return step(*args)


@pytest.mark.parametrize("arch, variant", [("mamba2", "tensor_cores"), ("mamba2", "loop"), ("gdn", "loop"),
                                           ("gdn", "tensor_cores"), ("gdn", "tensor_cores_split"),
                                           ("mamba2", "late_cursor"), ("gdn", "late_cursor"),
                                           ("mamba2", "output_dot"), ("gdn", "output_dot"),
                                           ("mamba2", "load_order"), ("gdn", "load_order"),
                                           ("mamba2", "stream"), ("gdn", "stream"),
                                           ("mamba2", "two_tier"), ("gdn", "two_tier"),
                                           ("mamba2", "all_experiments"), ("gdn", "all_experiments")])
def test_triton_s32_matches_float64_reference(arch, variant, monkeypatch):
    """Both refresh folds (Mamba-2: tensor-core products, the default, or token by token; GDN:
    token by token, the default, or forward substitution with tensor-core products), with the
    cursor loaded by the step kernels (the early cursor is the default) and the outputs' products
    on tensor cores at every T (the default only from launch.OUTPUT_DOT_MIN_DRAFT), with the step
    programs' loads in the order the defaults do not use (``launch.preload``), fused refresh, with
    the read copy streamed through the products (``launch.stream_stages``), through decode and
    verify rounds."""
    from replayssm._triton import launch

    layer = TritonLayer(arch)
    # the tensor-core folds at the window the benchmarks use: every substitution step runs
    window = 16 if variant.startswith("tensor_cores") else 8
    tr = helpers.Tracker(layer, layer.cache(4, window=window, max_draft=4), seed=3)
    if variant == "late_cursor":
        launch.TUNING["early_cursor"] = False
    elif variant == "output_dot":
        launch.TUNING[variant] = True
    elif variant == "load_order":  # the three load orders in turn, step by step, refresh fused
        launch.TUNING["split_refresh"] = False
        orders = itertools.cycle(launch.LOAD_ORDERS)
        for name in ("decode", "verify"):
            setattr(tr, name, functools.partial(_with_next_order, getattr(tr, name), orders))
    elif variant == "stream":  # the read copy streamed through tensor-core products (launch.stream_stages)
        launch.TUNING.update(output_dot=True, stream=2, split_refresh=True)
    elif variant == "two_tier":  # a first tier of one slot: the step where two slots refresh uses both tiers
        launch.TUNING.update(split_refresh=True, two_tier_refresh=True)
        monkeypatch.setattr(launch, "TWO_TIER_SLACK", 0.25)
    elif variant == "all_experiments":  # as the next sweep will combine them
        launch.TUNING.update(early_cursor=True, output_dot=True, refresh_dot=True, split_refresh=True)
    else:
        launch.TUNING["refresh_dot"] = variant.startswith("tensor_cores")
        launch.TUNING["split_refresh"] = variant.endswith("split")
    try:
        _schedule(tr, rounds=10, rng=None)
    finally:
        launch.TUNING.clear()
    tr.check_counters([0, 1, 2])
    helpers.record(f"triton {arch} s32_rs max rel err", tr.max_rel)
    assert tr.max_rel <= 2e-5, tr.max_rel
    assert tr.state_error([0, 1, 2]) <= 1e-5


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
@pytest.mark.parametrize("precision", ["tp8_hi32", "tp4_hi16_sr", "f4_sr_rs", "bf16_rs"])
def test_triton_low_precision_agrees_with_torch_backend(arch, precision):
    """Same inputs through both backends: outputs agree to the read format's rounding, the
    anchors stay close, and the counters are identical."""
    base = helpers.make_layer(arch, 0, **GEOMETRY[arch])
    tl_layer = TritonLayer(arch)
    caches = [base.cache(3, window=8, max_draft=2, precision=precision) for _ in range(2)]
    g = helpers.generator(5)
    slots = torch.tensor([2, -1, 0])
    state = torch.randn(3, *base.state_shape, generator=g)
    for c in caches:
        c.load_state(slots, state)
    tol = {"tp8_hi32": 0.1, "tp4_hi16_sr": 0.4, "f4_sr_rs": 0.4, "bf16_rs": 0.02}[precision]
    for step in range(12):
        verify = step % 3 == 2
        tok = base.tokens(g, 3, 2 if verify else 1)
        y_torch = base.run(caches[0], slots, tok, verify)
        y_triton = tl_layer.run(caches[1], slots, tok, verify)
        scale = y_torch.abs().max().clamp(min=1.0)
        assert (y_torch - y_triton).abs().max() <= tol * scale
        if verify:
            for c, backend in zip(caches, ("torch", "triton")):
                c.accept(slots, torch.tensor([1, 0, 2]), backend=backend)
    a, b = (c.materialize(slots) for c in caches)
    assert (a - b).abs().max() <= tol * a.abs().max().clamp(min=1.0)
    assert all(torch.equal(x, y) for x, y in zip(caches[0].counters(slots).values(),
                                                 caches[1].counters(slots).values()))


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
@pytest.mark.parametrize("precision", ["s32_rs", "tp4_hi16_sr"])
def test_split_refresh_launch_matches_the_fused_kernel_bit_for_bit(arch, precision):
    """The refresh in a launch of its own (launch.TUNING["split_refresh"]) computes the same
    checkpoint and outputs as the fused step kernel, stochastic rounding included, with the cursor
    copied early (the default) or loaded by each kernel, and with the refresh launch one program
    per tile (the default) or persistent (a few programs loop over the refreshing slots' tiles, or
    one program per tile of ceil(b T / L) slots), or in two tiers (one program per tile of the
    first refreshing slot, then a persistent launch for the second: launch.refresh_launches);
    the fused one must differ once a refresh is skipped, so the comparison can fail."""
    from replayssm._triton import launch

    layer = TritonLayer(arch)
    g = helpers.generator(11)
    slots = torch.tensor([1, -1, 0])
    state = torch.randn(3, *layer.state_shape, generator=g)
    toks = [layer.tokens(g, 3, 1) for _ in range(7)]
    runs = []
    for tuning in (dict(split_refresh=False), dict(split_refresh=True), dict(split_refresh=True, early_cursor=False),
                   dict(split_refresh=False, early_cursor=False),
                   dict(split_refresh=True, persistent_refresh=True),
                   dict(split_refresh=True, persistent_refresh=True, refresh_programs=0),
                   dict(split_refresh=True, two_tier_refresh=True)):
        cache = layer.cache(3, window=4, max_draft=2, precision=precision)
        cache.load_state(slots, state)
        launch.TUNING.update(tuning)
        try:
            runs.append((torch.cat([layer.run(cache, slots, t, False) for t in toks]),
                         cache.state_dict()))  # cloned tensors
        finally:
            launch.TUNING.clear()
    (y0, sd0) = runs[0]
    used = slots[slots >= 0]  # the other rows were never written (uninitialized or NaN-poisoned)
    for y1, sd1 in runs[1:]:
        assert torch.equal(y0, y1)
        assert sd0.keys() == sd1.keys()
        for k in sd0:
            same = torch.equal(sd0[k][used], sd1[k][used]) if torch.is_tensor(sd0[k]) else sd0[k] == sd1[k]
            assert same, k
    # teeth: the split run really launched the refresh kernel and a step kernel without refresh code
    names = []
    launch.TUNING["split_refresh"] = True
    launch.LAUNCHER = lambda kernel, grid, args, kw: names.append((kernel.fn.__name__, kw.get("FUSED_REFRESH")))
    try:
        cache = layer.cache(3, window=4, max_draft=2, precision=precision)
        cache.load_state(slots, state)
        layer.run(cache, slots, toks[0], False)
    finally:
        launch.TUNING.clear()
        launch.LAUNCHER = launch._launch
    assert (f"_{arch}_refresh_kernel", None) in names and (f"_{arch}_step_kernel", False) in names


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
@pytest.mark.parametrize("launches", ["one", "persistent", "two_tier"])
def test_split_refresh_at_its_own_launch_shape_refreshes_every_row(arch, launches):
    """The split refresh launch may tile rows differently from the step kernel
    (launch.REFRESH_SHAPES, TUNING["refresh_rows"]): a refresh at 16 rows per program after
    steps at 32 gives the fused kernel's bits, one program per tile, persistent, or in two tiers;
    a grid or a tile count taken from the step's tiling would leave half the rows unrefreshed."""
    from replayssm._triton import launch

    geometry = {"mamba2": dict(nheads=2, headdim=32, dstate=32, ngroups=1),
                "gdn": dict(num_k_heads=1, num_v_heads=2, head_k_dim=32, head_v_dim=32)}[arch]
    layer = TritonLayer(arch, **geometry)
    base = layer.base
    slots, state, toks = _two_slots(layer, 17, steps=5)  # window 4: the fifth step refreshes
    snaps = []
    for tuning in (dict(split_refresh=False),
                   dict(split_refresh=True, refresh_rows=16, refresh_warps=1,
                        persistent_refresh=launches == "persistent", two_tier_refresh=launches == "two_tier")):
        cache = base.cache(2, window=4, max_draft=1)
        cache.load_state(slots, state)
        launch.TUNING.update(tuning, block_rows=32)
        try:
            ys = torch.cat([layer.run(cache, slots, t, False) for t in toks])
        finally:
            launch.TUNING.clear()
        snaps.append((ys, helpers.snapshot(cache)))
    assert torch.equal(snaps[0][0], snaps[1][0])
    assert not helpers.snapshot_diff(snaps[0][1], snaps[1][1])


@pytest.mark.parametrize("precision", ["s32_rs", "tp8_hi32", "bf16_rs"])
def test_mamba2_refresh_in_column_chunks_matches_whole_rows(precision):
    """A Mamba-2 refresh folds and encodes 32 columns at a time (launch.refresh_columns; 64 from
    a 2-byte anchor, so at dstate 128): at dstate 64 that is two passes, each with its own fp8
    scale blocks, and it must give the bits of one pass over whole rows (the same arithmetic per
    element), split or fused, and agree with the float64 recurrence; a pass skipped or a scale
    block misplaced would not."""
    from replayssm._triton import launch

    layer = TritonLayer("mamba2", nheads=2, headdim=16, dstate=64, ngroups=1)
    wide = TritonLayer("mamba2", nheads=1, headdim=16, dstate=128, ngroups=1).base.cache(
        1, window=4, max_draft=1, precision=precision)
    assert launch.refresh_columns(wide, "mamba2") == (64 if precision == "bf16_rs" else 32)
    assert launch.refresh_columns(wide, "gdn") == 32
    base = layer.base
    slots, state, toks = _two_slots(layer, 23, steps=6, order=(0, 1))  # window 4: steps 5 and 6 refresh
    snaps = []
    for tuning in (dict(refresh_columns=64), dict(refresh_columns=32), dict(refresh_columns=32, split_refresh=True)):
        cache = base.cache(2, window=4, max_draft=1, precision=precision)
        cache.load_state(slots, state)
        launch.TUNING.update(tuning)
        try:
            ys = torch.cat([layer.run(cache, slots, t, False) for t in toks])
        finally:
            launch.TUNING.clear()
        snaps.append((ys, helpers.snapshot(cache, slots)))  # the scratch row is never written here
    for ys, snap in snaps[1:]:
        assert torch.equal(snaps[0][0], ys)
        assert not helpers.snapshot_diff(snaps[0][1], snap)
    ref = state.double()
    for t in toks[:4]:  # the checkpoint written at step 5 holds the first four tokens
        _, ref = base.reference(ref, t)
    anchor = cache.decode_anchor(slots).double()
    tol = 1e-5 if precision != "bf16_rs" else 2.0 ** -7  # a bf16 anchor rounds at the load and the refresh
    assert (anchor - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
@pytest.mark.parametrize("precision", ["tp8_hi32", "f4_sr_rs"])
def test_output_products_on_tensor_cores_keep_the_anchor_and_the_outputs(arch, precision):
    """launch.TUNING["output_dot"] (the read-copy products of a step's queries as one tensor-core
    product over the dequantized read copy) changes only the outputs' last bits: block-scaled
    read copies decode to the same values, and the anchor never sees the read path. The same
    with the read copy streamed 32 columns at a time (``launch.stream_stages``; not NVFP4)."""
    from replayssm._triton import launch

    layer = TritonLayer(arch)
    g = helpers.generator(13)
    slots = torch.tensor([1, -1, 0])
    state = torch.randn(3, *layer.state_shape, generator=g)
    toks = [layer.tokens(g, 3, 2 if i % 3 == 2 else 1) for i in range(9)]
    runs = []
    for tuning in (dict(output_dot=False), dict(output_dot=True),
                   dict(output_dot=True, stream=2, split_refresh=True)):  # streamed (launch.stream_stages)
        cache = layer.cache(3, window=4, max_draft=2, precision=precision)
        cache.load_state(slots, state)
        launch.TUNING.update(tuning)
        try:
            ys = []
            for tok in toks:
                verify = tok[next(iter(tok))].shape[1] > 1
                ys.append(layer.run(cache, slots, tok, verify).flatten())
                if verify:
                    cache.accept(slots, torch.tensor([2, 0, 1]))
            runs.append((torch.cat(ys), cache.materialize(slots)))
        finally:
            launch.TUNING.clear()
    (y0, a0), (y1, a1), (y2, a2) = runs
    assert not torch.equal(y0, y1)  # the products really took the other path
    for y, a in ((y1, a1), (y2, a2)):
        assert (y0 - y).abs().max() <= 1e-5 * y0.abs().max()
        assert torch.equal(a0[[0, 2]], a[[0, 2]])


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
@pytest.mark.parametrize("precision", ["s32_rs", "tp8_hi32"])
def test_streamed_products_over_several_chunks(arch, precision):
    """At dk = 64 a streamed step (launch.stream_stages) accumulates its read-copy products over
    two 32-column chunks, each with its own fp8 block scales: outputs as the whole-tile product's
    to fp32 rounding, the same anchor. A chunk read twice or a scale block misplaced would not."""
    from replayssm._triton import launch

    geometry = {"mamba2": dict(nheads=2, headdim=16, dstate=64, ngroups=1),
                "gdn": dict(num_k_heads=1, num_v_heads=2, head_k_dim=64, head_v_dim=16)}[arch]
    layer = TritonLayer(arch, **geometry)
    base = layer.base
    slots, state, toks = _two_slots(layer, 29, steps=5, T=2)  # window 4, verify rounds of 2: rounds 3 and 5 refresh
    runs = []
    for stream in (0, 2):
        cache = base.cache(2, window=4, max_draft=2, precision=precision)
        cache.load_state(slots, state)
        launch.TUNING.update(output_dot=True, split_refresh=True, stream=stream)
        try:
            ys = []
            for tok in toks:
                ys.append(layer.run(cache, slots, tok, True))
                cache.accept(slots, torch.tensor([2, 1]))
        finally:
            launch.TUNING.clear()
        runs.append((torch.cat(ys), cache.materialize(slots)))
    (y0, a0), (y1, a1) = runs
    assert (y0 - y1).abs().max() <= 1e-5 * y0.abs().max()
    assert torch.equal(a0, a1)


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
def test_triton_read_precision_leaves_anchor_bit_identical(arch):
    """Changing only the read format (fp32 anchor) changes outputs, never the anchor bits."""
    layer = TritonLayer(arch)
    g = helpers.generator(9)
    slots = torch.tensor([0, 1])
    state = torch.randn(2, *layer.state_shape, generator=g)
    caches = {p: layer.cache(2, window=4, max_draft=2, precision=p) for p in ("s32_rs", "tp8_hi32", "tp4_hi32")}
    outs = {p: [] for p in caches}
    for c in caches.values():
        c.load_state(slots, state)
    for step in range(10):
        tok = layer.tokens(g, 2, 1)
        for p, c in caches.items():
            outs[p].append(layer.run(c, slots, tok, False))
    anchors = [c.anchor["values"][:2] for c in caches.values()]  # loaded slots (the rest is NaN-poisoned)
    assert all(torch.equal(anchors[0], a) for a in anchors[1:])
    assert not torch.equal(torch.cat(outs["s32_rs"]), torch.cat(outs["tp8_hi32"]))


def test_triton_rejects_geometry_it_cannot_tile():
    cache = rs.Mamba2Cache(2, 2, 8, 16)
    before = helpers.snapshot(cache)
    with pytest.raises(ValueError, match="dv"):
        rs.mamba2_decode(cache, torch.tensor([0]), torch.randn(1, 2, 8), torch.rand(1, 2), -torch.rand(2),
                         torch.randn(1, 1, 16), torch.randn(1, 1, 16), backend="triton")
    assert helpers.snapshot_diff(before, helpers.snapshot(cache)) == []


@pytest.mark.parametrize("normalize", [True, False])
def test_gdn_input_preparation_in_kernel_matches_torch(normalize):
    """The Triton GDN step prepares q, k (L2 norm, scale), g and beta inside its first launch;
    with bf16 inputs and either normalization it agrees with the PyTorch backend's preparation."""
    g = helpers.generator(21)
    HK, HV, K, V, b = 2, 4, 32, 16, 3
    caches = [rs.GDNCache(4, HK, HV, K, V, window=4, max_draft=2) for _ in range(2)]
    slots = torch.tensor([3, -1, 0])
    state = torch.randn(b, HV, V, K, generator=g) * 0.1
    for c in caches:
        c.load_state(slots, state)
    for step in range(6):
        q, k = (torch.randn(b, HK, K, generator=g) * (1 if normalize else K ** -0.5) for _ in range(2))
        v = torch.randn(b, HV, V, generator=g)
        gg, beta = -torch.rand(b, HV, generator=g), torch.rand(b, HV, generator=g)
        args = [t.to(torch.bfloat16) for t in (q, k, v, gg, beta)]
        outs = [rs.gdn_decode(c, slots, *args, scale=0.3, use_qk_l2norm=normalize, backend=be)
                for c, be in zip(caches, ("torch", "triton"))]
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(caches[1].materialize(slots[slots >= 0]), caches[0].materialize(slots[slots >= 0]),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("softplus", [True, False])
def test_mamba2_input_preparation_in_kernel_matches_torch(softplus):
    """The Triton Mamba-2 step computes softplus(dt + dt_bias) and A * dt inside its first launch
    (3 heads per group: a padded head vector); bf16 inputs agree with the PyTorch backend."""
    g = helpers.generator(22)
    H, P, N, G, b = 6, 16, 32, 2, 3
    caches = [rs.Mamba2Cache(4, H, P, N, ngroups=G, window=4, max_draft=2) for _ in range(2)]
    slots = torch.tensor([3, -1, 0])
    state = torch.randn(b, H, P, N, generator=g) * 0.1
    for c in caches:
        c.load_state(slots, state)
    A = -torch.rand(H, generator=g) - 0.2
    bias = torch.randn(H, generator=g) if softplus else None
    for step in range(6):
        x = torch.randn(b, H, P, generator=g)
        dt = torch.randn(b, H, generator=g) * 4 if softplus else torch.rand(b, H, generator=g) * 0.3
        Bm, Cm = torch.randn(b, G, N, generator=g), torch.randn(b, G, N, generator=g)
        args = [t.to(torch.bfloat16) for t in (x, dt)] + [A] + [t.to(torch.bfloat16) for t in (Bm, Cm)]
        outs = [rs.mamba2_decode(c, slots, *args, dt_bias=bias, dt_softplus=softplus, backend=be)
                for c, be in zip(caches, ("torch", "triton"))]
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    used = slots[slots >= 0]
    torch.testing.assert_close(caches[1].materialize(used), caches[0].materialize(used), rtol=1e-5, atol=1e-6)
    # the buffered step sizes and log decays themselves, to ~2 ulp of torch's fp32 softplus (log1p)
    for name in ("dt", "log_alpha"):
        torch.testing.assert_close(caches[1].buffer[name][used], caches[0].buffer[name][used], rtol=3e-7, atol=0)


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
def test_a_triton_step_is_four_launches_and_no_pytorch_compute(arch):
    """With check_values off (as under CUDA-graph capture) a decode step is the scores, refresh,
    step and advance launches (scores, step, advance with the fused refresh, Mamba-2's default
    below launch.SPLIT_MIN_BATCH rows; GDN always splits); PyTorch only allocates outputs and
    scratch and makes views."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from replayssm._triton import launch

    class Ops(TorchDispatchMode):
        names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    g = helpers.generator(23)
    bf = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    slots = torch.tensor([0, -1, 1])
    if arch == "mamba2":
        cache = rs.Mamba2Cache(2, 4, 16, 32, ngroups=2, window=4)
        args = (bf(3, 4, 16), bf(3, 4), -torch.rand(4, generator=g), bf(3, 2, 32), bf(3, 2, 32), torch.randn(4),
                bf(3, 4, 16), torch.randn(4), True)
        call = rs.mamba2_decode
    else:
        cache = rs.GDNCache(2, 2, 4, 32, 16, window=4)
        args = (bf(3, 2, 32), bf(3, 2, 32), bf(3, 4, 16), -torch.rand(3, 4, generator=g), bf(3, 4))
        call = rs.gdn_decode
    cache.check_values = False
    by_batch = launch.SPLIT_MIN_BATCH[arch] <= 3
    assert launch.split_refresh(arch, 3) == by_batch and launch.split_refresh(arch, launch.SPLIT_MIN_BATCH[arch])
    draft = launch.SPLIT_MIN_DRAFT[arch]  # verify steps of this many drafts split at any batch
    assert draft is None or (launch.split_refresh(arch, 3, draft)
                             and launch.split_refresh(arch, 3, draft - 1) == by_batch)
    for split in (True, False, None):  # None: the default for a batch of 3
        launches = []
        launch.LAUNCHER = lambda kernel, grid, a, kw: launches.append(kernel.fn.__name__)
        if split is not None:
            launch.TUNING["split_refresh"] = split
        try:
            with Ops() as ops:
                call(cache, slots, *args, backend="triton")
        finally:
            launch.LAUNCHER = launch._launch
            launch.TUNING.clear()
        refresh = [f"_{arch}_refresh_kernel"] if (by_batch if split is None else split) else []
        assert launches == [f"_{arch}_scores_kernel", *refresh, f"_{arch}_step_kernel", "advance_kernel"]
        assert ops.names <= {"empty", "empty_like", "select", "unsqueeze", "view", "slice"}, ops.names


def test_triton_accept_matches_torch_accept():
    """The accept kernel against the PyTorch form on the same counters: pads skipped, counts
    clamped to [0, pending] (value checks off, so out-of-range counts reach the kernel), several
    programs (launch.ACCEPT_BLOCK lowered to 4)."""
    from replayssm._triton import launch

    base = helpers.make_layer("gdn", 0, **GEOMETRY["gdn"])
    caches = [base.cache(11, window=8, max_draft=4) for _ in range(2)]
    g = helpers.generator(9)
    slots = torch.tensor([3, -1, 0, 7, 10, -1, 5, 1, 9, 2])
    counts = torch.randint(-2, 7, (10,), generator=g)
    for c in caches:
        c.check_values = False
        c.committed.copy_(torch.randint(0, 5, c.committed.shape, generator=helpers.generator(1)))
        c.pending.copy_(torch.randint(0, 5, c.pending.shape, generator=helpers.generator(2)))
        c.tokens.copy_(torch.randint(0, 99, c.tokens.shape, generator=helpers.generator(3)))
    old, launch.ACCEPT_BLOCK = launch.ACCEPT_BLOCK, 4
    try:
        caches[0].accept(slots, counts, backend="torch")
        caches[1].accept(slots, counts.to(torch.int32), backend="triton")
    finally:
        launch.ACCEPT_BLOCK = old
    for name in ("committed", "pending", "tokens", "refreshes"):
        assert torch.equal(getattr(caches[0], name), getattr(caches[1], name)), name
