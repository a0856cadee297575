"""The ``replayssm`` command: ``run`` (the reproduction runner), ``bench`` (GPU benchmarks and their
report) and ``eval-kl`` (teacher-forced KL of the presets through a transformers model).

Building the parser imports no torch, so ``--help`` and ``--version`` answer at once. A usage
mistake prints one line and exits with 2.
"""
from __future__ import annotations

import argparse
import sys


class UsageError(Exception):
    """A user mistake: printed as one line ``replayssm CMD: message``, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .bench import cli as bench
    from .integrations import evalkl_cli
    from .run import cli as run

    parser = _Parser(prog="replayssm", description="ReplaySSM: decode Mamba-2 and Gated DeltaNet layers from a "
                     "checkpoint plus a replay buffer. Commands: run (the reproduction runner, CPU), bench (GPU "
                     "benchmarks and their report), eval-kl (teacher-forced KL of the presets, transformers).")
    parser.add_argument("--version", action="version", version=f"replayssm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    run.add_arguments(sub.add_parser("run", help="the reproduction protocol beside float64, its checks and report"))
    bench.add_arguments(sub.add_parser("bench", help="GPU benchmarks against the conventional kernels; "
                                                    "--report regenerates BENCHMARKS.md from their JSON"))
    evalkl_cli.add_arguments(sub.add_parser("eval-kl", help="teacher-forced KL of the presets (needs transformers)"))
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"replayssm {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"replayssm {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
