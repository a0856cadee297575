"""Speculative verify / accept / rollback against the float64 recurrence, for both architectures."""
import random

import pytest
import torch

from helpers import S32_TOL, Tracker, make_layer, snapshot, snapshot_diff

ARCHS = ["mamba2", "gdn"]


def _staggered(arch, num_slots=5, window=8, max_draft=4, precision="s32_rs", seed=0):
    """A cache whose slots sit at different window positions: slot i has decoded 2i+1 tokens."""
    layer = make_layer(arch, seed)
    cache = layer.cache(num_slots, window=window, max_draft=max_draft, precision=precision)
    tr = Tracker(layer, cache, seed=seed + 1)
    slots = list(range(num_slots))
    tr.load(slots)
    for n in range(2 * num_slots - 1):
        tr.decode([s for s in slots if 2 * s + 1 > n])
    assert len(set(tr.h.values())) > 2  # really at different positions
    return layer, cache, tr


def _round_batch(rng, num_slots):
    """A random subset of the slots in random order, with one or two pads mixed in."""
    real = rng.sample(range(num_slots), rng.randint(2, num_slots - 1))
    batch = real + [-1] * rng.randint(1, 2)
    rng.shuffle(batch)
    return batch


@pytest.mark.parametrize("arch", ARCHS)
def test_random_drafts_and_acceptance(arch):
    layer, cache, tr = _staggered(arch)
    rng = random.Random(7)
    verify_err = decode_err = 0.0
    for _ in range(40):
        batch = _round_batch(rng, cache.num_slots)
        T = rng.randint(1, cache.max_draft)
        _, e = tr.verify(batch, T)
        verify_err = max(verify_err, e)
        counts = [rng.randint(0, T) for _ in batch]
        tr.accept(counts)
        _, e = tr.decode(batch)  # plain decode continues from the accepted prefix
        decode_err = max(decode_err, e)
    real = list(range(cache.num_slots))
    tr.check_counters(real)
    state_err = tr.state_error(real)
    print(f"\n{arch} speculative: verify err {verify_err:.3e}, decode-after-accept err "
          f"{decode_err:.3e}, state err {state_err:.3e}, refreshes {tr.refreshes}, "
          f"max |y_ref| {tr.max_ref:.1f}, max rel err {tr.max_rel:.2e}")
    assert min(tr.refreshes.values()) >= 2
    # |y - y_ref| <= 1e-5 * max(1, |y_ref|) per element (outputs here reach ~40)
    assert tr.max_rel <= S32_TOL and state_err <= S32_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_accept_without_rollback_is_detected(arch, monkeypatch):
    """Teeth: an accept that commits every draft (no rollback) breaks the continued decode."""
    layer, cache, tr = _staggered(arch)
    orig = cache.accept
    monkeypatch.setattr(cache, "accept", lambda slots, n: orig(slots, torch.full_like(n, 3)))
    tr.verify([0, 1, 2], 3)
    tr.accept([1, 0, 2])
    _, err = tr.decode([0, 1, 2])
    assert err > 1e-3


def _pending_state(cache, slots):
    """Everything that zero acceptance must leave bit-identical: anchor, read copy, counters,
    and the committed region of the buffer."""
    rows = torch.tensor(slots)
    snap = snapshot(cache, rows)
    h = cache.counters(rows)["committed"].tolist()
    for name, buf in (cache.buffer or {}).items():  # None before the first decode or verify
        snap[name + ".committed"] = torch.cat([buf[r, :n].reshape(-1).view(torch.uint8).clone()
                                               for r, n in zip(slots, h)])
    return {k: v for k, v in snap.items() if not k.startswith("buffer.")}


@pytest.mark.parametrize("precision", ["s32_rs", "tp4_hi16_sr"])
@pytest.mark.parametrize("arch", ARCHS)
def test_zero_acceptance_is_bit_identical(arch, precision):
    layer = make_layer(arch)
    cache = layer.cache(3, window=8, max_draft=4, precision=precision)
    tr = Tracker(layer, cache)
    tr.load([0, 1, 2])
    for _ in range(3):
        tr.decode([1, 2])  # slot 0 at h = 0 (empty history), slots 1, 2 at h = 3
    before = _pending_state(cache, [0, 1, 2])
    assert before["anchor.values"].numel() > 0
    tr.verify([0, -1, 1, 2], 4)  # h + T = 7 <= 8: no refresh
    tr.accept([0, 3, 0, 0])
    assert snapshot_diff(before, _pending_state(cache, [0, 1, 2])) == []
    _, err = tr.decode([0, 1, 2])
    if precision == "s32_rs":
        assert tr.max_rel <= S32_TOL
    else:  # NVFP4 read copy: loose, relative to the output scale
        assert tr.max_err <= 0.5 * tr.max_ref
    tr.check_counters([0, 1, 2])


@pytest.mark.parametrize("arch", ARCHS)
def test_zero_acceptance_teeth(arch, monkeypatch):
    """Teeth: an accept that folds the (empty) history into a new checkpoint is caught, because
    the read copy is re-derived from the rounded anchor."""
    layer = make_layer(arch)
    cache = layer.cache(2, window=8, precision="tp4_hi16_sr", buffer_dtype=torch.float32)
    orig = cache.accept

    def accept_and_fold(slots, n):
        orig(slots, n)
        rows, valid = cache.rows_of(slots)
        cache.refresh(rows, valid)
    monkeypatch.setattr(cache, "accept", accept_and_fold)
    tr = Tracker(layer, cache)
    tr.load([0, 1])
    before = _pending_state(cache, [0, 1])
    tr.verify([0, 1], 2)
    tr.accept([0, 0])
    diff = snapshot_diff(before, _pending_state(cache, [0, 1]))
    assert any(k.startswith("read_copy.") for k in diff)


@pytest.mark.parametrize("arch", ARCHS)
def test_refresh_at_window_edge(arch):
    """Window 8, h = 6: a verify of T = 3 refreshes first (folding the 6 committed entries),
    a verify of T = 2 (h + T = 8 <= window) does not."""
    layer = make_layer(arch)
    cache = layer.cache(2, window=8, max_draft=4)
    tr = Tracker(layer, cache)
    tr.load([0, 1])
    for _ in range(6):
        tr.decode([0, 1])
    rows = torch.tensor([0, 1])
    tr.verify([0, 1], 3)  # slot 0 and 1 both at h = 6
    c = cache.counters(rows)
    assert c["refreshes"].tolist() == [1, 1] and c["committed"].tolist() == [0, 0]
    assert c["pending"].tolist() == [3, 3]
    tr.accept([3, 1])
    c = cache.counters(rows)
    assert c["committed"].tolist() == [3, 1] and c["pending"].tolist() == [0, 0]
    tr.check_counters([0, 1])
    assert tr.state_error([0, 1]) <= S32_TOL
    # slot 1 now at h = 1, slot 0 at h = 3; bring slot 0 to 6 and verify T = 2: no refresh
    for _ in range(3):
        tr.decode([0])
    tr.verify([0], 2)
    c = cache.counters(torch.tensor([0]))
    assert c["refreshes"].tolist() == [1] and c["committed"].tolist() == [6]
    tr.accept([2])
    c = cache.counters(torch.tensor([0]))
    assert c["committed"].tolist() == [8] and c["refreshes"].tolist() == [1]
    _, err = tr.decode([0, 1])  # slot 0 at h = 8 = window: refreshes now
    tr.check_counters([0, 1])
    assert tr.refreshes[0] == 2
    assert tr.max_rel <= S32_TOL
    assert tr.state_error([0, 1]) <= S32_TOL
