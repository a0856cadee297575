"""Suite-wide fixtures.

- Every test runs under ``rs.poison_fresh_allocations()``: fresh float storage of a cache is
  NaN, so any read of memory the code never wrote shows up as NaN and fails the tolerance and
  finiteness checks of ``helpers.Tracker``.
- The measured error figures collected in ``helpers.MEASURED`` are printed as a table at the end
  of the run; under pytest-xdist each worker hands its figures to the controller, which keeps the
  largest of each.
"""
from __future__ import annotations

import os
import sys

# Without a GPU, Triton kernels run in its interpreter; this must be set before triton is
# imported anywhere (it decides, at decoration time, how kernels are compiled).
if os.environ.get("REPLAYSSM_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

import replayssm as rs

sys.path.insert(0, os.path.dirname(__file__))
import helpers  # noqa: E402

# Tiny shapes: one intra-op thread is fastest and immune to oversubscription on small CI boxes.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _poison_fresh_allocations():
    with rs.poison_fresh_allocations():
        yield


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)  # set on xdist workers only
    if workeroutput is not None:
        workeroutput["replayssm_measured"] = dict(helpers.MEASURED)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    for key, value in getattr(node, "workeroutput", {}).get("replayssm_measured", {}).items():
        helpers.MEASURED[key] = max(helpers.MEASURED.get(key, 0.0), value)


def pytest_terminal_summary(terminalreporter):
    if not helpers.MEASURED:
        return
    tr = terminalreporter
    tr.section("replayssm measured errors (max over the run, vs the float64 reference)")
    width = max(len(k) for k in helpers.MEASURED)
    for key in sorted(helpers.MEASURED):
        tr.write_line(f"{key:<{width}}  {helpers.MEASURED[key]:.3e}")
