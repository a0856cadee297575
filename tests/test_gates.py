"""GDN gates from the raw inputs an engine holds (a, b, A_log, dt_bias, as flash-linear-attention's
gated delta rule and vLLM take them), computed by the PyTorch backend or inside the Triton
backend's first launch, against the float64 recurrence fed gates computed in float64."""
import pytest
import torch
import torch.nn.functional as F

import helpers
import replayssm as rs

pytest.importorskip("triton")

HK, HV, K, V = 2, 4, 32, 16


def _gates64(a, b, A_log, dt_bias):
    return -A_log.double().exp() * F.softplus(a.double() + dt_bias.double()), torch.sigmoid(b.double())


@pytest.mark.parametrize("backend", ["torch", "triton", "triton_fused"])
def test_raw_gates_match_float64(backend):
    """Decode and verify rounds (accepting 0..T) across refreshes, a pad, raw gates; decays
    exp(g) spread over (0, 1) by A_log and a + dt_bias. triton_fused: the step of one launch
    (``StepShape.fused``), whose programs compute the gates themselves."""
    if backend == "triton_fused":
        from replayssm._triton import launch

        launch.TUNING.update(fused=True)
        try:
            test_raw_gates_match_float64("triton")
        finally:
            launch.TUNING.clear()
        return
    g = helpers.generator(41)
    cache = rs.GDNCache(3, HK, HV, K, V, window=4, max_draft=2)
    slots = torch.tensor([2, -1, 0])
    state = torch.randn(3, HV, V, K, generator=g) * 0.3
    cache.load_state(slots, state)
    ref = {2: state[0:1].double(), 0: state[2:3].double()}
    A_log = torch.log(helpers.uniform(g, (HV,), 0.5, 8.0))
    dt_bias = torch.randn(HV, generator=g)
    worst = 0.0
    for step in range(8):
        T = 2 if step % 3 == 2 else 1
        q, k = torch.randn(3, T, HK, K, generator=g), torch.randn(3, T, HK, K, generator=g)
        v = torch.randn(3, T, HV, V, generator=g)
        a, b = torch.randn(3, T, HV, generator=g) * 2, torch.randn(3, T, HV, generator=g)
        kw = dict(use_qk_l2norm=True, a=a, b=b, A_log=A_log, dt_bias=dt_bias, backend=backend)
        o = (rs.gdn_verify(cache, slots, q, k, v, **kw) if T > 1 else
             rs.gdn_decode(cache, slots, q[:, 0], k[:, 0], v[:, 0], **{**kw, "a": a[:, 0], "b": b[:, 0]})[:, None])
        g64, beta64 = _gates64(a, b, A_log, dt_bias)
        n = [1, 0, 2] if T > 1 else [1, 1, 1]
        for i, s in enumerate(slots.tolist()):
            if s < 0:
                assert torch.equal(o[i], torch.zeros_like(o[i]))
                continue
            st = ref[s]
            for t in range(T):
                y, st_next = rs.gdn_reference_step(st, q[i:i + 1, t], k[i:i + 1, t], v[i:i + 1, t], g64[i:i + 1, t],
                                                   beta64[i:i + 1, t], use_qk_l2norm=True)
                worst = max(worst, (o[i, t].double() - y[0]).abs().max().item())
                st = st_next
                if t + 1 == n[i]:
                    ref[s] = st
        if T > 1:
            cache.accept(slots, torch.tensor(n), backend=backend)
    assert worst <= 1e-5, worst
    assert int(cache.refreshes[[0, 2]].min()) >= 1
    for s in (0, 2):
        assert (cache.materialize(torch.tensor([s]))[0].double() - ref[s][0]).abs().max() <= 1e-5


def test_raw_gates_validation_names_the_argument():
    g = helpers.generator(42)
    cache = rs.GDNCache(2, HK, HV, K, V, window=4)
    slots = torch.tensor([0])
    q, k, v = torch.randn(1, HK, K, generator=g), torch.randn(1, HK, K, generator=g), torch.randn(1, HV, V, generator=g)
    a, b, A_log = torch.randn(1, HV), torch.randn(1, HV), torch.zeros(HV)
    before = helpers.snapshot(cache)
    for kw, name in ((dict(a=a, b=b, A_log=A_log, g=-torch.rand(1, HV), beta=torch.rand(1, HV)), "g and beta"),
                     (dict(a=a, A_log=A_log), "a, b and A_log"), (dict(a=a[:, :2], b=b, A_log=A_log), "a"),
                     (dict(a=a, b=b, A_log=torch.zeros(HV + 1)), "A_log"),
                     (dict(a=a, b=b, A_log=A_log, dt_bias=torch.zeros(2)), "dt_bias"), (dict(), "g")):
        with pytest.raises(ValueError, match=name):
            rs.gdn_decode(cache, slots, q, k, v, **kw)
    assert helpers.snapshot_diff(before, helpers.snapshot(cache)) == []
