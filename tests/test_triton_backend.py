"""The Triton backend, run by Triton's interpreter on the CPU (TRITON_INTERPRET=1, conftest),
against the float64 recurrence and against the PyTorch backend: decode across refreshes,
speculative rounds with every accept count, pad slots, slots at different window positions,
and the two-precision invariants. Geometries are small: dims of 16 and 32 mostly, and heads of any
dims (``ANY_DIMS``)."""
import importlib

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import helpers  # noqa: E402
import replayssm as rs  # noqa: E402
from replayssm._triton import window  # noqa: E402

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
              ("gdn", False): rs.gdn_decode, ("gdn", True): rs.gdn_verify,
              ("kda", False): rs.kda_decode, ("kda", True): rs.kda_verify}[(self.name, verify)]
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


#: Geometries whose heads hold two fold sub-tiles (dv = 64): a program of 64 rows folds 32 at a time.
WIDE = {"mamba2": dict(nheads=2, headdim=64, dstate=32, ngroups=1),
        "gdn": dict(num_k_heads=1, num_v_heads=2, head_k_dim=32, head_v_dim=64),
        "kda": dict(num_k_heads=1, num_v_heads=2, head_k_dim=32, head_v_dim=64)}


@pytest.mark.parametrize("arch, variant", [("mamba2", "default"), ("gdn", "default"),
                                           ("mamba2", "window8"), ("gdn", "window8"),
                                           ("mamba2", "rows64"), ("gdn", "rows64"),
                                           ("gdn", "stream"), ("mamba2", "stream"),
                                           ("mamba2", "split"), ("gdn", "split"), ("gdn", "beside"),
                                           ("gdn", "beside_split"), ("mamba2", "beside"), ("gdn", "fused"),
                                           ("mamba2", "fused"), ("gdn", "fused_stream"), ("gdn", "split_solve_here"),
                                           ("gdn", "beside_solve_here")])
def test_triton_s32_matches_float64_reference(arch, variant):
    """Decode and verify rounds of every draft length and accept count, with pads and staggered
    slots, across refreshes: the default launch policy at a full 16-entry window (every step of
    the residual solve runs) and at 8; 64-row programs folding two 32-row sub-tiles; the read-copy
    products on tensor cores at every draft length (streamed); and the
    refresh in a launch of its own, whose one program per tile (``launch.refresh_grid`` of 4 slots)
    refreshes every slot due in turn; and the slots due refreshed and stepped in a launch of their
    own (``StepShape.beside``: each refresh a branch of its step, or after a refresh launch), the
    other slots' step skipping them; GDN's refreshing programs solving their heads' systems
    themselves (``StepShape.solve_here``) in a refresh launch or beside the others."""
    from replayssm._triton import launch

    layer = TritonLayer(arch, **(WIDE[arch] if variant == "rows64" else {}))
    window = 8 if variant == "window8" else 16
    tr = helpers.Tracker(layer, layer.cache(4, window=window, max_draft=4), seed=3)
    launch.TUNING.update({"rows64": dict(rows=64), "stream": dict(output_dot=True, stream=2), "split": dict(split=True),
                          "beside": dict(split=False, beside=True),
                          "beside_split": dict(split=True, beside=True), "fused": dict(fused=True),
                          "fused_stream": dict(fused=True, output_dot=True, stream=2),
                          "split_solve_here": dict(split=True, solve_here=True),
                          "beside_solve_here": dict(split=False, beside=True, solve_here=True)}.get(variant, {}))
    try:
        _schedule(tr, rounds=10 if variant == "default" else 6, rng=None)
    finally:
        launch.TUNING.clear()
    tr.check_counters([0, 1, 2])
    assert not tr.cache.programs_done.any()  # every refreshing slot's count back at zero
    helpers.record(f"triton {arch} s32_rs max rel err", tr.max_rel)
    assert tr.max_rel <= 2e-5, tr.max_rel
    assert tr.state_error([0, 1, 2]) <= 1e-5


@pytest.mark.parametrize("arch, fused", [("mamba2", False), ("gdn", False), ("mamba2", True), ("gdn", True)])
def test_a_refreshing_slot_advances_only_after_its_last_program(arch, fused):
    """A refreshing slot's programs fold the buffered shared entries (B; GDN's k and beta) that
    the advance overwrites with the new tokens', so the last of them to finish advances the slot
    (``launch.advance_row``); in a step of one launch (``fused``) every slot's, whose programs
    read the cursor the advance moves. Counted one program short (``programs_done`` starting at 1),
    the slot advances before its last program folds (or reads its cursor), and the outputs leave
    the float64 recurrence behind."""
    from replayssm._triton import launch

    layer = TritonLayer(arch)
    errors = []
    for short in (False, True):
        tr = helpers.Tracker(layer, layer.cache(4, window=4, max_draft=2), seed=5)
        tr.load([0, 1])
        tr.decode([1])  # staggered: the slots refresh in different steps
        launch.TUNING.update(fused=fused)
        try:
            for _ in range(20):
                if short:
                    tr.cache.programs_done.fill_(1)
                tr.decode([0, 1])
        except AssertionError:  # the tracker's own checks: non-finite outputs
            tr.max_rel = float("inf")
        finally:
            launch.TUNING.clear()
        errors.append(tr.max_rel)
    assert errors[0] <= 2e-5 and errors[1] > 100 * 2e-5, errors  # a window of 4: entry 0 weighs in the fold


@triton.jit
def _decays_one_entry_early(G, G_next, path, path_next):
    """``decay.path_decays`` with entry j's own log decay counted in g(j, t] (the suffix sum from
    j instead of after it)."""
    seg = tl.cumsum(tl.where(path[None, :], G, 0.0), 1, reverse=True)
    return tl.exp(tl.where(path[None, :], seg, float("-inf"))), tl.exp(tl.sum(tl.where(path[None, :], G, 0.0), 1))


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
def test_a_scores_launch_whose_decays_start_one_entry_early_is_detected(arch, monkeypatch):
    """The step kernels take every decay from the scores launch's weights: with each segment
    starting one entry early, the outputs leave the float64 recurrence far behind."""
    monkeypatch.setattr(importlib.import_module(f"replayssm.{arch}.triton"), "path_decays", _decays_one_entry_early)
    layer = TritonLayer(arch)
    tr = helpers.Tracker(layer, layer.cache(4, window=16, max_draft=4), seed=3)
    _schedule(tr, rounds=2, rng=None)
    assert tr.max_rel > 100 * 2e-5, tr.max_rel


@triton.jit
def _due_list_with_one_other_row(slots_ptr, committed_ptr, due_ptr, B, T: tl.constexpr, L: tl.constexpr,
                                 CH: tl.constexpr, PASSES: tl.constexpr):
    """``window.list_due``, then batch row 0 written over its order of the rows not due."""
    window.list_due(slots_ptr, committed_ptr, due_ptr, B, T, L, CH, PASSES)
    tl.debug_barrier()  # the list's stores, read back by other threads
    count = tl.load(due_ptr)
    for p in tl.static_range(PASSES):
        i = p * CH + tl.arange(0, CH)
        tl.store(due_ptr + 1 + i, i * 0, mask=(i >= count) & (i < B))


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
def test_a_step_launch_that_misses_a_row_in_its_due_first_order_is_detected(arch, monkeypatch):
    """Below batch 64 the step launch takes the batch rows in the scores launch's order, the slots
    due first (``StepShape.due_first``): an order that names one row for every row not due leaves
    the others' outputs unwritten and their entries unstored, which the tracker's checks or the
    float64 recurrence catch."""
    from replayssm._triton import launch

    assert launch.step_shape(TritonLayer(arch).cache(4, window=16, max_draft=4), arch, 1, batch=4).due_first
    monkeypatch.setattr(importlib.import_module(f"replayssm.{arch}.triton"), "list_due", _due_list_with_one_other_row)
    layer = TritonLayer(arch)
    tr = helpers.Tracker(layer, layer.cache(4, window=16, max_draft=4), seed=4)
    try:
        _schedule(tr, rounds=2, rng=None)
    except AssertionError:  # the tracker's own checks caught it first (a pad's outputs not zero)
        return
    assert tr.max_rel > 100 * 2e-5, tr.max_rel


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
@pytest.mark.parametrize("precision", ["tp8_hi32", "tp4_hi16_sr", "f4_sr_rs", "bf16_rs", "tp4_hi16_sr@dot"])
def test_triton_low_precision_agrees_with_torch_backend(arch, precision):
    """Same inputs through both backends: outputs agree to the read format's rounding, the
    anchors stay close, and the counters are identical. ``@dot``: every step's read-copy products
    streamed on tensor cores, as large batches of NVFP4 steps take them (``launch.SHAPES``)."""
    from replayssm._triton import launch

    precision, _, dot = precision.partition("@")
    launch.TUNING.update(dict(output_dot=True, stream=2) if dot else {})
    try:
        _agrees_with_torch_backend(arch, precision)
    finally:
        launch.TUNING.clear()


def _agrees_with_torch_backend(arch, precision):
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


@pytest.mark.parametrize("arch", ["gdn", "kda", "mamba2"])
@pytest.mark.parametrize("preset, tuning", [("tp16_hi32", {}), ("tpbf16_hi32", {}), ("tp8_hi32", {}),
                                            ("tp4_hi32", dict(rows=64, output_dot=True, stream=2)),
                                            ("tp4_hi32", dict(rows=32, output_dot=True, stream=2))])
def test_verify_products_from_narrow_read_copies_are_fp32_accurate(arch, preset, tuning):
    """A verify of 4 drafts right after a load computes its outputs from the read copy alone, its
    products on tensor cores with the read copy's values as they are stored and the keys and queries
    split into 16-bit pieces (``formats.exact_operand_products``; NVFP4 values times their block
    scales in fp16, streamed over programs of one or two global-scale blocks): against the float64
    recurrence started from the decoded read copy, within fp32 accuracy. Started from the state that
    was loaded instead, the reference differs by the read format's rounding, which the bound catches
    (a single pass over 16-bit keys and queries would round them alike)."""
    from replayssm._triton import launch

    dims = dict(nheads=2, headdim=64, dstate=32, ngroups=1) if arch == "mamba2" else dict(
        num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=64)
    if arch == "mamba2":
        tuning = dict(tuning, output_dot=True)  # Mamba-2 takes row reductions unless told
        layer = TritonLayer(arch, **dims)
    else:
        layer = helpers.make_layer(arch, 0, **dims)
    g = helpers.generator(11)
    cache = layer.cache(3, window=16, max_draft=4, precision=preset)
    slots = torch.tensor([2, 0])
    state = torch.randn(2, *layer.state_shape, generator=g)
    state[:, :, 32:] *= 1e3  # the second global-scale block of each head far from the first
    cache.load_state(slots, state)
    tok = layer.tokens(g, 2, 4)
    launch.TUNING.update(tuning)
    try:
        if arch == "mamba2":
            y = layer.run(cache, slots, tok, verify=True)
        elif arch == "kda":
            y = rs.kda_verify(cache, slots, **tok, use_qk_l2norm=True, backend="triton")
        else:
            y = rs.gdn_verify(cache, slots, **tok, use_qk_l2norm=True, backend="triton")
    finally:
        launch.TUNING.clear()

    def rel(start):
        ref = layer.reference(start.double(), tok)[0]
        return ((y.double() - ref).norm() / ref.norm()).item()

    assert rel(cache.decode_read(slots)) <= 1e-5
    assert rel(state) > 1e-4


@pytest.mark.parametrize("arch", ["mamba2", "gdn", "kda"])
def test_triton_read_precision_and_tile_leave_anchor_bit_identical(arch):
    """Changing only the read format of an fp32 anchor (and so the step's tile: NVFP4 runs 4 warps,
    others 1), the rows per program (64 rows fold as two 32-row sub-tiles) or the launches (a step of
    one launch computes each refresh's scalars in the refreshing program, the launches in the scores
    or solve launch) changes outputs, never the anchor bits: decode and verify rounds of up to 4
    drafts (GDN's one launch takes the read-copy products of 3 and 4 on tensor cores) across
    refreshes, two heads of 64 rows."""
    from replayssm._triton import launch

    layer = TritonLayer(arch, **WIDE[arch])
    g = helpers.generator(9)
    slots = torch.tensor([0, 1])
    state = torch.randn(2, *layer.state_shape, generator=g)
    runs = {p: layer.cache(2, window=4, max_draft=4, precision=p)
            for p in ("s32_rs", "tp16_hi32", "tpbf16_hi32", "tp8_hi32", "tp4_hi32")}
    runs["s32_rs@64"] = layer.cache(2, window=4, max_draft=4, precision="s32_rs")
    # two slots: one launch by default (``launch.FUSED_MAX_BATCH``; fp8 and NVFP4 verify of 3 or
    # more drafts, the launches); the launches too
    runs["s32_rs@launches"] = layer.cache(2, window=4, max_draft=4, precision="s32_rs")
    if arch == "gdn":  # each refreshing program solves its own head's system (no solve launch)
        runs["s32_rs@solve_here"] = layer.cache(2, window=4, max_draft=4, precision="s32_rs")
        runs["tp16_hi32@solve_here"] = layer.cache(2, window=4, max_draft=4, precision="tp16_hi32")
    outs = {p: [] for p in runs}
    for c in runs.values():
        c.load_state(slots, state)
    for step in range(10):
        T = (1, 1, 2, 1, 3, 1, 4, 1, 2, 1)[step]
        tok = layer.tokens(g, 2, T)
        for p, c in runs.items():
            launch.TUNING.clear()
            launch.TUNING.update({"@64": dict(rows=64), "@launches": dict(fused=False),
                                  "@solve_here": dict(fused=False, solve_here=True)}.get(p[p.find("@"):], {}))
            try:
                outs[p].append(layer.run(c, slots, tok, T > 1).reshape(-1))
                if T > 1:
                    layer.accept(c, slots, torch.tensor([1, T]))
            finally:
                launch.TUNING.clear()
    assert all(int(c.refreshes[:2].min()) >= 2 for c in runs.values())
    anchors = [c.anchor["values"][:2] for c in runs.values()]  # loaded slots (the rest is NaN-poisoned)
    assert all(torch.equal(anchors[0], a) for a in anchors[1:])
    assert not torch.equal(torch.cat(outs["s32_rs"]), torch.cat(outs["tp8_hi32"]))


#: Heads whose dv is a multiple of 16 but not of 32 (Nemotron-Nano's headdim 80; dv = 48): programs
#: of 16 rows, fold sub-tiles of 16 rows, NVFP4 global scales per 16 rows.
ODD_ROWS = {"mamba2": dict(nheads=2, headdim=80, dstate=32, ngroups=1),
            "gdn": dict(num_k_heads=1, num_v_heads=2, head_k_dim=32, head_v_dim=48)}


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
def test_triton_heads_of_16_row_multiples_match_float64(arch):
    """dv = 80 / 48 on the Triton backend: decode and verify rounds with every accept count across
    refreshes against the float64 recurrence (s32_rs); an fp8 and an NVFP4 read copy keep the fp32
    anchor's bits; every row of the head is computed (a program count that skipped the last rows
    would leave them at the poisoned NaN)."""
    layer = TritonLayer(arch, **ODD_ROWS[arch])
    tr = helpers.Tracker(layer, layer.cache(4, window=8, max_draft=4), seed=12)
    _schedule(tr, rounds=5, rng=None)
    tr.check_counters([0, 1, 2])
    assert tr.max_rel <= 2e-5, tr.max_rel
    assert tr.state_error([0, 1, 2]) <= 1e-5
    g = helpers.generator(13)
    slots = torch.tensor([0, 1])
    state = torch.randn(2, *layer.state_shape, generator=g)
    caches = {p: layer.cache(2, window=4, max_draft=2, precision=p) for p in ("s32_rs", "tp8_hi32", "tp4_hi32")}
    for c in caches.values():
        c.load_state(slots, state)
    for step in range(6):
        tok = layer.tokens(g, 2, 1)
        for c in caches.values():
            assert torch.isfinite(layer.run(c, slots, tok, False)).all()
    anchors = [c.anchor["values"][:2] for c in caches.values()]
    assert all(torch.equal(anchors[0], a) for a in anchors[1:])


#: Heads whose dims are neither powers of two nor multiples of 16: dv = 8 and 24 (programs of one
#: 8-row block, NVFP4 global scales per 8 rows), dk = 24 and 48 (column tiles of 32 and 64 masked
#: from dk on; fp8 rows of one and two scale blocks, NVFP4 rows of two and three), dv = 3 with
#: dk = 5 (1-row programs, an NVFP4 global scale per row). The refresh a branch of the step, or a
#: launch of its own (split); GDN's verify products on tensor cores streamed (fp32, the default for
#: 4 drafts; fp8 at dv = 24, dk = 48), or row reductions; its decode from 2-byte and fp8
#: read copies at dk = 24 (a masked tile) and dk = 40 (fp8: a stored scale block of padding past 40);
#: the step of one launch (``StepShape.fused``) from fp8 and NVFP4 read copies; GDN's NVFP4 decode as
#: at large batches (the slots due beside the others after their refresh launch, streamed products).
ANY_DIMS = [("mamba2", 8, 24, "s32_rs", {}), ("mamba2", 24, 48, "tp8_hi32", dict(split=True)),
            ("mamba2", 3, 5, "tp4_hi32", {}), ("gdn", 24, 24, "s32_rs", {}),
            ("gdn", 8, 48, "tp4_hi32", dict(split=True)), ("gdn", 24, 48, "tp8_hi32", dict(output_dot=True)),
            ("gdn", 8, 24, "tp16_hi32", {}), ("gdn", 24, 40, "tp8_hi32", {}),
            ("gdn", 24, 48, "tp8_hi32", dict(fused=True)), ("mamba2", 3, 5, "tp4_hi32", dict(fused=True, warps=4)),
            ("gdn", 24, 48, "tp4_hi32", dict(split=True, beside=True, output_dot=True, stream=2))]


@pytest.mark.parametrize("arch, dv, dk, preset, tuning", ANY_DIMS)
def test_triton_heads_of_any_dims_match_float64(arch, dv, dk, preset, tuning):
    helpers.check_any_dims(TritonLayer(arch, **helpers.any_dims(arch, dv, dk)), preset, tuning, seed=dv + dk)


@triton.jit
def _first_block_scale(mat, r0, BV: tl.constexpr, DV: tl.constexpr):
    """A broken ``formats.global_scale_index``: every row of a program read with its first block's scale."""
    return mat * (DV // 32) + r0 // 32


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
def test_nvfp4_programs_of_several_row_blocks_read_each_its_global_scale(arch, monkeypatch):
    """An NVFP4 read copy has one global scale per 32-row block; a program of 64 rows reads two,
    one per row (``formats.global_scale_index``). With the second block's rows 1000 times the
    first's, decodes and verify rounds across refreshes at 64-row programs (the refresh a branch and
    a launch of its own) stay within NVFP4's bound of the float64 recurrence; read with the first
    block's scale for all 64 rows, the same steps leave it far behind."""
    rows = torch.cat([torch.full((32,), 1e-3), torch.ones(32)])
    module = importlib.import_module(f"replayssm.{arch}.triton")
    errors = []
    for broken in (False, True):
        if broken:
            monkeypatch.setattr(module, "global_scale_index", _first_block_scale)
        for split in (False, True):
            tr = helpers.refresh_schedule(TritonLayer(arch, **WIDE[arch]), "tp4_hi32",
                                          dict(rows=64, warps=4, split=split), 13, rows=rows)
            assert min(tr.refreshes.values()) >= 1
            assert tr.state_error([0, 1, 2]) <= 1e-5  # the fp32 anchor: no read path in it
            errors.append(tr.max_err / tr.max_ref)
    assert max(errors[:2]) <= helpers.READ_BOUND["nvfp4"] < min(errors[2:]), errors


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
def test_a_triton_step_is_two_or_three_launches_and_no_pytorch_compute(arch):
    """With check_values off (as under CUDA-graph capture) a decode step is the scores and step
    launches (GDN: and the solve launch after the scores; the step advances the cursors) with the
    refresh a branch of the step, or with the refresh launch before the step (``StepShape.split``);
    GDN's step of one launch (``StepShape.fused``) is the step launch alone. PyTorch only allocates
    outputs and scratch and makes views."""
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
    cache.follow_inputs(torch.bfloat16)  # the buffer of the bf16 inputs, allocated ahead as before a capture
    cache.check_values = False
    for split, beside, fused in ((False, False, False), (True, False, False), (False, True, False),
                                 (True, True, False), (False, False, True)):
        launches = []
        launch.LAUNCHER = lambda kernel, grid, a, kw: launches.append((kernel.fn.__name__, kw.get("DUE")))
        launch.TUNING.update(split=split, beside=beside, fused=fused)
        try:
            with Ops() as ops:
                call(cache, slots, *args, backend="triton")
        finally:
            launch.LAUNCHER = launch._launch
            launch.TUNING.clear()
        names = [name for name, _ in launches]
        if fused:
            assert names == [f"_{arch}_step_kernel"]
            assert ops.names <= {"empty", "empty_like", "select", "unsqueeze", "view", "slice"}, ops.names
            continue
        solve = ["_gdn_solve_kernel"] if arch == "gdn" else []
        refresh = [f"_{arch}_refresh_kernel"] if split else []
        if beside:  # the slots due first (on a side stream on a GPU), then the others
            assert [due for _, due in launches] == [None, *[None] * (len(solve) + split), launch.DUE_ONLY,
                                                    launch.NOT_DUE]
            assert names == [f"_{arch}_scores_kernel", *solve, *refresh, f"_{arch}_step_kernel",
                             f"_{arch}_step_kernel"]
            continue
        assert names == [f"_{arch}_scores_kernel", *solve, *refresh, f"_{arch}_step_kernel"]
        assert ops.names <= {"empty", "empty_like", "select", "unsqueeze", "view", "slice"}, ops.names


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
def test_step_beside_the_slots_due_leaves_them_to_their_own_launch(arch):
    """With ``StepShape.beside`` the step launch over every batch row (``launch.NOT_DUE``) skips the
    slots due: dropping the launch over the slots due (``launch.DUE_ONLY``) leaves exactly their
    outputs unwritten, and with it every output matches the same step without the split."""
    from replayssm._triton import launch

    g = helpers.generator(29)
    bf = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    slots = torch.tensor([0, 1, 2, 3])
    if arch == "mamba2":
        make = lambda: rs.Mamba2Cache(4, 2, 16, 32, ngroups=1, window=4)  # noqa: E731
        inputs = (bf(4, 2, 16), bf(4, 2), -torch.rand(2, generator=g), bf(4, 1, 32), bf(4, 1, 32), torch.randn(2),
                  bf(4, 2, 16), torch.randn(2), True)
        call = rs.mamba2_decode
    else:
        make = lambda: rs.GDNCache(4, 1, 2, 32, 16, window=4)  # noqa: E731
        inputs = (bf(4, 1, 32), bf(4, 1, 32), bf(4, 2, 16), -torch.rand(4, 2, generator=g),
                  torch.rand(4, 2, generator=g))
        call = rs.gdn_decode
    outs = []
    for drop_due in (False, True, None):
        cache = make()
        cache.load_state(slots, torch.randn(4, *cache.state_shape, generator=helpers.generator(5)) * 0.1)
        cache.check_values = False
        for k in range(4):  # slots 0 and 2 are due, 1 is not, 3 has an empty window
            call(cache, torch.tensor([0, 1 if k == 0 else -1, 2, -1]), *inputs, backend="triton")
        out = torch.full((4, 2, 16), float("nan"))
        launch.TUNING.update(split=True, beside=drop_due is not None)
        launch.LAUNCHER = lambda kernel, grid, a, kw: (None if drop_due and kw.get("DUE") == launch.DUE_ONLY
                                                       else launch._launch(kernel, grid, a, kw))
        try:
            call(cache, slots, *inputs, backend="triton", out=out)
        finally:
            launch.LAUNCHER = launch._launch
            launch.TUNING.clear()
        outs.append(out)
    assert torch.isnan(outs[1][[0, 2]]).all() and torch.equal(outs[1][[1, 3]], outs[0][[1, 3]])
    assert torch.isfinite(outs[0]).all()
    torch.testing.assert_close(outs[0], outs[2], rtol=1e-6, atol=1e-6)


def test_step_shapes_follow_the_policy():
    """``launch.step_shape``: the table by draft length, rows kept to whole fold sub-tiles and
    NVFP4 row blocks (one or several; of fewer than 32 rows for small or odd dv), the entries that
    differ below batch 64 (``launch.SMALL_BATCH_SHAPES``), sweep labels; ``launch.column_pad``: dk
    padded to a power of two >= 16, >= 32 with fp8."""
    from replayssm._triton import launch

    wide = rs.GDNCache(1, 1, 2, 32, 128, precision="s32_rs")
    one = launch.step_shape(wide, "gdn", 1)  # the slots due beside the others, each refresh a branch
    assert one[:2] == (32, 1) and one.beside and not one.split
    # below batch 64: the slots due first up to batch 16 and two windows of tokens, else beside
    for T, batch in ((1, 8), (1, 16), (4, 4), (4, 8)):
        small_batch = launch.step_shape(wide, "gdn", T, batch=batch)
        assert small_batch.due_first and not small_batch.beside and not small_batch.split, (T, batch)
    for T, batch in ((1, 32), (4, 16)):
        assert launch.step_shape(wide, "gdn", T, batch=batch).beside and not launch.step_shape(
            wide, "gdn", T, batch=batch).due_first, (T, batch)
    assert not launch.step_shape(wide, "gdn", 1).due_first and not launch.step_shape(wide, "gdn", 1, batch=1).due_first
    # GDN decode beside the others from fp32 and 2-byte read copies: the refreshing programs solve their
    # heads' systems where the others' step is short (batch x value heads <= 1536), not in verify, at
    # batch 256 or from fp8
    qwen3_next = rs.GDNCache(1, 16, 32, 128, 128, precision="s32_rs")
    for batch in (24, 32, 48):
        assert launch.step_shape(qwen3_next, "gdn", 1, batch=batch).solve_here, batch
    assert not launch.step_shape(qwen3_next, "gdn", 4, batch=32).solve_here
    assert not launch.step_shape(qwen3_next, "gdn", 1, batch=256).solve_here
    qwen35 = rs.GDNCache(1, 16, 64, 128, 128, precision="s32_rs")
    assert launch.step_shape(qwen35, "gdn", 1, batch=24).solve_here
    assert not launch.step_shape(qwen35, "gdn", 1, batch=32).solve_here
    for preset in ("tp16_hi32", "tpbf16_hi32"):
        assert launch.step_shape(rs.GDNCache(1, 16, 32, 128, 128, precision=preset), "gdn", 1, batch=32).solve_here
    assert not launch.step_shape(rs.GDNCache(1, 16, 32, 128, 128, precision="tp8_hi32"), "gdn", 1,
                                 batch=32).solve_here
    # GDN fp32 verify of 4 or more drafts at batch 32-63: the slots due beside the others, refreshed
    # in a launch of their own before their step; not at batch 16, for 2 drafts or from fp16
    for T, batch in ((4, 32), (4, 48), (8, 32)):
        verify = launch.step_shape(qwen35, "gdn", T, batch=batch)
        assert verify.beside and verify.split, (T, batch)
    for T, batch in ((4, 16), (2, 32), (1, 32)):
        assert not launch.step_shape(qwen35, "gdn", T, batch=batch).split, (T, batch)
    assert not launch.step_shape(rs.GDNCache(1, 16, 64, 128, 128, precision="tp16_hi32"), "gdn", 4, batch=32).split
    m2_32 = launch.step_shape(rs.Mamba2Cache(1, 2, 64, 128), "mamba2", 1, batch=32)
    assert m2_32.due_first and not m2_32.beside
    assert not launch.step_shape(rs.Mamba2Cache(1, 2, 64, 128), "mamba2", 1).due_first
    m8 = rs.Mamba2Cache(1, 2, 64, 128, precision="tp8_hi32")  # Mamba-2 fp8: beside, after a refresh launch
    assert launch.step_shape(m8, "mamba2", 1).beside and launch.step_shape(m8, "mamba2", 1).split
    assert not launch.step_shape(m8, "mamba2", 4).beside
    kda = rs.KDACache(1, 1, 2, 32, 128, precision="s32_rs")  # KDA: no side stream, a refresh launch
    assert launch.step_shape(kda, "kda", 1).split and not launch.step_shape(kda, "kda", 1).beside
    assert not launch.step_shape(kda, "kda", 1, batch=32).beside
    # the scores launch's warps by architecture, whatever the step
    assert [launch.step_shape(c, a, T, batch=b).scores_warps for c, a, T, b in (
        (kda, "kda", 4, 256), (kda, "kda", 1, 8), (wide, "gdn", 4, 256), (m8, "mamba2", 1, 256))] == [1, 1, 1, 2]
    four = launch.step_shape(wide, "gdn", 4)
    assert (four.rows, four.warps, four.output_dot, four.stream, four.split, four.refresh_maxnreg) == (
        64, 2, True, 3, True, 168)
    four_small = launch.step_shape(wide, "gdn", 4, batch=8)  # small batches: the refresh a branch, 32 rows
    assert not four_small.split and (four_small.rows, four_small.warps, four_small.output_dot) == (32, 1, True)
    assert launch.step_shape(wide, "gdn", 3).pin == 16  # the T = 1 entry still applies
    half = rs.GDNCache(1, 1, 2, 32, 128, precision="tp16_hi32")  # 2-byte read copies: products from 2 drafts
    assert launch.step_shape(half, "gdn", 2)[:2] == (64, 2) and launch.step_shape(half, "gdn", 2).output_dot
    assert not launch.step_shape(half, "gdn", 1).output_dot
    eight = rs.GDNCache(1, 1, 2, 32, 128, precision="tp8_hi32")  # fp8: the small batches' own entries
    assert [launch.step_shape(eight, "gdn", T, batch=b)[:5] for T, b in ((2, 256), (2, 32), (4, 256), (4, 32))] == [
        (64, 1, 0, True, 3), (32, 1, 0, False, 0), (64, 1, 0, True, 3), (32, 1, 0, True, 3)]
    assert not launch.step_shape(eight, "gdn", 2).beside and launch.step_shape(eight, "gdn", 4).beside
    fp4 = rs.GDNCache(1, 1, 2, 32, 128, precision="tp4_hi32")  # NVFP4: streamed products but small decodes
    assert [launch.step_shape(fp4, "gdn", T, batch=b)[:5] for T, b in ((1, 256), (4, 256), (1, 8), (4, 8))] == [
        (64, 1, 0, True, 2), (32, 1, 0, True, 2), (32, 4, 0, False, 0), (32, 1, 0, True, 2)]
    assert launch.step_shape(fp4, "gdn", 1).beside and not launch.step_shape(fp4, "gdn", 4).beside
    kda4 = rs.KDACache(1, 1, 2, 32, 128, precision="tp4_hi32")  # KDA: GDN's NVFP4 decodes, with a refresh launch
    assert [launch.step_shape(kda4, "kda", 1, batch=b)[:5] for b in (256, 32)] == [
        (64, 1, 0, True, 2), (32, 4, 0, False, 0)]
    assert launch.step_shape(kda4, "kda", 1).split and not launch.step_shape(kda4, "kda", 1).beside
    # Mamba-2 NVFP4 and fp8: 64-row programs from batch 64 on (NVFP4 decode beside), 32 rows below
    m4 = rs.Mamba2Cache(1, 2, 64, 128, precision="tp4_hi32")
    assert [launch.step_shape(m4, "mamba2", T)[:5] for T in (1, 2)] == [(64, 1, 0, False, 0), (64, 2, 0, True, 3)]
    assert [launch.step_shape(m4, "mamba2", T, batch=32)[:5] for T in (1, 2)] == [
        (32, 4, 0, False, 0), (32, 2, 0, True, 2)]
    assert launch.step_shape(m4, "mamba2", 1).beside and not launch.step_shape(m4, "mamba2", 1, batch=32).beside
    assert [launch.step_shape(m8, "mamba2", 1, batch=b).rows for b in (256, 32)] == [64, 32]
    small = rs.Mamba2Cache(1, 2, 16, 32)
    assert launch.step_shape(small, "mamba2").rows == 16
    for arch, cache in (("gdn", wide), ("mamba2", m8), ("kda", kda)):  # one launch for the smallest steps
        assert [launch.step_shape(cache, arch, T, batch=b).fused
                for b, T in ((1, 1), (2, 2), (3, 1), (1, 5))] == [arch != "kda"] * 2 + [False] * 2
    assert launch.step_shape(wide, "gdn", 1, batch=1)[:2] == (32, 2)
    # Mamba-2's one launch from fp32 and 2-byte read copies: 4 warps at batch 1 and for decode at batch 2
    m32 = rs.Mamba2Cache(1, 2, 64, 128, max_draft=4)
    assert [launch.step_shape(m32, "mamba2", T, batch=b).warps for b, T in ((1, 1), (1, 4), (2, 1), (2, 2))] == [
        4, 4, 4, 2]
    assert launch.step_shape(m8, "mamba2", 1, batch=1).warps == 2
    # GDN's refresh launch capped at 168 registers from fp8 and NVFP4 read copies of fp32 anchors only
    assert [launch.step_shape(rs.GDNCache(1, 1, 2, 32, 128, precision=p), "gdn", T).refresh_maxnreg
            for p, T in (("tp8_hi32", 1), ("tp8_hi32", 4), ("tp4_hi32", 1), ("tp4_hi32", 2), ("tp4_hi16_sr", 1),
                         ("f4_sr_rs", 2))] == [168, 168, 168, 168, 0, 0]
    # KDA: GDN's caps, none from NVFP4 read copies
    assert [launch.step_shape(rs.KDACache(1, 1, 2, 32, 128, precision=p), "kda", 1).refresh_maxnreg
            for p in ("s32_rs", "tp8_hi32", "tp4_hi32")] == [128, 168, 0]
    # verify rounds of 3 and 4 drafts too, from fp32 and 2-byte read copies; GDN's with streamed products
    for preset, one in (("s32_rs", True), ("tp16_hi32", True), ("tpbf16_hi32", True), ("tp8_hi32", False)):
        for arch, cache in (("gdn", rs.GDNCache(1, 1, 2, 32, 64, precision=preset, max_draft=8)),
                            ("mamba2", rs.Mamba2Cache(1, 2, 64, 32, precision=preset, max_draft=8))):
            for T, b in ((3, 1), (4, 2)):
                found = launch.step_shape(cache, arch, T, batch=b)
                assert found.fused == one and (not one or found.output_dot == (arch == "gdn")), (preset, arch, T, b)
            assert not launch.step_shape(cache, arch, 5, batch=1).fused
            assert not launch.step_shape(cache, arch, 2, batch=1).output_dot
    odd = rs.GDNCache(1, 1, 2, 48, 24, precision="tp8_hi32")  # dk = 48, dv = 24: 8-row blocks
    assert launch.step_shape(odd, "gdn").rows == 8 and launch.column_pad(odd) == 64
    assert launch.step_shape(rs.Mamba2Cache(1, 2, 3, 5), "mamba2").rows == 1
    assert [launch.column_pad(rs.Mamba2Cache(1, 1, 16, 8, precision=p)) for p in ("s32_rs", "tp8_hi32")] == [16, 32]
    try:
        launch.TUNING.update(rows=48, scores_warps=8, pdl=True)  # pdl: a launch option, not a shape field
        assert launch.step_shape(kda, "kda", 4).scores_warps == 8
        assert launch.step_shape(wide, "gdn").rows == launch.FOLD_ROWS
        launch.TUNING.update(rows=128)  # NVFP4: whole global-scale blocks, four of them
        assert launch.step_shape(rs.GDNCache(1, 1, 2, 32, 128, precision="tp4_hi32"), "gdn").rows == 128
        assert launch.step_shape(rs.GDNCache(1, 1, 2, 32, 80, precision="tp4_hi32"), "gdn").rows == 16
    finally:
        launch.TUNING.clear()
    assert launch.parse_shape("64x4ok3") == dict(rows=64, warps=4, output_dot=True, stream=3)
    try:  # products on tensor cores are always streamed: 2 chunks in flight where a label gives none
        launch.TUNING.update(launch.parse_shape("32x1o"))
        assert launch.step_shape(wide, "gdn", 1).stream == 2 and launch.step_shape(wide, "gdn", 4).stream == 3
    finally:
        launch.TUNING.clear()
    assert launch.parse_shape("32x1v16") == dict(rows=32, warps=1, pin=16)
    assert launch.parse_shape("32x1v16fb") == dict(rows=32, warps=1, pin=16, split=False, beside=True)
    assert launch.parse_shape("32x1s4n2r168") == dict(rows=32, warps=1, split=True, refresh_warps=4, stages=2,
                                                      maxnreg=168)
    with pytest.raises(ValueError, match="label"):
        launch.parse_shape("32x1q")


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
        c.draft_gaps.copy_(torch.randint(0, 2, c.draft_gaps.shape, generator=helpers.generator(4)))
    old, launch.ACCEPT_BLOCK = launch.ACCEPT_BLOCK, 4
    try:
        caches[0].accept(slots, counts, backend="torch")
        caches[1].accept(slots, counts.to(torch.int32), backend="triton")
    finally:
        launch.ACCEPT_BLOCK = old
    for name in ("committed", "pending", "tokens", "refreshes", "draft_gaps"):
        assert torch.equal(getattr(caches[0], name), getattr(caches[1], name)), name
