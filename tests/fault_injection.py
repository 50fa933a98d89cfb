"""Run an entry point with a failure or a slow rank injected.

    python -m tests.fault_injection --fail-at-step N TARGET [args ...]
    python -m tests.fault_injection --slow-rank R --slow-from-step N --delay-s D TARGET [args ...]

``TARGET`` is a script (``pretrain_dit.py``) or a module
(``megascale_omni.smoke``). ``--fail-at-step``: optimizer step ``N``
(1-based) raises :class:`InjectedFault` on every rank before any parameter
changes, inside the Trainer's failure guard, so the failure-checkpoint path
runs as it would for a real error. ``--slow-rank``: from step ``N`` on, rank
``R`` sleeps ``D`` seconds while fetching its micro-batches (a data-starved
rank). Test-only: production code carries no fault hooks.
"""

from __future__ import annotations

import argparse
import runpy
import sys


class InjectedFault(RuntimeError):
    """Raised on purpose by a test."""


def install(fail_at_step: int) -> None:
    from megascale_omni.training.trainer import Trainer

    original = Trainer._step

    def step_with_fault(self, progress):
        if self.state.step + 1 == fail_at_step:
            raise InjectedFault(f"injected failure at step {fail_at_step} (tests/fault_injection.py)")
        return original(self, progress)

    Trainer._step = step_with_fault


def install_slow_rank(rank: int, from_step: int, delay_s: float) -> None:
    import os
    import time

    from megascale_omni.elastic.service import StaticMembership

    if int(os.environ.get("RANK", "0")) != rank:
        return
    original = StaticMembership.microbatches

    def slow_microbatches(self, share):
        if share.step + 1 >= from_step:
            time.sleep(delay_s)
        return original(self, share)

    StaticMembership.microbatches = slow_microbatches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fail-at-step", type=int, default=None)
    parser.add_argument("--slow-rank", type=int, default=None)
    parser.add_argument("--slow-from-step", type=int, default=1)
    parser.add_argument("--delay-s", type=float, default=0.2)
    parser.add_argument("target")
    args, rest = parser.parse_known_args()
    if args.fail_at_step is not None:
        install(args.fail_at_step)
    if args.slow_rank is not None:
        install_slow_rank(args.slow_rank, args.slow_from_step, args.delay_s)
    run_target(args.target, rest)


def run_target(target: str, args: list[str]) -> None:
    """Run entry point ``target`` (a script path or a module name) as ``__main__`` with ``args``."""
    sys.argv = [target, *args]
    if target.endswith(".py"):
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
