"""Kimi Delta Attention on the Triton backend, run by Triton's interpreter on the CPU
(TRITON_INTERPRET=1, conftest), against the float64 per-token recurrence (``kda_reference``):
decode across refreshes, verify rounds with random accept counts, pads, GQA heads, per-channel
decays in (0.2, 0.9999), every precision preset, the anchor's independence of the read format,
the refresh as a launch of its own and as a branch, heads of any dims, and teeth. Geometries are
small (dk = dv = 16; dk = 32, a whole fp8 scale block, for every preset)."""
import pytest
import torch

pytest.importorskip("triton")

import helpers  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import replayssm as rs  # noqa: E402
from replayssm._triton import launch  # noqa: E402
from replayssm._triton.window import window_rows  # noqa: E402
from replayssm.kda import triton as kda_triton  # noqa: E402

#: Two value heads reading one key head (GQA ratio 2).
GEOMETRY = dict(num_k_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16)
#: Rows of one whole fp8 scale block (dk = 32).
WIDE_K = dict(num_k_heads=1, num_v_heads=2, head_k_dim=32, head_v_dim=16)


class TritonKDALayer(helpers.KDALayer):
    """helpers' KDA layer (decays log-uniform in [0.2, 0.9999] per channel) on the Triton backend,
    accept included."""

    backend = "triton"

    def accept(self, cache, slots, counts):
        cache.accept(slots, counts, backend="triton")


def make_layer(seed=0, **geometry):
    return TritonKDALayer(helpers.generator(seed), **(geometry or GEOMETRY))


def _rounds(tr, rounds, seed):
    """Verify rounds of random draft lengths 1..max_draft with random accept counts 0..T (every
    fourth round a decode), a pad and slots at different window positions."""
    pick = torch.Generator().manual_seed(seed)
    for r in range(rounds):
        if r % 4 == 3:
            tr.decode([2, -1, 0, 1])
            continue
        T = int(torch.randint(1, tr.cache.max_draft + 1, (), generator=pick))
        tr.verify([1, -1, 2, 0], T)
        tr.accept(torch.randint(0, T + 1, (4,), generator=pick).tolist())


def test_triton_decode_matches_float64_over_refreshes():
    """48 decode steps at a full 16-entry window (three refreshes; every step of the residual
    solve's inverse runs), the refresh a branch of the step kernel, beside a pad: every output,
    committed state and counter against the float64 recurrence."""
    layer = make_layer()
    tr = helpers.Tracker(layer, layer.cache(3, window=16), seed=1)
    tr.load([0, 1, 2])
    for _ in range(3):  # slot 2 three tokens ahead
        tr.decode([2, 0])
    for _ in range(48):
        tr.decode([2, -1])
    tr.check_counters([0, 1, 2])
    assert tr.refreshes[2] == 3
    helpers.record("triton kda s32_rs decode max rel err", tr.max_rel)
    assert tr.max_rel <= 2e-5, tr.max_rel
    assert tr.state_error([0, 2]) <= helpers.S32_TOL


@pytest.mark.parametrize("variant", ["split", "output_dot"])
def test_triton_verify_rounds_match_float64(variant):
    """Verify rounds with random draft lengths and accept counts across refreshes: the refresh a
    launch of its own (read-copy products of 4 drafts streamed on tensor cores, of fewer as
    matvecs), or a branch of the step with every step's read-copy products streamed on tensor
    cores."""
    layer = make_layer(1)
    tr = helpers.Tracker(layer, layer.cache(4, window=8, max_draft=4), seed=2)
    tr.load([0, 1, 2])
    tr.decode([1])
    tr.decode([2, 1])
    launch.TUNING.update({"split": dict(split=True), "output_dot": dict(output_dot=True)}[variant])
    try:
        _rounds(tr, rounds=14, seed=3)
    finally:
        launch.TUNING.clear()
    tr.check_counters([0, 1, 2])
    assert min(tr.refreshes[s] for s in (0, 1, 2)) >= 2
    helpers.record(f"triton kda s32_rs verify ({variant}) max rel err", tr.max_rel)
    assert tr.max_rel <= 2e-5, tr.max_rel
    assert tr.state_error([0, 1, 2]) <= helpers.S32_TOL


def test_triton_split_refresh_of_aligned_windows():
    """Every slot due in the same step, the refresh a launch of its own: its programs walk the list
    of slots due (one program per tile here refreshes all three), checked against float64."""
    layer = make_layer(6)
    tr = helpers.Tracker(layer, layer.cache(3, window=4), seed=7)
    tr.load([0, 1, 2])
    launch.TUNING.update(split=True)
    try:
        for _ in range(6):
            tr.decode([1, -1, 2, 0])
    finally:
        launch.TUNING.clear()
    assert [tr.refreshes[s] for s in (0, 1, 2)] == [1, 1, 1]
    assert tr.max_rel <= 2e-5, tr.max_rel
    assert tr.state_error([0, 1, 2]) <= helpers.S32_TOL


@pytest.mark.parametrize("preset", sorted(rs.PRESETS))
def test_triton_every_preset_within_its_read_format(preset):
    """Decode and a verify across two refreshes: outputs within the read format's bound of the
    float64 recurrence, and a low-precision read copy really used."""
    layer = make_layer(2, **WIDE_K)
    tr = helpers.Tracker(layer, layer.cache(2, window=4, max_draft=2, precision=preset), seed=4,
                         check_untouched=False)
    tr.load([0, 1])
    for _ in range(8):
        tr.decode([1, 0])
    tr.verify([0, 1], 2)
    tr.accept([1, 2])
    tr.decode([0, 1])
    assert tr.refreshes[0] == 2
    rel = tr.max_err / tr.max_ref
    read = rs.get_precision(preset).read_format.name
    helpers.record(f"triton kda {preset} rel", rel)
    assert rel <= helpers.READ_BOUND[read], rel
    if read != "fp32":
        assert rel > 1e-7


@pytest.mark.parametrize("normalize", [True, False])
def test_triton_bf16_inputs_and_explicit_scale(normalize):
    """bf16 inputs (a bf16 value buffer) with and without the in-kernel L2 norm, an explicit
    scale, two value heads per key head: outputs and state against the float64 recurrence run
    on the same bf16 inputs."""
    layer = make_layer(4, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16)
    cache = layer.cache(3, window=4, buffer_dtype=torch.bfloat16)
    g = helpers.generator(21)
    slots = torch.tensor([2, -1, 0])
    state = torch.randn(3, *layer.state_shape, generator=g)
    cache.load_state(slots, state)
    ref, err = state[[0, 2]].double(), 0.0
    for _ in range(6):
        tok = {k: v[:, 0].bfloat16() for k, v in layer.tokens(g, 3, 1).items()}
        if not normalize:
            tok["q"], tok["k"] = (torch.nn.functional.normalize(tok[n].float(), dim=-1).bfloat16() for n in "qk")
        o = rs.kda_decode(cache, slots, **tok, scale=0.3, use_qk_l2norm=normalize, backend="triton")
        assert torch.equal(o[1], torch.zeros_like(o[1]))
        oref, ref = rs.kda_reference_step(ref, **{k: v[[0, 2]] for k, v in tok.items()}, scale=0.3,
                                          use_qk_l2norm=normalize)
        err = max(err, (o[[0, 2]].double() - oref).abs().max().item())
    assert err <= helpers.S32_TOL
    assert (cache.materialize(slots[[0, 2]]).double() - ref).abs().max() <= helpers.S32_TOL


@pytest.mark.parametrize("dv, dk, preset, tuning", [(8, 24, "s32_rs", {}), (24, 48, "tp8_hi32", dict(split=True)),
                                                     (8, 24, "tp4_hi32", {})])
def test_triton_heads_of_any_dims_match_float64(dv, dk, preset, tuning):
    """dv = 8, 24 and dk = 24, 48 (``test_triton_backend.ANY_DIMS``): decode and verify rounds of 4
    drafts against the float64 recurrence, the refresh a branch of the step or a launch of its own."""
    helpers.check_any_dims(make_layer(dv + dk, **helpers.any_dims("kda", dv, dk)), preset, tuning, seed=dv)


@triton.jit
def _first_channel_decays(bg_ptr, g_ptr, sgb, sgt, sgh, sge, row, pid_b, h, vhead, HV, T: tl.constexpr,
                          L: tl.constexpr, LP: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr):
    """A broken ``_log_decays``: channel 0's log decay for every channel (a GDN-style decay)."""
    G = window_rows(bg_ptr, g_ptr, sgb, sgt, sgh, sge, row, pid_b, h, vhead, HV, tl.arange(0, DKP), DK, T, L, LP)
    first = tl.sum(tl.where(tl.arange(0, DKP)[None, :] == 0, G, 0.0), 1)
    return first[:, None] + tl.zeros_like(G)


def test_a_kernel_with_one_decay_for_all_channels_fails_the_check(monkeypatch):
    """Teeth: the kernels reading one channel's decay for every channel (outputs and refresh)
    fail the float64 comparison, in the outputs and in the folded state."""
    monkeypatch.setattr(kda_triton, "_log_decays", _first_channel_decays)
    layer = make_layer(5)
    tr = helpers.Tracker(layer, layer.cache(2, window=4), seed=6)
    tr.load([0, 1])
    errs = [tr.decode([0, 1])[1] for _ in range(5)]
    assert tr.refreshes[0] == 1
    assert min(errs[1:]) > 1e-3
    assert tr.state_error([0, 1]) > 1e-3


@pytest.mark.parametrize("split", [False, True])
def test_a_triton_kda_step_is_three_or_four_launches_and_no_pytorch_compute(split):
    """With check_values off a decode step is the scores, solve, (refresh,) and step launches;
    PyTorch only allocates outputs and scratch and makes views."""
    Ops = helpers.TorchOps

    g = helpers.generator(23)
    bf = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    cache = rs.KDACache(2, 1, 2, 16, 16, window=4)
    cache.follow_inputs(torch.bfloat16)  # the buffer of the bf16 inputs, allocated ahead as before a capture
    cache.check_values = False
    args = (bf(3, 1, 16), bf(3, 1, 16), bf(3, 2, 16), -torch.rand(3, 2, 16, generator=g), bf(3, 2))
    slots = torch.tensor([0, -1, 1])
    launches = []
    launch.LAUNCHER = lambda kernel, grid, a, kw: launches.append(kernel.fn.__name__)
    launch.TUNING["split"] = split
    try:
        with Ops() as ops:
            rs.kda_decode(cache, slots, *args, backend="triton")
    finally:
        launch.LAUNCHER = launch._launch
        launch.TUNING.clear()
    refresh = ["_kda_refresh_kernel"] if split else []
    assert launches == ["_kda_scores_kernel", "_kda_solve_kernel", *refresh, "_kda_step_kernel"]
    assert ops.names <= {"empty", "empty_like", "select", "unsqueeze", "view", "slice"}, ops.names
