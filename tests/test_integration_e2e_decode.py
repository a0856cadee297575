"""benchmarks/e2e_decode.py on the CPU (``--tiny``): every path runs, agrees with the stock path,
and its decode steps hold no host synchronization (what a CUDA graph could not capture)."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script():
    spec = importlib.util.spec_from_file_location("e2e_decode", os.path.join(ROOT, "benchmarks", "e2e_decode.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_e2e_decode_tiny_cpu(tmp_path, capsys):
    e2e = _script()
    out = tmp_path / "e2e.json"
    assert e2e.main(["--tiny", "--out", str(out), "--batches", "2", "--window", "4", "--check-steps", "6",
                     "--reps", "1"]) == 0
    rep = json.loads(out.read_text())
    rows = {(r["model"], r["path"]): r for r in rep["rows"]}
    assert set(rows) == {(m, p) for m in ("nemotron-h", "qwen3.5") for p in e2e.PATHS + ("no_ssm",)}
    for (model, path), r in rows.items():
        assert "error" not in r, (model, path, r.get("error"))
        assert r["host_syncs"] == [], (model, path, r["host_syncs"])
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0
        if path not in ("stock", "no_ssm"):
            # fp32 tiny models, 6 steps (a refresh at L = 4): every path is the stock recurrence
            assert r["max_abs_dlogit_vs_stock"] < 1e-4, (model, path)
            assert r["speedup_vs_stock"] > 0 and 0 <= r["ssm_share"] <= 1
    assert rep["models"]["nemotron-h"]["layers"].count("full_attention") == 1
    table = capsys.readouterr().out
    assert "tp8_hi32" in table and "SSM share" in table


def test_e2e_decode_sync_detector_has_teeth():
    """The host-synchronization check sees a ``.item()`` in a step."""
    e2e = _script()
    det = e2e.sync_detector()
    x = torch.ones(3)
    with det:
        (x * 2).sum().item()
    assert len(det.hits) == 1 and "_local_scalar_dense" in det.hits[0]


def test_e2e_decode_needs_a_gpu_without_tiny(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert _script().main(["--out", "unused.json"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
