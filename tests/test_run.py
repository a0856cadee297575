"""Tests for the reproduction runner ``replayssm run``.

The runner runs here on a tiny configuration (one seed, a small geometry, a short schedule). The
mutation tests break the library on purpose (read copy derived from the anchor, a refresh that
never writes the checkpoint, rejected drafts committed, an anchor rewritten by a zero-accept
round) and require the runner to exit non-zero naming the check that catches it.
"""
from __future__ import annotations

import json
import sys

import pytest
import torch

import replayssm as rs
from replayssm import run
from replayssm.cache import ReplayCache
from replayssm.cli import main
from replayssm.geometry import Geometry, parse_geometry
from replayssm.precision import S32_MAX_ABS
from replayssm.run import protocol

TINY = ["--seeds", "7", "--steps", "24", "--batch", "2", "--geometry", "2,8,16,1"]
CHECK_IDS = {"a", "b", "c", "d", "e", "f"}


def run_cli(tmp_path, *extra, name="r.json", arch=None):
    """arch None: no --arch (the default layer kinds, mamba2 and gdn)."""
    out = tmp_path / name
    code = main(["run", *TINY, *([] if arch is None else ["--arch", arch]), "--output", str(out), *extra])
    return code, (json.loads(out.read_text()) if out.exists() else None)


# ------------------------------------------------------------------------------------------------
# A correct implementation passes; the report has the documented schema
# ------------------------------------------------------------------------------------------------
def test_tiny_run_passes_with_schema(tmp_path, capsys):
    code, rep = run_cli(tmp_path)
    text = capsys.readouterr().out
    assert code == 0, text
    assert "PASS" in text and "Summary: RMSE relative to s32_rs" in text
    assert rep["protocol"] == run.PROTOCOL and rep["schema"] == run.SCHEMA
    assert rep["package"]["version"] == rs.__version__ and "git_commit" in rep["package"]
    assert rep["environment"]["torch"] == torch.__version__ and rep["environment"]["device"] == "cpu"
    assert len(rep["inputs"]["sha256"]) == 64 and set(rep["inputs"]["per_case"]) == {"mamba2/7", "gdn/7"}
    assert rep["passed"] is True and rep["failed_checks"] == []
    assert {c["id"] for c in rep["checks"]} == CHECK_IDS
    assert all(c["passed"] and c["evaluated"] > 0 for c in rep["checks"])

    presets = {(r["arch"], r["preset"]) for r in rep["runs"]}
    assert rep["config"]["archs"] == ["mamba2", "gdn"]  # Kimi Delta Attention is opt-in
    for arch in ("mamba2", "gdn"):
        for p in rs.REPRODUCTION_PRESETS:
            assert (arch, p) in presets
    assert set(rep["config"]["controls"]) == {"ctl_fp16sr_r32", "ctl_nvfp4sr_r32"}
    for r in rep["runs"]:
        m = r["metrics"]
        for key in ("output_max_abs_vs_f64", "output_rmse_vs_f64", "output_rmse_vs_s32", "anchor_rmse_vs_f64",
                    "anchor_rmse_vs_s32", "read_rmse_vs_f64", "state_max_abs_vs_f64"):
            assert isinstance(m[key], float) and m[key] >= 0, (r["preset"], key)
        assert r["tokens_committed"] == sum(r["tokens_per_sequence"]) and min(r["tokens_per_sequence"]) >= 17
        assert min(r["refreshes_per_sequence"]) >= 1 and r["wall_s"] > 0
        sp = r["rounds"]["speculative"]
        assert sp["zero"] and sp["partial"] and sp["full"] and r["rounds"]["paused_rows"]
        assert r["tokens_committed"] == r["rounds"]["decode"]["tokens"] + sp["accepted"]
        if r["preset"] == "s32_rs":
            assert m["output_rmse_vs_s32"] == 0 and m["anchor_rmse_vs_s32"] == 0
            assert m["output_max_abs_vs_f64"] <= S32_MAX_ABS
        if r["preset"] == "tp8_hi32":  # fp32 anchor: bit-identical to s32_rs's, outputs differ
            assert m["anchor_rmse_vs_s32"] == 0 and m["output_rmse_vs_s32"] > 0
    summ = rep["summary"]["gdn"]
    assert summ["s32_rs"]["output_rmse_vs_s32"]["mean"] == 0
    assert summ["f4_sr_rs"]["anchor_rmse_vs_s32"]["mean"] > summ["tp4_hi16_sr"]["anchor_rmse_vs_s32"]["mean"] > 0


def test_same_protocol_same_inputs_and_compare(tmp_path, capsys):
    _, a = run_cli(tmp_path, name="a.json", arch="gdn")
    _, b = run_cli(tmp_path, name="b.json", arch="gdn")
    assert a["inputs"] == b["inputs"]
    assert [r["metrics"] for r in a["runs"]] == [r["metrics"] for r in b["runs"]]  # CPU is deterministic
    capsys.readouterr()
    assert main(["run", "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert " 0 differ" in capsys.readouterr().out

    code = main(["run", *TINY[2:], "--seeds", "8", "--arch", "gdn", "--output", str(tmp_path / "c.json")])
    assert code == 0
    c = json.loads((tmp_path / "c.json").read_text())
    assert c["inputs"]["sha256"] != a["inputs"]["sha256"]
    capsys.readouterr()
    assert main(["run", "--compare", str(tmp_path / "a.json"), str(tmp_path / "c.json")]) == 1
    assert "NOT COMPARABLE" in capsys.readouterr().out


def test_inputs_do_not_depend_on_presets(tmp_path):
    _, a = run_cli(tmp_path, "--presets", "s32_rs", name="a.json", arch="mamba2")
    _, b = run_cli(tmp_path, "--presets", "all", name="b.json", arch="mamba2")
    assert a["inputs"] == b["inputs"]
    base = lambda rep: next(r for r in rep["runs"] if r["preset"] == "s32_rs")["metrics"]  # noqa: E731
    assert base(a) == base(b)
    assert {r["preset"] for r in b["runs"]} >= set(rs.PRESETS)


# ------------------------------------------------------------------------------------------------
# Deliberately broken implementations: non-zero exit naming the failed check
# ------------------------------------------------------------------------------------------------
def _expect_failure(tmp_path, capsys, check, *extra, arch=None):
    code, rep = run_cli(tmp_path, *extra, arch=arch)
    out = capsys.readouterr().out
    name = f"({check}) {run.CHECK_NAMES[check]}"
    assert code == 1, out
    assert name in rep["failed_checks"], rep["failed_checks"]
    assert "FAIL: " in out and name in out.splitlines()[-2 if "report written" in out else -1]
    return rep


def test_read_copy_from_anchor_fails_independent_cast(tmp_path, capsys, monkeypatch):
    """The read copy encoded from the decoded (rounded) anchor instead of from S."""
    original = ReplayCache.write_checkpoint

    def broken(self, rows, state, mask):
        original(self, rows, state, mask)
        if self.read_copy is not None:
            anchor = self.decode_anchor(rows).reshape(  # the storage layout: 32-row blocks
                -1, self.nheads, self.dv // self.row_block, self.row_block, self.dk)
            enc = self.precision.read.encode(anchor, self.precision.read_rounding)
            for name, t in enc.items():
                keep = mask.view(-1, *([1] * (t.dim() - 1)))
                self.read_copy[name][rows] = torch.where(keep, t, self.read_copy[name][rows])

    monkeypatch.setattr(ReplayCache, "write_checkpoint", broken)
    rep = _expect_failure(tmp_path, capsys, "f")
    failed = {c["preset"] for c in rep["checks"] if c["id"] == "f" and not c["passed"]}
    assert "tp4_hi16_sr" in failed
    assert all(c["passed"] for c in rep["checks"] if c["id"] == "f" and c["preset"] == "tp8_hi32")


def test_skipped_refresh_fails_s32_error(tmp_path, capsys, monkeypatch):
    """A refresh that empties the buffer but never writes the new checkpoint."""
    def broken(self, rows, need):
        self.committed[rows] = torch.where(need, 0, self.committed[rows])
        self.refreshes[rows] += need.long()

    monkeypatch.setattr(ReplayCache, "refresh", broken)
    rep = _expect_failure(tmp_path, capsys, "a", "--presets", "s32_rs", arch="mamba2")
    assert next(c for c in rep["checks"] if c["id"] == "a")["figure"] > S32_MAX_ABS


def test_committed_rejected_drafts_fail(tmp_path, capsys, monkeypatch):
    """accept() that commits every pending draft, whatever the sampler accepted."""
    original = ReplayCache.accept

    def broken(self, slots, num_accepted):
        rows, _ = self.rows_of(slots)
        original(self, slots, self.pending[rows].to(num_accepted.dtype))

    monkeypatch.setattr(ReplayCache, "accept", broken)
    _expect_failure(tmp_path, capsys, "d", "--presets", "s32_rs", arch="gdn")


def test_anchor_rewritten_on_zero_accept_fails(tmp_path, capsys, monkeypatch):
    """accept() that folds the committed history into the anchor when nothing was accepted."""
    original = ReplayCache.accept

    def broken(self, slots, num_accepted):
        original(self, slots, num_accepted)
        rows, valid = self.rows_of(slots)
        self.refresh(rows, valid & (num_accepted == 0) & (self.committed[rows] > 0))

    monkeypatch.setattr(ReplayCache, "accept", broken)
    _expect_failure(tmp_path, capsys, "b", "--presets", "tp4_hi16_sr", arch="mamba2")


def test_exception_is_a_named_failure(tmp_path, capsys, monkeypatch):
    def broken(self, slots):
        raise RuntimeError("materialize exploded")

    monkeypatch.setattr(ReplayCache, "materialize", broken)
    rep = _expect_failure(tmp_path, capsys, "x", "--presets", "s32_rs", arch="mamba2")
    assert "materialize exploded" in rep["checks"][0]["detail"]


# ------------------------------------------------------------------------------------------------
# Protocol pieces
# ------------------------------------------------------------------------------------------------
def test_schedule_covers_the_protocol():
    sched = protocol.Schedule(batch=4, steps=48, max_draft=4)
    steps = list(sched)
    assert len(steps) == 48 and sched.base_slots.count(-1) == 1
    tokens = [0] * 4
    accepts = set()
    mixed = False
    for st in steps:
        for q, (slot, a) in enumerate(zip(st.slots, st.accept or [1] * len(st.slots))):
            seq = sched.row_seq[q]
            if slot >= 0:
                tokens[seq] += a
                if st.speculative:
                    accepts.add(a if a in (0, st.T) else "partial")
        if st.speculative:
            live = [a for a, s in zip(st.accept, st.slots) if s >= 0]
            mixed |= len(set(live)) > 1
    assert accepts == {0, 4, 2, "partial"} and mixed
    assert min(tokens) >= 17
    assert any(-1 in st.slots[2:] for st in steps)  # a paused sequence, besides the permanent pad


def test_controls_give_every_anchor_format_two_reads():
    plan = run.plan_presets(list(rs.REPRODUCTION_PRESETS), controls=True)
    names = [p.name for p, _ in plan]
    assert names[:4] == list(rs.REPRODUCTION_PRESETS)
    groups = {}
    for p, _ in plan:
        groups.setdefault(protocol.anchor_key(p), set()).add(protocol.read_key(p))
    assert all(len(reads) == 2 for reads in groups.values())
    assert [p.name for p, c in run.plan_presets(["tp8_hi32"], controls=True)] == ["s32_rs", "tp8_hi32"]
    assert [p.name for p, c in run.plan_presets(["s32_rs"], controls=True) if c] == ["tp16_hi32"]
    assert [p.name for p, _ in run.plan_presets(["f4_sr_rs"], controls=False)] == ["s32_rs", "f4_sr_rs"]


def test_kda_run_passes_and_is_opt_in(tmp_path, capsys):
    """--arch kda: the Kimi Delta Attention case passes every check, its summary table is titled
    KDA; --arch all names the three kinds; a Kimi-Linear geometry runs KDA only."""
    code, rep = run_cli(tmp_path, arch="kda")
    text = capsys.readouterr().out
    assert code == 0, text
    assert rep["config"]["archs"] == ["kda"] and set(rep["inputs"]["per_case"]) == {"kda/7"}
    assert {c["id"] for c in rep["checks"]} == CHECK_IDS and all(c["passed"] for c in rep["checks"])
    assert "KDA output RMSE" in text and set(rep["summary"]) == {"kda"}
    base = next(r for r in rep["runs"] if r["preset"] == "s32_rs")["metrics"]
    assert 0 < base["output_max_abs_vs_f64"] <= S32_MAX_ABS
    from replayssm.run.cli import _archs
    assert _archs("all") == ("mamba2", "gdn", "kda") and _archs("kda,mamba2") == ("mamba2", "kda")
    assert parse_geometry("kimi-linear-48b") == ("kda", Geometry(32, 128, 128, 32))
    for argv, needle in ((["run", "--arch", "rwkv"], "unknown layer kind rwkv"),
                         (["run", "--geometry", "kimi-linear-48b", "--arch", "gdn"], "kda geometry")):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        assert code == 2 and needle in capsys.readouterr().err


def test_kda_uniform_decay_fails_s32_error(tmp_path, capsys, monkeypatch):
    """A KDA refresh that folds with one decay per head (the channel mean) instead of one per key
    channel: the s32_rs outputs leave the float64 recurrence (check (a))."""
    from replayssm.kda import replay
    original = replay.fold

    def broken(state, buf, count):
        g = buf["g"]
        return original(state, {**buf, "g": g.mean(-1, keepdim=True).expand_as(g)}, count)

    monkeypatch.setattr(replay, "fold", broken)
    _expect_failure(tmp_path, capsys, "a", "--presets", "s32_rs", arch="kda")


def test_geometry_parsing():
    assert parse_geometry("small") == (None, Geometry(4, 16, 32, 2))
    assert parse_geometry("8,4,16,2") == (None, Geometry(8, 4, 16, 2))
    assert parse_geometry("qwen35-122b", "gdn") == ("gdn", Geometry(64, 128, 128, 16))
    for bad, arch in (("8,4,16,3", "all"), ("8,4,16", "all"), ("qwen35-122b", "mamba2"), ("x", "gdn")):
        with pytest.raises(ValueError, match="geometry"):
            parse_geometry(bad, arch)


def test_usage_mistakes_are_one_line_and_exit_2(tmp_path, capsys):
    """Every user mistake: one line on stderr naming it, exit code 2, no traceback."""
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text("{}")
    cases = [(["run", "--presets", "s32_rs,nope"], "unknown preset nope"),
             (["run", "--steps", "0"], "--steps"),
             (["run", "--seeds", "a"], "--seeds"),
             (["run", "--max-draft", "8", "--window", "4"], "--max-draft (8) must be <= --window (4)"),
             (["run", "--geometry", "qwen35-122b", "--arch", "mamba2"], "gdn geometry"),
             (["run", "--device", "tpu"], "--device"),
             (["run", "--compare", str(tmp_path / "missing.json"), str(tmp_path / "bad.json")], "cannot read"),
             (["run", "--compare", str(tmp_path / "bad.json"), str(tmp_path / "bad.json")], "is not JSON"),
             (["run", "--compare", str(tmp_path / "other.json"), str(tmp_path / "other.json")], "not a replayssm run"),
             (["bench", "--presets", "nope"], "unknown preset"),
             (["bench", "--report", str(tmp_path / "missing.json")], "no such file"),
             (["eval-kl", "--model", str(tmp_path / "none"), "--text-file", "x"], "no such file"),
             (["nope"], "invalid choice")]
    for argv, needle in cases:
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
        err = capsys.readouterr().err.strip()
        assert code == 2, (argv, err)
        assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err, (argv, err)


def test_eval_kl_without_transformers_says_how_to_install(tmp_path, capsys, monkeypatch):
    (tmp_path / "model").mkdir()
    (tmp_path / "text.txt").write_text("In the beginning")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    code = main(["eval-kl", "--model", str(tmp_path / "model"), "--text-file", str(tmp_path / "text.txt")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == "replayssm eval-kl: needs transformers: pip install 'replayssm[hf]'"


def test_version_and_help_need_no_torch():
    """``replayssm --version`` / ``--help`` answer without importing torch (fast start)."""
    import subprocess
    code = ("import sys\nfrom replayssm.cli import main\n"
            "for argv in (['--version'], ['--help'], ['run', '--help'], ['bench', '--help'], ['eval-kl', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"replayssm {rs.__version__}" in done.stdout


def test_drift_records_and_plot_skip(tmp_path, capsys, monkeypatch):
    code, rep = run_cli(tmp_path, "--steps", "120", "--drift-every", "2", "--presets", "f4_sr_rs",
                        "--plot", str(tmp_path / "d.png"), arch="gdn")
    assert code == 0
    drift = next(r for r in rep["runs"] if r["preset"] == "f4_sr_rs")["drift"]
    assert len(drift) >= 3 and all(d["refreshes"] % 2 == 0 for d in drift)
    assert [d["tokens"] for d in drift] == sorted(d["tokens"] for d in drift)
    assert all(d["anchor_rmse_vs_f64"] > 0 for d in drift)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert "skipped" in run.plot_drift(rep, tmp_path / "e.png")


def test_compare_lists_runs_of_one_report_briefly(tmp_path, capsys):
    """Reports with partly overlapping runs: the runs of only one report fit on a short line."""
    _, a = run_cli(tmp_path, "--presets", "all", name="a.json", arch="mamba2")
    _, b = run_cli(tmp_path, "--presets", "s32_rs", name="b.json", arch="mamba2")
    capsys.readouterr()
    assert main(["run", "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("runs only in A"))
    assert "f4_sr_rs (seeds 7)" in line and "more" in line and len(line) < 400
    assert not (tmp_path / "e.png").exists()
