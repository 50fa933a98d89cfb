"""Run an elastic LLaVA job under a seeded fault plan and prove that nothing
was lost (docs/operations.md).

    python tools/chaos.py --duration 120 [--seed 0] [--groups 2] [--faults N]
        [--classes kill_rank,hang_rank,...] [--run-dir runs/chaos] [--data DIR]
        [--set section.field=value ...] [--anchor-every 500] [--json result.json]

Starts a torchft lighthouse and ``--groups`` replica groups (PP2, the
distributed optimizer, async checkpoints on a size-limited tmpfs when run
as root; one of them kept by the live scheduler, ``omni-sched run``, when
``kill_scheduler`` is planned) and a fault-free reference of the same seed,
re-anchored on the job's checkpoints every ``--anchor-every`` steps; fires
the plan (each fault once the job has every group again after the previous
one; a fault that only starts a group that must be refused runs beside the next);
then checks every committed step's loss against the reference, the sample
ledger (exactly once), every checkpoint left behind, that no process is
left over and that nothing but the plan and the supervisor acted. Prints the
per-class table (count, detection and recovery seconds, steps lost) and the
ETTR; writes ``<run-dir>/chaos-result.json``. Exit 0 when every proof
holds, 1 otherwise, 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megascale_omni.chaos.plan import FAULT_CLASSES  # noqa: E402
from megascale_omni.config import ConfigError  # noqa: E402
from megascale_omni.entry import run_cli  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=120.0, help="seconds of faults after every group trains")
    p.add_argument("--seed", type=int, default=0, help="seeds the fault plan (the job's own seed is fixed)")
    p.add_argument("--groups", type=int, default=2, help="replica groups (2 or 3)")
    p.add_argument("--faults", type=int, default=None, help="faults to fire (default: one per available class)")
    p.add_argument("--classes", default="", help="comma-separated fault classes (default: every available)")
    p.add_argument("--run-dir", default="runs/chaos")
    p.add_argument("--data", default="", help="a LLaVA shard set (default: the shapes demo set, made in the run dir)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra override for every group and the reference (e.g. watchdog.enabled=true)")
    p.add_argument("--spares", type=int, default=1, help="warm standby groups kept ready (default 1)")
    p.add_argument("--cut-off", action="store_true",
                   help="stop firing at --duration even if planned faults are left (default: fire them all)")
    p.add_argument("--anchor-every", type=int, default=500, metavar="STEPS",
                   help="re-anchor the reference on the job's checkpoint every STEPS steps (default 500)")
    p.add_argument("--json", default="", help="also write the result here")
    args = p.parse_args(argv)
    kinds = [k for k in args.classes.split(",") if k] or None
    for k in kinds or []:
        if k not in FAULT_CLASSES:
            raise ConfigError("--classes", k, f"unknown fault class; use some of {', '.join(FAULT_CLASSES)}")
    if args.groups not in (2, 3):
        raise ConfigError("--groups", args.groups, "use 2 or 3 replica groups (2 cores run 3 at most)")
    if args.spares < 0:
        raise ConfigError("--spares", args.spares, "must be >= 0 (0: replace lost groups by cold starts)")
    if args.anchor_every < 1:
        raise ConfigError("--anchor-every", args.anchor_every, "must be >= 1 step")
    if not args.duration > 0:
        raise ConfigError("--duration", args.duration, "must be > 0 seconds")
    if any("=" not in s for s in args.set):
        raise ConfigError("--set", args.set, "each must be section.field=value")
    run_dir = Path(args.run_dir).resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError("--run-dir", str(run_dir), "exists and is not empty; remove it or choose another")
    data = Path(args.data).resolve() if args.data else run_dir / "data"
    if not args.data:
        from megascale_omni.demo.llava_shapes import make_shapes_dataset

        make_shapes_dataset(data, num_train=200, num_val=8, seed=1, samples_per_shard=50)
    from megascale_omni.chaos.run import ChaosConfig, run_chaos, summary

    logging.basicConfig(level=logging.WARNING, format="chaos: %(message)s")
    # SIGTERM (a CI timeout, kill) unwinds through run_chaos, which kills every process of the run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cfg = ChaosConfig(run_dir=run_dir, data_dir=data, duration_s=args.duration, seed=args.seed,
                      slots=args.groups, faults=args.faults, kinds=kinds, overrides=list(args.set),
                      cut_off=args.cut_off, spares=args.spares, anchor_every=args.anchor_every)
    result = run_chaos(cfg)
    print(summary(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    run_cli(lambda: sys.exit(main()))
