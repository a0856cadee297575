"""Mamba-2: s32_rs replay decode against the float64 conventional recurrence."""
import pytest

from helpers import (S32_TOL, Tracker, check_decode_accuracy, check_perturbed_buffer_detected,
                     check_skipped_refresh_detected, make_layer)

ARCH = "mamba2"


def test_s32_decode_matches_reference_over_refreshes(record_property):
    check_decode_accuracy(ARCH, record_property)


def test_perturbed_buffer_entry_is_detected():
    check_perturbed_buffer_detected(ARCH)


def test_skipped_refresh_is_detected(monkeypatch):
    check_skipped_refresh_detected(ARCH, monkeypatch)


@pytest.mark.parametrize("ngroups", [1, 4])
def test_groups_and_call_without_optional_inputs(ngroups):
    """B/C shared by the heads of a group; a call without D, z and dt_bias."""
    layer = make_layer(ARCH, nheads=4, headdim=8, dstate=16, ngroups=ngroups)
    layer.D = None
    layer.dt_bias = None
    tr = Tracker(layer, layer.cache(3, window=4))
    tr.load([1, 2])
    for _ in range(6):  # one refresh at window 4
        tr.decode([2, 1])
    tr.check_counters([1, 2])
    assert tr.refreshes[1] == 1
    assert tr.max_err <= S32_TOL
    assert tr.state_error([1, 2]) <= S32_TOL
