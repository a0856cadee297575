"""No silent corruption from any accepted input: slot ids as strided views or int32, strided
per-head constants, empty batches, inputs that require grad, impossible or malformed
``state_dict``s, custom precisions that share a name, the scratch row, and the NaN-poisoning
switch across threads. Both backends (Triton under its interpreter, at the smallest geometry its
kernels tile); every output is measured against the float64 recurrence."""
import gc
import io
import threading
import weakref

import pytest
import torch

import replayssm as rs
from helpers import S32_TOL, Tracker, make_layer, snapshot, snapshot_diff

ARCHS = ["mamba2", "gdn"]
BACKENDS = ["torch", "triton"]

#: The smallest geometries the Triton kernels tile (dims >= 16).
TILED = {"mamba2": dict(nheads=4, headdim=16, dstate=32, ngroups=2),
         "gdn": dict(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=16)}


def _strided(ids, dtype, filler):
    """``ids`` as a view with stride 2 into storage whose other half is ``filler`` (valid ids of
    other slots): a backend that read the raw storage would touch those slots."""
    base = torch.stack([torch.as_tensor(ids, dtype=dtype), torch.as_tensor(filler, dtype=dtype)], 1)
    view = base[:, 0]
    assert not view.is_contiguous() or len(ids) <= 1
    return view


class ViewLayer:
    """A helpers layer whose calls pass slot ids and accepted counts as strided views of
    ``dtype`` (contiguous tensors with ``contiguous``), and Mamba-2's ``D`` as a strided view;
    ``backend`` picks the backend."""

    def __init__(self, arch, backend, dtype, num_slots, contiguous=False, **geometry):
        self.base = make_layer(arch, 0, **geometry)
        self.name, self.state_shape = self.base.name, self.base.state_shape
        self.backend, self.dtype, self.num_slots = backend, dtype, num_slots
        self.contiguous = contiguous

    def cache(self, num_slots, **kw):
        return self.base.cache(num_slots, **kw)

    def tokens(self, g, b, T):
        return self.base.tokens(g, b, T)

    def reference(self, state, tok):
        return self.base.reference(state, tok)

    def _view(self, slots):
        ids = slots.tolist()
        if self.contiguous:
            return torch.tensor(ids, dtype=self.dtype)
        others = [s for s in range(self.num_slots) if s not in ids] or [0]
        return _strided(ids, self.dtype, [others[i % len(others)] for i in range(len(ids))])

    def accept(self, cache, slots, counts):
        n = (torch.tensor(counts.tolist(), dtype=self.dtype) if self.contiguous
             else _strided(counts.tolist(), self.dtype, [cache.max_draft] * len(counts)))
        cache.accept(self._view(slots), n, backend=self.backend)

    def run(self, cache, slots, tok, verify):
        sv = self._view(slots)
        if self.name == "mamba2":
            c = self.base._consts()
            wide = torch.stack([c["D"], torch.full_like(c["D"], 7.0)], 1)
            c["D"] = wide[:, 0]  # stride 2
            fn = rs.mamba2_verify if verify else rs.mamba2_decode
        else:
            c = {"use_qk_l2norm": True}
            fn = rs.gdn_verify if verify else rs.gdn_decode
        if verify:
            return fn(cache, sv, **tok, **c, backend=self.backend)
        return fn(cache, sv, **{k: v[:, 0] for k, v in tok.items()}, **c, backend=self.backend)[:, None]


@pytest.mark.parametrize("dtype, contiguous", [(torch.int64, False), (torch.int32, False), (torch.int32, True)])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_strided_and_int32_slot_ids_touch_only_their_slots(arch, backend, dtype, contiguous):
    """Decode, verify and accept with strided (and int32) slot ids and counts, and with contiguous
    int32 ones (which the Triton kernels read as given): outputs match the float64 recurrence,
    slots outside the batch stay bit-identical (Tracker), counters follow."""
    layer = ViewLayer(arch, backend, dtype, 5, contiguous, **TILED[arch])
    cache = layer.cache(5, window=4, max_draft=2)
    tr = Tracker(layer, cache, seed=3)
    tr.load([0, 1, 2, 3, 4])
    tr.decode([3, -1, 1])
    tr.decode([1, 3])
    tr.verify([4, 1, -1], 2)
    tr.accept([1, 2, 0])
    tr.decode([4, 1, 3])  # slot 1 refreshes here (4 committed)
    tr.check_counters([0, 1, 2, 3, 4])
    assert tr.max_err <= S32_TOL * max(1.0, tr.max_ref)
    assert tr.state_error([1, 3, 4]) <= S32_TOL * max(1.0, tr.max_ref)
    # int32 ids through the other cache methods
    ids = torch.tensor([4, -1, 1], dtype=dtype)
    assert torch.equal(cache.materialize(ids), cache.materialize(ids.long()))
    assert {k: v.tolist() for k, v in cache.counters(ids).items()} == \
        {k: v.tolist() for k, v in cache.counters(ids.long()).items()}
    cache.reset(_strided([2], dtype, [0]))
    cache.load_state(torch.tensor([0], dtype=dtype), cache.materialize(torch.tensor([0], dtype=dtype)))


@pytest.mark.parametrize("arch", ARCHS)
def test_int32_slot_ids_counts_and_paths_reach_the_triton_kernels_uncopied(arch):
    """An engine's int32 state indices (vLLM's), accepted counts and paths cost no conversion kernel
    on the Triton backend: with value checks off (as in a CUDA graph), a decode, a verify and its
    accept dispatch no conversion of an int32 tensor at all (before, each call copied its int32
    ids to int64, a launch per layer and step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Conversions(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default:
                self.seen.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    layer = ViewLayer(arch, "triton", torch.int32, 3, True, **TILED[arch])
    cache = layer.cache(3, window=4, max_draft=2)
    g = torch.Generator().manual_seed(4)
    cache.load_state(torch.arange(3), torch.randn(3, *layer.state_shape, generator=g))
    cache.check_values = False
    slots = torch.tensor([2, -1, 0], dtype=torch.int32)
    tok = layer.tokens(g, 3, 2)
    with Conversions() as seen:
        layer.run(cache, slots, {k: v[:, :1] for k, v in tok.items()}, False)
        layer.run(cache, slots, tok, True)
        cache.accept(slots, torch.tensor([1, 0, 2], dtype=torch.int32), torch.tensor([[0, 1]] * 3, dtype=torch.int32),
                     backend="triton")
    assert torch.int32 not in seen.seen, seen.seen
    assert cache.counters(slots.long())["committed"].tolist() == [2, 0, 3]


def test_strided_slots_teeth():
    """Teeth: a strided view's raw storage names other slots (what a kernel reading it raw
    would use), so the test above would see the wrong slots written."""
    view = _strided([0, 2], torch.int64, [1, 3])
    assert view.untyped_storage().nbytes() == 32
    raw = torch.tensor([], dtype=torch.int64).set_(view.untyped_storage(), 0, (2,))
    assert raw.tolist() == [0, 1]


@pytest.mark.parametrize("layout", ["strided", "expanded"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_mamba2_strided_or_expanded_D(backend, layout):
    layer = make_layer("mamba2", 0, **TILED["mamba2"])
    g = torch.Generator().manual_seed(5)
    S = torch.randn(2, *layer.state_shape, generator=g)
    cache = layer.cache(2, window=4)
    cache.load_state(torch.arange(2), S)
    tok = {k: v[:, 0] for k, v in layer.tokens(g, 2, 1).items()}
    c = layer._consts()
    D = (torch.stack([c["D"], -c["D"]], 1)[:, 0] if layout == "strided"
         else torch.tensor([0.7]).expand(layer.H))
    y = rs.mamba2_decode(cache, torch.arange(2), **tok, **{**c, "D": D}, backend=backend)
    ref, _ = rs.mamba2_reference_step(S.double(), **tok, **{**c, "D": D.clone()})
    assert (y.double() - ref).abs().max() <= S32_TOL * max(1.0, ref.abs().max().item())


def test_triton_gdn_verify_four_drafts_at_head_k_dim_16():
    """GDN verify of T = 4 drafts at head_k_dim 16 on the Triton backend vs float64 (its read copy
    streams in chunks of at most the head's 16 columns; 32 read past the row)."""
    layer = make_layer("gdn", 0, num_k_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    cache = layer.cache(2, window=8, max_draft=4)
    g = torch.Generator().manual_seed(6)
    S = torch.randn(2, *layer.state_shape, generator=g)
    cache.load_state(torch.arange(2), S)
    tok = layer.tokens(g, 2, 4)
    y = rs.gdn_verify(cache, torch.arange(2), **tok, use_qk_l2norm=True, backend="triton")
    ref, _ = layer.reference(S.double(), tok)
    assert torch.isfinite(y).all()
    assert (y.double() - ref).abs().max() <= S32_TOL * max(1.0, ref.abs().max().item())


# ------------------------------------------------------------------------------------------------
# Empty batches
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_empty_batch_returns_empty_and_touches_nothing(arch, backend):
    layer = make_layer(arch, 0, **TILED[arch])
    cache = layer.cache(2, window=4, max_draft=2)
    Tracker(layer, cache).load([0, 1])
    before = snapshot(cache)
    g = torch.Generator().manual_seed(7)
    none = torch.zeros(0, dtype=torch.int64)
    kw = layer._consts() if arch == "mamba2" else {"use_qk_l2norm": True}
    dec, ver = ((rs.mamba2_decode, rs.mamba2_verify) if arch == "mamba2" else (rs.gdn_decode, rs.gdn_verify))
    tok = layer.tokens(g, 0, 2)
    y = ver(cache, none, **tok, **kw, backend=backend)
    out_tail = (layer.H, layer.P) if arch == "mamba2" else (layer.HV, layer.V)
    assert y.shape == (0, 2, *out_tail) and y.dtype == torch.float32
    y = dec(cache, none.int(), **{k: v[:, 0] for k, v in tok.items()}, **kw, backend=backend)
    assert y.shape == (0, *out_tail)
    cache.accept(none, none, backend=backend)
    assert cache.materialize(none).shape == (0, *layer.state_shape)
    cache.load_state(none, torch.zeros(0, *layer.state_shape))
    cache.reset(none)
    assert snapshot_diff(before, snapshot(cache)) == []


# ------------------------------------------------------------------------------------------------
# Inputs that require grad
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_inputs_that_require_grad_do_not_build_a_graph(arch):
    """Decode and verify are inference: the storage never joins an autograd graph, the outputs
    do not require grad, and the inputs are freed after the call (a graph through the storage
    would keep every token's inputs alive: memory growing with every decode)."""
    layer = make_layer(arch)
    cache = layer.cache(2, window=4, max_draft=2)
    g = torch.Generator().manual_seed(8)
    S = torch.randn(2, *layer.state_shape, generator=g).requires_grad_()
    cache.load_state(torch.arange(2), S)
    ref = S.detach().double()
    alive = []
    err = 0.0
    for step in range(10):
        T = 2 if step % 3 == 2 else 1
        tok = {k: v.requires_grad_() for k, v in layer.tokens(g, 2, T).items()}
        consts = {}
        if arch == "mamba2":
            consts = {k: (v.clone().requires_grad_() if isinstance(v, torch.Tensor) else v)
                      for k, v in layer._consts().items()}
        y = (layer.run(cache, torch.arange(2), tok, T == 2) if not consts else
             (rs.mamba2_verify(cache, torch.arange(2), **tok, **consts) if T == 2 else
              rs.mamba2_decode(cache, torch.arange(2), **{k: v[:, 0] for k, v in tok.items()}, **consts)[:, None]))
        assert not y.requires_grad and y.grad_fn is None
        plain = {k: v.detach() for k, v in tok.items()}
        if T == 2:
            cache.accept(torch.arange(2), torch.tensor([2, 2]))
        yr, ref = layer.reference(ref, plain)
        err = max(err, (y.double() - yr).abs().max().item())
        alive += [weakref.ref(t) for t in tok.values()]
        del tok, consts, y
    gc.collect()
    assert err <= S32_TOL
    for name, t in cache.state_dict().items():
        if isinstance(t, torch.Tensor):
            assert not t.requires_grad and t.grad_fn is None, name
    for t in [*cache.anchor.values(), *cache.buffer.values()]:
        assert not t.requires_grad and t.grad_fn is None
    assert not cache.materialize(torch.arange(2)).requires_grad
    assert all(r() is None for r in alive), "inputs kept alive by an autograd graph"


def test_graph_detection_teeth():
    """Teeth: an index-put of a tensor that requires grad (what the storage writes do) builds
    the graph that keeps the input alive, and the checks above see it."""
    buf = torch.zeros(2, 3)
    x = torch.randn(3, requires_grad=True)
    r = weakref.ref(x)
    buf[0] = x * 2
    del x
    gc.collect()
    assert buf.grad_fn is not None and r() is not None


# ------------------------------------------------------------------------------------------------
# state_dict: atomic, refuses impossible cursors and malformed dicts
# ------------------------------------------------------------------------------------------------
def _saved(arch):
    layer = make_layer(arch)
    cache = layer.cache(3, window=4, max_draft=2, precision="tp8_hi32")
    tr = Tracker(layer, cache)
    tr.load([0, 1, 2])
    for _ in range(3):
        tr.decode([0, 1, 2])
    return layer, cache, cache.state_dict()


def _with_row(sd, name, row, value):
    t = sd[name].clone()
    t[row] = value
    return {**sd, name: t}


@pytest.mark.parametrize("arch", ARCHS)
def test_load_state_dict_refuses_impossible_cursors_atomically(arch):
    layer, cache, sd = _saved(arch)
    target = layer.cache(3, window=4, max_draft=2, precision="tp8_hi32")
    Tracker(layer, target, seed=9).load([0, 1, 2])  # different contents than sd
    before = snapshot(target)
    bad = [("committed", _with_row(sd, "committed", 1, -1)),
           ("committed", _with_row(sd, "committed", 2, 5)),  # > window
           ("committed", _with_row(sd, "committed", 0, 2**31 - 1)),
           ("pending", _with_row(sd, "pending", 0, 3)),  # > max_draft
           ("pending", _with_row(sd, "pending", 1, -2)),
           ("pending", _with_row(_with_row(sd, "committed", 1, 3), "pending", 1, 2)),  # 3 + 2 > 4
           ("refreshes", _with_row(sd, "refreshes", 0, -1)),
           ("tokens", _with_row(sd, "tokens", 2, 1)),  # fewer tokens than committed
           ("tokens", {**sd, "tokens": sd["tokens"].to("meta")}),  # last entry copied: no data
           ("seeds", {**sd, "seeds": sd["seeds"].to("meta")}),
           ("extra", {**sd, "extra": torch.zeros(1)}),
           ("seeds", {k: v for k, v in sd.items() if k != "seeds"}),
           ("state_dict", None), ("state_dict", [sd]), ("state_dict", list(sd.items()))]
    for name, d in bad:
        with pytest.raises(ValueError, match=name):
            target.load_state_dict(d)
        assert snapshot_diff(before, snapshot(target)) == [], name
    # the extremes of the possible cursors are accepted
    ok = _with_row(_with_row(sd, "committed", 0, 2), "pending", 0, 2)
    ok = _with_row(_with_row(ok, "committed", 1, 4), "tokens", 1, 4)
    target.load_state_dict(ok)
    assert target.counters(torch.arange(3))["pending"].tolist()[0] == 2


@pytest.mark.parametrize("arch", ARCHS)
def test_reset_and_load_state_dict_refuse_non_tensors(arch):
    layer, cache, _ = _saved(arch)
    before = snapshot(cache)
    for fn, name in ((lambda: cache.reset([0]), "slots"), (lambda: cache.reset(None), "slots"),
                     (lambda: cache.load_state_dict(None), "state_dict"),
                     (lambda: cache.load_state_dict([1, 2]), "state_dict")):
        with pytest.raises(ValueError, match=name):
            fn()
        assert snapshot_diff(before, snapshot(cache)) == []


def test_custom_precisions_with_one_name_do_not_restore_into_each_other():
    fp16 = rs.get_format("fp16")
    near = rs.Precision("mine", fp16, "nearest")
    sr = rs.Precision("mine", fp16, "stochastic")
    nvfp4_read = rs.Precision("mine", fp16, "nearest", rs.get_format("nvfp4"))
    layer = make_layer("gdn")
    src = layer.cache(2, precision=near)
    Tracker(layer, src).load([0, 1])
    sd = src.state_dict()
    for other in (sr, nvfp4_read):
        dst = layer.cache(2, precision=other)
        before = snapshot(dst)
        with pytest.raises(ValueError, match="config"):
            dst.load_state_dict(sd)
        assert snapshot_diff(before, snapshot(dst)) == []
    same = layer.cache(2, precision=rs.Precision("mine", fp16, "nearest"))  # an equal description
    same.load_state_dict(sd)
    assert snapshot_diff(snapshot(src), snapshot(same)) == []


# ------------------------------------------------------------------------------------------------
# Deterministic storage and the poisoning switch
# ------------------------------------------------------------------------------------------------
def _dirty_heap(cache_factory):
    """Build and drop caches whose storage is filled with a non-zero pattern, so that memory
    handed out next is likely to hold stale bytes."""
    for _ in range(3):
        c = cache_factory()
        for t in [*c.anchor.values(), *c.buffer.values(), *(c.read_copy or {}).values()]:
            t.view(torch.uint8).fill_(0x3c)
        del c


@pytest.mark.parametrize("precision", ["s32_rs", "tp8_hi32", "tp4_hi16_sr"])
def test_fresh_storage_and_scratch_row_are_zero(precision):
    """Without poisoning, two caches built alike hold identical (zero) bytes, scratch row
    included, whatever the allocator hands out; with poisoning, the scratch row is still zero."""
    layer = make_layer("mamba2")
    build = lambda: layer.cache(3, window=4, precision=precision, buffer_dtype=torch.float32)  # noqa: E731
    with rs.poison_fresh_allocations(False):
        _dirty_heap(build)
        a = build()
        _dirty_heap(build)
        b = build()
    assert snapshot_diff(snapshot(a), snapshot(b)) == []
    for k, v in snapshot(a).items():
        assert not v.any(), k
    poisoned = build()  # the suite runs under poisoning
    assert torch.isnan(poisoned.anchor["values"][:3].float()).all()
    for k, v in snapshot(poisoned, [poisoned.scratch_row]).items():
        assert not v.any(), k
    # a restored cache carries the same bytes as a fresh one built the same way
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    assert len(buf.getvalue()) > 0


def test_poisoning_switch_stays_in_its_thread():
    """The suite's NaN switch (on in this thread) must not reach caches built by another
    thread, and another thread turning it off must not turn it off here."""
    layer = make_layer("gdn")
    seen = {}
    barrier = threading.Barrier(2, timeout=30)

    def other():
        try:
            seen["other"] = layer.cache(1).anchor["values"][0]
            with rs.poison_fresh_allocations(False):
                barrier.wait()  # the main thread builds while this one has it off
                barrier.wait()
        except BaseException as e:  # reported below; the barrier breaks for the main thread
            seen["error"] = e
            barrier.abort()

    t = threading.Thread(target=other)
    t.start()
    try:
        barrier.wait()
        mine = layer.cache(1).anchor["values"][0]
        barrier.wait()
    finally:
        t.join(30)
    assert "error" not in seen, seen.get("error")
    assert not torch.isnan(seen["other"]).any(), "poisoning leaked into another thread"
    assert torch.isnan(mine).all(), "another thread turned poisoning off here"
