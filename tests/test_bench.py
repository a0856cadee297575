"""`replayssm bench` on the CPU: argument handling, the no-GPU path, the traffic and memory
arithmetic, and the correctness gate (which must refuse a broken kernel)."""
import os
import subprocess
import sys

import pytest
import torch

from replayssm.bench import GEOMETRIES, Problem
from replayssm.bench import cli as bench


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_without_gpu_it_says_so_and_exits_nonzero(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from replayssm.cli import main

    assert main(["bench"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_kernel_profile_without_gpu_says_so_and_exits_nonzero():
    """benchmarks/profile_kernels.py (device time per kernel of a step) needs a GPU."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "profile_kernels.py"), "gdn:s32_rs:1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr, done.stderr


def test_geometry_names_and_tuples():
    assert bench.parse_geometry("qwen35-122b", "all") == GEOMETRIES["qwen35-122b"]
    assert bench.parse_geometry("8,64,128,1", "mamba2") == ("mamba2", (8, 64, 128, 1))
    for bad, arch in (("8,64,128", "mamba2"), ("8,64,128,1", "all"), ("nemotron3-super", "gdn"), ("x", "gdn")):
        with pytest.raises(ValueError, match="geometry"):
            bench.parse_geometry(bad, arch)


def test_traffic_model_against_the_formats():
    """Bytes per step from the format sizes: a shared fp32 checkpoint reads |S| per step and
    reads + writes it once per window; an fp8 read copy reads 1 + 4/32 bytes per element."""
    from replayssm.bench import suite

    arch, dims = GEOMETRIES["nemotron3-nano"]
    p = Problem(arch, dims, 4, 1)
    n = p.batch * p.state_elems
    L = 16
    for preset, read_bytes, write_read in (("s32_rs", 4.0, 0.0), ("tp8_hi32", 1.125, 1.125)):
        cache = suite.make_cache(p, 1, preset, L, 4, "meta")
        tr = suite.traffic(p, cache, L, 1.0 / L)
        buffer = p.batch * cache.bytes_per_slot()["buffer"] / L * ((L - 1) / 2 + 1)
        state = n * ((L - 1) / L * read_bytes + (4.0 + 4.0 + write_read) / L)
        assert tr["replay"] == pytest.approx(state + buffer)
        assert tr["conventional"] == n * 8
    # the traffic bound on the speed-up of shared fp32 decode: 2 / (1 + 1/L) = 1.88 for L = 16
    cache = suite.make_cache(p, 1, "s32_rs", L, 4, "meta")
    tr = suite.traffic(p, cache, L, 1.0 / L)
    assert 1.7 < tr["conventional"] / tr["replay"] < 2 * L / (L + 1)


def test_memory_report_per_sequence():
    arch, dims = GEOMETRIES["qwen35-122b"]
    rows = {r["preset"]: r for r in bench.memory_report(arch, dims, ["s32_rs", "tp8_hi32", "f4_sr_rs"], 16, 4)}
    elems = Problem(arch, dims, 1, 1).state_elems
    assert rows["s32_rs"]["anchor"] == elems * 4 and rows["s32_rs"]["read_copy"] == 0
    assert rows["tp8_hi32"]["read_copy"] == elems * 1.125
    assert rows["f4_sr_rs"]["anchor"] < elems * 0.6  # half a byte per element plus scales
    assert rows["s32_rs"]["conventional_speculative"] == elems * 4 * 5


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
def test_correctness_gate_passes_the_real_kernel_and_refuses_a_broken_one(arch):
    from replayssm.bench import measure, suite

    dims = (4, 16, 32, 2) if arch == "mamba2" else (2, 4, 32, 16)
    p = Problem(arch, dims, 4, 1)  # batch 4: at the first step the only active row is a pad
    _, rel, _ = measure.correctness(p, "s32_rs", "cpu", "torch", steps=18, rounds=2, T=2)
    assert rel <= measure.gate_tolerance("s32_rs")

    def broken(*args, **kw):  # a kernel that is 1% off
        y = suite.replay_call(*args, **kw)
        return torch.where(y != 0, y * 1.01, y)

    _, rel_broken, _ = measure.correctness(p, "s32_rs", "cpu", "torch", steps=18, rounds=2, T=2, call=broken)
    assert rel_broken > measure.gate_tolerance("s32_rs")


def test_replot_merges_reports_without_a_gpu(tmp_path, capsys):
    """--replot merges bench.json files (rows, gates, memory), fills in the accept rate of
    speculative rows, lets a later measurement of the same row replace the earlier one, and
    writes the merged bench.json (plots when matplotlib is there)."""
    import json

    def report(batch, draft, accept, us=8.0):
        base = dict(arch="mamba2", dims=[8, 16, 32, 1], window=16, draft=draft, batch=batch, mode="-",
                    kernel="ours", us=10.0, spread=0.1, bytes=8e6)
        ours = dict(base, kernel="s32_rs", mode="staggered", us=us, bytes=4e6, speedup_vs_ours=10.0 / us)
        return {"environment": {"gpu": "test"}, "args": {"accept": accept}, "copy_bandwidth": 4e12,
                "rows": [base, ours], "gate": [{"passed": True}], "memory": {}, "skipped": {}}

    paths = []
    runs = ((8, 0, "all", 8.0), (64, 0, "all", 8.0), (64, 4, "half", 8.0), (64, 0, "all", 5.0))  # the last: again
    for i, (batch, draft, accept, us) in enumerate(runs):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(report(batch, draft, accept, us)))
    from replayssm.cli import main

    assert main(["bench", "--replot", *map(str, paths), "--output", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged" / "bench.json").read_text())
    assert len(merged["rows"]) == 6 and len(merged["gate"]) == 4
    assert [r["accept"] for r in merged["rows"] if r["draft"]] == ["half", "half"]
    assert merged["rows"][1]["tb_per_s"] == pytest.approx(4e6 / 8.0 / 1e6)
    again = [r for r in merged["rows"] if r["batch"] == 64 and r["draft"] == 0 and r["kernel"] == "s32_rs"]
    assert [r["us"] for r in again] == [5.0]
    assert "s32_rs" in capsys.readouterr().out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    drawn = sorted(p.name for p in (tmp_path / "merged").glob("*.png"))
    # two batches: a batch curve; one window and one draft length: no curve to draw for those
    assert drawn == ["bandwidth.png", "speedup_vs_batch.png"]


def test_report_names_the_commit_given_by_replayssm_commit(monkeypatch):
    """A device machine's copy of the tree may carry a stale .git: REPLAYSSM_COMMIT wins over git."""
    monkeypatch.setenv("REPLAYSSM_COMMIT", "0123abc")
    assert bench._environment()["commit"] == "0123abc"
    monkeypatch.delenv("REPLAYSSM_COMMIT")
    assert bench._environment()["commit"] != "0123abc"
