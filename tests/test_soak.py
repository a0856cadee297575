"""The serving-lifecycle soak (``benchmarks/soak.py``) in CI: every preset of both layers on the
PyTorch backend at tiny geometry, the Triton backend under its interpreter at a smaller size, the
driver script's command line, and teeth (a lost draft, a restore that drops the buffer, a NaN
that leaks across rows all fail the soak). Sizes are parameters of ``SIZES``."""
import importlib.util
import os
import sys

import pytest

import replayssm as rs
from helpers import S32_TOL, record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("soak", os.path.join(ROOT, "benchmarks", "soak.py"))
soak = importlib.util.module_from_spec(_spec)
sys.modules["soak"] = soak  # dataclasses look their module up there
_spec.loader.exec_module(soak)

ARCHS = ["mamba2", "gdn"]

#: Per-run sizes (requests; slots = the batch of a full round). The reference preset runs a few
#: hundred requests; the others fewer, over the same lifecycle.
SIZES = {"reference": dict(requests=300, num_slots=6), "preset": dict(requests=40, num_slots=6),
         "triton": dict(requests=6, num_slots=3)}
COMMON = dict(window=8, max_draft=3, max_len=24, p_preempt=0.08, p_fork=0.08, p_save=0.05, seed=7)

#: Bound on the relative output error of a run by storage format, at unit-scale inputs and fp32
#: buffers (a preset's bound is the larger of its anchor's and its read copy's, as in the
#: two-precision tests; drift of stochastically rounded anchors over preemptions included). One
#: call may reach twice the bound (``Soak.check``); materialized states are bounded by the anchor's.
BOUND = {"fp32": S32_TOL, "fp16": 4e-3, "bf16": 3e-2, "fp8_e4m3": 0.1, "nvfp4": 0.5}


def _bounds(preset):
    p = rs.get_precision(preset)
    return max(BOUND[p.read_format.name], BOUND[p.anchor.name]), BOUND[p.anchor.name]


def _report(s, key):
    f = s.figures()
    print(f"\n{key}: {f['requests']} requests, {f['tokens']} tokens, {f['rounds']} rounds, "
          f"{f['preemptions']} preemptions, {f['forks']} forks, {f['restores']} restores "
          f"({f['restores_pending']} with a verify pending), {f['nan_fed']} NaN/Inf feeds, "
          f"rel err {f['run_rel_err']:.2e} (worst call {f['max_rel_err']:.2e}, max abs {f['max_abs_err']:.2e}), "
          f"state {f['max_state_rel_err']:.2e}, "
          f"lost/duplicated {f['token_mismatches']}")
    record(f"soak {key} out rel", f["run_rel_err"])
    record(f"soak {key} out rel worst call", f["max_rel_err"])
    record(f"soak {key} state rel", f["max_state_rel_err"])
    return f


def _covers_the_lifecycle(f):
    """The run went through every event it is meant to exercise."""
    assert f["requests_finished"] == f["requests"]
    for name in ("preemptions", "forks", "restores", "restores_pending", "resets", "loads", "nan_fed",
                 "nan_committed", "pad_rows", "int32_calls", "verify_calls", "decode_calls"):
        assert f[name] > 0, name
    assert 0 < f["drafts_accepted"] < f["drafts"]


@pytest.mark.parametrize("preset", sorted(rs.PRESETS))
@pytest.mark.parametrize("arch", ARCHS)
def test_soak_torch_backend(arch, preset):
    size = SIZES["reference" if preset == "s32_rs" else "preset"]
    s = soak.Soak(arch, preset, geometry=soak.TINY[arch], backend="torch", **size, **COMMON).run()
    f = _report(s, f"{arch} {preset} torch")
    _covers_the_lifecycle(f)
    s.check(*_bounds(preset))


@pytest.mark.parametrize("arch", ARCHS)
def test_soak_triton_backend(arch):
    pytest.importorskip("triton")
    s = soak.Soak(arch, "s32_rs", geometry=soak.TINY_TRITON[arch], backend="triton", **SIZES["triton"],
                  **{**COMMON, "max_len": 5, "max_draft": 2, "p_preempt": 0.15, "p_fork": 0.3, "p_save": 0.15,
                     "seed": 3})
    s.run()
    f = _report(s, f"{arch} s32_rs triton")
    assert f["requests_finished"] == f["requests"]
    for name in ("preemptions", "forks", "restores", "nan_fed", "pad_rows", "verify_calls"):
        assert f[name] > 0, name
    s.check(*_bounds("s32_rs"))


def test_driver_script_runs_at_tiny_size(capsys):
    """The GPU driver's command line, on the CPU at tiny size: prints the figures, exits 0."""
    rc = soak.main(["--tiny", "--device", "cpu", "--batch", "3", "--steps", "40", "--requests", "6",
                    "--max-len", "8", "--window", "4", "--max-draft", "2", "--presets", "s32_rs",
                    "tp8_hi32", "--budget", "30"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count('"ok": true') == 4
    assert "lost/dup" in out


# ------------------------------------------------------------------------------------------------
# Teeth: the soak fails on a broken library
# ------------------------------------------------------------------------------------------------
def _small(arch="mamba2", **kw):
    return soak.Soak(arch, "s32_rs", geometry=soak.TINY[arch], requests=30, num_slots=4,
                     **{**COMMON, **kw})


def test_teeth_lost_accepted_draft(monkeypatch):
    """An accept that drops one accepted draft of one slot: lost tokens, wrong outputs."""
    orig = rs.Mamba2Cache.accept
    calls = [0]

    def accept(self, slots, num_accepted, path=None, backend=None):
        calls[0] += 1
        n = num_accepted.clone()
        if calls[0] % 5 == 0:
            n[(n > 0).nonzero()[:1]] -= 1
        return orig(self, slots, n, path=path, backend=backend)

    monkeypatch.setattr(rs.Mamba2Cache, "accept", accept)
    s = _small().run()
    assert s.figures()["token_mismatches"] > 0
    with pytest.raises(AssertionError):
        s.check(*_bounds("s32_rs"))


def test_teeth_restore_that_drops_the_buffer(monkeypatch):
    """A restore that loses the replay buffer (committed entries since the checkpoint)."""
    orig = rs.GDNCache.load_state_dict

    def load_state_dict(self, sd):
        orig(self, sd)
        for t in self.buffer.values():
            t.zero_()

    monkeypatch.setattr(rs.GDNCache, "load_state_dict", load_state_dict)
    s = _small("gdn", p_save=0.2).run()
    with pytest.raises(AssertionError, match="error"):
        s.check(*_bounds("s32_rs"))


def test_teeth_nan_leaking_across_rows(monkeypatch):
    """A backend that lets one row's NaN reach the other rows of the batch."""
    orig = soak.Mamba2Layer.call

    def call(self, cache, slots, tok, verify, backend):
        y = orig(self, cache, slots, tok, verify, backend)
        return y + 0.0 * y.sum()

    monkeypatch.setattr(soak.Mamba2Layer, "call", call)
    with pytest.raises(AssertionError, match="non-finite output|pad outputs"):
        _small().run()
