"""``replayssm bench``: how much ReplaySSM buys on this GPU, for this model shape, and why.

Sweeps batch x window x draft length x preset against the conventional kernels timed in the same
run, after a correctness gate against the float64 recurrence at each shape; reports medians with
their spread, the traffic model, achieved bandwidth against the measured copy ceiling, and the
cache memory per sequence. Writes DIR/bench.json and, with matplotlib, DIR/*.png.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

import replayssm as rs

from . import GEOMETRIES, Problem

DEFAULT_GEOMETRY = {"mamba2": "nemotron3-super", "gdn": "qwen35-122b"}
EXTERNAL = {"mamba2": "mamba_ssm", "gdn": "fla"}


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parse_geometry(text: str, arch: str) -> tuple[str, tuple]:
    """A named geometry, or 4 integers: H,P,N,G (Mamba-2) or HK,HV,K,V (GDN)."""
    if text in GEOMETRIES:
        g_arch, dims = GEOMETRIES[text]
        if arch != "all" and g_arch != arch:
            raise ValueError(f"--geometry {text} is a {g_arch} geometry, not {arch}")
        return g_arch, dims
    try:
        dims = tuple(int(v) for v in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 4 or min(dims) < 1 or arch == "all":
        raise ValueError(f"--geometry must be one of {sorted(GEOMETRIES)} or, with --arch mamba2|gdn, "
                         f"four integers H,P,N,G / HK,HV,K,V; got {text!r}")
    return arch, dims


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--arch", choices=["mamba2", "gdn", "all"], default="all")
    ap.add_argument("--geometry", default=None,
                    help=f"one of {sorted(GEOMETRIES)} or H,P,N,G | HK,HV,K,V (default: one per arch)")
    ap.add_argument("--batch", type=_ints, default=[1, 8, 32, 64, 128, 256, 512])
    ap.add_argument("--window", type=_ints, default=[16])
    ap.add_argument("--draft", type=_ints, default=[0, 4], help="0 = standard decode; T > 0 = verify T drafts")
    ap.add_argument("--accept", choices=["all", "none", "half"], default="all")
    ap.add_argument("--presets", default="s32_rs,tp16_hi32,tp8_hi32,tp4_hi16_sr,f4_sr_rs")
    ap.add_argument("--baselines", default="ours,mamba_ssm,fla")
    ap.add_argument("--modes", default="staggered", help="staggered,aligned,refresh")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="time CUDA-graph replays (default) or eager launches")
    ap.add_argument("--output", default="runs/bench")
    ap.add_argument("--replot", nargs="+", metavar="JSON",
                    help="no measuring: merge these bench.json files into DIR (table, bench.json, plots)")
    ap.set_defaults(func=run)


def plan(args) -> list[tuple[str, tuple]]:
    """(arch, dims) pairs to run, validated before any GPU work."""
    archs = ["mamba2", "gdn"] if args.arch == "all" else [args.arch]
    if args.geometry is not None:
        return [parse_geometry(args.geometry, args.arch)]
    return [GEOMETRIES[DEFAULT_GEOMETRY[a]] for a in archs]


def memory_report(arch, dims, presets, window, draft) -> list[dict]:
    """Bytes of cache per sequence per layer for each preset next to the conventional state (and
    conventional speculation's T states): the concurrency gain at a fixed memory budget."""
    from . import suite

    p = Problem(arch, dims, 1, 1)
    conv = p.state_elems * 4
    rows = []
    for preset in presets:
        c = suite.make_cache(p, 1, preset, window, max(draft, 1), "meta")
        per = c.bytes_per_slot()
        total = per["anchor"] + per["read_copy"] + per["buffer"]
        rows.append(dict(preset=preset, **per, total=total, conventional=conv,
                         conventional_speculative=conv * (1 + draft), ratio=conv * (1 + draft) / total))
    return rows


def _environment() -> dict:
    env = {"torch": torch.__version__, "replayssm": rs.__version__}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            env["driver"] = None
    # REPLAYSSM_COMMIT names the tree where its copy has no (or a stale) .git, as on a device
    # machine that receives the working tree: git there described an old commit
    env["commit"] = os.environ.get("REPLAYSSM_COMMIT")
    if not env["commit"]:
        try:
            env["commit"] = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                                           text=True, cwd=os.path.dirname(__file__), timeout=10).stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            env["commit"] = None
    return env


class _Progress:
    def __init__(self, total):
        self.total, self.done, self.tty = total, 0, sys.stderr.isatty()

    def step(self, label):
        self.done += 1
        if self.tty:
            print(f"\r[{self.done}/{self.total}] {label:60s}", end="", file=sys.stderr, flush=True)


def run(args) -> int:
    if args.replot:
        return replot(args)
    from . import measure, suite  # triton is needed from here on, not for --help

    if not torch.cuda.is_available():
        print("replayssm bench needs a CUDA GPU (torch.cuda.is_available() is False); "
              "it measures nothing and reports nothing without one.", file=sys.stderr)
        return 2
    try:
        todo = plan(args)
        presets = [rs.get_precision(p).name for p in args.presets.split(",") if p]
    except ValueError as exc:
        print(f"replayssm bench: {exc}", file=sys.stderr)
        return 2
    baselines = [b for b in args.baselines.split(",") if b]
    modes = [m for m in args.modes.split(",") if m]
    if not args.graphs:
        suite.time_graph = suite.time_eager
    os.makedirs(args.output, exist_ok=True)
    report = {"environment": _environment(), "args": {k: v for k, v in vars(args).items() if k != "func"},
              "copy_bandwidth": suite.copy_bandwidth(), "rows": [], "gate": [], "memory": {}, "skipped": {}}
    for b in baselines:
        if b in EXTERNAL.values():
            why = suite.baseline_available(b)
            if why:
                report["skipped"][b] = why
    total = sum(len(args.window) * len(args.draft) * len(args.batch) * (len(presets) * len(modes) + len(baselines))
                for _ in todo)
    bar = _Progress(total)
    for arch, dims in todo:
        key = f"{arch}:{','.join(map(str, dims))}"
        report["memory"][key] = memory_report(arch, dims, presets, max(args.window), max(args.draft))
        for window in args.window:
            gate_T = max(1, min(max(args.draft), window))
            passed = {}
            for preset in presets:  # the correctness gate, once per preset, geometry and window
                e, rel, se = measure.correctness(Problem(arch, dims, 16, 1), preset, "cuda", None,
                                                 steps=window + 4, rounds=3, T=gate_T, window=window)
                passed[preset] = rel <= measure.gate_tolerance(preset)
                report["gate"].append(dict(arch=arch, dims=dims, window=window, preset=preset, max_abs=e,
                                           rel=rel, state=se, tolerance=measure.gate_tolerance(preset),
                                           passed=passed[preset]))
            for draft in args.draft:
                T = max(draft, 1)
                if T > window:
                    continue
                for batch in args.batch:
                    p = Problem(arch, dims, batch, T)
                    base = {}
                    for b in baselines:
                        bar.step(f"{key} L={window} T={draft} b={batch} {b}")
                        if b in report["skipped"] or (b in EXTERNAL.values() and (b != EXTERNAL[arch] or draft)):
                            continue
                        (us, spread), _ = measure.bench_one(p, None, baseline=b, window=window)
                        base[b] = us
                        report["rows"].append(dict(arch=arch, dims=dims, window=window, draft=draft, batch=batch,
                                                   kernel=b, mode="-", us=us, spread=spread,
                                                   bytes=p.batch * p.state_elems * 4 * (1 + T)))
                        _save(report, args.output)
                    for preset in presets:
                        for mode in modes:
                            bar.step(f"{key} L={window} T={draft} b={batch} {preset} {mode}")
                            if not passed[preset]:
                                continue  # refuses to report a speedup for a kernel that is wrong here
                            (us, spread), tr = measure.bench_one(p, preset, mode, window=window,
                                                                 accept=args.accept if draft else "all")
                            row = dict(arch=arch, dims=dims, window=window, draft=draft, batch=batch,
                                       kernel=preset, mode=mode, us=us, spread=spread, bytes=tr["replay"],
                                       accept=args.accept if draft else None)
                            row.update({f"speedup_vs_{b}": t / us for b, t in base.items()})
                            report["rows"].append(row)
                            _save(report, args.output)
    if bar.tty:
        print(file=sys.stderr)
    _save(report, args.output)
    print(format_report(report))
    plots(report, args.output)
    return 0 if all(g["passed"] for g in report["gate"]) else 1


def _save(report, out) -> None:
    """Write DIR/bench.json (after every figure, so an interrupted sweep keeps what it measured)."""
    for r in report["rows"]:
        r["tb_per_s"] = r["bytes"] / r["us"] / 1e6
        r["fraction_of_copy"] = r["bytes"] / (r["us"] * 1e-6) / report["copy_bandwidth"]
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)


def format_report(report) -> str:
    lines = [f"GPU {report['environment'].get('gpu')}  copy ceiling {report['copy_bandwidth'] / 1e12:.2f} TB/s"]
    for name, why in report["skipped"].items():
        lines.append(f"baseline {name} skipped: {why}")
    for g in report["gate"]:
        if not g["passed"]:
            lines.append(f"GATE FAILED {g['arch']} {g['preset']} L={g['window']}: rel err {g['rel']:.2e} > "
                         f"{g['tolerance']:.0e}; no speedup reported")
    head = f"{'arch':7s} {'L':>3s} {'T':>2s} {'batch':>5s} {'kernel':12s} {'mode':9s} {'us':>9s} {'±':>6s} " \
           f"{'x ours':>7s} {'x ext':>6s} {'TB/s':>5s} {'%copy':>5s}"
    lines += [head, "-" * len(head)]
    for r in report["rows"]:
        ext = [v for k, v in r.items() if k.startswith("speedup_vs_") and k != "speedup_vs_ours"]
        lines.append(f"{r['arch']:7s} {r['window']:3d} {r['draft']:2d} {r['batch']:5d} {r['kernel']:12s} "
                     f"{r['mode']:9s} {r['us']:9.1f} {r['spread']:6.1f} {r.get('speedup_vs_ours', float('nan')):7.2f} "
                     f"{(ext[0] if ext else float('nan')):6.2f} {r['tb_per_s']:5.2f} {100 * r['fraction_of_copy']:5.0f}")
    for key, rows in report["memory"].items():
        lines.append(f"memory per sequence per layer, {key}:")
        for m in rows:
            lines.append(f"  {m['preset']:12s} {m['total'] / 2**20:7.2f} MiB (anchor {m['anchor'] / 2**20:.2f}, "
                         f"read {m['read_copy'] / 2**20:.2f}, buffer {m['buffer'] / 2**20:.2f}) vs conventional "
                         f"{m['conventional'] / 2**20:.2f} MiB, speculative {m['conventional_speculative'] / 2**20:.2f} "
                         f"MiB: x{m['ratio']:.2f} sequences per byte")
    return "\n".join(lines)


def _geometry_name(row: dict) -> str:
    """The geometry's name in GEOMETRIES, else arch and dims: curves never mix geometries."""
    named = {(arch, tuple(dims)): name for name, (arch, dims) in GEOMETRIES.items()}
    return named.get((row["arch"], tuple(row["dims"])), f"{row['arch']} {','.join(map(str, row['dims']))}")


def plots(report, out) -> None:
    """Speedup vs batch, vs window, vs draft length; achieved bandwidth vs the copy ceiling."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: plots skipped (pip install 'replayssm[plot]')")
        return
    # staggered windows only: an aligned or refresh-only row of the same point is another curve
    rows = [r for r in report["rows"] if r["mode"] == "staggered" and "speedup_vs_ours" in r]
    views = [("batch", "speedup_vs_batch.png", lambda r: r["draft"] == 0 and r["window"] == 16),
             ("window", "speedup_vs_window.png", lambda r: r["draft"] == 0 and r["batch"] == 256),
             ("draft", "speedup_vs_draft.png", lambda r: r["draft"] > 0 and r["batch"] == 256)]
    # one colour per preset and one line style per geometry, so that curves stay apart past ten
    presets = sorted({r["kernel"] for r in rows})
    colour = {k: plt.cm.tab10(i % 10) for i, k in enumerate(presets)}
    for x, name, keep in views:
        series = {}
        for r in filter(keep, rows):
            key = (_geometry_name(r), r["kernel"], (r.get("accept") or "all") if x == "draft" else None)
            series.setdefault(key, {})[r[x]] = r["speedup_vs_ours"]
        series = {k: sorted(v.items()) for k, v in series.items() if len(v) > 1}
        if not series:  # one value of x in this sweep: a curve would be a dot
            continue
        style = {g: ("-", "--", "-.", (0, (1, 1)))[i % 4] for i, g in enumerate(sorted({k[0] for k in series}))}
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        for (geometry, kernel, accept), pts in sorted(series.items()):
            label = f"{geometry} {kernel}" + (f" accept {accept}" if accept else "")
            ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", ms=3, color=colour[kernel],
                    ls=style[geometry], alpha=1.0 if accept in (None, "all") else 0.5, label=label)
        ax.axhline(1.0, color="gray", lw=0.8)
        if x == "batch":
            ax.set_xscale("log", base=2)
        ax.set_xlabel(x + (" (window 16)" if x == "batch" else " (batch 256)"))
        ax.set_ylabel("speed-up vs conventional (ours)")
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=100)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for arch, marker in (("mamba2", "o"), ("gdn", "s")):
        for kind, color in (("baseline", "black"), ("replay", "tab:blue")):
            pts = [(r["batch"], r["tb_per_s"]) for r in report["rows"] if r["arch"] == arch and r["draft"] == 0
                   and (r["mode"] == "-") == (kind == "baseline")]
            if pts:
                ax.scatter(*zip(*pts), s=10, marker=marker, color=color, label=f"{arch} {kind}s")
    ax.axhline(report["copy_bandwidth"] / 1e12, color="red", lw=0.8, label="copy ceiling")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (decode, T = 1)")
    ax.set_ylabel("TB/s (traffic model)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "bandwidth.png"), dpi=100)
    plt.close(fig)


def _row_key(row: dict) -> tuple:
    return (row["arch"], tuple(row["dims"]), row["window"], row["draft"], row.get("accept"), row["batch"],
            row["kernel"], row.get("mode"))


def replot(args) -> int:
    """``--replot``: merge earlier bench.json reports into one table, DIR/bench.json and plots
    (no GPU needed). The first report's environment and copy ceiling head the merged one; a row
    measured again in a later report (same layer, window, draft, accept, batch, kernel, mode)
    replaces the earlier one."""
    reports = []
    for path in args.replot:
        with open(path) as f:
            reports.append(json.load(f))
    merged = dict(reports[0], rows=[], gate=[], memory={}, skipped={}, sources=list(args.replot))
    for r in reports:
        for row in r["rows"]:
            row.setdefault("accept", r["args"].get("accept") if row["draft"] else None)
        again = {_row_key(row) for row in r["rows"]}
        merged["rows"] = [row for row in merged["rows"] if _row_key(row) not in again] + r["rows"]
        merged["gate"] += r.get("gate", [])
        merged["memory"].update(r.get("memory", {}))
        merged["skipped"].update(r.get("skipped", {}))
    os.makedirs(args.output, exist_ok=True)
    _save(merged, args.output)
    print(format_report(merged))
    plots(merged, args.output)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="replayssm bench", description=__doc__)
    add_arguments(ap)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
