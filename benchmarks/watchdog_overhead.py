"""Cost of the hang watchdog: the training thread's heartbeat and the watchdog thread's poll.

    .venv/bin/python benchmarks/watchdog_overhead.py [--steps 5000] [--polls 2000] [--quick]

Training thread: a stand-in step makes the calls a PP2 step with 8
micro-batches makes on the step's phase clock (start, 16 pipeline
send/receive phases, the gradient sync, the cross-replica phase, two marks,
one read) and the loop's own heartbeat marks, with the clock alone
(baseline) and with the watchdog's heartbeat listening, side by side in one
process. Watchdog thread: one poll (publish this rank's heartbeat, read the
published verdict and each watched peer's heartbeat, judge) against a real
c10d TCPStore on loopback, with 1 and 8 watched peers.

``--quick``: 200 steps, 20 polls.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _quick import add_quick_flag, apply_quick  # noqa: E402

QUICK = {"steps": 200, "polls": 20}
MICROBATCHES = 8
#: The tiny GPT's median PP2 step on this machine (BENCHMARKS.md, "Cost of the step metrics").
TINY_STEP_S = 0.1187


def stand_in_step(clock, beat) -> None:
    """The phase-clock and heartbeat calls of one PP2 step with 8 micro-batches."""
    beat.enter("quorum")
    beat.enter("data-wait")
    clock.start()
    for _ in range(2 * MICROBATCHES):
        with clock.phase("pipeline_wait"):
            pass
    with clock.phase("grad_sync"):
        pass
    with clock.phase("cross_replica"):
        pass
    clock.mark("fwd_bwd")
    clock.mark("optimizer")
    clock.read()
    beat.step_ended(1)
    beat.enter("step-boundary")
    beat.enter("checkpoint")


def time_steps(listening: bool, steps: int) -> float:
    """Median seconds per stand-in step over 5 rounds of ``steps``."""
    from megascale_omni.metrics.clock import PhaseClock
    from megascale_omni.watchdog import Heartbeat

    beat = Heartbeat()
    clock = PhaseClock()
    clock.listen(beat if listening else None)
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(steps):
            stand_in_step(clock, beat)
        rounds.append((time.perf_counter() - t0) / steps)
    return statistics.median(rounds)


def time_polls(peers: int, polls: int) -> float:
    """Median seconds per watchdog poll with ``peers`` watched peers publishing, real TCPStore."""
    import torch.distributed as dist

    from megascale_omni.config import WatchdogConfig
    from megascale_omni.watchdog import Watchdog

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    world = peers + 1

    def client():
        store = dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=30))
        return dist.PrefixStore("omni-watchdog/0", store)

    cfg = WatchdogConfig()
    dogs = [Watchdog(cfg, r, world, "bench", elastic=False, local_rank=r, local_world_size=world, store=client)
            for r in range(world)]
    for d in dogs:
        d.check()
    me = dogs[0]
    times = []
    for _ in range(polls):
        for d in dogs[1:]:
            d._publish(d._beat())  # the peers keep publishing, as live ranks do
        t0 = time.perf_counter()
        assert me.check() is None
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--polls", type=int, default=2000)
    add_quick_flag(p, QUICK)
    args = apply_quick(p.parse_args(), QUICK)
    base, listened = [], []
    for _ in range(3):  # interleaved, so drifting load hits both alike
        base.append(time_steps(False, args.steps))
        listened.append(time_steps(True, args.steps))
    b, w = statistics.median(base), statistics.median(listened)
    added = w - b
    print(f"training thread, stand-in PP2 step with {MICROBATCHES} micro-batches, {args.steps} steps x 15 rounds:")
    print(f"  phase clock alone (baseline): {b * 1e6:.1f} us per step")
    print(f"  with the heartbeat listening: {w * 1e6:.1f} us per step; ratio {w / b:.2f}x")
    print(f"  added {added * 1e6:.1f} us per step = {added / TINY_STEP_S:.4%} of the tiny GPT's PP2 step "
          f"({TINY_STEP_S * 1e3:.1f} ms)")
    print(f"watchdog thread, one poll (publish, read verdict and peers, judge), TCPStore on loopback, "
          f"{args.polls} polls:")
    for peers in (1, 8):
        poll = time_polls(peers, args.polls)
        print(f"  {peers} watched peer(s): {poll * 1e6:.0f} us per poll = {poll / 5.0:.4%} of one core at "
              f"poll_s=5, {poll / 0.25:.3%} at poll_s=0.25")


if __name__ == "__main__":
    main()
