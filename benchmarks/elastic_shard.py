"""Cross-replica bytes and optimizer state per rank: whole optimizer vs the
distributed optimizer inside elastic replica groups.

    .venv/bin/python benchmarks/elastic_shard.py [--inner-dp 2] [--hidden 256] [--steps 20] [--quick]

Two replica groups of ``--inner-dp`` processes each (TP1 x PP1, a GPT of
examples/elastic/gpt_pp2.yaml's depth with ``--hidden``), one lighthouse,
trained for ``--steps`` steps, twice in one run: with the whole optimizer on
every rank (baseline, the cross-replica all-reduce of every full fp32
gradient buffer) and with ``parallel.use_distributed_optimizer`` (megatron
reduce-scatters inside the group; each rank all-reduces only its shard
across groups). Read from the step records of rank 0 of group r0:

- ``cross_replica_bytes``: payload bytes that rank handed to torchft's
  all-reduce in the step (gradients, token count, loss report), counted at
  the seam (megascale_omni/elastic/cross_replica.py), on steps with 2 participants;
- ``optimizer_state_bytes``: Adam moments and fp32 main copies held by the rank;
- the median step time with 2 participants, and the largest relative loss
  difference between the two runs (the same job, so it should be float noise).

``--quick``: hidden 64, 4 steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _quick import add_quick_flag, apply_quick  # noqa: E402

from tests.dist.elastic_helpers import start_lighthouse, start_replica, step_records  # noqa: E402
from tests.launcher import finish, kill_group  # noqa: E402

QUICK = {"hidden": 64, "steps": 4}
TIMEOUT_S = 1200


def _run(out: Path, inner_dp: int, hidden: int, steps: int, sharded: bool) -> list[dict]:
    """Two groups r0, r1 of one elastic job; returns r0's step records."""
    lighthouse, addr = start_lighthouse(timeout=TIMEOUT_S)
    args = [
        "parallel.pp=1", f"parallel.use_distributed_optimizer={str(sharded).lower()}", f"model.hidden_size={hidden}",
        f"train.steps={steps}", "train.lr_decay_style=constant", "logging.progress_bar=false",
        # No step commits with one group, so every record has both groups in it.
        "elastic.quorum_timeout_s=600", "elastic.min_replicas=2",
    ]
    procs = [start_replica(rid, addr, out, args, timeout=TIMEOUT_S, nproc=inner_dp) for rid in ("r0", "r1")]
    try:
        for p in procs:
            res = finish(p, TIMEOUT_S)
            if res.returncode != 0:
                raise RuntimeError(f"{p.args} exited {res.returncode}: {res.stderr[-3000:]}")
    finally:
        for p in [*procs, lighthouse]:
            kill_group(p)
    return step_records(out / "r0")


def _summary(records: list[dict]) -> dict:
    both = [r for r in records if r["participants"] == 2 and not r["healed"]]
    if not both:
        raise RuntimeError("r1 never trained with r0; raise --steps")
    sent = {r["cross_replica_bytes"] for r in both}
    if len(sent) != 1:
        raise RuntimeError(f"cross-replica bytes changed between steps: {sorted(sent)}")
    return {
        "bytes": sent.pop(),
        "optimizer": records[-1]["optimizer_state_bytes"],
        "step_ms": 1000 * statistics.median(r["step_s"] for r in both),
        "steps_both": len(both),
        "losses": {r["step"]: r["loss"] for r in records},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inner-dp", type=int, default=2, help="processes (DP ranks) per replica group")
    p.add_argument("--hidden", type=int, default=256, help="model.hidden_size")
    p.add_argument("--steps", type=int, default=20, help="training steps of each run")
    p.add_argument("--out", type=Path, default=None, help="run directory (default: a fresh one under /tmp)")
    add_quick_flag(p, QUICK)
    args = apply_quick(p.parse_args(), QUICK)
    out = args.out or Path(f"/tmp/elastic_shard_{int(time.time())}")
    results = {}
    for name, sharded in (("whole", False), ("sharded", True)):
        t0 = time.perf_counter()
        results[name] = _summary(_run(out / name, args.inner_dp, args.hidden, args.steps, sharded))
        print(f"{name}: {time.perf_counter() - t0:.0f} s, {results[name]['steps_both']} steps with 2 participants",
              flush=True)
    whole, sharded = results["whole"], results["sharded"]
    print(f"model: GPT 4 layers, hidden {args.hidden}; 2 replica groups x inner DP {args.inner_dp} (TP1 PP1), "
          f"{args.steps} steps; rank 0 of r0")
    print("| optimizer | cross-replica bytes per step | optimizer state | median step, 2 participants |")
    print("|---|---|---|---|")
    for name, label in (("whole", "whole on every rank (baseline)"), ("sharded", "distributed (sharded)")):
        r = results[name]
        print(f"| {label} | {r['bytes']} | {r['optimizer']} | {r['step_ms']:.1f} ms |")
    print(f"ratio sharded / whole: bytes {sharded['bytes'] / whole['bytes']:.4f}, optimizer state "
          f"{sharded['optimizer'] / whole['optimizer']:.4f} (1/inner DP = {1 / args.inner_dp:.4f}), step time "
          f"{sharded['step_ms'] / whole['step_ms']:.2f}")
    common = sorted(set(whole["losses"]) & set(sharded["losses"]))
    worst = max(abs(sharded["losses"][s] - whole["losses"][s]) / abs(whole["losses"][s]) for s in common)
    print(f"loss, sharded vs whole, max relative difference over {len(common)} steps: {worst:.2e}")


if __name__ == "__main__":
    main()
