"""Run an elastic job on one machine and scale it: join, standby join, drain, SIGKILL.

    .venv/bin/python examples/elastic/local_cluster.py [--out runs/elastic-local]

Starts a torchft lighthouse, then replica group r0 (a torchrun job of 2
processes: TP1 x PP2, examples/elastic/gpt_pp2.yaml). When r0 has committed
10 steps it starts r1, which heals from r0 and joins (a cold join), and r2
as a warm standby (``elastic.standby=true``: built, outside the quorum);
once r1 trains, ``omni-ctl join`` brings r2 in within a fraction of a
second. A few steps later it drains r1 with ``omni-ctl drain`` (r1 leaves
the quorum at the next step boundary and exits 0), then SIGKILLs r2 (every
process of it); r0 carries on alone for 10 steps and is drained. Each group
writes ``<out>/<replica>/metrics.jsonl`` (one line per committed step, with
``participants``) and the sample ledger goes to ``<out>/ledger``. On a
cluster, a scheduler does the same with its own launcher; ``omni-sched run``
(docs/scheduler.md, "Running live") does it with the launchers of
``megascale_omni/scheduler/launchers.py``, whose process helpers this script uses.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from megascale_omni.scheduler.launchers import free_port, kill_tree

BIN = Path(sys.executable).parent
CONFIG = "examples/elastic/gpt_pp2.yaml"


def committed(out: Path, replica: str) -> list[dict]:
    """Committed step records of ``replica`` so far (a half-written last line is skipped)."""
    path = out / replica / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in record:
            records.append(record)
    return records


def start_replica(replica: str, lighthouse: str, out: Path, steps: int, standby: bool = False) -> subprocess.Popen:
    """One replica group: its own torchrun with its own store port."""
    cmd = [
        str(BIN / "torchrun"), "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        "-m", "megascale_omni.smoke", "--config", CONFIG, f"train.steps={steps}",
        f"elastic.replica_id={replica}", f"elastic.lighthouse={lighthouse}", f"elastic.ledger_dir={out / 'ledger'}",
        f"logging.output_dir={out / replica}", f"elastic.standby={str(standby).lower()}",
    ]
    log = open(out / f"{replica}.log", "w")
    print(f"start {replica}: {' '.join(cmd)}")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def omni_ctl(out: Path, replica: str, *command: str) -> dict:
    """Send a control command to ``replica``; returns its JSON reply."""
    res = subprocess.run([str(BIN / "omni-ctl"), "--run-dir", str(out / replica), "--timeout", "300", "--json",
                          *command], capture_output=True, text=True)
    return json.loads(res.stdout) if res.stdout.strip() else {"ok": False, "error": res.stderr.strip()}


def wait_until(what: str, predicate, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(0.2)
    print(what)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100_000, help="step budget; the run ends by drain well before")
    p.add_argument("--out", default="runs/elastic-local")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    port = free_port()
    # join_timeout far above a step time (see docs/elastic.md); heartbeat
    # timeout = how long survivors wait for a drained or dead group.
    lighthouse = subprocess.Popen(
        [str(BIN / "torchft_lighthouse"), "--min_replicas", "1", "--bind", f"[::]:{port}",
         "--join_timeout_ms", "60000", "--heartbeat_timeout_ms", "2000"],
        stdout=open(out / "lighthouse.log", "w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    addr = f"http://localhost:{port}"
    groups: dict[str, subprocess.Popen] = {}

    def steps_with(participants: int, n: int) -> None:
        at = len(committed(out, "r0"))
        wait_until(f"{n} steps with {participants} replica group(s)",
                   lambda: len(committed(out, "r0")) >= at + n and committed(out, "r0")[-1]["participants"] == participants)

    try:
        groups["r0"] = start_replica("r0", addr, out, args.steps)
        wait_until("r0 committed 10 steps", lambda: len(committed(out, "r0")) >= 10)
        groups["r1"] = start_replica("r1", addr, out, args.steps)
        groups["r2"] = start_replica("r2", addr, out, args.steps, standby=True)
        wait_until("r1 joined (cold start)", lambda: committed(out, "r0")[-1]["participants"] == 2)
        wait_until("r2 stands by", lambda: (out / "r2" / "control.json").exists()
                   and omni_ctl(out, "r2", "status").get("result", {}).get("state") == "standby")
        sent = time.monotonic()
        print(f"join r2: {omni_ctl(out, 'r2', 'join')}")
        wait_until("r2 joined (standby)", lambda: committed(out, "r0")[-1]["participants"] == 3)
        print(f"r2 joined {time.monotonic() - sent:.2f} s after the join command")
        steps_with(3, 3)
        print(f"drain r1: {omni_ctl(out, 'r1', 'drain')}")
        print(f"drained r1: exited {groups.pop('r1').wait()}")
        steps_with(2, 3)
        kill_tree(groups.pop("r2"))
        print("SIGKILLed r2")
        steps_with(1, 10)
        print(f"drain r0: {omni_ctl(out, 'r0', 'drain')}")
        for rid, proc in groups.items():
            print(f"{rid} exited {proc.wait()}")
        recs = committed(out, "r0")
        runs: list[list[int]] = []
        for r in recs:
            if runs and runs[-1][0] == r["participants"]:
                runs[-1][1] += 1
            else:
                runs.append([r["participants"], 1])
        print("participants x steps: " + ", ".join(f"{p}x{n}" for p, n in runs))
        print(f"final loss {recs[-1]['loss']:.4f} at step {recs[-1]['step']}")
    finally:
        for proc in [*groups.values(), lighthouse]:
            if proc.poll() is None:
                kill_tree(proc)


if __name__ == "__main__":
    main()
