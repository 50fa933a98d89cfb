"""Run an entry point with a failure injected into one training step.

    python -m tests.fault_injection --fail-at-step N TARGET [args ...]

``TARGET`` is a script (``pretrain_dit.py``) or a module
(``megascale_omni.smoke``). Optimizer step ``N`` (1-based) raises
:class:`InjectedFault` on every rank before any parameter changes, inside the
Trainer's failure guard, so the failure-checkpoint path runs as it would for
a real error. Test-only: production code carries no fault hooks.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fail-at-step", type=int, required=True)
    parser.add_argument("target")
    args, rest = parser.parse_known_args()
    install(args.fail_at_step)
    sys.argv = [args.target, *rest]
    if args.target.endswith(".py"):
        runpy.run_path(args.target, run_name="__main__")
    else:
        runpy.run_module(args.target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
