"""The ``replayssm`` command: ``run`` (the reproduction runner), ``bench`` (GPU benchmarks) and
``eval-kl`` (teacher-forced KL of the presets through a transformers model)."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="replayssm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from . import run
    run.add_arguments(sub.add_parser("run", help="the seeded reproduction protocol and its report"))
    from .bench import cli as bench
    bench.add_arguments(sub.add_parser("bench", help="GPU benchmarks against the conventional kernels"))
    from .integrations import evalkl  # imports transformers only when the command runs
    evalkl.add_arguments(sub.add_parser("eval-kl", help="teacher-forced KL of the presets (transformers)"))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
