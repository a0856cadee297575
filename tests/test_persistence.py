"""state_dict / load_state_dict round-trip bit-exactly; mismatched configurations are refused."""
import io

import pytest
import torch

from helpers import S32_TOL, Tracker, make_layer, snapshot, snapshot_diff

ARCHS = ["mamba2", "gdn"]


def _run(arch, precision, seeds):
    """A cache mid-window, a verify pending on one slot, per-slot rounding seeds."""
    layer = make_layer(arch)
    cache = layer.cache(3, window=4, max_draft=2, precision=precision, seed=11)
    tr = Tracker(layer, cache, seed=2)
    tr.load([0, 1, 2])
    cache.load_state(torch.tensor([0, 1, 2]), cache.materialize(torch.tensor([0, 1, 2])),
                     seeds=torch.tensor(seeds))
    for _ in range(5):
        tr.decode([0, 1, 2])
    tr.verify([1], 2)
    return layer, cache, tr


def _continue(layer, cache, seed):
    """Identical continued inputs: finish the verify, decode across a refresh."""
    tr = Tracker(layer, cache, seed=seed, check_untouched=False)
    outs = []
    for _ in range(4):
        tok = layer.tokens(tr.g, 3, 1)
        outs.append(layer.run(cache, torch.tensor([0, 2, -1]), tok, False))
    return torch.cat(outs)


@pytest.mark.parametrize("precision", ["s32_rs", "tp4_hi16_sr"])
@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_bit_exact(arch, precision):
    layer, cache, _ = _run(arch, precision, [5, 6, 7])
    buf = io.BytesIO()
    torch.save(cache.state_dict(), buf)
    buf.seek(0)
    fresh = layer.cache(3, window=4, max_draft=2, precision=precision, seed=11)
    fresh.load_state_dict(torch.load(buf))
    assert snapshot_diff(snapshot(cache), snapshot(fresh)) == []
    for c in (cache, fresh):
        c.accept(torch.tensor([1]), torch.tensor([1]))
    y0, y1 = _continue(layer, cache, 9), _continue(layer, fresh, 9)
    assert torch.equal(y0, y1)
    assert snapshot_diff(snapshot(cache), snapshot(fresh)) == []


@pytest.mark.parametrize("arch", ARCHS)
def test_restored_cache_matches_reference(arch):
    layer, cache, tr = _run(arch, "s32_rs", [1, 2, 3])
    sd = cache.state_dict()
    fresh = layer.cache(3, window=4, max_draft=2, seed=11)
    fresh.load_state_dict(sd)
    tr.cache = fresh
    tr.accept([2])
    for _ in range(6):
        tr.decode([0, 1, 2])
    tr.check_counters([0, 1, 2])
    assert tr.max_rel <= S32_TOL
    assert tr.state_error([0, 1, 2]) <= S32_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_lost_rounding_seeds_are_detected(arch):
    """Teeth: restoring everything but the per-slot seeds changes a stochastically rounded
    anchor at the next refresh, so the round-trip comparison would catch a missing entry."""
    layer, cache, _ = _run(arch, "tp4_hi16_sr", [5, 6, 7])
    sd = cache.state_dict()
    fresh = layer.cache(3, window=4, max_draft=2, precision="tp4_hi16_sr", seed=11)
    sd_no_seeds = {**sd, "seeds": fresh.state_dict()["seeds"]}
    fresh.load_state_dict(sd_no_seeds)
    for c in (cache, fresh):
        c.accept(torch.tensor([1]), torch.tensor([0]))
        _continue(layer, c, 9)
    assert "anchor.values" in snapshot_diff(snapshot(cache), snapshot(fresh))


@pytest.mark.parametrize("arch", ARCHS)
def test_mismatched_config_is_refused(arch):
    layer, cache, _ = _run(arch, "s32_rs", [1, 2, 3])
    sd = cache.state_dict()
    others = [layer.cache(3, window=8, max_draft=2, seed=11),
              layer.cache(3, window=4, max_draft=1, seed=11),
              layer.cache(2, window=4, max_draft=2, seed=11),
              layer.cache(3, window=4, max_draft=2, precision="tp8_hi32", seed=11),
              layer.cache(3, window=4, max_draft=2, buffer_dtype=torch.bfloat16, seed=11),
              make_layer("gdn" if arch == "mamba2" else "mamba2").cache(3, window=4, max_draft=2)]
    for other in others:
        before = snapshot(other)
        with pytest.raises(ValueError, match="config"):
            other.load_state_dict(sd)
        assert snapshot_diff(before, snapshot(other)) == []
    # a tampered entry with the right config
    fresh = layer.cache(3, window=4, max_draft=2, seed=11)
    before = snapshot(fresh)
    for bad in ({k: v for k, v in sd.items() if k != "committed"},
                {**sd, "committed": sd["committed"].long()},
                {**sd, "anchor.values": sd["anchor.values"][:2]}):
        with pytest.raises(ValueError, match="state_dict"):
            fresh.load_state_dict(bad)
        assert snapshot_diff(before, snapshot(fresh)) == []


@pytest.mark.parametrize("arch", ARCHS)
def test_caches_driven_alike_save_identical_bytes(arch):
    """Two caches built and driven alike (pads included, so the scratch row is used) save
    byte-identical state_dicts even without the NaN fill, whatever memory they were given."""
    import replayssm as rs

    layer = make_layer(arch)
    sds = []
    for _ in range(2):
        with rs.poison_fresh_allocations(False):
            junk = [torch.full((4096,), 3.0) for _ in range(8)]  # freed memory with stale bytes
            del junk
            cache = layer.cache(3, window=4, max_draft=2, precision="tp8_hi32", seed=11)
        tr = Tracker(layer, cache, seed=2, check_untouched=False)
        tr.load([0, 2])
        for _ in range(3):
            tr.decode([2, -1, 0])
        tr.verify([-1, 0], 2)
        sds.append(cache.state_dict())
    assert sds[0]["config"] == sds[1]["config"]
    for k in sds[0]:
        if k != "config":
            assert torch.equal(sds[0][k].view(torch.uint8), sds[1][k].view(torch.uint8)), k
