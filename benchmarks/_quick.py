"""``--quick`` for the benchmarks: the same code path at tiny sizes.

A quick run finishes in seconds to a minute on a 2-core CPU and prints the
same tables; its numbers mean nothing (tests/e2e/test_benchmarks_quick.py
runs every benchmark this way so the commands in BENCHMARKS.md keep working).
"""

from __future__ import annotations

import argparse


def add_quick_flag(parser: argparse.ArgumentParser, quick: dict) -> None:
    """``--quick``: replace the options in ``quick`` (dest -> value) by tiny sizes."""
    sizes = ", ".join(f"--{dest.replace('_', '-')} {value}" for dest, value in quick.items())
    parser.add_argument(
        "--quick", action="store_true",
        help=f"the same code path at tiny sizes, to check the benchmark runs (the numbers mean nothing); "
             f"sets {sizes}" if sizes else "the same code path at tiny sizes (the numbers mean nothing)",
    )


def apply_quick(args: argparse.Namespace, quick: dict) -> argparse.Namespace:
    """Under ``--quick``, set every option of ``quick`` (whatever was given)."""
    if args.quick:
        for dest, value in quick.items():
            setattr(args, dest, value)
    return args
