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
PTXAS_REPORT = os.path.join(ROOT, "benchmarks", "ptxas_report.py")


def _compile_for_sm90(tmp_path, *args) -> str:
    """stdout of ``python args...`` with a real Triton compile (no interpreter), src on the path and
    a fresh Triton cache: how these CPU tests see the kernels as built for an H100/H200."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "src")
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


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


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
def test_correctness_gate_passes_the_real_kernel_and_refuses_a_broken_one(arch):
    from replayssm.bench import measure, suite

    dims = (4, 16, 32, 2) if arch == "mamba2" else (4, 16, 32, 2)
    p = Problem(arch, dims, 4, 1)  # batch 4: at the first step the only active row is a pad
    _, rel, _ = measure.correctness(p, "s32_rs", "cpu", "torch", steps=18, rounds=2, T=2)
    assert rel <= measure.gate_tolerance("s32_rs")

    def broken(*args, **kw):  # a kernel that is 1% off
        y = suite.replay_call(*args, **kw)
        return torch.where(y != 0, y * 1.01, y)

    _, rel_broken, _ = measure.correctness(p, "s32_rs", "cpu", "torch", steps=18, rounds=2, T=2, call=broken)
    assert rel_broken > measure.gate_tolerance("s32_rs")


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
    monkeypatch.setattr(suite, "baseline_available", lambda name: "not installed here")
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


def test_launch_shape_keeps_nvfp4_programs_on_whole_scale_blocks():
    pytest.importorskip("triton")
    import replayssm as rs
    from replayssm._triton import launch

    for preset in ("s32_rs", "tp8_hi32", "tp4_hi16_sr", "f4_sr_rs"):
        cache = rs.Mamba2Cache(1, 2, 64, 128, ngroups=1, precision=preset, device="meta")
        rows, warps, *_ = launch.launch_shape(cache, "mamba2")
        assert 64 % rows == 0 and rows >= 16 and warps >= 1
        if "4" in preset:  # an NVFP4 format: a program owns exactly one global-scale block
            assert rows == cache.row_block
    try:
        launch.TUNING.update(block_rows=64, num_warps=8)
        cache = rs.Mamba2Cache(1, 2, 64, 128, ngroups=1, precision="tp4_hi16_sr", device="meta")
        assert launch.launch_shape(cache, "mamba2")[0] == cache.row_block  # the override cannot split blocks
    finally:
        launch.TUNING.clear()


def test_ptxas_report_compiles_the_step_kernels_for_sm90(tmp_path):
    """benchmarks/ptxas_report.py records a step's launches on the CPU and compiles them for an
    H100/H200; the default fp32 shapes must assemble without register spills."""
    pytest.importorskip("triton")
    stdout = _compile_for_sm90(tmp_path, PTXAS_REPORT, "--presets", "s32_rs")
    rows = [line.split() for line in stdout.splitlines() if "_step_kernel" in line]
    assert {r[0] for r in rows} == {"mamba2", "gdn"}
    for arch, preset, shape, kernel, regs, spills, stack, smem, sass, shfl in rows:
        assert 0 < int(regs) <= 255 and spills == "0/0", (arch, regs, spills)
        assert int(sass) > int(shfl) > 0, (arch, sass, shfl)  # the step kernels reduce across lanes


PDL_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import ptxas_report as pr
from replayssm._triton import launch

launch.TUNING["split_refresh"] = True
for arch in ("mamba2", "gdn"):
    for kernel, args, kw in pr.record_step(arch, "s32_rs")[:-1]:  # not advance: positional constexprs
        for pdl in ((False, True) if kernel.fn.__name__.endswith("scores_kernel") else (True,)):
            code = pr.compile_sm90(kernel, args, dict(kw, PDL=pdl)).asm["ptx"]
            wait, load = code.find("griddepcontrol.wait"), code.find("ld.global")
            print(arch, kernel.fn.__name__, pdl, wait >= 0 and 0 <= load and wait < load, code.count("griddepcontrol"))
"""


def test_programmatic_launch_waits_before_any_memory_access(tmp_path):
    """With programmatic dependent launch (launch.programmatic; GPU only, so compiled here for
    sm_90 rather than run) a kernel may start before the previous launch of the step has
    finished: every kernel must wait for it before its first global load. Without it, no wait."""
    pytest.importorskip("triton")
    from replayssm._triton import launch

    assert not launch.programmatic(torch.arange(2))  # never on the CPU
    stdout = _compile_for_sm90(tmp_path, "-c", PDL_SCRIPT, os.path.join(ROOT, "benchmarks"))
    rows = [line.split() for line in stdout.splitlines()]
    assert len(rows) == 8, rows  # scores (twice), refresh and step kernels of both architectures
    for arch, name, pdl, waits_first, count in rows:
        if pdl == "True":
            assert waits_first == "True" and count == "2", (arch, name)  # the wait and the go-ahead
        else:
            assert count == "0", (arch, name)


@pytest.mark.parametrize("arch, pinned", [("mamba2", True), ("gdn", True), ("gdn", False)])
def test_read_precision_leaves_the_anchors_operations_unchanged(tmp_path, arch, pinned):
    """The two-precision invariant (docs/design.md) at compile level, for the GPU kernels this machine cannot run: compiled for
    sm_90 as Triton's launcher specializes them on the GPU (alignment facts included: without
    them the compile is not the device's, and this check passed while the GPU's GDN anchors
    differed), the operations behind the anchor's stores (ptxas_report.anchor_slice), with the
    layouts of the reductions and products that combine values, are the same for an fp16 or fp8
    read copy as for the shared fp32 copy, in every kernel that refreshes by default (each at the
    shared copy's refresh tile: that the tiles ``launch.REFRESH_SHAPES`` picks by format fold
    alike is a GPU check, refresh_bits.py --split-only). Unpinned
    (``launch.pin_vector_width``), GDN's token-loop fold follows the read copy's vector width and
    must differ: the failure measured on an H200, where the GDN anchors then differed by read format."""
    pytest.importorskip("triton")
    stdout = _compile_for_sm90(tmp_path, PTXAS_REPORT, "--anchor-ops", "--arch", arch, "--presets",
                               "s32_rs,tp16_hi32,tp8_hi32", "--tuning", f"pin_vector_width={int(pinned)}")
    rows = [line.split() for line in stdout.splitlines() if line.startswith("anchor-ops")]
    # 2 read formats x (Mamba-2: the split refresh and the fused step kernel; GDN: always split)
    assert len(rows) == (4 if arch == "mamba2" else 2), stdout
    verdicts = {row[6] for row in rows}
    assert verdicts == ({"same"} if pinned else {"DIFFER"}), stdout


@pytest.mark.parametrize("arch, draft", [("mamba2", 4), ("gdn", 1)])
def test_step_pin_shortens_the_read_copy_reductions(tmp_path, arch, draft):
    """``launch.SHAPES`` / ``DRAFT_SHAPES`` pin these steps' read-copy load to 16 elements per
    thread (``formats.pin_vector_width``) so that a row reduction takes fewer shuffles: compiled for
    sm_90 as on the GPU, the pinned step kernel has fewer SHFL instructions than with the pin off
    (``TUNING["step_pin"] = 0``). Fails if the kernel ignores STEP_PIN."""
    pytest.importorskip("triton")
    shuffles = []
    for tuning in ([], ["--tuning", "step_pin=0"]):
        stdout = _compile_for_sm90(tmp_path, PTXAS_REPORT, "--arch", arch, "--presets", "s32_rs", "--batch", "256",
                                   "--draft", str(draft), *tuning)
        row = [line.split() for line in stdout.splitlines() if "_step_kernel" in line]
        assert len(row) == 1, stdout
        shuffles.append(int(row[0][-1]))
    assert shuffles[0] < shuffles[1], shuffles


def test_report_names_the_commit_given_by_replayssm_commit(monkeypatch):
    """A device machine's copy of the tree may carry a stale .git: REPLAYSSM_COMMIT wins over git."""
    monkeypatch.setenv("REPLAYSSM_COMMIT", "0123abc")
    assert bench._environment()["commit"] == "0123abc"
    monkeypatch.delenv("REPLAYSSM_COMMIT")
    assert bench._environment()["commit"] != "0123abc"


def test_verify_steps_take_their_draft_shape_only_where_the_refresh_is_split():
    """``launch.DRAFT_SHAPES``: a GDN verify step of T >= least runs at its own rows and warps (its
    refresh is always a launch of its own, so the anchor never sees that shape), shorter steps and
    a forced fused refresh keep ``SHAPES``; the read-copy pin follows the draft length at any batch
    (Mamba-2 s32_rs: unpinned decode, pinned verify steps, fused refresh or not)."""
    pytest.importorskip("triton")
    import replayssm as rs
    from replayssm._triton import launch

    gdn_presets = {"fp32": "s32_rs", "fp16": "tp16_hi32", "bf16": "tpbf16_hi32", "fp8_e4m3": "tp8_hi32"}
    for fmt, preset in gdn_presets.items():
        cache = rs.GDNCache(1, 2, 4, 128, 128, precision=preset, device="meta")
        (least, rows, warps, pin, loads), *_ = launch.DRAFT_SHAPES[("gdn", fmt)]
        step = launch.SHAPES[("gdn", fmt)]
        assert launch.launch_shape(cache, "gdn", least) == (rows, warps, step[2], pin, loads)
        assert launch.launch_shape(cache, "gdn", 1) == step == launch.launch_shape(cache, "gdn", least - 1)
        try:
            launch.TUNING["split_refresh"] = False  # a fused refresh would fold at the step's shape
            assert launch.launch_shape(cache, "gdn", least)[:2] == step[:2]
        finally:
            launch.TUNING.clear()
    cache = rs.Mamba2Cache(1, 2, 64, 128, ngroups=1, precision="s32_rs", device="meta")
    (least, *_, pin, loads), = launch.DRAFT_SHAPES[("mamba2", "fp32")]
    assert launch.launch_shape(cache, "mamba2", 1)[3] == launch.SHAPES[("mamba2", "fp32")][3] != pin
    assert launch.launch_shape(cache, "mamba2", 1)[4] == launch.SHAPES[("mamba2", "fp32")][4] != loads
    fp8 = rs.Mamba2Cache(1, 2, 64, 128, ngroups=1, precision="tp8_hi32", device="meta")
    (least, *_, loads), (later, *_, later_loads) = launch.DRAFT_SHAPES[("mamba2", "fp8_e4m3")]
    assert launch.launch_shape(fp8, "mamba2", later - 1)[4] == loads != later_loads  # the last entry that applies
    assert launch.launch_shape(fp8, "mamba2", later + 4)[4] == later_loads
    try:
        for fused in (False, True):
            launch.TUNING["split_refresh"] = not fused
            assert launch.launch_shape(cache, "mamba2", least)[3] == pin
        launch.TUNING["step_pin"] = 0
        assert launch.launch_shape(cache, "mamba2", least)[3] == 0
    finally:
        launch.TUNING.clear()


def test_shape_labels_read_every_switch():
    """``launch.parse_shape``: the labels the sweeps and refresh_bits.py pass, flag by flag."""
    pytest.importorskip("triton")
    from replayssm._triton import launch

    t = launch.parse_shape("64x4seonuv8/16x2@64")
    assert (t["block_rows"], t["num_warps"], t["refresh_rows"], t["refresh_warps"], t["refresh_columns"],
            t["step_pin"]) == (64, 4, 16, 2, 64, 8)
    assert t["split_refresh"] and t["early_cursor"] and t["output_dot"] and not t["refresh_dot"]
    assert t["fp_fusion"] is False and t["pin_vector_width"] is False
    t = launch.parse_shape("32x1dpl")
    assert t["refresh_dot"] and t["persistent_refresh"] and t["pdl"] and not t["split_refresh"]
    assert "fp_fusion" not in t and "pin_vector_width" not in t and "step_pin" not in t  # the defaults apply
    assert launch.parse_shape("32x1dsev0")["step_pin"] == 0
    t = launch.parse_shape("32x1dsev16f1/16x2")
    assert (t["step_pin"], t["loads"], t["refresh_rows"]) == (16, 1, 16) and t["refresh_dot"]
    assert launch.parse_shape("32x1sef")["loads"] == 2 and "loads" not in launch.parse_shape("32x1se")
    t = launch.parse_shape("32x1sef2/16x2#0")
    assert (t["loads"], t["refresh_rows"], t["refresh_programs"]) == (2, 16, 0) and t["persistent_refresh"]
    assert "refresh_programs" not in launch.parse_shape("32x1dsep")
    t = launch.parse_shape("64x4seok3/16x2")
    assert (t["stream"], t["block_rows"], t["refresh_rows"]) == (3, 64, 16) and t["output_dot"]
    assert launch.parse_shape("32x1sek")["stream"] == 2 and "stream" not in launch.parse_shape("32x1se")


def test_only_gdn_verify_steps_stream_their_read_copy():
    """``launch.STREAM_STAGES``: GDN steps of T >= 4 stream the read copy through tensor-core
    products where those products are on (``output_dot``), the refresh is a launch of its own
    and the read copy is not NVFP4; decode, short drafts and Mamba-2 load the tile whole."""
    pytest.importorskip("triton")
    import replayssm as rs
    from replayssm._triton import launch

    (least, stages), = launch.STREAM_STAGES["gdn"]
    gdn = rs.GDNCache(1, 2, 4, 128, 128, precision="s32_rs", device="meta")
    assert launch.stream_stages(gdn, "gdn", least, True) == stages > 0
    assert launch.stream_stages(gdn, "gdn", least - 1, True) == 0
    assert launch.stream_stages(gdn, "gdn", least, False) == 0  # a fused refresh folds from the tile
    fp4 = rs.GDNCache(1, 2, 4, 128, 128, precision="tp4_hi32", device="meta")
    assert launch.stream_stages(fp4, "gdn", least, True) == 0
    m2 = rs.Mamba2Cache(1, 2, 64, 128, ngroups=1, precision="s32_rs", device="meta")
    assert all(launch.stream_stages(m2, "mamba2", T, True) == 0 for T in (1, 4, 8))
    try:
        launch.TUNING["stream"] = 0
        assert launch.stream_stages(gdn, "gdn", least, True) == 0
    finally:
        launch.TUNING.clear()


def test_refresh_shapes_by_read_format_and_draft_length():
    """``launch.REFRESH_SHAPES``: the split refresh launch takes the entry of its architecture and
    read format (the last one whose least draft length is <= T), else the step's shape; NVFP4
    keeps the step's (its programs own a scale block of rows); TUNING overrides."""
    pytest.importorskip("triton")
    import replayssm as rs
    from replayssm._triton import launch

    for arch, fmt in launch.REFRESH_SHAPES:
        assert launch.REFRESH_SHAPES[(arch, fmt)][0][0] == 1  # decode has an entry too
    gdn = {p: rs.GDNCache(1, 2, 4, 128, 128, precision=p, device="meta")
           for p in ("s32_rs", "tp16_hi32", "tp8_hi32", "tp4_hi32")}
    for preset, fmt in (("s32_rs", "fp32"), ("tp16_hi32", "fp16"), ("tp8_hi32", "fp8_e4m3")):
        for T in (1, 4):
            want = [(r, w) for least, r, w in launch.REFRESH_SHAPES[("gdn", fmt)] if T >= least][-1]
            assert launch.refresh_shape(gdn[preset], "gdn", 32, 1, T) == want
    assert launch.refresh_shape(gdn["tp4_hi32"], "gdn", 32, 4, 1) == (32, 4)
    m2 = rs.Mamba2Cache(1, 2, 64, 128, ngroups=1, precision="s32_rs", device="meta")
    assert ("mamba2", "fp32") not in launch.REFRESH_SHAPES and launch.refresh_shape(m2, "mamba2", 32, 1) == (32, 1)
    try:
        launch.TUNING.update(refresh_rows=16, refresh_warps=2)
        assert launch.refresh_shape(gdn["s32_rs"], "gdn", 32, 1, 4) == (16, 2)
    finally:
        launch.TUNING.clear()


def test_mamba2_steps_never_load_before_the_refresh():
    """``launch.LOAD_ORDERS``: order 2 issues a step's loads before a fused refresh, and on the
    H200 a fused Mamba-2 step then gave other output bits than the split launch, so outputs would
    depend on the batch size. Mamba-2 refreshes inside the step
    below ``SPLIT_MIN_BATCH``, so none of its table entries may take order 2; GDN, which always
    refreshes in a launch of its own, may."""
    pytest.importorskip("triton")
    from replayssm._triton import launch

    assert launch.SPLIT_MIN_BATCH["mamba2"] > 1 and launch.SPLIT_MIN_BATCH["gdn"] == 1
    for (arch, fmt), shape in launch.SHAPES.items():
        orders = [shape[-1]] + [entry[-1] for entry in launch.DRAFT_SHAPES.get((arch, fmt), ())]
        assert all(order in launch.LOAD_ORDERS for order in orders), (arch, fmt)
        if arch == "mamba2":
            assert 2 not in orders, fmt
