"""Fault classes and the seeded fault plan (pure: no processes, no I/O).

A plan is a list of :class:`Fault` sorted by the time (seconds after the
job's first committed step) at which the harness fires it. The harness fires
faults one at a time: a fault due while the previous one is still being
recovered from waits for it (the delay is reported), so each fault's
detection and recovery times are its own.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class FaultClass:
    """One kind of fault: ``what`` it does to the job and what ``detected``
    means for it (the event the harness times from the firing)."""

    name: str
    what: str
    detected: str


#: Every fault class of issue 35, in the order the report prints them.
FAULT_CLASSES: dict[str, FaultClass] = {c.name: c for c in (
    FaultClass("kill_rank", "SIGKILL one rank of a replica group",
               "the survivors commit a step without the group"),
    FaultClass("kill_group", "SIGKILL every process of a replica group",
               "the survivors commit a step without the group"),
    FaultClass("kill_lighthouse", "SIGKILL the torchft lighthouse (the supervisor restarts it on its port)",
               "a step commits under the restarted lighthouse"),
    FaultClass("kill_scheduler", "SIGKILL the live scheduler process (omni-sched run keeping some of the groups)",
               "its supervisor (the harness) sees it gone and restarts it"),
    FaultClass("hang_rank", "SIGSTOP one rank (a hang: alive, no progress)",
               "the survivors commit a step without the stuck group, or the group exits"),
    FaultClass("hang_data_worker", "SIGSTOP one data-loader worker process of a rank",
               "the survivors commit a step without the stuck group, or the group exits"),
    FaultClass("straggler", "one rank slowed down (SIGSTOP/SIGCONT duty cycle)",
               "nothing to detect: the job keeps committing, slower"),
    FaultClass("ckpt_enospc", "the checkpoint file system runs out of space during saves",
               "a group reports the failed save (No space left on device)"),
    FaultClass("shard_corrupt", "a data shard replaced by a corrupted copy while the job runs",
               "a group opening the shard refuses it (exit 3) naming the shard"),
    FaultClass("control_flood", "a flood of connections, garbage and requests on a group's control socket",
               "nothing to detect: the socket keeps answering and training goes on"),
    FaultClass("preflight_fail", "a replica group started on a node that fails its pre-flight checks",
               "the group exits 44 before joining, naming node, check, measured and expected"),
)}


@dataclass(frozen=True)
class Fault:
    """One fault of a plan: class ``kind`` fired ``at_s`` seconds after the
    first committed step at replica group slot ``slot`` (ignored by classes
    that hit the job as a whole: the lighthouse, the scheduler)."""

    index: int
    at_s: float
    kind: str
    slot: int

    def to_json(self) -> dict:
        return asdict(self)


def make_plan(seed: int, duration_s: float, kinds: list[str], slots: int, count: int | None = None,
              first_s: float = 10.0) -> list[Fault]:
    """A seeded plan of ``count`` faults (default: one per class of
    ``kinds``) spread evenly over ``[first_s, duration_s)``.

    Every class of ``kinds`` occurs at least ``count // len(kinds)`` times
    (at least once when ``count >= len(kinds)``); the remainder is drawn
    with the seeded generator, and so are the order and the target slots
    (``0 .. slots-1``). The same arguments give the same plan.

    Raises ValueError for an unknown class, an empty ``kinds``, ``count``
    below ``len(kinds)``, ``slots < 1`` or a window with no room.
    """
    unknown = [k for k in kinds if k not in FAULT_CLASSES]
    if unknown:
        raise ValueError(f"unknown fault class(es) {unknown}; known: {sorted(FAULT_CLASSES)}")
    if not kinds:
        raise ValueError("no fault class to plan")
    count = len(kinds) if count is None else count
    if count < len(kinds):
        raise ValueError(f"count={count}: below the {len(kinds)} classes, each of which must occur")
    if slots < 1:
        raise ValueError(f"slots={slots}: a plan needs at least one replica group")
    if not duration_s > first_s >= 0:
        raise ValueError(f"duration_s={duration_s}, first_s={first_s}: need 0 <= first_s < duration_s")
    rng = random.Random(seed)
    per_class, extra = divmod(count, len(kinds))
    chosen = [k for k in kinds for _ in range(per_class)] + rng.sample(list(kinds), extra)
    rng.shuffle(chosen)
    gap = (duration_s - first_s) / count
    return [Fault(index=i, at_s=round(first_s + i * gap, 3), kind=k, slot=rng.randrange(slots))
            for i, k in enumerate(chosen)]
