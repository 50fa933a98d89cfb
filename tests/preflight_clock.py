"""Run ``omni-preflight`` with one rank's wall clock shifted (a planted clock skew).

    python -m tests.preflight_clock --rank R --offset-s S [omni-preflight args ...]

Rank ``R`` (torchrun's ``RANK``) reads ``time.time() + S`` through the
check's injectable clock; the other ranks read the true time. Test-only:
production code carries no fault hooks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--offset-s", type=float, required=True)
    args, rest = parser.parse_known_args(sys.argv[1:])
    shifted = int(os.environ.get("RANK", "0")) == args.rank

    def clock() -> float:
        return time.time() + (args.offset_s if shifted else 0.0)

    from megascale_omni.entry import run_cli
    from megascale_omni.preflight.cli import main as preflight_main

    run_cli(lambda: preflight_main(rest, clock=clock))


if __name__ == "__main__":
    main()
