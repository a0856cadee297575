"""``replayssm run``: the reproduction runner. Drives every requested precision preset of a
ReplaySSM cache through one fixed, versioned schedule of decodes and speculative rounds beside the
float64 conventional recurrence, checks the invariants of the design, writes a JSON report and
prints tables (``docs/runner.md``).

- ``protocol``: configuration, schedule, input distributions, presets and control runs;
- ``checks``: the lockstep loop over presets and the invariant checks (a)-(f);
- ``report``: the JSON report, the printed tables, the drift plot, ``--compare``;
- ``cli``: the command line.

This package's ``__init__`` imports nothing heavy: ``replayssm run --help`` needs no torch.
"""
from __future__ import annotations

import importlib

PROTOCOL = "replayssm-protocol-v1"
#: Version of the JSON layout (bumped when a field changes meaning or moves).
SCHEMA = 1

_EXPORTS = {
    "Config": "protocol", "Schedule": "protocol", "Step": "protocol", "Draw": "protocol",
    "plan_presets": "protocol", "anchor_key": "protocol", "read_key": "protocol", "BASELINE": "protocol",
    "CHECKS": "checks", "CHECK_NAMES": "checks", "run_case": "checks",
    "build_report": "report", "print_report": "report", "compare_reports": "report", "plot_drift": "report",
    "add_arguments": "cli", "main": "cli", "run_all": "cli",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
