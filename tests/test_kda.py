"""Kimi Delta Attention: the replay decode and verify against the float64 conventional recurrence
(per-channel decays in (0.2, 0.9999)), every precision preset, the anchor's independence of the
read format, teeth, and validation."""
import math

import pytest
import torch

import replayssm as rs
import replayssm.backend as backend_module
import helpers
from helpers import (READ_BOUND, S32_TOL, Tracker, check_decode_accuracy, check_explicit_scale,
                     check_perturbed_buffer_detected, check_skipped_refresh_detected, make_layer, parts_equal, record,
                     snapshot, snapshot_diff)
from replayssm.kda import replay

ARCH = "kda"


def test_s32_decode_matches_reference_over_refreshes(record_property):
    check_decode_accuracy(ARCH, record_property)


def _speculative_rounds(layer, cache, rounds, seed):
    """Verify rounds with random draft lengths and accept counts 0..T, decodes in between, a pad,
    and slots at different window positions; checks every output, state and counter."""
    tr = Tracker(layer, cache, seed=seed)
    pick = torch.Generator().manual_seed(seed + 100)
    tr.load([0, 1, 2])
    for _ in range(3):  # slot 1 runs ahead: the slots sit at different window positions
        tr.decode([1])
    tr.decode([2, 1])
    assert [tr.h[s] for s in (0, 1, 2)] == [0, 4, 1]
    batch = [2, -1, 0, 1]
    real = [2, 0, 1]
    for r in range(rounds):
        if r % 5 == 4:
            tr.decode(batch)
        else:
            T = int(torch.randint(1, cache.max_draft + 1, (), generator=pick))
            tr.verify(batch, T)
            counts = torch.randint(0, T + 1, (len(batch),), generator=pick).tolist()
            tr.accept(counts)
        tr.check_counters(real)
        if r % 8 == 7:
            assert tr.state_error(real) <= S32_TOL
    return tr


def test_speculative_rounds_match_reference():
    """>= 48 rounds (verify with random accept counts 0..T, and decodes) over several refreshes."""
    layer = make_layer(ARCH)
    cache = layer.cache(4, window=8, max_draft=4)
    tr = _speculative_rounds(layer, cache, rounds=48, seed=2)
    print(f"\nkda s32_rs speculative: max abs output error {tr.max_err:.3e} "
          f"(max |y_ref| {tr.max_ref:.2f}), refreshes {tr.refreshes}")
    record("kda s32_rs speculative out", tr.max_err)
    assert min(tr.refreshes[s] for s in (0, 1, 2)) >= 3
    assert tr.max_err <= S32_TOL
    assert tr.state_error([0, 1, 2]) <= S32_TOL


class StrongDecayLayer(helpers.KDALayer):
    """Decays in [0.2, 0.22] on every channel: the log decay since a checkpoint passes the fp32
    range of exp within a 64-token window."""

    def tokens(self, g, b, T):
        tok = super().tokens(g, b, T)
        tok["g"] = torch.log(helpers.log_uniform(g, (b, T, self.HV, self.K), 0.2, 0.22))
        return tok


def test_strong_decays_over_a_long_window():
    """With |G| past 88.7 (exp(-G) is inf in fp32, so a factored e^{G_t} e^{-G_i} form would
    give NaN) the per-channel segment sums keep outputs and the fold at fp32 accuracy."""
    assert torch.isinf(torch.exp(torch.tensor(-62 * math.log(0.22))))  # |G| after 62 tokens
    layer = StrongDecayLayer(helpers.generator(0))
    tr = Tracker(layer, layer.cache(1, window=64, max_draft=2))
    tr.load([0])
    for _ in range(62):
        tr.decode([0])
    tr.verify([0], 2)
    tr.accept([2])
    tr.decode([0])  # 64 + 1 > 64: the refresh folds 64 strongly decayed entries
    assert tr.refreshes[0] == 1
    assert tr.max_err <= S32_TOL
    assert tr.state_error([0]) <= S32_TOL


def test_decays_span_the_requested_range():
    """The test inputs really exercise per-channel decays from 0.2 to 0.9999."""
    tok = make_layer(ARCH).tokens(torch.Generator().manual_seed(0), 64, 4)
    alpha = torch.exp(tok["g"])
    assert alpha.min() < 0.22 and alpha.max() > 0.999 and alpha.max() <= 0.9999 + 1e-6
    assert (alpha.amax(-1) / alpha.amin(-1)).min() > 1.5  # channels of one head differ


@pytest.mark.parametrize("num_k_heads,num_v_heads", [(2, 4), (1, 4), (2, 2)])
def test_gqa_ratios(num_k_heads, num_v_heads):
    """Value head h reads key head h // (HV / HK)."""
    layer = make_layer(ARCH, num_k_heads=num_k_heads, num_v_heads=num_v_heads)
    tr = Tracker(layer, layer.cache(3, window=4))
    tr.load([0, 2])
    for _ in range(6):
        tr.decode([0, 2])
    tr.verify([2, 0], 3)
    tr.accept([1, 3])
    tr.check_counters([0, 2])
    assert tr.max_err <= S32_TOL
    assert tr.state_error([0, 2]) <= S32_TOL


def test_explicit_scale_without_l2norm():
    """q, k passed already unit-norm with an explicit scale (no in-kernel normalization)."""
    check_explicit_scale(ARCH)


# ---- teeth -------------------------------------------------------------------------------------
def test_perturbed_buffer_entry_is_detected():
    check_perturbed_buffer_detected(ARCH)


def test_skipped_refresh_is_detected(monkeypatch):
    check_skipped_refresh_detected(ARCH, monkeypatch)


def test_channel_mean_decay_is_detected(monkeypatch):
    """Teeth: applying each head's decay as its channel mean (a GDN-style scalar decay) fails the
    parity check, in the outputs and in the folded state."""
    monkeypatch.setattr(replay, "log_decays",
                        lambda buf: buf["g"].float().mean(-1, keepdim=True).expand_as(buf["g"]))
    layer = make_layer(ARCH)
    tr = Tracker(layer, layer.cache(2, window=4))
    tr.load([0, 1])
    errs = [tr.decode([0, 1])[1] for _ in range(6)]
    assert min(errs) > 1e-3
    assert tr.state_error([0, 1]) > 1e-3


def test_perturbed_buffered_decay_is_detected():
    """Teeth: one channel of one buffered log decay changed breaks the next output."""
    layer = make_layer(ARCH)
    cache = layer.cache(2, window=16)
    tr = Tracker(layer, cache)
    tr.load([0, 1])
    for _ in range(5):
        tr.decode([0, 1])
    assert tr.max_err <= S32_TOL
    cache.buffer["g"][1, 3, 0, 5] -= 0.5
    _, err = tr.decode([0, 1])
    assert err > 10 * S32_TOL


# ---- precisions --------------------------------------------------------------------------------
def test_anchor_is_bit_identical_across_read_formats():
    """An fp32 anchor does not depend on the read format (refresh folds from the anchor with the
    raw buffered inputs); at each refresh it equals the unrounded committed state."""
    presets = ["s32_rs", "tp16_hi32", "tp8_hi32"]
    rows = torch.tensor([0, 1])
    trackers = []
    for p in presets:
        layer = make_layer(ARCH, seed=3)
        tr = Tracker(layer, layer.cache(2, window=8, precision=p), seed=4, check_untouched=False)
        tr.load([0, 1])
        trackers.append(tr)
    refreshes_seen = 0
    for step in range(20):
        refresh_due = trackers[0].h[0] + 1 > 8
        pre = [tr.cache.materialize(rows) for tr in trackers] if refresh_due else None
        ys = [tr.decode([0, 1])[0] for tr in trackers]
        for tr, y in zip(trackers[1:], ys[1:]):
            assert parts_equal(tr.cache.anchor, trackers[0].cache.anchor), f"anchor differs at step {step}"
            assert not torch.equal(y, ys[0]), "a different read format must change the outputs"
        if refresh_due:
            refreshes_seen += 1
            for tr, S in zip(trackers, pre):
                assert torch.equal(tr.cache.decode_anchor(rows), S)
                if tr.cache.read_copy is not None:
                    assert parts_equal({k: v[rows] for k, v in tr.cache.read_copy.items()},
                                       tr.cache.precision.read.encode(S, "nearest"))
    assert refreshes_seen == 2


def test_refresh_from_read_copy_is_detected(monkeypatch):
    """Teeth of the test above: folding from the read copy changes the anchor."""
    anchors = []
    for broken in (False, True):
        layer = make_layer(ARCH, seed=3)
        cache = layer.cache(2, window=4, precision="tp8_hi32")
        if broken:
            monkeypatch.setattr(cache, "decode_anchor", cache.decode_read)
        tr = Tracker(layer, cache, seed=4)
        tr.load([0, 1])
        for _ in range(6):
            tr.decode([0, 1])
        anchors.append(cache.anchor)
    assert not parts_equal(*anchors)


@pytest.mark.parametrize("preset", sorted(rs.PRESETS))
def test_error_bounded_by_read_format(preset):
    layer = make_layer(ARCH, seed=3)
    tr = Tracker(layer, layer.cache(2, window=8, precision=preset), seed=4, check_untouched=False)
    tr.load([0, 1])
    errs = [tr.decode([0, 1])[1] for _ in range(16)]  # 2 refreshes at window 8
    tr.verify([1, 0], 3)
    tr.accept([2, 1])
    errs.append(tr.decode([0, 1])[1])
    assert tr.refreshes[0] == 2
    rel = max(errs) / tr.max_ref
    read = rs.get_precision(preset).read_format.name
    bound = READ_BOUND[read]
    print(f"\nkda    {preset:12s} read {read:8s} max abs err {max(errs):.3e}  rel {rel:.3e}  "
          f"(bound {bound:.0e})")
    record(f"kda {preset} rel", rel)
    assert rel <= bound
    if read != "fp32":
        assert rel > 1e-7  # the read format is really used


# ---- validation --------------------------------------------------------------------------------
META = torch.device("meta")


def _setup():
    layer = make_layer(ARCH)
    cache = layer.cache(3, window=8, max_draft=4, precision="tp8_hi32")
    tr = Tracker(layer, cache)
    tr.load([0, 1, 2])
    tr.decode([0, 1])
    return layer, cache, tr


def _args(layer, seed, b, T=None):
    tok = layer.tokens(torch.Generator().manual_seed(seed), b, T or 1)
    return tok if T else {k: v[:, 0] for k, v in tok.items()}


def _call(cache, slots, args, verify, **kw):
    f = rs.kda_verify if verify else rs.kda_decode
    return f(cache, slots, **args, use_qk_l2norm=True, **kw)


def _rejects(cache, fn, match):
    before = snapshot(cache)
    with pytest.raises(ValueError, match=match):
        fn()
    assert snapshot_diff(before, snapshot(cache)) == []


@pytest.mark.parametrize("verify", [False, True])
def test_every_input_shape_dtype_device(verify):
    layer, cache, _ = _setup()
    slots = torch.tensor([0, -1, 1])
    args = _args(layer, 0, 3, 2 if verify else None)
    for name, t in args.items():
        bad_variants = [t[..., :-1] if t.shape[-1] > 1 else t[None], t.to(torch.int32), t.double(),
                        t.to(META)]
        if name == "g":  # a per-head (GDN-shaped) decay is refused
            bad_variants.append(t[..., 0])
        for bad in bad_variants:
            _rejects(cache, lambda: _call(cache, slots, {**args, name: bad}, verify), name)
    _rejects(cache, lambda: _call(cache, slots, args, verify, scale="0.5"), "scale")
    if verify:
        _rejects(cache, lambda: _call(cache, slots[:2], args, verify), "shape")
        long = _args(layer, 1, 3, 5)  # max_draft = 4
        _rejects(cache, lambda: _call(cache, slots, long, verify), "draft length")
    _call(cache, slots, args, verify)  # and the valid call goes through


def test_positive_log_decay_rejected_with_value_checks():
    layer, cache, _ = _setup()
    args = _args(layer, 4, 2)
    bad = args["g"].clone()
    bad[1, 2, 3] = 0.1  # one channel of one head
    _rejects(cache, lambda: _call(cache, torch.tensor([0, 1]), {**args, "g": bad}, False), "g")
    cache.check_values = False  # value checks off (graph capture): not read, no error
    _call(cache, torch.tensor([0, 1]), {**args, "g": bad}, False)


def test_slots_pending_and_accept():
    layer, cache, tr = _setup()
    args = _args(layer, 2, 2)
    for bad in (torch.tensor([0, 3]), torch.tensor([1, 1]), torch.tensor([0.0, 1.0]), [0, 1]):
        _rejects(cache, lambda: _call(cache, bad, args, False), "slots")
    tr.verify([2], 2)
    slots = torch.tensor([2, 0])
    _rejects(cache, lambda: _call(cache, slots, args, False), "pending")
    _rejects(cache, lambda: cache.accept(slots, torch.tensor([3, 0])), "num_accepted")
    cache.accept(slots, torch.tensor([2, 0]))
    _call(cache, slots, args, False)


@pytest.mark.parametrize("verify", [False, True])
def test_backend_choice_and_triton_geometry(verify, monkeypatch):
    """backend='triton' runs a geometry of 8-wide heads (masked tiles) and agrees with
    backend='torch' on the same cache; an unknown backend names ``backend`` and leaves the cache
    unchanged; backend=None picks Triton for a CUDA cache. (The kernels themselves:
    test_triton_kda.py.)"""
    layer, cache, _ = _setup()
    _, twin, _ = _setup()
    assert cache.dv == 8 and snapshot_diff(snapshot(cache), snapshot(twin)) == []
    slots = torch.tensor([0, 1])
    args = _args(layer, 3, 2, 2 if verify else None)
    _rejects(cache, lambda: _call(cache, slots, args, verify, backend="cuda"), "backend")
    monkeypatch.setattr(backend_module, "triton_available", lambda: True)
    monkeypatch.setattr(cache, "device", torch.device("cuda", 0))  # what backend=None sees on a GPU
    assert backend_module.pick_backend(cache) == "triton"
    monkeypatch.undo()
    ref = _call(twin, slots, args, verify, backend="torch")
    torch.testing.assert_close(_call(cache, slots, args, verify, backend="triton"), ref, rtol=1e-4, atol=1e-5)


def test_load_state_and_construction():
    layer, cache, _ = _setup()
    S = torch.randn(2, *layer.state_shape)
    slots = torch.tensor([0, 1])
    for bad in (S[..., :-1], S.to(torch.int32), S.double(), S.to(META)):
        _rejects(cache, lambda: cache.load_state(slots, bad), "state")
    with pytest.raises(ValueError, match="num_v_heads"):
        rs.KDACache(2, 2, 3, 16, 8)
    with pytest.raises(ValueError, match="head_k_dim"):
        rs.KDACache(2, 2, 4, 0, 8)
    with pytest.raises(ValueError, match="max_draft"):
        layer.cache(2, window=4, max_draft=5)
    with pytest.raises(ValueError, match="precision"):
        layer.cache(2, precision="fp7_nope")


def test_empty_batch_and_state_dict_round_trip():
    layer, cache, _ = _setup()
    args = {k: v[:0] for k, v in _args(layer, 5, 1).items()}
    before = snapshot(cache)
    y = _call(cache, torch.zeros(0, dtype=torch.int64), args, False)
    assert y.shape == (0, layer.HV, layer.V) and snapshot_diff(before, snapshot(cache)) == []
    other = layer.cache(3, window=8, max_draft=4, precision="tp8_hi32")
    other.load_state_dict(cache.state_dict())
    assert snapshot_diff(snapshot(cache), snapshot(other)) == []
    assert other.config()["kind"] == "kda"


def test_channel_constant_decay_is_gated_deltanet():
    """The oracle itself: with one decay shared by the channels of a head, the KDA recurrence is
    the Gated DeltaNet recurrence (two independent float64 implementations), and the cache's
    outputs match both."""
    layer = make_layer(ARCH)
    gen = torch.Generator().manual_seed(7)
    tok = layer.tokens(gen, 2, 12)
    tok["g"] = tok["g"][..., :1].expand_as(tok["g"]).contiguous()
    S = torch.randn(2, *layer.state_shape, generator=gen)
    y_kda, s_kda = rs.kda_reference(S, **tok, use_qk_l2norm=True)
    y_gdn, s_gdn = rs.gdn_reference(S, **{**tok, "g": tok["g"][..., 0]}, use_qk_l2norm=True)
    assert (y_kda - y_gdn).abs().max() < 1e-12 and (s_kda - s_gdn).abs().max() < 1e-12
    cache = layer.cache(2, window=4)
    cache.load_state(torch.tensor([0, 1]), S)
    ys = [rs.kda_decode(cache, torch.tensor([1, 0]), **{k: v[[1, 0], t] for k, v in tok.items()},
                        use_qk_l2norm=True) for t in range(12)]
    assert (torch.stack(ys, 1)[[1, 0]].double() - y_gdn).abs().max() <= S32_TOL


def test_half_precision_inputs_and_buffer():
    """bf16 inputs with a bf16 value buffer: the cache sees exactly the inputs the oracle sees
    (v is stored losslessly), so the error stays at fp32 compute level."""
    layer = make_layer(ARCH)
    cache = layer.cache(2, window=4, buffer_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(8)
    S = torch.randn(2, *layer.state_shape, generator=gen)
    slots = torch.tensor([1, 0])
    cache.load_state(slots, S)
    ref, err = S.double(), 0.0
    for _ in range(6):
        tok = {k: v[:, 0].bfloat16() for k, v in layer.tokens(gen, 2, 1).items()}
        y = rs.kda_decode(cache, slots, **tok, use_qk_l2norm=True)
        yref, ref = rs.kda_reference_step(ref, **tok, use_qk_l2norm=True)
        err = max(err, (y.double() - yref).abs().max().item())
    assert cache.buffer["v"].dtype == torch.bfloat16
    assert err <= S32_TOL
    assert (cache.materialize(slots).double() - ref).abs().max() <= S32_TOL
