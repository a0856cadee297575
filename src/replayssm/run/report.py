"""The report of ``replayssm run``: the JSON document, the printed tables, the drift plot and
``--compare`` of two reports. ``docs/runner.md`` documents every field.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import math
import platform
import subprocess
import sys
from pathlib import Path

import torch

from .. import __version__
from ..layers import ARCHS
from .checks import CHECK_NAMES, CHECKS
from .protocol import ARCH_TITLE, BASELINE, PROTOCOL, SCHEMA, Config, Schedule, describe_precision


def _git_commit():
    root = Path(__file__).resolve().parents[3]
    if not (root / ".git").exists():
        return None, None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip() != ""
        return commit, dirty
    except (OSError, subprocess.SubprocessError):
        return None, None


def _environment(cfg: Config) -> dict:
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    dev = torch.device(cfg.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton_version,
            "platform": platform.platform(), "device": str(dev), "device_name": name,
            "backend": cfg.backend or ("triton" if dev.type == "cuda" and triton_version else "torch"),
            "torch_threads": torch.get_num_threads()}


def _mean_std(vals):
    vals = [v for v in vals if v is not None]
    if not vals:
        return None
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else None
    return {"mean": mean, "std": std, "n": len(vals)}


SUMMARY_METRICS = ("output_rmse_vs_s32", "anchor_rmse_vs_s32", "output_rmse_vs_f64", "anchor_rmse_vs_f64")


def _summary(runs) -> dict:
    out = {}
    for r in runs:
        out.setdefault(r["arch"], {}).setdefault(r["preset"], []).append(r)
    return {arch: {preset: {m: _mean_std([x["metrics"][m] for x in rs]) for m in SUMMARY_METRICS}
                   | {"control": rs[0]["control"], "drift_exponent": _drift_exponent(rs)}
                   for preset, rs in presets.items()}
            for arch, presets in out.items()}


def _drift_exponent(runs):
    """Least-squares slope of log(anchor RMSE vs f64) against log(refreshes), records averaged
    over seeds (0.5 = error growing like sqrt(refreshes)); None with fewer than 3 points."""
    pts = {}
    for r in runs:
        for d in r["drift"]:
            pts.setdefault(d["refreshes"], []).append(d["anchor_rmse_vs_f64"])
    xy = [(math.log(k), math.log(sum(v) / len(v))) for k, v in sorted(pts.items()) if k > 0 and sum(v) > 0]
    if len(xy) < 3:
        return None
    mx = sum(x for x, _ in xy) / len(xy)
    my = sum(y for _, y in xy) / len(xy)
    sxx = sum((x - mx) ** 2 for x, _ in xy)
    return sum((x - mx) * (y - my) for x, y in xy) / sxx if sxx > 0 else None


def build_report(cfg: Config, plan, cases: dict, wall: float) -> dict:
    runs = [r for c in cases.values() for r in c["runs"]]
    checks = [ch for c in cases.values() for ch in c["checks"]]
    failed = [ch for ch in checks if not ch["passed"]]
    commit, dirty = _git_commit()
    hashes = {f"{a}/{s}": c["input_sha256"] for (a, s), c in cases.items()}
    total = hashlib.sha256("".join(f"{k}={v};" for k, v in sorted(hashes.items())).encode()).hexdigest()
    return {
        "protocol": PROTOCOL, "schema": SCHEMA,
        "package": {"name": "replayssm", "version": __version__, "git_commit": commit, "git_dirty": dirty},
        "environment": _environment(cfg),
        "config": {"archs": list(cfg.archs), "presets": list(cfg.presets),
                   "controls": [p.name for p, c in plan if c], "seeds": list(cfg.seeds), "steps": cfg.steps,
                   "window": cfg.window, "max_draft": cfg.max_draft, "batch": cfg.batch,
                   "geometry": {a: cfg.geometry.describe(a) for a in cfg.archs},
                   "twin": cfg.twin, "drift_every": cfg.drift_every, "check_every": cfg.check_every,
                   "schedule": Schedule(cfg.batch, cfg.steps, cfg.max_draft).describe(),
                   "s32_output_limit": cfg.s32_limit},
        "precisions": {p.name: describe_precision(p) | {"control": c} for p, c in plan},
        "inputs": {"sha256": total, "per_case": hashes},
        "runs": runs, "checks": checks, "summary": _summary(runs),
        "passed": not failed,
        "failed_checks": sorted({f"({ch['id']}) {ch['name']}" for ch in failed}),
        "wall_s": wall,
    }


def _fmt(v, spec=".3e"):
    if v is None:
        return "-"
    if isinstance(v, float):
        return "0" if v == 0 else format(v, spec)
    return str(v)


def _table(headers, rows) -> str:
    cells = [list(map(str, headers))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _pm(ms, spec=".3g"):
    if ms is None:
        return "-"
    if ms["mean"] == 0 and not ms["std"]:
        return "0"
    std = "n/a" if ms["std"] is None else format(ms["std"], spec)
    return f"{format(ms['mean'], spec)} ± {std}"


def print_report(rep: dict, out=None) -> None:
    w = lambda s="": print(s, file=out or sys.stdout)  # noqa: E731
    cfg = rep["config"]
    env = rep["environment"]
    w(f"{rep['protocol']}  replayssm {rep['package']['version']} ({(rep['package']['git_commit'] or 'no git')[:12]})"
      f"  device {env['device']} [{env['backend']}]  torch {env['torch']}  triton {env['triton']}")
    w(f"archs {','.join(cfg['archs'])}  seeds {','.join(map(str, cfg['seeds']))}  steps {cfg['steps']}  "
      f"window {cfg['window']}  max_draft {cfg['max_draft']}  batch {cfg['batch']}+1 pad  "
      f"inputs sha256 {rep['inputs']['sha256'][:16]}")
    w()
    rows = []
    for r in rep["runs"]:
        m = r["metrics"]
        sp = r["rounds"]["speculative"]
        rows.append([r["arch"], r["preset"] + (" (ctl)" if r["control"] else ""), r["seed"],
                     _fmt(m["output_max_abs_vs_f64"]), _fmt(m["output_rmse_vs_f64"]),
                     _fmt(m["output_rmse_vs_s32"]), _fmt(m["anchor_rmse_vs_f64"]),
                     _fmt(m["anchor_rmse_vs_s32"]), _fmt(m["read_rmse_vs_f64"]), _fmt(m["state_max_abs_vs_f64"]),
                     r["tokens_committed"], r["refreshes"],
                     f"{r['rounds']['decode']['tokens']}/{sp['accepted']}/{sp['drafted']}",
                     f"{r['wall_s']:.2f}"])
    w("Per run (errors: max abs / RMSE vs the float64 recurrence, RMSE vs the s32_rs run)")
    w(_table(["arch", "preset", "seed", "out max", "out rmse", "out vs s32", "anchor rmse", "anc vs s32",
              "read rmse", "state max", "tokens", "refr", "dec/acc/draft", "wall s"], rows))
    w()
    w("Invariant checks")
    crow = []
    for cid, name, what in CHECKS:
        sel = [c for c in rep["checks"] if c["id"] == cid]
        if not sel:
            if cid != "x":
                crow.append([f"({cid}) {name}", "n/a", "-", "-", what])
            continue
        bad = [c for c in sel if not c["passed"]]
        figs = [c["figure"] for c in sel if c["figure"] is not None]
        fig = (max(figs) if cid == "a" else min(figs)) if figs else None
        crow.append([f"({cid}) {name}", "FAIL" if bad else "pass", sum(c["evaluated"] for c in sel),
                     _fmt(fig), bad[0]["detail"] + f" [{bad[0]['arch']} seed {bad[0]['seed']}"
                     + (f" {bad[0]['preset']}" if bad[0]["preset"] else "") + "]" if bad else what])
    w(_table(["check", "result", "evaluated", "figure", "detail"], crow))
    w()
    archs = [a for a in ARCHS if a in rep["summary"]]
    presets = [p for p in rep["summary"][archs[0]] if not rep["summary"][archs[0]][p]["control"]] if archs else []
    n = len(cfg["seeds"])
    w(f"Summary: RMSE relative to s32_rs, mean ± sample std over {n} seed{'s' * (n > 1)}")
    heads = ["preset"] + [f"{ARCH_TITLE[a]} {k}" for a in archs for k in ("output RMSE", "anchor RMSE")]
    srows = [[p] + [_pm(rep["summary"][a][p][m]) for a in archs
                    for m in ("output_rmse_vs_s32", "anchor_rmse_vs_s32")] for p in presets]
    w(_table(heads, srows))
    if any(r["drift"] for r in rep["runs"]) and cfg["steps"] >= 1000:
        w()
        w(f"Anchor drift vs float64 (every {cfg['drift_every']} refreshes, mean over seeds)")
        drows = []
        for a in archs:
            for p, s in rep["summary"][a].items():
                recs = _mean_drift([r for r in rep["runs"] if r["arch"] == a and r["preset"] == p])
                if recs:
                    drows.append([a, p, f"{recs[0][1]:.0f}", _fmt(recs[0][2]), f"{recs[-1][1]:.0f}",
                                  _fmt(recs[-1][2]), _fmt(s["drift_exponent"], ".2f")])
        w(_table(["arch", "preset", "tokens@first", "rmse@first", "tokens@last", "rmse@last",
                  "slope log-log"], drows))
    w()
    if rep["passed"]:
        w(f"PASS: every invariant holds ({rep['wall_s']:.1f} s)")
    else:
        w(f"FAIL: {', '.join(rep['failed_checks'])}")


def _mean_drift(runs):
    """[(refreshes, tokens, anchor_rmse_vs_f64)] averaged over seeds."""
    acc = {}
    for r in runs:
        for d in r["drift"]:
            a = acc.setdefault(d["refreshes"], [0.0, 0.0, 0])
            a[0] += d["tokens"]
            a[1] += d["anchor_rmse_vs_f64"]
            a[2] += 1
    return [(k, t / c, e / c) for k, (t, e, c) in sorted(acc.items())]


def plot_drift(rep: dict, path: Path) -> str:
    """Anchor RMSE vs float64 against committed tokens, log-log, one panel per arch, with a
    sqrt(tokens) guide. Returns a message (the plot is skipped without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "drift plot skipped: matplotlib is not installed (pip install 'replayssm[plot]')"
    archs = [a for a in ARCHS if a in rep["summary"]]
    fig, axes = plt.subplots(1, len(archs), figsize=(6 * len(archs), 4.5), squeeze=False)
    for ax, a in zip(axes[0], archs):
        for p in rep["summary"][a]:
            recs = _mean_drift([r for r in rep["runs"] if r["arch"] == a and r["preset"] == p])
            recs = [x for x in recs if x[2] > 0]
            if recs:
                ts = [x[1] for x in recs]
                ax.loglog(ts, [x[2] for x in recs], label=p)
                guide = "∝ sqrt(tokens)" if p == BASELINE else None
                ax.loglog(ts, [recs[0][2] * math.sqrt(t / ts[0]) for t in ts], ":", color="0.6", label=guide)
        ax.set_title(f"{ARCH_TITLE[a]}: anchor drift vs float64")
        ax.set_xlabel("committed tokens")
        ax.set_ylabel("anchor RMSE at refresh")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"drift plot written to {path}"


COMPARE_METRICS = ("output_max_abs_vs_f64", "output_rmse_vs_f64", "output_rmse_vs_s32", "anchor_rmse_vs_f64",
                   "anchor_rmse_vs_s32", "read_rmse_vs_f64", "state_max_abs_vs_f64")


def _short_runs(keys) -> str:
    """(arch, preset, seed) keys as "arch preset (seeds s1,s2)", at most 6 entries then a count."""
    groups: dict = {}
    for arch, preset, seed in keys:
        groups.setdefault((arch, preset), []).append(str(seed))
    items = [f"{a} {p} (seeds {','.join(s)})" for (a, p), s in groups.items()]
    return "; ".join(items[:6]) + (f"; and {len(items) - 6} more" if len(items) > 6 else "")


def compare_reports(a: dict, b: dict, out=None) -> int:
    """Print the differences between two reports. Returns 0 when they ran the same protocol on
    identical inputs (the metrics may differ: that is what is being compared), else 1."""
    w = lambda s="": print(s, file=out or sys.stdout)  # noqa: E731
    rows = []
    for key in ("protocol", "schema"):
        rows.append([key, a.get(key), b.get(key)])
    for key in ("version", "git_commit", "git_dirty"):
        rows.append([f"package.{key}", a["package"].get(key), b["package"].get(key)])
    for key in ("device", "device_name", "backend", "torch", "triton"):
        rows.append([key, a["environment"].get(key), b["environment"].get(key)])
    for key in ("steps", "window", "max_draft", "batch", "seeds", "presets"):
        rows.append([key, a["config"].get(key), b["config"].get(key)])
    rows.append(["inputs sha256", a["inputs"]["sha256"][:16], b["inputs"]["sha256"][:16]])
    rows.append(["passed", a["passed"], b["passed"]])
    w(_table(["", "A", "B"], [[k, str(x), str(y)] for k, x, y in rows]))
    same_inputs = a.get("protocol") == b.get("protocol")
    common = sorted(set(a["inputs"]["per_case"]) & set(b["inputs"]["per_case"]))
    differing = [c for c in common if a["inputs"]["per_case"][c] != b["inputs"]["per_case"][c]]
    if not same_inputs or differing or not common:
        w(f"\nNOT COMPARABLE: different protocol or inputs ({', '.join(differing) or 'no common case'})")
        same_inputs = False
    w()
    ra = {(r["arch"], r["preset"], r["seed"]): r for r in a["runs"]}
    rb = {(r["arch"], r["preset"], r["seed"]): r for r in b["runs"]}
    drows, identical = [], 0
    for key in sorted(set(ra) & set(rb)):
        for m in COMPARE_METRICS:
            x, y = ra[key]["metrics"].get(m), rb[key]["metrics"].get(m)
            if x == y:
                identical += 1
                continue
            rel = _fmt((y - x) / abs(x), ".2e") if x and y is not None else "-"
            drows.append([*map(str, key), m, _fmt(x), _fmt(y), _fmt(y - x if None not in (x, y) else None), rel])
        for m in ("tokens_committed", "refreshes"):
            if ra[key][m] != rb[key][m]:
                drows.append([*map(str, key), m, ra[key][m], rb[key][m], rb[key][m] - ra[key][m], "-"])
    if drows:
        w(_table(["arch", "preset", "seed", "metric", "A", "B", "B - A", "rel"], drows))
    w(f"\n{identical} metric values identical, {len(drows)} differ")
    for label, keys in (("A", sorted(set(ra) - set(rb))), ("B", sorted(set(rb) - set(ra)))):
        if keys:
            w(f"runs only in {label}: {_short_runs(keys)}")
    wall_a = sum(r["wall_s"] for r in a["runs"])
    wall_b = sum(r["wall_s"] for r in b["runs"])
    w(f"cache wall time: A {wall_a:.2f} s, B {wall_b:.2f} s")
    ca = {(c["id"], c["arch"], c["seed"], c["preset"]): c["passed"] for c in a["checks"]}
    cb = {(c["id"], c["arch"], c["seed"], c["preset"]): c["passed"] for c in b["checks"]}
    flips = [k for k in sorted(set(ca) & set(cb), key=str) if ca[k] != cb[k]]
    for k in flips:
        w(f"check ({k[0]}) {CHECK_NAMES[k[0]]} {k[1]} seed {k[2]} {k[3] or ''}: "
          f"A {'pass' if ca[k] else 'FAIL'}, B {'pass' if cb[k] else 'FAIL'}")
    w(f"failed checks: A {a['failed_checks'] or 'none'}, B {b['failed_checks'] or 'none'}")
    return 0 if same_inputs else 1



def jsonable(x):
    """NaN/Inf are not JSON: write them as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x
