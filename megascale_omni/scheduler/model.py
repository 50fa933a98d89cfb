"""What the scheduler reasons about: pools, jobs, replica groups, the policy's
snapshot, its decisions, and the actuator that carries them out.

Units: time in minutes of scheduler time (``*_min``) unless a name ends in
``_s`` (seconds); capacity in nodes and GPUs; throughput in samples/s. A
replica group occupies whole nodes of one pool (``replica_gpus`` is a
multiple of the pool's ``gpus_per_node``).

Everything here is a plain value: the policy gets a :class:`Snapshot` and
returns :class:`Decision` values; the simulator and the live actuator
(``actuator.LiveActuator``, through launchers and control sockets)
implement :class:`Actuator`.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field
from typing import Protocol, Sequence

BARE_METAL, VM = "bare_metal", "vm"


@dataclass(frozen=True)
class Step:
    """One point of a piecewise-constant timeline: ``value`` from ``at_min`` on."""

    at_min: float
    value: float


@dataclass(frozen=True)
class Timeline:
    """A piecewise-constant function of time, optionally periodic.

    ``steps`` ascend in ``at_min`` and the first is at 0. With ``period_min``
    the pattern repeats (times are taken modulo the period).
    """

    steps: tuple[Step, ...]
    period_min: float | None = None

    def at(self, t_min: float) -> float:
        """The value in force at ``t_min``."""
        if self.period_min:
            t_min = t_min % self.period_min
        i = bisect.bisect_right([s.at_min for s in self.steps], t_min) - 1
        return self.steps[max(i, 0)].value

    def changes(self, until_min: float) -> list[Step]:
        """Every change of value in ``(0, until_min]``, unrolled over periods."""
        out: list[Step] = []
        base = 0.0
        while base <= until_min:
            for s in self.steps:
                t = base + s.at_min
                if 0 < t <= until_min and self.at(t - 1e-6) != s.value:
                    out.append(Step(t, s.value))
            if not self.period_min:
                break
            base += self.period_min
        return out


@dataclass(frozen=True)
class ThroughputCurve:
    """Samples/s as a function of the replica groups taking part.

    ``points`` are ``(replicas, samples_per_s)`` ascending in replicas; values
    between points are interpolated linearly, below the first point scaled
    linearly from 0, above the last held flat. In the simulator the curve
    comes from the trace; a live scheduler fits it from each job's measured
    ``samples_per_s`` at the sizes it has run at.
    """

    points: tuple[tuple[float, float], ...]

    @property
    def best_per_replica(self) -> float:
        """The highest samples/s per replica group anywhere on the curve (its
        most efficient size): the yardstick of useful GPU time."""
        return max(y / x for x, y in self.points)

    def __call__(self, replicas: float) -> float:
        if replicas <= 0:
            return 0.0
        xs = [p[0] for p in self.points]
        if replicas <= xs[0]:
            return self.points[0][1] * replicas / xs[0]
        if replicas >= xs[-1]:
            return self.points[-1][1]
        i = bisect.bisect_right(xs, replicas)
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        return y0 + (y1 - y0) * (replicas - x0) / (x1 - x0)


@dataclass(frozen=True)
class PoolSpec:
    """A pool of identical nodes. ``kind`` is ``bare_metal`` (fixed inventory,
    holds each job's core replica groups) or ``vm`` (borrowed; its
    ``availability`` in nodes changes over time, and a drop is announced
    ``reclaim_notice_min`` ahead: that is the reclaim's deadline)."""

    name: str
    kind: str
    gpus_per_node: int
    nodes: int
    availability: Timeline | None = None
    reclaim_notice_min: float = 10.0

    def available(self, t_min: float) -> int:
        """Nodes the pool has at ``t_min``."""
        return self.nodes if self.availability is None else int(self.availability.at(t_min))


@dataclass(frozen=True)
class JobSpec:
    """A training job as the trace describes it.

    ``min_replicas`` is the core (placed on bare metal, never drained by the
    policy); the job may grow to ``max_replicas``. ``work_samples`` is the
    total work; ``demand`` is the GPUs the job can keep busy over time
    (relative to its arrival): replica groups beyond it add no throughput.
    ``standby`` warm standby groups make a grow a standby join instead of a
    cold start when the pool has room for them. Higher ``priority`` wins
    contested capacity (marginal gains are weighted by it).
    """

    name: str
    arrive_min: float
    priority: float
    replica_gpus: int
    min_replicas: int
    max_replicas: int
    work_samples: float
    curve: ThroughputCurve
    demand: Timeline
    standby: int = 0


@dataclass(frozen=True)
class Costs:
    """Actuation latencies in seconds. Defaults are the worst cases measured
    in BENCHMARKS.md, "Elastic join vs full torchrun restart" (2026-11-29):
    standby join 1.822 s and cold join 17.51 s (launch or ``join`` -> first
    committed step), restart + checkpoint reload 10.68 s, a drain leaves at
    the next step boundary (one step, 0.894 s, the largest median step
    measured), and survivors lose 0.57 step times per join (0.51 s)."""

    standby_join_s: float = 1.822
    cold_join_s: float = 17.51
    drain_s: float = 0.894
    restart_s: float = 10.68
    join_disruption_s: float = 0.51


@dataclass(frozen=True)
class CostModel:
    """Move costs from what a user can set or measure (a trace's ``cost_model:``).

    A joining replica group first starts (``startup_s``: scheduling,
    container and process start, CUDA/NCCL initialisation, warm-up), then
    heals: it receives the replica state (``state_gb`` per group: weights and
    optimizer state, 7B parameters x 16 bytes of bf16 weights, fp32 master
    weights and Adam moments = 112 GB) from a live peer at ``heal_gb_per_s``
    (one 100 Gb/s NIC = 12.5 GB/s), then takes a step. Synchronous data
    parallelism makes the survivors wait while the peer sends and while the
    quorum reconfigures, so each join costs them the heal plus one step. A
    full restart reads a checkpoint (``checkpoint_gb_per_s``) after its
    start-up. The defaults are GPU-cluster-like, not measured here; the CPU
    measurements are :class:`Costs`' defaults."""

    state_gb: float = 112.0
    heal_gb_per_s: float = 12.5
    startup_s: float = 150.0
    step_s: float = 5.0
    checkpoint_gb_per_s: float = 2.0

    def costs(self) -> "Costs":
        """The simulator's latencies: cold join = start-up + heal + step;
        standby join (already started) = heal + step; drain = one step;
        restart = start-up + checkpoint read + step; survivors lose heal +
        step per join."""
        heal = self.state_gb / self.heal_gb_per_s
        return Costs(standby_join_s=heal + self.step_s, cold_join_s=self.startup_s + heal + self.step_s,
                     drain_s=self.step_s,
                     restart_s=self.startup_s + self.state_gb / self.checkpoint_gb_per_s + self.step_s,
                     join_disruption_s=heal + self.step_s)


class Action(str, enum.Enum):
    GROW = "grow"  # start `count` replica groups on `pool` (standby join if one is warm, else cold)
    DRAIN = "drain"  # `replica_ids` leave at their next step boundary (no work lost)
    KILL = "kill"  # `replica_ids` stop now (the step in flight is retried by the others)
    MOVE = "move"  # drain `replica_ids`, start as many on `pool`


@dataclass(frozen=True)
class Decision:
    """One actuation the policy asks for, with the reason that gets logged."""

    job: str
    action: Action
    reason: str
    count: int = 0
    pool: str = ""
    replica_ids: tuple[str, ...] = ()

    def describe(self) -> str:
        what = f"{self.count} on {self.pool}" if self.action is Action.GROW else ",".join(self.replica_ids)
        if self.action is Action.MOVE:
            what += f" -> {self.pool}"
        return f"{self.job} {self.action.value} {what}: {self.reason}"


@dataclass(frozen=True)
class ReplicaView:
    """A replica group as the policy sees it. ``state``: joining, running or draining."""

    id: str
    pool: str
    state: str
    straggler_since_min: float | None = None


@dataclass(frozen=True)
class Reclaim:
    """``nodes`` nodes of VM pool ``pool`` go away at ``deadline_min``."""

    pool: str
    nodes: int
    deadline_min: float


@dataclass(frozen=True)
class PoolView:
    """A pool now: ``nodes`` available, ``used`` by replica groups (any state),
    ``reclaiming`` announced to leave (capacity the policy must not use)."""

    name: str
    kind: str
    gpus_per_node: int
    nodes: int
    used: int
    reclaiming: int = 0

    @property
    def free(self) -> int:
        """Nodes a grow may take now; negative: nodes still to vacate for announced reclaims
        (draining groups elsewhere on the pool does not make room until that is paid)."""
        return self.nodes - self.reclaiming - self.used


@dataclass(frozen=True)
class JobView:
    """A job now. ``demand_gpus`` and ``samples_per_s`` are measured (the
    simulator adds the trace's noise; live, they come from the step metrics);
    ``admitted`` is false while it waits for its core. ``remaining_samples``:
    the work left (the simulator knows it from the trace; live it is unknown,
    None, and the policy then ranks jobs by priority alone)."""

    name: str
    priority: float
    replica_gpus: int
    min_replicas: int
    max_replicas: int
    curve: ThroughputCurve
    demand_gpus: float
    samples_per_s: float
    admitted: bool
    replicas: tuple[ReplicaView, ...] = ()
    remaining_samples: float | None = None

    @property
    def active(self) -> tuple[ReplicaView, ...]:
        """Replica groups not draining (the job's size once joins finish)."""
        return tuple(r for r in self.replicas if r.state != "draining")

    def nodes_per_replica(self, gpus_per_node: int) -> int:
        return self.replica_gpus // gpus_per_node


@dataclass(frozen=True)
class Snapshot:
    """Everything a policy decides from, at ``time_min``."""

    time_min: float
    pools: tuple[PoolView, ...]
    jobs: tuple[JobView, ...]
    reclaims: tuple[Reclaim, ...] = ()

    def pool(self, name: str) -> PoolView:
        return next(p for p in self.pools if p.name == name)


class Actuator(Protocol):
    """Carries out decisions on real or simulated jobs. The simulator
    implements it; the live actuator (``actuator.LiveActuator``) maps ``grow``
    to ``join``-ing a warm standby (or launching), ``drain`` to ``drain`` on
    the group's control socket, ``kill`` to the launcher's kill."""

    def grow(self, job: str, pool: str, count: int, reason: str) -> Sequence[str]:
        """Start ``count`` replica groups; returns their ids."""

    def drain(self, job: str, replica_ids: Sequence[str], reason: str) -> None:
        """Ask the groups to leave at their next step boundary."""

    def kill(self, job: str, replica_ids: Sequence[str], reason: str) -> None:
        """Stop the groups now."""


def apply(actuator: Actuator, decision: Decision) -> None:
    """Dispatch one decision to ``actuator`` (a move is a drain then a grow)."""
    if decision.action is Action.GROW:
        actuator.grow(decision.job, decision.pool, decision.count, decision.reason)
    elif decision.action is Action.DRAIN:
        actuator.drain(decision.job, decision.replica_ids, decision.reason)
    elif decision.action is Action.KILL:
        actuator.kill(decision.job, decision.replica_ids, decision.reason)
    else:
        actuator.drain(decision.job, decision.replica_ids, decision.reason)
        actuator.grow(decision.job, decision.pool, len(decision.replica_ids), decision.reason)


@dataclass
class Straggler:
    """A trace event: one replica group of ``job`` runs at ``slowdown`` of its
    speed from ``at_min`` to ``until_min``; synchronous data parallelism
    makes the whole job that slow (every group waits for it)."""

    job: str
    at_min: float
    until_min: float
    slowdown: float


@dataclass
class Trace:
    """A whole simulation input (see docs/scheduler.md for the file format)."""

    pools: list[PoolSpec]
    jobs: list[JobSpec]
    costs: Costs = field(default_factory=Costs)
    tick_min: float = 1.0
    horizon_min: float = 10080.0
    stragglers: list[Straggler] = field(default_factory=list)
    policy: dict = field(default_factory=dict)
    name: str = "trace"
