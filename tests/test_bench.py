"""`replayssm bench` on the CPU: argument handling, the no-GPU path, the traffic and memory
arithmetic, and the correctness gate (which must refuse a broken kernel)."""
import os
import subprocess
import sys

import pytest
import torch

from replayssm.bench import Problem
from replayssm.bench import cli as bench
from replayssm.cli import UsageError
from replayssm.cli import main as main_cli
from replayssm.geometry import GEOMETRIES as NAMED
from replayssm.geometry import Geometry

GEOMETRIES = {name: (g.arch, g.geometry) for name, g in NAMED.items() if g.arch}


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_without_gpu_it_says_so_and_exits_nonzero(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from replayssm.cli import main

    assert main(["bench"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and len(err.strip().splitlines()) == 1


def test_kernel_profile_without_gpu_says_so_and_exits_nonzero():
    """benchmarks/profile_kernels.py (device time per kernel of a step) needs a GPU."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "profile_kernels.py"), "gdn:s32_rs:1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr, done.stderr


def test_geometry_names_and_tuples():
    """``bench --geometry`` reads H,P,N,G as ``run --geometry`` does (one table, one order)."""
    import argparse

    def plan(geometry, arch):
        return bench.plan(argparse.Namespace(geometry=geometry, arch=arch))

    assert plan("qwen35-122b", "all") == [GEOMETRIES["qwen35-122b"]] == [("gdn", Geometry(64, 128, 128, 16))]
    assert plan("8,64,128,1", "mamba2") == [("mamba2", (8, 64, 128, 1))]
    assert plan(None, "all") == [GEOMETRIES["nemotron3-super"], GEOMETRIES["qwen35-122b"]]
    for bad, arch in (("8,64,128", "mamba2"), ("8,64,128,1", "all"), ("nemotron3-super", "gdn"), ("x", "gdn")):
        with pytest.raises(UsageError, match="geometry"):
            plan(bad, arch)


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


@pytest.mark.parametrize("arch", ["mamba2", "gdn", "kda"])
def test_correctness_gate_passes_the_real_kernel_and_refuses_a_broken_one(arch):
    from replayssm.bench import measure, suite

    dims = (4, 16, 32, 2)
    p = Problem(arch, dims, 4, 1)  # batch 4: at the first step the only active row is a pad
    _, rel, _ = measure.correctness(p, "s32_rs", "cpu", "torch", steps=18, rounds=2, T=2)
    assert rel <= measure.gate_tolerance("s32_rs")

    def broken(*args, **kw):  # a kernel that is 1% off
        y = suite.replay_call(*args, **kw)
        return torch.where(y != 0, y * 1.01, y)

    _, rel_broken, _ = measure.correctness(p, "s32_rs", "cpu", "torch", steps=18, rounds=2, T=2, call=broken)
    assert rel_broken > measure.gate_tolerance("s32_rs")


def test_correctness_gate_at_batch_one_checks_its_one_row():
    from replayssm.bench import measure

    p = Problem("gdn", (4, 16, 32, 2), 1, 1)
    err, rel, state_err = measure.correctness(p, "s32_rs", "cpu", "torch", steps=6, rounds=2, T=2)
    assert 0 < err and rel <= measure.gate_tolerance("s32_rs") and state_err < 1e-5


def _bench_report(batch, draft, accept, us=8.0, ext=None, legacy=False):
    """A bench.json with one conventional row and one s32_rs row (and an external baseline)."""
    dims = [16, 64, 128, 128] if legacy else [64, 128, 128, 16]  # qwen35-122b, older GDN order first
    base = dict(arch="gdn", dims=dims, window=16, draft=draft, batch=batch, mode="-", kernel="ours", us=10.0,
                spread=0.1, bytes=8e6)
    rows = [base, dict(base, kernel="s32_rs", mode="staggered", us=us, bytes=4e6, speedup_vs_ours=10.0 / us)]
    if ext:
        rows.append(dict(base, kernel="fla", us=ext))
    rep = {"environment": {"gpu": "test GPU", "commit": "abc1234"}, "args": {"accept": accept, "batch": [batch]},
           "copy_bandwidth": 4e12, "rows": rows, "memory": {}, "skipped": {},
           "gate": [dict(arch="gdn", dims=dims, window=16, preset="s32_rs", max_abs=1e-7, rel=1e-7, state=1e-7,
                         tolerance=1e-4, passed=True)]}
    if not legacy:
        rep["dims_order"] = "H,P,N,G"
    return rep


def test_report_merges_and_regenerates_without_a_gpu(tmp_path, capsys):
    """``bench --report`` merges bench.json files (a later measurement of a row replaces the earlier
    one; older files' GDN dims are read in their order), then writes the merged JSON, BENCHMARKS.md
    and the README's headline table from them alone. Ratios are taken between rows of the merged
    table: a conventional time measured again changes every ratio against it."""
    import json

    paths = []
    runs = ((8, 0, "all", 8.0, 4.0, True), (256, 0, "all", 8.0, 12.0, True), (256, 4, "half", 8.0, None, False),
            (256, 0, "all", 5.0, 12.0, False))  # the last measures batch 256 decode again
    for i, (batch, draft, accept, us, ext, legacy) in enumerate(runs):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(_bench_report(batch, draft, accept, us, ext, legacy)))
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- headline table: generated by python -m replayssm.bench.report; do not edit -->\n"
                      "old\n<!-- end of headline table -->\ntail\n")
    from replayssm.cli import main

    out = tmp_path / "merged"
    assert main(["bench", "--report", *map(str, paths), "--output", str(out), "--markdown",
                 str(tmp_path / "B.md"), "--readme", str(readme)]) == 0
    merged = json.loads((out / "bench.json").read_text())
    assert len(merged["rows"]) == 8 and merged["dims_order"] == "H,P,N,G"
    assert {tuple(r["dims"]) for r in merged["rows"]} == {(64, 128, 128, 16)}
    assert [r["accept"] for r in merged["rows"] if r["draft"]] == ["half", "half"]
    again = [r for r in merged["rows"] if r["batch"] == 256 and r["draft"] == 0 and r["kernel"] == "s32_rs"]
    assert [r["us"] for r in again] == [5.0] and again[0]["commit"] == "abc1234"
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("tail\n") and "old" not in text
    row = next(line for line in text.splitlines() if "`s32_rs`" in line)
    cells = [c.strip() for c in row.split("|")]
    assert cells[3:6] == ["5.0", "2.00", "2.40"]  # us, x conventional (10 / 5), x fla (12 / 5)
    md = (tmp_path / "B.md").read_text()
    assert "## Headline: batch 256" in md and "abc1234" in md and len(md.splitlines()) <= 300
    # the report's input may be its own output: re-running on the merged file changes nothing
    assert main(["bench", "--report", str(out / "bench.json"), "--output", str(out), "--markdown", "-",
                 "--readme", "-"]) == 0
    assert json.loads((out / "bench.json").read_text())["rows"] == merged["rows"]
    capsys.readouterr()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "speedup_vs_batch.png").exists() and (out / "bandwidth.png").exists()


def test_sweep_writes_what_the_report_reads(tmp_path, monkeypatch, capsys):
    """The GPU sweep's bookkeeping, with the GPU measurements replaced by fixed figures: rows in
    H,P,N,G order with their commit, ratios against the baselines of the same run, a preset
    that fails the correctness gate gets no row and the exit code is 1, and the report reads
    the file back into the headline table."""
    import json

    from replayssm.bench import measure, report, suite

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "_environment", lambda: {"gpu": "stub GPU", "commit": "abc1234"})
    monkeypatch.setattr(suite, "copy_bandwidth", lambda: 4e12)
    monkeypatch.setattr(suite, "baseline_available", lambda name, arch=None: "not installed here")
    monkeypatch.setattr(measure, "correctness",
                        lambda p, preset, *a, **kw: (1e-3, 1e-8 if preset == "s32_rs" else 1.0, 1e-7))

    def bench_one(p, preset, mode="staggered", baseline="ours", **kw):
        us = 10.0 * p.batch * p.T if preset is None else 4.0 * p.batch * p.T
        return (us, 0.1), (None if preset is None else {"replay": 1e6, "conventional": 2e6})

    monkeypatch.setattr(measure, "bench_one", bench_one)
    code = main_cli(["bench", "--arch", "gdn", "--batch", "8,256", "--draft", "0,4", "--presets", "s32_rs,tp8_hi32",
                     "--output", str(tmp_path)])
    assert code == 1  # tp8_hi32 failed its gate
    assert "GATE FAILED gdn tp8_hi32" in capsys.readouterr().out
    rep = json.loads((tmp_path / "bench.json").read_text())
    assert rep["dims_order"] == "H,P,N,G" and rep["skipped"] == {"mamba_ssm": "not installed here",
                                                                   "fla": "not installed here"}
    kernels = {(r["kernel"], r["batch"], r["draft"]) for r in rep["rows"]}
    assert kernels == {(k, b, d) for k in ("ours", "s32_rs") for b in (8, 256) for d in (0, 4)}
    for r in rep["rows"]:
        assert r["dims"] == [64, 128, 128, 16] and r["geometry"] == "qwen35-122b" and r["commit"] == "abc1234"
        if r["kernel"] == "s32_rs":
            assert r["speedup_vs_ours"] == pytest.approx(2.5)
    t = report.Table(report.merge([report.load(str(tmp_path / "bench.json"))]))
    row = next(r for r in report.headline_rows(t) if "`s32_rs`" in r[1])
    assert row[3] == "2.50" and row[4] == "–" and row[6] == "2.50"  # x ours decode, x fla (absent), x ours T=4


def test_report_names_the_commit_given_by_replayssm_commit(monkeypatch):
    """A device machine's copy of the tree may carry a stale .git: REPLAYSSM_COMMIT wins over git."""
    monkeypatch.setenv("REPLAYSSM_COMMIT", "0123abc")
    assert bench._environment()["commit"] == "0123abc"
    monkeypatch.delenv("REPLAYSSM_COMMIT")
    assert bench._environment()["commit"] != "0123abc"


def test_same_run_tables_from_the_comparison_json(tmp_path):
    """``report --peers``: the same-run comparison's rows become tables (× = the vLLM kernel's time /
    this one's), our aligned windows stay out of the tables, and the README's block is replaced."""
    import json

    from replayssm.bench import peers, report

    rows = [dict(kernel="vllm_packed_decode", model="qwen3.5-122b(HV64)", B=256, mode="decode", us_per_step=500.0),
            dict(kernel="replayssm_gdn_decode", model="qwen3.5-122b(HV64)", B=256, mode="decode L=16 desync",
                 us_per_step=250.0),
            dict(kernel="rs_lib_gdn_decode[s32_rs]", model="qwen3.5-122b(HV64)", B=256, mode="decode L=16 stagger",
                 us_per_step=200.0),
            dict(kernel="rs_lib_gdn_decode[s32_rs]", model="qwen3.5-122b(HV64)", B=256, mode="decode L=16 aligned",
                 us_per_step=190.0)]
    path = tmp_path / "peers.json"
    path.write_text(json.dumps({"env": {"gpu": "stub"}, "results": rows, "replayssm_commit": "abc1234"}))
    rep = peers.load(str(path))
    assert peers.ratios(rep, "gdn", "qwen3.5-122b(HV64)", 256) == {"s32_rs": 0.8}
    text = peers.tables(rep)
    assert "| ReplaySSM `s32_rs` | staggered | 200.0 · 2.50× |" in text and "190.0" not in text
    # with the run's copy ceiling, the bytes each step moves by the traffic model, beside the time
    sizes = [dict(conv_state_bytes_per_step=2 ** 31), dict(rs_state_bytes=1.2e9),
             dict(bytes_per_slot={"anchor": 4194304, "read_copy": 0, "buffer": 861184}, L=16), {}]
    path.write_text(json.dumps({"env": {"gpu": "stub"}, "results": [dict(r, **x) for r, x in zip(rows, sizes)],
                                "hbm": {"d2d_copy_4GiB": {"GBps": 4000.0}}}))
    text = peers.tables(peers.load(str(path)))
    # s32_rs, staggered: 15/16 of the slots read the 4 MiB anchor, 1/16 read and write it, every
    # slot reads 8.5 of its buffer's 16 entries on average: 256 x 4913952 B, at 200 us 157% of 4 TB/s
    assert "| ReplaySSM `s32_rs` | staggered | 200.0 · 2.50× | 1258 · 157% |" in text
    assert "| vLLM packed GDN decode | – | 500.0 · 1.00× | 2147 · 107% |" in text
    assert "| paper's ReplaySSM kernel | staggered | 250.0 · 2.00× | 1200 · 120% |" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"x\n{report.README_START}\nold\n{report.README_END}\n{report.SAME_RUN_START}\nold\n"
                      f"{report.SAME_RUN_END}\ny\n")
    bench_json = tmp_path / "bench.json"
    bench_json.write_text(json.dumps(_bench_report(256, 0, "all")))
    report.generate([str(bench_json)], str(tmp_path / "out"), str(tmp_path / "B.md"), str(readme), draw=False,
                    peers_json=str(path))
    out = readme.read_text()
    assert "paper's ReplaySSM kernel" in out and "old" not in out and out.endswith("y\n")
    assert "abc1234" in (tmp_path / "B.md").read_text() and "One process, one GPU" in (tmp_path / "B.md").read_text()
    # a comparison made by several processes on one machine (each batch size's rows from one) says so
    path.write_text(json.dumps({"env": {"gpu": "stub"}, "results": rows, "replayssm_commit": "abc1234", "jobs": 2}))
    assert "Two processes back to back" in report.same_run_section(str(path))[0]
    # a further comparison (another GPU, a later commit) follows the first's tables, titled by both
    other = tmp_path / "peers_other.json"
    other.write_text(json.dumps({"env": {"gpu": "other-gpu"}, "results": rows, "replayssm_commit": "def5678"}))
    report.generate([str(bench_json)], str(tmp_path / "out"), str(tmp_path / "B.md"), "-", draw=False,
                    peers_json=[str(path), str(other)])
    text = (tmp_path / "B.md").read_text()
    assert text.index("abc1234") < text.index("## The same comparison on an other-gpu, library at `def5678`")
    assert "peers_other.json" in text


def test_tree_acceptance_section_from_its_json(tmp_path):
    """``report --trees``: one table row per (model, budget, chain / tree pair), chain figure first,
    greedy-identical from both rows; the command and commit that made the JSON; the option reaches
    BENCHMARKS.md through ``python -m replayssm.bench.report`` and next to ``replayssm bench``'s
    own ``--trees``."""
    import json

    from replayssm.bench import report

    def row(drafter, budget, tps, apv, same=True):
        return dict(model="tiny-m", budget=budget, drafter=drafter, tokens_per_step=tps, accepted_per_verify=apv,
                    greedy_identical=same)

    rep = {"command": "PYTHONPATH=src python benchmarks/tree_acceptance.py", "commit": "abc1234",
           "settings": {"models": ["tiny-m"], "budgets": [4, 8], "new_tokens": 64, "prompts": 2, "prompt_len": 128,
                        "text": "models/kjv_heldout.txt"},
           "pairs": [{"pair": "n-gram", "chain": "C()", "tree": "T()"}],
           "rows": [row("C()", 4, 1.5, 0.5), row("T()", 4, 1.75, 0.8), row("C()", 8, 2.0, 1.0),
                    row("T()", 8, 1.9, 0.9, same=False)]}
    path = tmp_path / "trees.json"
    path.write_text(json.dumps(rep))
    text = report.tree_acceptance_section(str(path))
    assert "| `tiny-m` | `C()` / `T()` | 4 | 1.500 / 1.750 | 0.500 / 0.800 | yes |" in text
    assert "| `tiny-m` | `C()` / `T()` | 8 | 2.000 / 1.900 | 1.000 / 0.900 | **no** |" in text
    assert "`abc1234`" in text and rep["command"] in text and "64 new tokens" in text
    bench_json = tmp_path / "bench.json"
    bench_json.write_text(json.dumps(_bench_report(256, 0, "all")))
    assert report.main([str(bench_json), "--output", str(tmp_path / "out"), "--markdown", str(tmp_path / "B.md"),
                        "--readme", "-", "--no-plots", "--trees", str(path)]) == 0
    md = (tmp_path / "B.md").read_text()
    assert "## Draft trees against chains on the tiny models" in md and f"--trees {path}" in md
    assert main_cli(["bench", "--report", str(bench_json), "--output", str(tmp_path / "out"), "--markdown", "-",
                     "--readme", "-"]) == 0



def test_tree_acceptance_section_groups_trees_of_one_chain(tmp_path):
    """Pairs that share a chain make one row: the chain's figure, then each tree's in the pairs'
    order; greedy-identical only if all of them are; a tree without rows is left out."""
    import json

    from replayssm.bench import report

    def row(drafter, tps, apv, same=True):
        return dict(model="tiny-m", budget=8, drafter=drafter, tokens_per_step=tps, accepted_per_verify=apv,
                    greedy_identical=same)

    rep = {"command": "c", "commit": "abc1234",
           "settings": {"models": ["tiny-m"], "budgets": [8], "new_tokens": 64, "prompts": 2, "prompt_len": 128,
                        "text": "t.txt"},
           "pairs": [{"pair": "a", "chain": "C()", "tree": "T(2)"}, {"pair": "b", "chain": "C()", "tree": "T(3)"},
                     {"pair": "c", "chain": "C()", "tree": "Missing()"},
                     {"pair": "d", "chain": "D()", "tree": "U()"}],
           "rows": [row("C()", 5.0, 4.0), row("T(2)", 4.0, 3.0), row("T(3)", 5.5, 4.5),
                    row("D()", 1.5, 0.5), row("U()", 1.75, 0.75, same=False)]}
    path = tmp_path / "trees.json"
    path.write_text(json.dumps(rep))
    text = report.tree_acceptance_section(str(path))
    assert "| `tiny-m` | `C()` / `T(2)`, `T(3)` | 8 | 5.000 / 4.000, 5.500 | 4.000 / 3.000, 4.500 | yes |" in text
    assert "| `tiny-m` | `D()` / `U()` | 8 | 1.500 / 1.750 | 0.500 / 0.750 | **no** |" in text
    assert text.count("| `tiny-m` |") == 2


def test_kda_geometries_are_benchmarked():
    """``bench --arch kda`` times Kimi Delta Attention at the Kimi-Linear-48B-A3B geometry; a KDA
    model geometry names its layer kind; ``all`` stays Mamba-2 and GDN."""
    import argparse

    def plan(geometry, arch):
        return bench.plan(argparse.Namespace(geometry=geometry, arch=arch))

    kimi = ("kda", Geometry(32, 128, 128, 32))
    assert plan(None, "kda") == [kimi] == [GEOMETRIES["kimi-linear-48b"]]
    assert plan("kimi-linear-48b", "all") == [kimi] == plan("kimi-linear-48b", "kda")
    assert plan("4,16,32,2", "kda") == [("kda", (4, 16, 32, 2))]
    assert [a for a, _ in plan(None, "all")] == ["mamba2", "gdn"]
    with pytest.raises(UsageError, match="geometry"):
        plan("kimi-linear-48b", "gdn")


def test_kda_sweep_and_its_baselines(tmp_path, monkeypatch, capsys):
    """The sweep's bookkeeping for ``--arch kda`` (GPU measurements replaced by fixed figures):
    rows at the Kimi-Linear geometry against our conventional kernel, and fla's availability asked
    for its KDA kernel."""
    import json

    from replayssm.bench import measure, suite

    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "_environment", lambda: {"gpu": "stub GPU", "commit": "abc1234"})
    monkeypatch.setattr(suite, "copy_bandwidth", lambda: 4e12)
    monkeypatch.setattr(suite, "baseline_available", lambda name, arch=None: asked.append((name, arch)) or "absent")
    monkeypatch.setattr(measure, "correctness", lambda p, preset, *a, **kw: (1e-7, 1e-8, 1e-7))
    monkeypatch.setattr(measure, "bench_one", lambda p, preset, *a, **kw: ((10.0 if preset is None else 5.0, 0.1),
                                                                             {"replay": 1e6, "conventional": 2e6}))
    assert main_cli(["bench", "--arch", "kda", "--batch", "8", "--draft", "0", "--presets", "s32_rs",
                     "--output", str(tmp_path)]) == 0
    capsys.readouterr()
    rep = json.loads((tmp_path / "bench.json").read_text())
    assert ("fla", "kda") in asked and rep["skipped"]["fla"] == "absent"
    assert {(r["kernel"], r["geometry"], tuple(r["dims"])) for r in rep["rows"]} == {
        (k, "kimi-linear-48b", (32, 128, 128, 32)) for k in ("ours", "s32_rs")}
    assert [r["speedup_vs_ours"] for r in rep["rows"] if r["kernel"] == "s32_rs"] == [2.0]


def test_kda_conventional_kernel_and_triton_gate_against_float64():
    """Under the interpreter: the conventional GDN and KDA baseline kernel (one kernel; the state
    updated in place for a decode, one state per draft for a verify) matches the float64
    recurrence, and the correctness gate passes KDA's Triton backend."""
    from replayssm.bench import measure, suite

    gen = torch.Generator().manual_seed(0)
    for arch, T in (("kda", 1), ("kda", 3), ("gdn", 1), ("gdn", 3)):
        p = Problem(arch, (4, 16, 16, 2), 3, T)
        inp = suite.make_inputs(p, "cpu", gen, dtype=torch.float32)
        assert inp["g"].shape == ((3, T, 4, 16) if arch == "kda" else (3, T, 4))
        state = torch.randn(5, *suite.state_shape(p), generator=gen) * 0.1
        slots = torch.tensor([4, 0, 2])
        ref = state[slots].double()
        inter = torch.empty(5, T, *suite.state_shape(p)) if T > 1 else None
        y = suite.conventional_call(p, state, slots, inp, {}, inter)
        states = []
        for t in range(T):
            yr, ref = measure.reference_step(p, ref, inp, {}, t)
            assert (y[:, t].double() - yr).abs().max() <= 1e-5
            states.append(ref)
        got = state[slots] if T == 1 else inter[slots, T - 1]
        assert (got.double() - states[-1]).abs().max() <= 1e-5
    p = Problem("kda", (2, 16, 16, 1), 2, 1)
    _, rel, state_err = measure.correctness(p, "s32_rs", "cpu", "triton", steps=6, rounds=2, T=2, window=4)
    assert rel <= measure.gate_tolerance("s32_rs") and state_err <= 1e-5


@pytest.mark.parametrize("arch", ["mamba2", "gdn", "kda"])
def test_conventional_kernels_prepare_their_inputs_in_the_kernel(arch):
    """Under the interpreter: the conventional baselines take the inputs ReplaySSM takes, raw (dt
    before softplus and z for Mamba-2; q, k before their L2 norms, bf16 beta), and prepare them in
    their one kernel, as a serving engine's kernel does: no PyTorch arithmetic around the launch
    (at batch 1 such elementwise kernels cost more than the step), outputs and states equal to the
    float64 recurrence's."""
    from replayssm.bench import measure, suite

    gen = torch.Generator().manual_seed(5)
    p = Problem(arch, (4, 16, 32, 2) if arch == "mamba2" else (4, 16, 16, 2), 3, 1)
    inp = suite.make_inputs(p, "cpu", gen)  # bf16 activations, as the benchmarks time them
    prm = suite.make_params(p, "cpu", gen)
    state = torch.randn(5, *suite.state_shape(p), generator=gen) * 0.1
    slots = torch.tensor([4, 0, 2])
    ref = state[slots].double()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y = suite.conventional_call(p, state, slots, inp, prm)
    arithmetic = ("softplus", "silu", "sigmoid", "mul", "add", "sum", "rsqrt", "div", "pow", "_to_copy")
    assert not [e.name for e in prof.events() if any(op in e.name for op in arithmetic)]
    yr, ref = measure.reference_step(p, ref, inp, prm, 0)
    assert (y[:, 0].double() - yr).abs().max() <= 1e-5 * max(1.0, yr.abs().max().item())
    assert (state[slots].double() - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
def test_conventional_tree_kernel_against_float64(arch):
    """Under the interpreter: the conventional tree verify (the tree baseline) writes each node's
    state from its parent's, every one and every output matching the float64 recurrence along the
    node's path; the same drafts as a chain give other states (a kernel ignoring parents fails)."""
    from replayssm.bench import measure, suite

    gen = torch.Generator().manual_seed(3)
    parents, _ = measure.tree_of(6)
    p = Problem(arch, (4, 16, 32, 2) if arch == "mamba2" else (4, 16, 16, 2), 3, 6)
    inp = suite.make_inputs(p, "cpu", gen, dtype=torch.float32)
    prm = suite.make_params(p, "cpu", gen)
    state = torch.randn(5, *suite.state_shape(p), generator=gen) * 0.1
    slots = torch.tensor([4, 0, 2])
    inter = torch.empty(5, 6, *suite.state_shape(p))
    y = suite.conventional_call(p, state, slots, inp, prm, inter,
                                torch.tensor(parents, dtype=torch.int32).expand(3, 6).contiguous())
    root, states, chain = state[slots].double(), [], state[slots].double()
    for t in range(6):
        yr, st = measure.reference_step(p, root if parents[t] < 0 else states[parents[t]], inp, prm, t)
        states.append(st)
        chain = measure.reference_step(p, chain, inp, prm, t)[1]
        assert (y[:, t].double() - yr).abs().max() <= 1e-5
        assert (inter[slots, t].double() - st).abs().max() <= 1e-5
        if t >= 2:  # node t's parent is not t - 1 from here on
            assert (inter[slots, t].double() - chain).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
def test_tree_gate_passes_the_real_kernel_and_refuses_a_broken_one(arch):
    from replayssm.bench import measure, suite

    assert measure.tree_of(8) == ([-1, -1, 0, 0, 1, 1, 2, 2], [0, 2, 6])
    assert measure.tree_of(14)[1] == [0, 2, 6] and measure.tree_of(16)[1] == [0, 2, 6, 14]
    p = Problem(arch, (4, 16, 32, 2), 4, 6)
    parents = measure.tree_of(6)[0]
    _, rel, state_err = measure.tree_correctness(p, "s32_rs", parents, "cpu", "torch", rounds=3, window=8)
    assert rel <= measure.gate_tolerance("s32_rs") and state_err <= 1e-5

    def broken(*args, **kw):  # 1% off on the nodes whose parent is not the draft before them
        y = suite.replay_call(*args, **kw)
        if y.dim() == 4 and kw.get("parents") is not None:
            y[:, 2:] *= 1.01
        return y

    _, rel_broken, _ = measure.tree_correctness(p, "s32_rs", parents, "cpu", "torch", rounds=3, window=8,
                                                call=broken)
    assert rel_broken > measure.gate_tolerance("s32_rs")


def test_tree_sweep_rows(tmp_path, monkeypatch, capsys):
    """``--trees``: per node count and batch, the conventional tree verify, and each preset's tree
    and chain verify of as many drafts, all accepting the tree's depth, with ratios against the
    conventional tree; a preset failing its tree gate gets no tree rows."""
    import json

    from replayssm.bench import measure, suite

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "_environment", lambda: {"gpu": "stub GPU", "commit": "abc1234"})
    monkeypatch.setattr(suite, "copy_bandwidth", lambda: 4e12)
    monkeypatch.setattr(suite, "baseline_available", lambda name, arch=None: "absent")
    monkeypatch.setattr(measure, "correctness", lambda p, preset, *a, **kw: (1e-7, 1e-8, 1e-7))
    monkeypatch.setattr(measure, "tree_correctness",
                        lambda p, preset, *a, **kw: (1e-7, 1e-8 if preset == "s32_rs" else 1.0, 1e-7))
    seen = []

    def bench_one(p, preset, mode="staggered", baseline="ours", tree=None, accept="all", **kw):
        seen.append((preset, p.T, tree is not None, accept))
        us = 30.0 if preset is None else (6.0 if tree else 5.0)
        return (us, 0.1), (None if preset is None else {"replay": 1e6, "conventional": 2e6})

    monkeypatch.setattr(measure, "bench_one", bench_one)
    assert main_cli(["bench", "--arch", "gdn", "--batch", "256", "--draft", "0", "--trees", "8,32",
                     "--presets", "s32_rs,tp8_hi32", "--output", str(tmp_path)]) == 1  # tp8_hi32: tree gate
    capsys.readouterr()
    rep = json.loads((tmp_path / "bench.json").read_text())
    trees = [r for r in rep["rows"] if r["draft"] == 8]
    assert {(r["kernel"], r["mode"], r["accept"]) for r in trees} == {("ours", "tree", 3), ("s32_rs", "tree", 3),
                                                                     ("s32_rs", "chain", 3)}
    assert {r["speedup_vs_ours"] for r in trees if r["kernel"] == "s32_rs"} == {5.0, 6.0}
    assert not [r for r in rep["rows"] if r["draft"] == 32]  # more nodes than the window holds
    assert (None, 8, True, "all") in seen and ("s32_rs", 8, False, 3) in seen
    from replayssm.bench import report

    text = "\n".join(report.tree_lines(report.Table(report.merge([report.load(str(tmp_path / "bench.json"))]))))
    assert "## Tree verify + accept" in text and "Gated DeltaNet 8 drafts `s32_rs` 1.0e-08" in text
    assert "| Gated DeltaNet | 8 (path of 3) | 256 | 30.0 | 6.0 (5.00) | 5.0 (6.00) |" in text


def test_same_run_section_lists_every_measurement_since(tmp_path):
    """``report.same_run_section`` with figures measured again since the same-run comparison: one
    measurement or a list of them, each a section of its own with its commit, GPU and columns;
    README lines only for the ones that ask for them."""
    import json

    from replayssm.bench import report

    row = dict(arch="gdn", model="m", step="decode", preset="s32_rs", us=6.7, before=7.6)
    first = dict(commit="aaaaaaa", gpu="GPU A", how="first.", rows=[row])
    second = dict(commit="bbbbbbb", gpu="GPU B", how="second.", rows=[dict(row, us=5.0)], batch=1, readme=False,
                  columns=["µs, one launch", "µs, the launches"])
    for measured, sections in ((first, 1), ([first, second], 2)):
        path = tmp_path / "latest.json"
        path.write_text(json.dumps(measured))
        md, readme = report.same_run_section("docs/bench/peers.json", str(path))
        assert md.count("### Measured again at commit") == sections
        assert "`aaaaaaa` (GPU A)" in md and "| 6.7 | 7.6 |" in md
        assert readme.count("measured again at `aaaaaaa`") == 1 and "bbbbbbb" not in readme
    assert "`bbbbbbb` (GPU B)" in md and "µs, one launch" in md and "| 5.0 | 7.6 |" in md
