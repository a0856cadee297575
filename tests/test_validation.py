"""Every validation error raises ValueError naming the argument and leaves the cache unchanged;
reads of never-written memory show up as NaN."""
import pytest
import torch

import replayssm as rs
from helpers import Tracker, make_layer, snapshot, snapshot_diff

ARCHS = ["mamba2", "gdn"]
META = torch.device("meta")


def _setup(arch, pending=False):
    layer = make_layer(arch)
    cache = layer.cache(3, window=8, max_draft=4, precision="tp8_hi32")
    tr = Tracker(layer, cache)
    tr.load([0, 1, 2])
    tr.decode([0, 1])
    if pending:
        tr.verify([2], 2)
    return layer, cache, tr


def _args(layer, g, b, T=None):
    tok = layer.tokens(g, b, T or 1)
    tok = tok if T else {k: v[:, 0] for k, v in tok.items()}
    if layer.name == "mamba2":
        tok.update(A=layer.A.clone(), D=layer.D.clone(), dt_bias=layer.dt_bias.clone())
    return tok


def _call(layer, cache, slots, args, verify):
    if layer.name == "mamba2":
        f = rs.mamba2_verify if verify else rs.mamba2_decode
        return f(cache, slots, **args, dt_softplus=True)
    f = rs.gdn_verify if verify else rs.gdn_decode
    return f(cache, slots, **args, use_qk_l2norm=True)


def _rejects(cache, fn, name):
    before = snapshot(cache)
    with pytest.raises(ValueError, match=name):
        fn()
    assert snapshot_diff(before, snapshot(cache)) == []


def _bad_variants(t):
    """(label, replacement) for every way a tensor input can be wrong."""
    return [("shape", t[..., :-1] if t.shape[-1] > 1 else t[None]),
            ("int", t.to(torch.int32)), ("float64", t.double()), ("device", t.to(META))]


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_input_shape_dtype_device(arch, verify):
    layer, cache, _ = _setup(arch)
    g = torch.Generator().manual_seed(0)
    slots = torch.tensor([0, -1, 1])
    args = _args(layer, g, 3, 2 if verify else None)
    for name in args:
        for label, bad in _bad_variants(args[name]):
            if name == "A" and label == "int":
                bad = -torch.ones_like(args[name], dtype=torch.int32)
            _rejects(cache, lambda: _call(layer, cache, slots, {**args, name: bad}, verify), name)
    if verify:  # the batch dimension of every input must match the slots
        _rejects(cache, lambda: _call(layer, cache, slots[:2], args, verify), "shape")
    # and the valid call goes through
    _call(layer, cache, slots, args, verify)


@pytest.mark.parametrize("verify", [False, True])
def test_mamba2_head_dim_expanded_inputs(verify):
    """dt, A, D, dt_bias expanded over the head's dims (stride 0, as mamba_ssm passes them) are
    accepted; every wrong shape, dtype or device of the expanded form, and values that may differ
    along the head's dims (stride != 0), raise ValueError naming the argument, the cache unchanged."""
    layer, cache, _ = _setup("mamba2")
    H, P, N = layer.H, layer.P, layer.N
    slots = torch.tensor([0, -1, 1])
    args = _args(layer, torch.Generator().manual_seed(6), 3, 2 if verify else None)
    args.update(dt=args["dt"][..., None].expand(*args["dt"].shape, P), A=args["A"][:, None, None].expand(H, P, N),
                D=args["D"][:, None].expand(H, P), dt_bias=args["dt_bias"][:, None].expand(H, P))
    for name in ("dt", "A", "D", "dt_bias"):
        for label, bad in _bad_variants(args[name]) + [("stride", args[name].contiguous())]:
            if name == "A" and label == "int":
                bad = -torch.ones_like(args[name], dtype=torch.int32)
            _rejects(cache, lambda: _call(layer, cache, slots, {**args, name: bad}, verify), name)
    _call(layer, cache, slots, args, verify)


@pytest.mark.parametrize("arch", ARCHS)
def test_slots(arch):
    layer, cache, _ = _setup(arch)
    g = torch.Generator().manual_seed(1)
    args = _args(layer, g, 2)
    for bad in (torch.tensor([0, 3]), torch.tensor([-2, 0]), torch.tensor([1, 1]),
                torch.tensor([0, 1], dtype=torch.int16), torch.tensor([0.0, 1.0]),
                torch.tensor([[0, 1]]), torch.tensor([0, 1], device=META), [0, 1]):
        _rejects(cache, lambda: _call(layer, cache, bad, args, False), "slots")
        _rejects(cache, lambda: cache.accept(bad, torch.zeros(2, dtype=torch.int64)), "slots")
        _rejects(cache, lambda: cache.materialize(bad), "slots")
        _rejects(cache, lambda: cache.load_state(bad, torch.zeros(2, *layer.state_shape)), "slots")
    # repeated pads are fine
    _call(layer, cache, torch.tensor([-1, -1]), args, False)


@pytest.mark.parametrize("arch", ARCHS)
def test_draft_length(arch):
    layer, cache, _ = _setup(arch)
    g = torch.Generator().manual_seed(2)
    slots = torch.tensor([0, 1])
    for T in (0, 5):  # max_draft = 4
        args = _args(layer, g, 2, max(T, 1))
        if T == 0:
            args = {k: (v[:, :0] if v.dim() > 1 else v) for k, v in args.items()}
        _rejects(cache, lambda: _call(layer, cache, slots, args, True), "draft length")


@pytest.mark.parametrize("arch", ARCHS)
def test_accept_and_pending(arch):
    layer, cache, _ = _setup(arch, pending=True)  # slot 2 has a pending verify of 2 drafts
    g = torch.Generator().manual_seed(3)
    i64 = torch.int64
    slots = torch.tensor([2, 0])
    for n in (torch.tensor([-1, 0]), torch.tensor([3, 0]), torch.tensor([1, 1])):
        _rejects(cache, lambda: cache.accept(slots, n), "num_accepted")
    for n in (torch.tensor([1], dtype=i64), torch.tensor([1.0, 0.0]), torch.tensor([[1, 0]]),
              torch.tensor([1, 0], device=META)):
        _rejects(cache, lambda: cache.accept(slots, n), "num_accepted")
    # decode / verify while a verify is pending on slot 2
    _rejects(cache, lambda: _call(layer, cache, slots, _args(layer, g, 2), False), "pending")
    _rejects(cache, lambda: _call(layer, cache, slots, _args(layer, g, 2, 2), True), "pending")
    cache.accept(slots, torch.tensor([2, 0]))
    _call(layer, cache, slots, _args(layer, g, 2), False)


@pytest.mark.parametrize("arch", ARCHS)
def test_positive_log_decay(arch):
    layer, cache, _ = _setup(arch)
    g = torch.Generator().manual_seed(4)
    args = _args(layer, g, 2)
    name = "A" if arch == "mamba2" else "g"
    bad = args[name].clone()
    bad.view(-1)[0] = 0.1
    _rejects(cache, lambda: _call(layer, cache, torch.tensor([0, 1]), {**args, name: bad}, False), name)


@pytest.mark.parametrize("arch", ARCHS)
def test_load_state(arch):
    layer, cache, _ = _setup(arch)
    S = torch.randn(2, *layer.state_shape)
    slots = torch.tensor([0, 1])
    for label, bad in _bad_variants(S):
        _rejects(cache, lambda: cache.load_state(slots, bad), "state")
    _rejects(cache, lambda: cache.load_state(slots, S, seeds=torch.tensor([1, 2], dtype=torch.int32)),
             "seeds")


@pytest.mark.parametrize("arch", ARCHS)
def test_construction(arch):
    layer = make_layer(arch)
    with pytest.raises(ValueError, match="max_draft"):
        layer.cache(2, window=4, max_draft=5)
    with pytest.raises(ValueError, match="precision"):
        layer.cache(2, precision="fp7_nope")
    with pytest.raises(ValueError, match="window"):
        layer.cache(2, window=0, max_draft=1)
    with pytest.raises(ValueError, match="num_slots"):
        layer.cache(0)


def test_snapshot_comparison_has_teeth():
    """The 'cache unchanged' check sees a single flipped bit, even inside a NaN-filled slot."""
    layer = make_layer("gdn")
    cache = layer.cache(2)
    before = snapshot(cache)  # nothing loaded: all NaN under poisoning
    cache.anchor["values"].view(-1)[5] = 1.0
    assert snapshot_diff(before, snapshot(cache)) == ["anchor.values"]


@pytest.mark.parametrize("arch", ARCHS)
def test_never_loaded_slot_reads_nan(arch):
    """Teeth of the poisoning fixture: a slot that was never loaded produces NaN outputs, while
    a loaded slot in the same batch stays finite and correct."""
    layer = make_layer(arch)
    cache = layer.cache(3)
    tr = Tracker(layer, cache)
    tr.load([0])
    args = _args(layer, torch.Generator().manual_seed(5), 2)
    y = _call(layer, cache, torch.tensor([0, 2]), args, False)
    assert torch.isfinite(y[0]).all()
    assert torch.isnan(y[1]).all()
