"""Gated DeltaNet: s32_rs replay decode against the float64 conventional recurrence."""
import pytest

from helpers import (S32_TOL, Tracker, check_decode_accuracy, check_explicit_scale, check_perturbed_buffer_detected,
                     check_skipped_refresh_detected, make_layer)

ARCH = "gdn"


def test_s32_decode_matches_reference_over_refreshes(record_property):
    check_decode_accuracy(ARCH, record_property)


def test_perturbed_buffer_entry_is_detected():
    check_perturbed_buffer_detected(ARCH)


def test_skipped_refresh_is_detected(monkeypatch):
    check_skipped_refresh_detected(ARCH, monkeypatch)


@pytest.mark.parametrize("num_k_heads,num_v_heads", [(1, 4), (2, 2)])
def test_gqa_ratios(num_k_heads, num_v_heads):
    """Value head h reads key head h // (HV / HK)."""
    layer = make_layer(ARCH, num_k_heads=num_k_heads, num_v_heads=num_v_heads)
    tr = Tracker(layer, layer.cache(3, window=4))
    tr.load([0, 2])
    for _ in range(6):
        tr.decode([0, 2])
    tr.check_counters([0, 2])
    assert tr.max_err <= S32_TOL
    assert tr.state_error([0, 2]) <= S32_TOL


def test_explicit_scale_without_l2norm():
    """q, k passed already unit-norm with an explicit scale (no in-kernel normalization)."""
    check_explicit_scale(ARCH)
