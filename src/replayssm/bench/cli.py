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

from ..cli import UsageError
from ..geometry import DEFAULT_MODEL, GEOMETRIES, parse_geometry
from ..precision import PRESET_NAMES
from . import Problem

EXTERNAL = {"mamba2": "mamba_ssm", "gdn": "fla", "kda": "fla"}
BASELINE_NAMES = ("ours", "mamba_ssm", "fla")
DEFAULT_PRESETS = "s32_rs,tp16_hi32,tp8_hi32,tp4_hi16_sr,f4_sr_rs"


def _ints(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v]
    except ValueError:
        vals = []
    if not vals or min(vals) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated non-negative integers, got {text!r}")
    return vals


def _names(choices, what):
    def parse(text: str) -> list:
        items = [x for x in text.split(",") if x]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {what} {','.join(bad) or repr(text)}; choose from "
                                             f"{','.join(choices)}")
        return items
    return parse


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.description = ("Time ReplaySSM against the conventional decode kernels on a CUDA GPU, after a correctness "
                      "gate against the float64 recurrence, and write DIR/bench.json (and plots). With --report, "
                      "no GPU: merge bench JSON files and regenerate BENCHMARKS.md, the README headline table and "
                      "the plots. The default sweep takes about 10 minutes on an H200; a progress bar shows the ETA.")
    ap.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    ap.add_argument("--arch", choices=["mamba2", "gdn", "kda", "all"], default="all",
                    help="layer kinds to time (all: Mamba-2 and Gated DeltaNet)")
    ap.add_argument("--geometry", default=None, metavar="NAME|H,P,N,G",
                    help=f"one of {', '.join(n for n, g in GEOMETRIES.items() if g.arch)} or H,P,N,G with --arch "
                         f"mamba2|gdn|kda (default: {DEFAULT_MODEL['mamba2']} and {DEFAULT_MODEL['gdn']}; "
                         f"{DEFAULT_MODEL['kda']} for kda)")
    ap.add_argument("--batch", type=_ints, default=[1, 8, 32, 64, 128, 256, 512], help="batch sizes")
    ap.add_argument("--window", type=_ints, default=[16], help="refresh windows L")
    ap.add_argument("--draft", type=_ints, default=[0, 4], help="0 = standard decode; T > 0 = verify T drafts")
    ap.add_argument("--accept", choices=["all", "none", "half"], default="all", help="drafts accepted per round")
    ap.add_argument("--trees", type=_ints, default=[], metavar="NODES",
                    help="also time tree verifies of these node counts (binary top-k trees, breadth first) against "
                         "a chain of as many drafts and the conventional tree verify that writes one state per node, "
                         "each accepting the tree's depth per round (Mamba-2 and Gated DeltaNet)")
    ap.add_argument("--presets", type=_names(PRESET_NAMES, "preset"), default=DEFAULT_PRESETS.split(","),
                    help=f"comma-separated, from {','.join(PRESET_NAMES)}")
    ap.add_argument("--baselines", type=_names(BASELINE_NAMES, "baseline"), default=list(BASELINE_NAMES),
                    help="ours = the conventional kernels of this package; mamba_ssm and fla (fused_recurrent_kda "
                         "for kda) when installed")
    ap.add_argument("--modes", type=_names(("staggered", "aligned", "refresh"), "mode"), default=["staggered"],
                    help="staggered: slot i at window position i mod L; aligned: every slot refreshes in the same "
                         "step; refresh: every step refreshes every slot")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="time CUDA-graph replays (default) or eager launches")
    ap.add_argument("--output", default=None,
                    help="folder for bench.json and plots (default: runs/bench; with --report: docs/bench)")
    ap.add_argument("--report", nargs="+", metavar="JSON",
                    help="no measuring: merge these bench.json files (later rows replace earlier ones) into "
                         "OUTPUT/bench.json and regenerate --markdown, --readme and the plots")
    ap.add_argument("--markdown", default="BENCHMARKS.md", help="with --report: the file to write ('-': none)")
    ap.add_argument("--readme", default="README.md",
                    help="with --report: the README whose headline table is replaced ('-': none)")
    ap.set_defaults(func=run)


def plan(args) -> list[tuple[str, tuple]]:
    """(arch, geometry) pairs to run, validated before any GPU work."""
    archs = ["mamba2", "gdn"] if args.arch == "all" else [args.arch]
    if args.geometry is None:
        return [(a, GEOMETRIES[DEFAULT_MODEL[a]].geometry) for a in archs]
    try:
        arch, geo = parse_geometry(args.geometry, args.arch)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if arch is None:
        if args.arch == "all":
            raise UsageError("--geometry H,P,N,G needs --arch mamba2, gdn or kda")
        arch = args.arch
    return [(arch, geo)]


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
    import torch

    from .. import __version__
    env = {"torch": torch.__version__, "replayssm": __version__}
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


def run(args) -> int:
    if args.report:
        from . import report
        args.sources, args.plots = args.report, True
        args.output = args.output or "docs/bench"
        return report.run(args)
    args.output = args.output or "runs/bench"
    todo = plan(args)
    import torch

    if not torch.cuda.is_available():
        raise UsageError("needs a CUDA GPU (torch.cuda.is_available() is False); it measures nothing without one. "
                         "--report regenerates the report from JSON without a GPU")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise UsageError("needs triton: pip install 'replayssm[triton]'") from None
    from .. import _progress
    from . import measure, report, suite

    presets, baselines, modes = args.presets, args.baselines, args.modes
    if not args.graphs:
        suite.time_graph = suite.time_eager
    os.makedirs(args.output, exist_ok=True)
    env = _environment()
    argv = {k: v for k, v in vars(args).items() if k not in ("func", "report", "markdown", "readme")}
    argv["argv"] = sys.argv[2:] if len(sys.argv) > 2 and sys.argv[1] == "bench" else None
    out = {"environment": env, "args": argv, "dims_order": report.DIMS_ORDER, "copy_bandwidth": suite.copy_bandwidth(),
           "rows": [], "gate": [], "memory": {}, "skipped": {}}
    command = report._command(argv)
    for b in baselines:
        if b in EXTERNAL.values():
            archs = [a for a, _ in todo if EXTERNAL[a] == b]  # fla: its KDA kernel for a kda run
            why = suite.baseline_available(b, archs[0] if archs else None)
            if why:
                out["skipped"][b] = why
    total = sum(len(args.window) * len(args.batch) * (len(args.draft) * (len(presets) * len(modes) + len(baselines))
                                                     + (len(args.trees) * (1 + 2 * len(presets)) if a != "kda" else 0))
                for a, _ in todo)
    bar = _progress.bar(total, "replayssm bench", unit="point")
    try:
        for arch, dims in todo:
            _sweep(args, arch, dims, presets, baselines, modes, out, bar, command, measure, suite)
    finally:
        bar.close()
    _save(out, args.output)
    print(format_report(out))
    report.plots(report.Table(report.merge([report.load(os.path.join(args.output, "bench.json"))])), args.output)
    return 0 if all(g["passed"] for g in out["gate"]) else 1


def _sweep(args, arch, dims, presets, baselines, modes, out, bar, command, measure, suite) -> None:
    """Every window x draft x batch x kernel of one (arch, geometry), gate first."""
    from ..geometry import name_of
    key = f"{arch}:{','.join(map(str, dims))}"
    geo_name = name_of(arch, dims)
    env = out["environment"]
    stamp = dict(geometry=geo_name, commit=env.get("commit"), gpu=env.get("gpu"), command=command)
    out["memory"][key] = memory_report(arch, dims, presets, max(args.window), max(args.draft))
    for window in args.window:
        gate_T = max(1, min(max(args.draft), window))
        passed = {}
        for preset in presets:  # the correctness gate, once per preset, geometry and window
            e, rel, se = measure.correctness(Problem(arch, dims, 16, 1), preset, "cuda", None,
                                             steps=window + 4, rounds=3, T=gate_T, window=window)
            tol = measure.gate_tolerance(preset)
            passed[preset] = rel <= tol
            out["gate"].append(dict(arch=arch, dims=list(dims), window=window, preset=preset, max_abs=e, rel=rel,
                                    state=se, tolerance=tol, passed=passed[preset], commit=env.get("commit")))
        for draft in args.draft:
            T = max(draft, 1)
            if T > window:
                continue
            for batch in args.batch:
                p = Problem(arch, dims, batch, T)
                base = {}
                for b in baselines:
                    bar.set_description_str(f"{geo_name} L={window} T={draft} b={batch} {b}")
                    bar.update(1)
                    if b in out["skipped"] or (b in EXTERNAL.values() and (b != EXTERNAL[arch] or draft)):
                        continue
                    (us, spread), _ = measure.bench_one(p, None, baseline=b, window=window)
                    base[b] = us
                    out["rows"].append(dict(arch=arch, dims=list(dims), window=window, draft=draft, batch=batch,
                                            kernel=b, mode="-", us=us, spread=spread,
                                            bytes=p.batch * p.state_elems * 4 * (1 + T),
                                            accept=args.accept if draft else None, **stamp))
                    _save(out, args.output)
                for preset in presets:
                    for mode in modes:
                        bar.set_description_str(f"{geo_name} L={window} T={draft} b={batch} {preset} {mode}")
                        bar.update(1)
                        if not passed[preset]:
                            continue  # refuses to report a speed-up for a kernel that is wrong here
                        (us, spread), tr = measure.bench_one(p, preset, mode, window=window,
                                                             accept=args.accept if draft else "all")
                        row = dict(arch=arch, dims=list(dims), window=window, draft=draft, batch=batch, kernel=preset,
                                   mode=mode, us=us, spread=spread, bytes=tr["replay"],
                                   accept=args.accept if draft else None, **stamp)
                        row.update({f"speedup_vs_{b}": t / us for b, t in base.items()})
                        out["rows"].append(row)
                        _save(out, args.output)
        if arch != "kda":
            for nodes in args.trees:
                if nodes <= window:
                    _tree_sweep(args, arch, dims, presets, nodes, window, out, bar, stamp, measure)


def _tree_sweep(args, arch, dims, presets, nodes, window, out, bar, stamp, measure) -> None:
    """Rows of mode "tree" (the conventional tree verify: kernel "ours"; ReplaySSM per preset, after
    a tree correctness gate against float64) and "chain" (a chain of ``nodes`` drafts) at every
    batch, all accepting the tree's depth per round."""
    tree = measure.tree_of(nodes)
    depth = len(tree[1])
    passed = {}
    for preset in presets:
        e, rel, se = measure.tree_correctness(Problem(arch, dims, 16, nodes), preset, tree[0], "cuda", rounds=4,
                                              window=window)
        tol = measure.gate_tolerance(preset)
        passed[preset] = rel <= tol
        out["gate"].append(dict(arch=arch, dims=list(dims), window=window, preset=preset, max_abs=e, rel=rel,
                                state=se, tolerance=tol, passed=passed[preset], tree=nodes, commit=stamp["commit"]))
    for batch in args.batch:
        p = Problem(arch, dims, batch, nodes)
        bar.set_description_str(f"{stamp['geometry']} L={window} tree of {nodes} b={batch}")
        bar.update(1 + 2 * len(presets))
        (conv, spread), _ = measure.bench_one(p, None, window=window, tree=tree)
        common = dict(arch=arch, dims=list(dims), window=window, draft=nodes, batch=batch, accept=depth, **stamp)
        out["rows"].append(dict(common, kernel="ours", mode="tree", us=conv, spread=spread,
                                bytes=batch * p.state_elems * 4 * (1 + nodes)))
        for preset in presets:
            if not passed[preset]:
                continue
            for mode in ("tree", "chain"):
                (us, spread), tr = measure.bench_one(p, preset, window=window, accept=depth,
                                                     tree=tree if mode == "tree" else None)
                out["rows"].append(dict(common, kernel=preset, mode=mode, us=us, spread=spread, bytes=tr["replay"],
                                        speedup_vs_ours=conv / us))
        _save(out, args.output)


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


def main(argv=None) -> int:
    """``python -m replayssm.bench.cli`` = ``replayssm bench``."""
    from ..cli import main as cli_main
    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
