"""Inputs laid out as engines pass them, on the Triton backend (and the PyTorch one): q, k, v split
from one packed projection and the gates from another (vLLM), Mamba-2's x, B, C from one xBC tensor
and z, dt from one in_proj output, dt / A / D / dt_bias head-dim-expanded with stride 0 as mamba_ssm's
``selective_state_update`` takes them. Every output is measured against the float64 recurrence
(``helpers.Tracker``) and equals, bit for bit, the same call on contiguous copies into a twin cache;
the kernels receive the caller's own storage and no PyTorch op copies anything."""
import pytest
import torch

import helpers
import replayssm as rs

pytest.importorskip("triton")

from replayssm._triton import launch  # noqa: E402

GEOMETRY = {"mamba2": dict(nheads=4, headdim=16, dstate=32, ngroups=2),
            "gdn": dict(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=16),
            "kda": dict(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=16)}

#: What PyTorch may run inside a Triton step: allocations of outputs and scratch, and views.
VIEW_OPS = {"empty", "empty_like", "select", "unsqueeze", "view", "slice"}


def packed(parts, b, T):
    """Views of one packed [b, T, sum of widths] tensor holding ``parts`` (name -> [b, T, ...])
    side by side, each in its own shape: how an engine splits one projection's output."""
    flat = torch.cat([t.reshape(b, T, -1) for t in parts.values()], -1)
    out, at = {}, 0
    for name, t in parts.items():
        width = t[0, 0].numel()
        out[name] = flat[..., at:at + width].view(t.shape)
        at += width
    return out


class EngineLayer:
    """A ``helpers`` layer whose token inputs are views of packed tensors (``tokens``) and whose
    Mamba-2 constants are head-dim-expanded; ``run`` makes the public call on them and the same
    call on contiguous copies into ``twin``, a second cache, and asserts both give the same bits.
    The float64 reference sees the plain values."""

    def __init__(self, arch, backend, gates=False):
        self.base = helpers.make_layer(arch, 0, **GEOMETRY[arch])
        self.name, self.state_shape = arch, self.base.state_shape
        self.backend, self.gates, self.twin = backend, gates, None
        if arch == "gdn" and gates:  # raw gate inputs a, b with a strided A_log / dt_bias view
            g = helpers.generator(7)
            HV = self.base.HV
            self.gate_consts = torch.stack([helpers.uniform(g, (HV,), -1.0, 0.5),
                                            helpers.uniform(g, (HV,), -0.5, 0.5)], 1)  # [HV, 2]

    def cache(self, num_slots, **kw):
        self.twin = self.base.cache(num_slots, **kw)
        return self.base.cache(num_slots, **kw)

    def tokens(self, g, b, T):
        tok = self.base.tokens(g, b, T)
        if self.name == "mamba2":
            return {**packed({k: tok[k] for k in ("x", "B", "C")}, b, T), **packed({"z": tok["z"], "dt": tok["dt"]}, b, T)}
        if self.gates:
            tok["a"], tok["b"] = tok.pop("g"), tok.pop("beta")  # any values: the gates make them decays
        gate_names = ("a", "b") if self.gates else ("g", "beta")
        return {**packed({k: tok[k] for k in ("q", "k", "v")}, b, T), **packed({k: tok[k] for k in gate_names}, b, T)}

    def _call(self, cache, slots, tok, verify, expand):
        one = (lambda t: t) if verify else (lambda t: t[:, 0])
        tok = {k: one(v) for k, v in tok.items()}
        kw = dict(backend=self.backend)
        if self.name == "mamba2":
            base = self.base
            H, P, N = base.H, base.P, base.N
            A, D, dt_bias, dt = base.A, base.D, base.dt_bias, tok.pop("dt")
            if expand:  # as mamba_ssm's selective_state_update takes them ("tie_hdim")
                A = A[:, None, None].expand(H, P, N)
                D, dt_bias = D[:, None].expand(H, P), dt_bias[:, None].expand(H, P)
                dt = dt[..., None].expand(*dt.shape, P)
            f = rs.mamba2_verify if verify else rs.mamba2_decode
            return f(cache, slots, tok["x"], dt, A, tok["B"], tok["C"], D, tok["z"], dt_bias, True, **kw)
        if self.gates:
            kw.update(A_log=self.gate_consts[:, 0], dt_bias=self.gate_consts[:, 1])  # stride-2 views
        if self.name == "gdn":
            f = rs.gdn_verify if verify else rs.gdn_decode
        else:
            f = rs.kda_verify if verify else rs.kda_decode
        return f(cache, slots, **tok, use_qk_l2norm=True, **kw)

    def run(self, cache, slots, tok, verify):
        y = self._call(cache, slots, tok, verify, expand=True)
        dense = {k: v.contiguous() for k, v in tok.items()}
        assert all(not v.is_contiguous() for v in tok.values())  # the test has teeth: every input a view
        y_dense = self._call(self.twin, slots, dense, verify, expand=False)
        if self.backend == "triton":  # the same kernels on the same values: the same bits
            assert torch.equal(y, y_dense)
        else:
            torch.testing.assert_close(y, y_dense, rtol=1e-6, atol=1e-6)
        return y if verify else y[:, None]

    def accept(self, cache, slots, counts):
        cache.accept(slots, counts, backend=self.backend)
        self.twin.accept(slots, counts, backend=self.backend)

    def reference(self, state, tok):
        if self.name == "gdn" and self.gates:
            tok = dict(tok)
            A_log, dt_bias = self.gate_consts.double().unbind(1)
            a, b = tok.pop("a").double(), tok.pop("b").double()
            tok["g"] = -torch.exp(A_log) * torch.nn.functional.softplus(a + dt_bias)
            tok["beta"] = torch.sigmoid(b)
        return self.base.reference(state, tok)


def _rounds(layer, precision="s32_rs"):
    """Decodes and verify rounds over a pad and staggered slots, refreshes included (window 4);
    returns the tracker."""
    tr = helpers.Tracker(layer, layer.cache(3, window=4, max_draft=4, precision=precision))
    state = torch.randn(3, *layer.state_shape, generator=helpers.generator(3))
    for c in (layer.twin, tr.cache):
        c.load_state(torch.tensor([0, 1, 2]), state)
    for s in (0, 1, 2):
        tr.ref[s] = state[s:s + 1].double()
        tr.h[s], tr.refreshes[s], tr.tokens[s] = 0, 0, 0
    tr.decode([2, 1])
    for r in range(2):
        tr.decode([0, -1, 2])
        tr.verify([1, -1, 2, 0], 3)
        tr.accept([r + 1, 0, 3, 2 - r])
    tr.decode([0, 1, 2])
    tr.check_counters([0, 1, 2])
    assert min(tr.refreshes.values()) >= 1
    if layer.backend == "triton":  # the twin caches hold the same bits
        assert helpers.snapshot_diff(helpers.snapshot(layer.twin), helpers.snapshot(tr.cache)) == []
    return tr


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("arch,gates", [("gdn", False), ("gdn", True), ("kda", False)])
def test_delta_rule_packed_projections(arch, gates, backend):
    """GDN and KDA: q, k, v views of one [b, T, 2 HK K + HV V] tensor and g, beta (or GDN's raw
    a, b, with A_log and dt_bias strided views) of another, decode and verify."""
    tr = _rounds(EngineLayer(arch, backend, gates))
    assert tr.max_rel <= 2e-5, tr.max_rel


def test_gdn_packed_projections_in_a_step_of_one_launch():
    """GDN's step of one launch (``StepShape.fused``) reads every caller's view in place: q, k, v of
    one packed projection, the raw gates a, b of another, A_log and dt_bias strided views."""
    launch.TUNING.update(fused=True)
    try:
        tr = _rounds(EngineLayer("gdn", "triton", True))
    finally:
        launch.TUNING.clear()
    assert tr.max_rel <= 2e-5, tr.max_rel


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_mamba2_packed_projections_and_expanded_constants(backend):
    """Mamba-2: x, B, C views of one xBC tensor, z and dt of one in_proj output; dt [b, (T,) H, P],
    A [H, P, N], D and dt_bias [H, P] expanded with stride 0, decode and verify."""
    tr = _rounds(EngineLayer("mamba2", backend))
    assert tr.max_rel <= 2e-5, tr.max_rel


def test_an_element_stride_runs_too():
    """Inputs whose last axis is strided (every other element of a wider tensor) run on the Triton
    backend as well, against the float64 recurrence."""
    layer = helpers.make_layer("gdn", 0, **GEOMETRY["gdn"])
    cache = layer.cache(2, window=4)
    tr = helpers.Tracker(layer, cache)
    tr.load([0, 1])
    wide = lambda t: torch.stack([t, torch.full_like(t, float("nan"))], -1).flatten(-2)[..., ::2]  # noqa: E731
    for _ in range(5):
        tok = layer.tokens(tr.g, 2, 1)
        tok = {k: wide(v) if v.dim() == 4 else v for k, v in tok.items()}
        assert tok["v"].stride(-1) == 2
        y = rs.gdn_verify(cache, torch.tensor([0, 1]), **tok, use_qk_l2norm=True, backend="triton")
        cache.accept(torch.tensor([0, 1]), torch.tensor([1, 1]), backend="triton")
        for i in (0, 1):
            ref, tr.ref[i] = layer.reference(tr.ref[i], helpers.take(tok, i))
            assert (y[i:i + 1].double() - ref).abs().max() <= helpers.S32_TOL
    assert cache.counters(torch.tensor([0, 1]))["refreshes"].tolist() == [1, 1]


def _engine_call(arch, view):
    """(call, {kernel name: the caller's tensors it must read in place}) of one decode on a fresh
    cache; ``view``: engine layouts, else contiguous copies of the same values."""
    layer = EngineLayer(arch, "triton", gates=arch == "gdn")
    cache = layer.cache(3, window=4)
    cache.check_values = False  # value checks read the inputs; a step under graph capture skips them
    tok = {k: v[:, 0] for k, v in layer.tokens(helpers.generator(11), 3, 1).items()}
    cache.follow_inputs(tok["x" if arch == "mamba2" else "v"].dtype)  # as an engine does before capture
    if not view:
        tok = {k: v.contiguous() for k, v in tok.items()}
    slots = torch.tensor([0, -1, 2])
    if arch == "mamba2":
        b = layer.base
        H, P, N = b.H, b.P, b.N
        A, D, dt_bias, dt = b.A, b.D, b.dt_bias, tok["dt"]
        if view:
            A, D, dt_bias = A[:, None, None].expand(H, P, N), D[:, None].expand(H, P), dt_bias[:, None].expand(H, P)
            dt = dt[..., None].expand(*dt.shape, P)
        reads = {"_mamba2_scores_kernel": [tok["B"], tok["C"], dt, A, dt_bias],
                 "_mamba2_step_kernel": [tok["x"], tok["C"], D, tok["z"], tok["B"]]}
        return (lambda: rs.mamba2_decode(cache, slots, tok["x"], dt, A, tok["B"], tok["C"], D, tok["z"], dt_bias,
                                         True, backend="triton")), reads
    A_log, dt_bias = layer.gate_consts.unbind(1) if arch == "gdn" else (None, None)
    if arch == "gdn":
        reads = {"_gdn_scores_kernel": [tok["q"], tok["k"], tok["a"], tok["b"], A_log, dt_bias],
                 "_gdn_step_kernel": [tok["v"]]}
        return (lambda: rs.gdn_decode(cache, slots, **tok, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm=True,
                                      backend="triton")), reads
    reads = {"_kda_scores_kernel": [tok["q"], tok["k"], tok["g"]],
             "_kda_step_kernel": [tok["v"], tok["beta"], tok["g"]]}
    return (lambda: rs.kda_decode(cache, slots, **tok, use_qk_l2norm=True, backend="triton")), reads


@pytest.mark.parametrize("arch", ["mamba2", "gdn", "kda", "mamba2_fused", "gdn_fused"])
def test_engine_layouts_reach_the_kernels_without_a_copy(arch):
    """With check_values off (as under CUDA-graph capture), a decode on engine layouts runs no
    PyTorch op beyond allocations and views (the contiguous inputs' set, plus the selects that
    reduce expanded constants), and every kernel that reads a caller's tensor gets its storage:
    the data pointer of the caller's view, not of a copy (a step of one launch: all of them)."""
    Ops = helpers.TorchOps

    seen = {}
    fused = arch.endswith("_fused")
    arch = arch.removesuffix("_fused")
    for view in (False, True):
        call, reads = _engine_call(arch, view)
        if fused:
            reads = {f"_{arch}_step_kernel": [t for kernel_reads in reads.values() for t in kernel_reads]}
        launches = []
        launch.LAUNCHER = lambda kernel, grid, a, kw: launches.append(
            (kernel.fn.__name__, {t.data_ptr() for t in a if isinstance(t, torch.Tensor)}))
        launch.TUNING.update(fused=fused)
        try:
            with Ops() as ops:
                call()
        finally:
            launch.LAUNCHER = launch._launch
            launch.TUNING.clear()
        seen[view] = ops.names
        for name, tensors in reads.items():
            pointers = set().union(*(ptrs for kernel, ptrs in launches if kernel == name))
            for t in tensors:
                assert t.data_ptr() in pointers, (name, tuple(t.shape), t.stride())
    assert seen[True] <= VIEW_OPS, seen[True]
    assert seen[True] - seen[False] <= ({"select"} if arch == "mamba2" else set()), seen


def test_expanded_constants_that_vary_along_the_head_dims_are_refused():
    """Teeth: an [H, P, N] A (or [b, H, P] dt, [H, P] D or dt_bias) whose values may differ along P
    (stride != 0) cannot run on one decay per head: ValueError naming it, the cache unchanged."""
    layer = helpers.make_layer("mamba2", 0, **GEOMETRY["mamba2"])
    H, P, N = layer.H, layer.P, layer.N
    cache = layer.cache(2, window=4)
    tr = helpers.Tracker(layer, cache)
    tr.load([0, 1])
    tr.decode([0, 1])
    tok = {k: v[:, 0] for k, v in layer.tokens(helpers.generator(13), 2, 1).items()}
    ok = dict(A=layer.A[:, None, None].expand(H, P, N), dt=tok["dt"][..., None].expand(2, H, P),
              D=layer.D[:, None].expand(H, P), dt_bias=layer.dt_bias[:, None].expand(H, P))
    bad = {k: v.contiguous() for k, v in ok.items()}  # the same values, but stride != 0 along P
    bad["A_shape"] = layer.A[:, None].expand(H, P)  # neither [H] nor [H, P, N]
    for backend in ("triton", "torch"):
        for name, t in bad.items():
            args = dict(ok, **{name.split("_shape")[0]: t})
            before = helpers.snapshot(cache)
            with pytest.raises(ValueError, match=f"^{name.split('_shape')[0]} "):
                rs.mamba2_decode(cache, torch.tensor([0, 1]), tok["x"], args["dt"], args["A"], tok["B"], tok["C"],
                                 args["D"], tok["z"], args["dt_bias"], True, backend=backend)
            assert helpers.snapshot_diff(before, helpers.snapshot(cache)) == []
    # a size-1 expanded dim may have any stride; the accepted layouts run, here on the Triton backend
    one = helpers.make_layer("mamba2", 0, nheads=2, headdim=8, dstate=1, ngroups=1)
    c1 = one.cache(1, window=4)
    c1.load_state(torch.tensor([0]), torch.zeros(1, 2, 8, 1))
    t1 = {k: v[:, 0] for k, v in one.tokens(helpers.generator(1), 1, 1).items()}
    A = torch.stack([one.A, one.A], 1)[:, :, None][:, :1].expand(2, 8, 1)  # [H, P, 1]: stride 0 on P, 1 on N
    y = rs.mamba2_decode(c1, torch.tensor([0]), t1["x"], t1["dt"], A, t1["B"], t1["C"], one.D, t1["z"],
                         one.dt_bias, True, backend="triton")
    ref, _ = rs.mamba2_reference(torch.zeros(1, 2, 8, 1, dtype=torch.float64), t1["x"][:, None], t1["dt"][:, None],
                                 one.A, t1["B"][:, None], t1["C"][:, None], one.D, t1["z"][:, None], one.dt_bias, True)
    assert (y.double() - ref[:, 0]).abs().max() <= helpers.S32_TOL
