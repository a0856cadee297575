"""The command line of ``replayssm run``. Defining the options imports no torch (fast ``--help``)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..cli import UsageError, positive_int
from ..geometry import GEOMETRIES, parse_geometry
from ..precision import PRESET_NAMES, REPRODUCTION_PRESETS, S32_MAX_ABS
from . import PROTOCOL

ARCH_CHOICES = ("mamba2", "gdn", "kda")
#: what runs without --arch; Kimi Delta Attention is opt-in (--arch kda, or all)
DEFAULT_ARCHS = ("mamba2", "gdn")


def _archs(text: str) -> tuple:
    if text == "all":
        return ARCH_CHOICES
    items = [x for x in text.split(",") if x]
    bad = [x for x in items if x not in ARCH_CHOICES]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"unknown layer kind {','.join(bad) or repr(text)}; "
                                         f"choose from {','.join(ARCH_CHOICES)} (comma-separated) or all")
    return tuple(a for a in ARCH_CHOICES if a in items)


def _presets(text: str) -> list:
    if text == "all":
        return list(PRESET_NAMES)
    items = [x for x in text.split(",") if x]
    bad = [x for x in items if x not in PRESET_NAMES]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"unknown preset {','.join(bad) or repr(text)}; "
                                         f"choose from {','.join(PRESET_NAMES)} or all")
    return items


def _seeds(text: str) -> list:
    try:
        items = [int(x) for x in text.split(",") if x]
    except ValueError:
        items = []
    if not items or min(items) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated non-negative integers, got {text!r}")
    return items


def _geometry(text: str):
    try:
        return parse_geometry(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Define the ``run`` subcommand's options; the handler returns the exit code."""
    p.description = (f"Run the ReplaySSM reproduction protocol ({PROTOCOL}) beside the float64 recurrence, "
                     "check the invariants, print tables and write a JSON report. Exit code 0 only if every "
                     "invariant holds, 1 if one fails, 2 for a usage error. About 30 s on 2 CPU cores with the "
                     "defaults.")
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    # no default value (SUPPRESS): "not given" differs from any list when a model --geometry picks
    p.add_argument("--arch", type=_archs, default=argparse.SUPPRESS, metavar="mamba2|gdn|kda|all",
                   help=f"layer kinds to run, comma-separated, or all ({','.join(ARCH_CHOICES)}); default: "
                        f"{','.join(DEFAULT_ARCHS)}, or the kind of a model --geometry")
    p.add_argument("--presets", type=_presets, default=list(REPRODUCTION_PRESETS),
                   help=f"comma-separated presets or 'all' ({','.join(PRESET_NAMES)}); s32_rs always runs as "
                        "the baseline")
    p.add_argument("--seeds", type=_seeds, default=[42, 43, 44], help="random seeds of the inputs, one case each")
    p.add_argument("--steps", type=positive_int, default=48, help="schedule steps (decodes and speculative rounds)")
    p.add_argument("--window", type=positive_int, default=16, help="refresh window L")
    p.add_argument("--max-draft", type=positive_int, default=4, help="draft length T of speculative rounds")
    p.add_argument("--batch", type=positive_int, default=4, help="live sequences in the batch (plus one pad row)")
    p.add_argument("--geometry", type=_geometry, default=(None, GEOMETRIES["small"].geometry),
                   metavar="NAME|H,P,N,G",
                   help=f"one of {', '.join(GEOMETRIES)}, or H,P,N,G (default: small = "
                        f"{','.join(map(str, GEOMETRIES['small'].geometry))}); a model geometry runs its own "
                        "layer kind only")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--backend", default=None, choices=("torch", "triton"),
                   help="library backend (default: triton on CUDA when installed, else torch)")
    p.add_argument("--no-controls", dest="controls", action="store_false",
                   help="do not add the control presets that check (c) needs")
    p.add_argument("--no-twin", dest="twin", action="store_false",
                   help="do not run the twin caches that check (d) needs (halves the cost of long runs)")
    p.add_argument("--s32-limit", type=float, default=S32_MAX_ABS,
                   help="check (a): bound on s32_rs's max abs output error (sized for the small geometry; "
                        "large geometries have a longer fp32 rounding tail)")
    p.add_argument("--drift-every", type=positive_int, default=4, help="record anchor drift every N refreshes")
    p.add_argument("--check-every", type=positive_int, default=4,
                   help="materialize committed states (state error, twin comparison) every K steps and at the last")
    p.add_argument("--plot", default="auto",
                   help="drift plot PNG path; 'auto' = next to --output when --steps >= 1000; 'none'")
    p.add_argument("--output", default="runs/replayssm.json", help="JSON report path ('-' = do not write)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch CPU threads (the small geometry is latency-bound: more threads only add overhead)")
    p.add_argument("--quiet", action="store_true", help="print only the verdict line")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                   help="print the differences between two reports and exit (0: same protocol and inputs)")
    p.set_defaults(func=main)


def run_all(cfg, plan, progress: bool = False) -> dict:
    """Run every (arch, seed) case and build the report. An exception inside a case becomes a
    failed check (x) naming it, so a broken implementation still yields a report."""
    from .. import _progress
    from .checks import record, run_case
    from .report import build_report

    bar = _progress.bar(len(cfg.archs) * len(cfg.seeds) * cfg.steps, "replayssm run", enabled=progress or False)
    t0 = time.perf_counter()
    cases = {}
    for arch in cfg.archs:
        for seed in cfg.seeds:
            bar.set_description_str(f"{arch} seed {seed}")
            try:
                cases[(arch, seed)] = run_case(arch, seed, cfg, plan, bar)
            except Exception as exc:  # noqa: BLE001 - reported as a named failed check
                cases[(arch, seed)] = {"input_sha256": "", "runs": [], "checks": [record(
                    "x", arch, seed, None, False, None, 1, 1, f"{type(exc).__name__}: {exc}")]}
    bar.close()
    return build_report(cfg, plan, cases, time.perf_counter() - t0)


def _load_report(path: str) -> dict:
    try:
        with open(path) as f:
            rep = json.load(f)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(rep, dict) or rep.get("protocol") is None or "runs" not in rep:
        raise UsageError(f"{path} is not a replayssm run report")
    return rep


def main(args) -> int:
    if args.compare:
        from .report import compare_reports
        return compare_reports(*(_load_report(p) for p in args.compare))
    if args.max_draft > args.window:
        raise UsageError(f"--max-draft ({args.max_draft}) must be <= --window ({args.window})")
    geo_arch, geometry = args.geometry
    asked = getattr(args, "arch", None)  # None: --arch not given
    if geo_arch is not None and asked is not None and geo_arch not in asked:
        raise UsageError(f"--geometry is a {geo_arch} geometry, not {','.join(asked)}")
    archs = (geo_arch,) if geo_arch is not None else (asked or DEFAULT_ARCHS)

    import torch

    from .protocol import Config, plan_presets
    from .report import jsonable, plot_drift, print_report

    try:
        dev = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: CUDA is not available on this machine")
        if dev.index is None:  # tensors land on cuda:N; give the caches the same explicit index
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise UsageError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if args.backend == "triton":
        try:
            import triton  # noqa: F401
        except ImportError:
            raise UsageError("--backend triton: triton is not installed (pip install 'replayssm[triton]')") from None
    cfg = Config(archs, tuple(args.presets), tuple(args.seeds), args.steps, args.window, args.max_draft, args.batch,
                 geometry, str(dev), args.backend, args.controls, args.twin, args.drift_every, args.check_every,
                 args.s32_limit)
    plan = plan_presets(cfg.presets, cfg.controls)
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(args.threads)
    try:
        rep = run_all(cfg, plan, progress=sys.stderr.isatty() and not args.quiet)
    finally:
        torch.set_num_threads(threads)
    messages = []
    if args.output != "-":
        out = Path(args.output)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(jsonable(rep), indent=1) + "\n")
        except OSError as exc:
            raise UsageError(f"cannot write {out}: {exc.strerror}") from None
        messages.append(f"report written to {out}")
        plot = None if args.plot == "none" else (
            out.with_suffix(".drift.png") if args.plot == "auto" and cfg.steps >= 1000 else
            None if args.plot == "auto" else Path(args.plot))
        if plot is not None:
            messages.append(plot_drift(rep, plot))
    if args.quiet:
        print(f"PASS ({rep['wall_s']:.1f} s)" if rep["passed"] else f"FAIL: {', '.join(rep['failed_checks'])}")
    else:
        print_report(rep)
        for m in messages:
            print(m)
    return 0 if rep["passed"] else 1

