"""``omni-sched``: the reference scheduler's command line (docs/scheduler.md).

    omni-sched simulate --trace examples/scheduler/two_jobs.yaml --policy all --out runs/sched
    omni-sched simulate --trace examples/scheduler/two_jobs.yaml --noise 0.2 --seed 1
    omni-sched validate --trace my_trace.yaml --config knobs.yaml
    omni-sched generate --jobs 160 --gpus 32 --seed 1 --out runs/philly.yaml
    omni-sched probe --job A=runs/a/control.sock --job B=127.0.0.1:7700
    omni-sched run --config examples/scheduler/live_local.yaml

Exit codes: 0 ok, 2 bad trace, config or usage (one line naming the field,
the value and the fix), 3 ``probe`` could not reach every job.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import yaml

from megascale_omni.errors import ConfigError

EXIT_USAGE, EXIT_UNREACHABLE = 2, 3
POLICY_NAMES = ("elastic", "static", "greedy", "pollux")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omni-sched", description="Elastic scheduler: trace simulator and job probe "
                                "(see docs/scheduler.md).")
    p.add_argument("-v", "--verbose", action="store_true", help="log every decision with its reason to stderr")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    sim = sub.add_parser("simulate", help="run policies on a trace; print the side-by-side table")
    _trace_args(sim)
    sim.add_argument("--policy", default="all", choices=(*POLICY_NAMES, "all"),
                     help="elastic (hysteresis, cooldown, rebalance), static (peak allocation), greedy "
                          "(goodput every tick, no hysteresis), pollux (goodput every tick, charged for "
                          "reallocation), or all four side by side (default)")
    sim.add_argument("--out", metavar="DIR", help="write summary.json, decisions.log and PNG plots per policy here")
    sim.add_argument("--noise", default=0.0, type=float, metavar="F",
                     help="scale each job's demand every tick by a uniform factor in [1-F, 1+F] (default 0)")
    sim.add_argument("--seed", default=0, type=int, help="noise seed (same draws for every policy)")
    gen = sub.add_parser("generate", help="write a many-job trace with queues drawn from published Philly "
                         "statistics (docs/scheduler.md, Generated workloads)")
    gen.add_argument("--out", required=True, metavar="FILE", help="trace to write (.json, else YAML)")
    gen.add_argument("--jobs", type=int, default=160, help="jobs (default 160)")
    gen.add_argument("--gpus", type=int, default=64, help="GPUs in the cluster (default 64)")
    gen.add_argument("--window-min", type=float, default=480.0, metavar="MIN",
                     help="minutes the arrivals are spread over, at Philly's hourly rate (default 480)")
    gen.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    val = sub.add_parser("validate", help="check a trace (and knobs) without simulating")
    _trace_args(val)
    probe = sub.add_parser("probe", help="read status and the last step record of running jobs, with retries")
    probe.add_argument("--job", action="append", required=True, metavar="NAME=SOCKET",
                       help="a job and its control socket (path or HOST:PORT); repeat for several")
    probe.add_argument("--attempts", type=int, default=4, help="tries per job (default 4)")
    probe.add_argument("--backoff", type=float, default=0.5, metavar="S",
                       help="first wait between tries, doubled each time up to 8 s (default 0.5)")
    probe.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds per reply (default 5)")
    run = sub.add_parser("run", help="schedule live jobs: launch, join, drain and kill replica groups")
    run.add_argument("--config", required=True, metavar="FILE", help="live config (docs/scheduler.md, Running live)")
    run.add_argument("--ticks", type=int, metavar="N", help="stop (draining every group) after N ticks")
    run.add_argument("--dry-run", action="store_true",
                     help="slurm/kubernetes: print the commands and manifests instead of running them")
    return p


def _trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, metavar="FILE", help="trace, YAML or JSON (docs/scheduler.md)")
    p.add_argument("--config", metavar="FILE", help="policy knobs (YAML mapping), over the trace's policy: section")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command; raises ConfigError on bad input (see :func:`cli`)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if args.cmd == "probe":
        return _probe(args)
    if args.cmd == "generate":
        return _generate(args)
    if args.cmd == "run":
        from megascale_omni.scheduler.live_run import run_live

        for line in run_live(args.config, ticks=args.ticks, dry_run=args.dry_run):
            print(line)
        return 0
    from megascale_omni.scheduler.policy import Knobs
    from megascale_omni.scheduler.trace import load_trace

    trace = load_trace(args.trace)
    knobs = Knobs.from_dict(trace.policy, "policy")
    if args.config:
        knobs = Knobs.from_dict({**trace.policy, **_load_knobs(args.config)}, args.config)
    if args.cmd == "validate":
        print(f"{args.trace}: ok ({len(trace.pools)} pools, {len(trace.jobs)} jobs, horizon {trace.horizon_min:g} min)")
        return 0
    if not 0 <= args.noise < 1:
        raise ConfigError("--noise", args.noise, "give a fraction in [0, 1), e.g. 0.2 for +-20%")
    return _simulate(args, trace, knobs)


def _simulate(args: argparse.Namespace, trace, knobs) -> int:
    from megascale_omni.scheduler.baselines import make_policy
    from megascale_omni.scheduler.report import table, write_run
    from megascale_omni.scheduler.simulator import simulate

    names = POLICY_NAMES if args.policy == "all" else (args.policy,)
    results = [simulate(trace, make_policy(name, trace, knobs), noise=args.noise, seed=args.seed) for name in names]
    print(f"trace {trace.name}: {len(trace.jobs)} jobs, noise +-{args.noise:g}, seed {args.seed}")
    print(table(results))
    if args.out:
        out = Path(args.out) / trace.name
        for r in results:
            write_run(r, out / r.policy)
        (out / "comparison.md").write_text(table(results) + "\n", encoding="utf-8")
        print(f"wrote {out}/comparison.md and {', '.join(r.policy for r in results)}/"
              "{summary.json,decisions.log,allocation.png,pools.png,moves.png}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    import json

    from megascale_omni.scheduler.workload import WorkloadSpec, generate, generate_trace

    for flag, value in (("--jobs", args.jobs), ("--gpus", args.gpus)):
        if value < 1:
            raise ConfigError(flag, value, "must be >= 1" + (" (a larger request is capped at the cluster)"
                                                             if flag == "--gpus" else ""))
    if not 0 < args.window_min < float("inf"):
        raise ConfigError("--window-min", args.window_min, "give a finite number of minutes > 0")
    spec = WorkloadSpec(jobs=args.jobs, gpus=args.gpus, window_min=args.window_min)
    generate_trace(spec, args.seed)  # validated before anything is written
    doc = generate(spec, args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=1) if out.suffix == ".json" else yaml.safe_dump(doc, sort_keys=False)
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}: {args.jobs} jobs over {args.window_min:g} min on {args.gpus} GPUs, seed {args.seed}")
    return 0


def _load_knobs(path: str) -> dict:
    from megascale_omni.scheduler.trace import read_utf8

    text = read_utf8("--config", path, "give a YAML file of policy knobs")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError("--config", path, f"not valid YAML: {str(e).splitlines()[0]}") from None
    if isinstance(raw, dict) and set(raw) == {"policy"}:
        raw = raw["policy"]
    if not isinstance(raw, dict):
        raise ConfigError("--config", path, "must be a YAML mapping of policy knobs (knob: value)")
    return raw


def _probe(args: argparse.Namespace) -> int:
    from megascale_omni.control.client import parse_target
    from megascale_omni.scheduler.live import observe

    if args.attempts < 1:
        raise ConfigError("--attempts", args.attempts, "must be >= 1")
    targets = []
    for item in args.job:
        name, sep, where = item.partition("=")
        if not sep or not name or not where:
            raise ConfigError("--job", item, "write NAME=SOCKET, e.g. A=runs/a/control.sock or A=127.0.0.1:7700")
        try:
            targets.append((name, parse_target(where)))
        except ValueError as e:
            raise ConfigError("--job", item, str(e)) from None
    token = os.environ.get("MEGASCALE_CONTROL_TOKEN") or None
    seen = [observe(name, address, attempts=args.attempts, backoff_s=args.backoff, timeout_s=args.timeout,
                    token=token) for name, address in targets]
    for obs in seen:
        print(obs.describe())
    return 0 if all(o.reachable for o in seen) else EXIT_UNREACHABLE


def cli(argv: Optional[Sequence[str]] = None) -> None:
    """Console-script entry point: a ConfigError becomes one stderr line and exit code 2."""
    try:
        code = main(argv)
        sys.stdout.flush()
    except ConfigError as e:
        sys.stderr.write(f"omni-sched: {e}\n")
        code = EXIT_USAGE
    except BrokenPipeError:  # e.g. `omni-sched simulate ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    cli()
