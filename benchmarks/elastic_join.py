"""Join latency of an elastic replica group vs a full torchrun restart + checkpoint reload.

    .venv/bin/python benchmarks/elastic_join.py [--join-after 20] [--global-batch 12] [--pin] [--quick]

Three cases side by side on the tiny GPT of examples/elastic/gpt_pp2.yaml
(TP1 x PP2 = two processes per replica group), one lighthouse each:

- cold join: replica group r0 trains; after ``--join-after`` committed
  steps a new replica group r1 is launched (torchrun). Latency = launch ->
  r1's first committed step (it heals from r0 over HTTP, no disk).
- standby join: r1 is launched with ``elastic.standby=true``, builds
  everything and waits outside the quorum; ``--join-after`` steps of r0
  later, ``join`` is sent to its control socket. Latency = the command ->
  r1's first committed step.
- restart baseline: the same job without elasticity, checkpointing every
  step (synchronously, the best case for a restart); killed after
  ``--join-after`` steps and relaunched with torchrun. Latency = relaunch ->
  first committed step after resuming from the checkpoint. Every replica
  stops for all of it.

Survivor disruption (join cases) is r0's lost time in units of its median
step: over the steps from the one in flight when the join started to two
steps after the first step with the new participant count, the sum of each
step's excess over the steady-state median of its participant count (before
the join: the steps before; after: steps 3..23 after it). On this one
machine every process shares the same cores, so a cold joiner's start-up
also slows r0; that is reported separately (``startup_*``) because replica
groups of a real job run on their own nodes. ``--pin`` emulates that with
``taskset``: r0 (and the restarted job) on one half of the cores, r1 on the
other.

Times are wall-clock seconds observed by polling metrics.jsonl every 10 ms.

``--quick``: the join after 5 steps, r0's new steady state from 3 steps
(still 7 torchrun launches: a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _quick import add_quick_flag, apply_quick  # noqa: E402

from megascale_omni.control import ControlClient  # noqa: E402
from megascale_omni.control.client import endpoint_of_run  # noqa: E402
from tests.dist.elastic_helpers import CONFIG, start_lighthouse, start_replica, step_records  # noqa: E402
from tests.launcher import finish, kill_group, spawn, torchrun_cmd  # noqa: E402

#: r0's steps after the first step with the new participant count that are
#: skipped before its new steady state is measured (``--steady-steps`` steps).
STEADY_FROM = 3
QUICK = {"join_after": 5, "steady_steps": 3}


def _wait(predicate, timeout: float, procs=()) -> float:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark step timed out")
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args} exited {p.returncode}: {finish(p, 1).stderr[-2000:]}")
        time.sleep(0.01)
    return time.monotonic()


def _disruption(recs: list[dict], first_in_window: int, steady: range) -> dict:
    """r0's lost step times around its first step with a new participant count."""
    before = recs[0]["participants"]
    changed = next(i for i, r in enumerate(recs) if i >= first_in_window and r["participants"] != before)
    median_before = statistics.median(r["step_s"] for r in recs[2:first_in_window])  # skip warm-up
    median_after = statistics.median(recs[changed + k]["step_s"] for k in steady)
    window = recs[first_in_window : changed + 3]
    lost = sum(r["step_s"] - (median_before if r["participants"] == before else median_after) for r in window)
    return {
        "median_step_s_before": median_before,
        "median_step_s_after": median_after,
        "window_step_s": [round(r["step_s"], 4) for r in window],
        "lost_step_times": lost / median_before,
        "joined_at_step": recs[changed]["step"],
    }


def _first_commit_then_steady(run: Path, procs, steady: range) -> float:
    """Wait for r1's first committed step (returns when), then for enough
    steps of r0 to measure its new steady state."""
    first = _wait(lambda: len(step_records(run / "r1")) >= 1, 600, procs)
    at_first = len(step_records(run / "r0"))
    _wait(lambda: len(step_records(run / "r0")) >= at_first + steady.stop + 2, 600, procs)
    return first


def measure_cold_join(work: Path, args: list[str], join_after: int, cpus: dict, steady: range) -> dict:
    run = work / "cold"
    lighthouse, addr = start_lighthouse(timeout=1200)
    procs = [lighthouse]
    try:
        r0 = start_replica("r0", addr, run, args, timeout=1200, cpus=cpus.get("r0"))
        procs.append(r0)
        _wait(lambda: len(step_records(run / "r0")) >= join_after, 600, procs)
        at_launch = len(step_records(run / "r0"))
        launched = time.monotonic()
        procs.append(start_replica("r1", addr, run, args, timeout=1200, cpus=cpus.get("r1")))
        first = _first_commit_then_steady(run, procs, steady)
    finally:
        for p in procs:
            kill_group(p)
    recs = step_records(run / "r0")
    # The join itself: the step r1 first asked for a quorum in, onwards.
    healed_step = step_records(run / "r1")[0]["step"]
    join = _disruption(recs, next(i for i, r in enumerate(recs) if r["step"] >= healed_step - 1), steady)
    startup = [r["step_s"] for r in recs[at_launch : healed_step - 2]]
    return {
        "latency_s": first - launched,
        **join,
        "startup_steps": len(startup),
        "startup_lost_step_times": sum(s - join["median_step_s_before"] for s in startup) / join["median_step_s_before"],
    }


def measure_standby_join(work: Path, args: list[str], join_after: int, cpus: dict, steady: range) -> dict:
    run = work / "standby"
    lighthouse, addr = start_lighthouse(timeout=1200)
    procs = [lighthouse]
    try:
        r0 = start_replica("r0", addr, run, args, timeout=1200, cpus=cpus.get("r0"))
        r1 = start_replica("r1", addr, run, [*args, "elastic.standby=true"], timeout=1200, cpus=cpus.get("r1"))
        procs += [r0, r1]
        _wait(lambda: _state(run / "r1") == "standby", 600, procs)
        # The standby's start-up is over; r0 settles before the join.
        start = len(step_records(run / "r0"))
        _wait(lambda: len(step_records(run / "r0")) >= start + join_after, 600, procs)
        at_join = len(step_records(run / "r0"))
        sent = time.monotonic()
        with ControlClient(endpoint_of_run(str(run / "r1")), timeout_s=60) as client:
            client.call("join")
        first = _first_commit_then_steady(run, procs, steady)
    finally:
        for p in procs:
            kill_group(p)
    recs = step_records(run / "r0")
    return {"latency_s": first - sent, **_disruption(recs, max(at_join - 1, start + 2), steady)}


def _state(run_dir: Path):
    if not (run_dir / "control.json").exists():
        return None
    try:
        with ControlClient(endpoint_of_run(str(run_dir)), timeout_s=5) as client:
            return client.call("status")["state"]
    except (OSError, ConnectionError):
        return None


def measure_restart(work: Path, args: list[str], kill_after: int, cpus: dict) -> dict:
    out = work / "restart"
    cmd = torchrun_cmd(2, "megascale_omni.smoke", [
        "--config", CONFIG, "elastic.enabled=false", *args, f"logging.output_dir={out}",
        f"checkpoint.dir={out / 'ckpt'}", "checkpoint.interval=1", "checkpoint.async_save=false",
    ])
    if cpus.get("r0"):
        cmd = ["taskset", "-c", cpus["r0"], *cmd]
    first = spawn(cmd, timeout=1200)
    try:
        _wait(lambda: len(step_records(out)) >= kill_after + 1, 600, [first])
    finally:
        kill_group(first)
    done = len(step_records(out))
    relaunched = time.monotonic()
    second = spawn(cmd, timeout=1200)
    try:
        resumed = _wait(lambda: len(step_records(out)) > done, 600, [second])
    finally:
        kill_group(second)
    return {"latency_s": resumed - relaunched}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--join-after", type=int, default=20, help="r0's committed steps before the join starts")
    p.add_argument("--global-batch", type=int, default=12,
                   help="samples per step (micro-batches of 2; a larger batch gives a longer step)")
    p.add_argument("--pin", action="store_true",
                   help="give each replica group cores of its own (taskset: r0 and the restarted job on the first "
                        "half, r1 on the second), as on separate nodes")
    p.add_argument("--steady-steps", type=int, default=20,
                   help=f"r0's steps whose median is its new steady state, from step {STEADY_FROM} after the join on")
    add_quick_flag(p, QUICK)
    args = apply_quick(p.parse_args(), QUICK)
    if args.join_after < 4:
        p.error("--join-after must be >= 4 (r0's first two steps are warm-up; its step time before the join "
                "comes from the steps after them)")
    steady = range(STEADY_FROM, STEADY_FROM + args.steady_steps)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cpus: dict = {}
    if args.pin:
        n = os.cpu_count() or 2
        half = max(n // 2, 1)
        cpus = {"r0": f"0-{half - 1}", "r1": f"{half}-{n - 1}" if n > 1 else "0"}
    job_args = ["train.steps=100000", f"train.global_batch_size={args.global_batch}", "train.lr_decay_style=constant",
                "logging.progress_bar=false", "logging.tensorboard=false"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cold = measure_cold_join(work, job_args, args.join_after, cpus, steady)
        standby = measure_standby_join(work, job_args, args.join_after, cpus, steady)
        restart = measure_restart(work, job_args, args.join_after, cpus)
    result = {
        "pinned_cpus": cpus or None,
        "cold_join": cold, "standby_join": standby, "restart": restart,
        "cold_over_restart": cold["latency_s"] / restart["latency_s"],
        "standby_over_restart": standby["latency_s"] / restart["latency_s"],
    }
    print(json.dumps(result, indent=2))
    median = standby["median_step_s_before"]
    print(
        f"latency: cold join {cold['latency_s']:.2f} s, standby join {standby['latency_s']:.3f} s, "
        f"restart+reload {restart['latency_s']:.2f} s (ratios {result['cold_over_restart']:.2f} and "
        f"{result['standby_over_restart']:.3f})\n"
        f"survivor lost step times at the join: cold {cold['lost_step_times']:.2f}, "
        f"standby {standby['lost_step_times']:.2f} (median step {median * 1e3:.0f} ms); "
        f"during the cold joiner's start-up on the same cores {cold['startup_lost_step_times']:.2f}; "
        f"restart: every replica stops {restart['latency_s'] / median:.0f} step times"
    )


if __name__ == "__main__":
    main()
