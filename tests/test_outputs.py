"""What an engine passes for outputs: ``out_dtype`` (fp16/bf16 outputs stored by the kernels, half
the bytes) and ``out=`` (a preallocated tensor, any strides), on both backends; and value checks
that step aside while a CUDA graph is being captured."""
import pytest
import torch

import helpers
import replayssm as rs
from replayssm import checks

pytest.importorskip("triton")

GEOMETRY = {"mamba2": dict(nheads=4, headdim=16, dstate=32, ngroups=2),
            "gdn": dict(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=16)}
GEOMETRY["kda"] = GEOMETRY["gdn"]


def _run(layer, cache, slots, tok, backend, verify, **kw):
    fn = {("mamba2", False): rs.mamba2_decode, ("mamba2", True): rs.mamba2_verify,
          ("gdn", False): rs.gdn_decode, ("gdn", True): rs.gdn_verify,
          ("kda", False): rs.kda_decode, ("kda", True): rs.kda_verify}[(layer.name, verify)]
    consts = layer._consts() if layer.name == "mamba2" else {"use_qk_l2norm": True}
    args = tok if verify else {k: v[:, 0] for k, v in tok.items()}
    return fn(cache, slots, **args, **consts, backend=backend, **kw)


@pytest.mark.parametrize("arch", ["mamba2", "gdn", "kda"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_output_dtype_and_out_change_nothing_but_the_output(arch, backend):
    """Decode and verify with fp16 / bf16 outputs and into preallocated tensors (a contiguous one
    and a strided view) give the fp32 outputs rounded (fp16 bit for bit; bf16 to one unit in the
    last place: Triton's interpreter truncates its bf16 casts), leave the cache exactly as fp32
    outputs do, and are close to the float64 recurrence."""
    layer = helpers.make_layer(arch, 0, **GEOMETRY[arch])
    g = helpers.generator(31)
    slots = torch.tensor([1, -1, 0])
    state = torch.randn(3, *layer.state_shape, generator=g)
    caches = [layer.cache(2, window=4, max_draft=2) for _ in range(4)]
    for c in caches:
        c.load_state(slots, state)
    ref = {s: state[i:i + 1].double() for i, s in enumerate(slots.tolist()) if s >= 0}
    for step in range(5):
        verify = step % 2 == 1
        tok = layer.tokens(g, 3, 2 if verify else 1)
        y32 = _run(layer, caches[0], slots, tok, backend, verify)
        y16 = _run(layer, caches[1], slots, tok, backend, verify, out_dtype=torch.float16)
        out = torch.full((*y32.shape[:-1], 2 * y32.shape[-1]), 7.0, dtype=torch.bfloat16)[..., ::2]  # strided
        ybf = _run(layer, caches[2], slots, tok, backend, verify, out=out)
        dense = torch.empty_like(y32)
        ydense = _run(layer, caches[3], slots, tok, backend, verify, out=dense)
        assert ybf is out and ydense is dense and y16.dtype == torch.float16
        assert torch.equal(y16, y32.to(torch.float16)) and torch.equal(ydense, y32)
        ulp = (y32.abs() * 2.0 ** -7).clamp(min=1e-30)
        assert ((ybf.float() - y32).abs() <= ulp).all()
        assert torch.equal(y16[1], torch.zeros_like(y16[1])) and torch.equal(ybf[1].float(), torch.zeros_like(y32[1]))
        if verify:
            for c in caches:
                c.accept(slots, torch.tensor([1, 0, 2]), backend=backend)
        for i, s in enumerate(slots.tolist()):  # the float64 recurrence, on the committed tokens
            if s < 0:
                continue
            yref, st = layer.reference(ref[s], helpers.take(tok, i))
            assert (y16[i:i + 1].double() - yref).abs().max() <= 2e-3 * max(1.0, yref.abs().max().item())
            n = 1 if not verify else [1, 0, 2][i]
            if n:
                ref[s] = layer.reference(ref[s], helpers.take(tok, i, n))[1]
    snaps = [helpers.snapshot(c) for c in caches]
    assert all(helpers.snapshot_diff(snaps[0], s) == [] for s in snaps[1:])


@pytest.mark.parametrize("arch", ["mamba2", "gdn", "kda"])
def test_bad_output_arguments_name_the_argument_and_change_nothing(arch):
    layer = helpers.make_layer(arch, 0, **GEOMETRY[arch])
    g = helpers.generator(32)
    cache = layer.cache(2, window=4, max_draft=2)
    slots = torch.tensor([0, 1])
    cache.load_state(slots, torch.randn(2, *layer.state_shape, generator=g))
    tok = layer.tokens(g, 2, 1)
    shape = (2, *((layer.H, layer.P) if arch == "mamba2" else (layer.HV, layer.V)))
    before = helpers.snapshot(cache)
    for kw, name in ((dict(out=torch.empty(3, *shape[1:])), "out"), (dict(out=torch.empty(shape, dtype=torch.int32)), "out"),
                     (dict(out_dtype=torch.int8), "out_dtype"),
                     (dict(out=torch.empty(shape), out_dtype=torch.bfloat16), "out")):
        with pytest.raises(ValueError, match=name):
            _run(layer, cache, slots, tok, "torch", False, **kw)
    assert helpers.snapshot_diff(before, helpers.snapshot(cache)) == []


def test_value_checks_step_aside_during_graph_capture(monkeypatch):
    """Under CUDA-graph capture a value check would synchronize, which capture forbids: the checks
    skip themselves (``checks.values_checked``), the metadata checks still run. Fails if a value
    check runs during capture (it would raise here on the out-of-range slot id)."""
    cache = rs.Mamba2Cache(2, 2, 16, 32)
    assert checks.values_checked(cache)
    bad = torch.tensor([5])
    with pytest.raises(ValueError, match="slots"):
        checks.check_slots(cache, bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not checks.values_checked(cache)
    assert checks.check_slots(cache, bad) == 1
    with pytest.raises(ValueError, match="slots"):
        checks.check_slots(cache, torch.tensor([[0]]))  # shape checks stay
