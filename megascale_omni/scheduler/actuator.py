"""The live actuator: carries the policy's decisions out on running jobs
through a :class:`~megascale_omni.scheduler.launchers.ReplicaLauncher` and
the groups' control sockets.

- ``grow``: ``join`` a warm standby of the job on that pool if there is one
  (a standby still starting is joined as soon as it stands by), else a cold
  start through the launcher. Standbys are kept per pool by
  :meth:`LiveActuator.keep_standbys`, so the next grow is a join again.
- ``drain``: ``drain`` on the group's socket (it leaves at its next step
  boundary and exits 0). A group not serving yet has done no work: it is
  killed instead. A drain that is not done ``drain_timeout_s`` later is
  ended with the launcher's kill.
- ``kill``: the launcher's kill (the others retry the step in flight).

A launcher command that fails (``srun`` cannot start, ``scancel`` or
``kubectl`` exits non-zero or hangs) is retried with the same backoff,
then reported and left: a start that never went through is forgotten (the
policy asks again), a kill that never went through is retried every tick.
A group that exits with :data:`~megascale_omni.errors.EXIT_HUNG` (its hang
watchdog ended it) is replaced at once on the same pool; one that exits with
:data:`~megascale_omni.errors.EXIT_PREFLIGHT_FAILED` (or any exit with a
failed ``preflight.json``, docs/preflight.md) has the nodes its result names
excluded from further starts, and the policy regrows the job elsewhere. :meth:`LiveActuator.recover` adopts the groups of an
earlier scheduler process (after a crash) in the state they report.

Every action is logged with the decision's reason and passed to ``record``
(the live loop writes it to ``decisions.log``). A socket that does not
answer is retried with exponential backoff and then reported as a value,
never raised. Called from the scheduler's single thread; each call blocks
for at most a few control round trips (a deferred ``drain`` / ``join``
replies at the group's next step boundary, hence ``command_timeout_s``).
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence

from megascale_omni.control.client import ControlClient, ControlError
from megascale_omni.control.protocol import ProtocolError
from megascale_omni.errors import EXIT_HUNG, EXIT_PREFLIGHT_FAILED
from megascale_omni.preflight.result import PreflightReport, read_report
from megascale_omni.scheduler.launchers import GroupSpec, ReplicaLauncher
from megascale_omni.scheduler.live import Observation, observe

log = logging.getLogger(__name__)

#: Group states: ``starting`` (launched, socket not answering yet), ``standby``
#: (warm, outside the quorum), ``joining`` (joined or cold-started, not yet
#: seen training), ``running``, ``draining`` (drain sent; leaves at a step boundary).
STATES = ("starting", "standby", "joining", "running", "draining")


@dataclass
class Group:
    """A replica group the actuator launched. ``standby``: kept warm for a
    grow (not part of the job until joined); ``join_pending``: a grow took it
    while it was still starting, ``join`` is sent once it stands by."""

    spec: GroupSpec
    state: str = "starting"
    standby: bool = False
    join_pending: bool = False
    join_reason: str = ""
    since_s: float = 0.0
    straggler_since_min: Optional[float] = None
    last: Optional[Observation] = None

    @property
    def member(self) -> bool:
        """Part of the job for the policy (not a plain warm standby)."""
        return not self.standby or self.join_pending


@dataclass(frozen=True)
class Backoff:
    """Retries for control requests: ``attempts`` tries, waiting ``first_s`` x 2^k (at most ``max_s``) between."""

    attempts: int = 4
    first_s: float = 0.5
    max_s: float = 8.0


class LiveActuator:
    """Implements :class:`~megascale_omni.scheduler.model.Actuator` on live jobs.

    ``nodes_per_group`` maps (job, pool) to the nodes one group takes there;
    ``standbys`` maps (job, pool) to the warm standbys to keep. ``clock``
    gives seconds (monotonic); ``sleep`` is used between retries.
    ``first_serial`` maps a job to the number of its first group id
    (``<job>-r<n>``; default 0): the loop passes one past every id an earlier
    run used, so ids never repeat across scheduler restarts.
    """

    def __init__(self, launcher: ReplicaLauncher, nodes_per_group: Mapping[tuple[str, str], int],
                 standbys: Mapping[tuple[str, str], int] = (), *, token: Optional[str] = None,
                 backoff: Backoff = Backoff(), command_timeout_s: float = 60.0, drain_timeout_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 record: Callable[[str], None] = lambda line: None, first_serial: Mapping[str, int] = ()):
        self.launcher = launcher
        self.nodes_per_group = dict(nodes_per_group)
        self.standbys = dict(standbys)
        self.token, self.backoff = token, backoff
        self.command_timeout_s, self.drain_timeout_s = command_timeout_s, drain_timeout_s
        self.clock, self.sleep, self._record = clock, sleep, record
        self.groups: dict[str, Group] = {}
        self._serial: dict[str, itertools.count] = {j: itertools.count(n) for j, n in dict(first_serial).items()}
        #: Control and launcher failures so far, one line each (also logged).
        self.unreachable: list[str] = []
        #: Groups whose kill did not go through yet (retried every tick).
        self.pending_kills: dict[str, GroupSpec] = {}

    # ------------------------------------------------------------ Actuator
    def grow(self, job: str, pool: str, count: int, reason: str) -> Sequence[str]:
        """Join warm standbys of ``job`` on ``pool`` first, cold-start the rest; returns the group ids."""
        ids = []
        for _ in range(count):
            spare = sorted((g for g in self.groups.values() if g.spec.job == job and g.spec.pool == pool
                            and g.standby and not g.join_pending), key=lambda g: g.state != "standby")
            if spare and spare[0].state == "standby" and self._join(spare[0], reason):
                ids.append(spare[0].spec.replica_id)
            elif spare and spare[0].state == "starting":
                spare[0].join_pending, spare[0].join_reason = True, reason
                self._log(f"{job} grow: join standby {spare[0].spec.replica_id} on {pool} once it stands by: {reason}")
                ids.append(spare[0].spec.replica_id)
            else:
                group = self._launch(job, pool, standby=False, reason=reason)
                if group is not None:
                    ids.append(group.spec.replica_id)
        return ids

    def drain(self, job: str, replica_ids: Sequence[str], reason: str) -> None:
        """Drain through the socket; a group not serving yet is killed (it has done no work)."""
        for rid in replica_ids:
            group = self.groups.get(rid)
            if group is None or group.state == "draining":
                continue
            if group.state == "starting":
                self.kill(job, [rid], reason + " (not serving yet: nothing to drain)")
                continue
            reply = self._command(group, "drain")
            if reply is None:
                continue  # reported; the policy asks again next tick
            group.state, group.since_s = "draining", self.clock()
            self._log(f"{job} drain {rid} (leaves after step {reply.get('step')}): {reason}")

    def kill(self, job: str, replica_ids: Sequence[str], reason: str) -> None:
        for rid in replica_ids:
            group = self.groups.pop(rid, None)
            if group is not None:
                self._log(f"{job} kill {rid}: {reason}")
                if not self._launcher("kill", group.spec):
                    self.pending_kills[rid] = group.spec

    # ------------------------------------------------------------ per tick
    def refresh(self, now_min: float) -> dict[str, list[Observation]]:
        """Observe every group and update its state; send pending joins, kill
        overdue drains, forget groups that left. Returns the observations of
        the groups taking part, per job (for the snapshot)."""
        out: dict[str, list[Observation]] = {}
        for rid, spec in list(self.pending_kills.items()):
            if self._launcher("kill", spec, attempts=1):
                self.pending_kills.pop(rid)
                self._log(f"{spec.job} kill {rid}: went through on a retry")
        for rid, group in list(self.groups.items()):
            code = self._exit_code(group)
            if code is not None:
                self.groups.pop(rid)
                how = "left after its drain" if group.state == "draining" else "exited unexpectedly"
                self._log(f"{group.spec.job} {rid} {how} (exit code {code})")
                if group.state != "draining":
                    self._after_exit(group, code)
                continue
            live = group.state not in ("starting", "draining")
            address = self.launcher.address(group.spec)
            if group.state == "starting" and isinstance(address, str) and not os.path.exists(address):
                if self.clock() - group.since_s > self.drain_timeout_s:  # no socket yet: nothing to ask
                    self.kill(group.spec.job, [rid], f"not serving {self.drain_timeout_s:g} s after its start")
                continue
            attempts = self.backoff.attempts if live else 1
            seen = observe(group.spec.job, address, attempts=attempts,
                           backoff_s=self.backoff.first_s, max_backoff_s=self.backoff.max_s,
                           timeout_s=self.command_timeout_s, token=self.token, sleep=self.sleep, quiet=not live)
            group.last = seen
            if not seen.reachable:
                if group.state == "draining":
                    self.groups.pop(rid)
                    self._log(f"{group.spec.job} {rid} left after its drain (socket closed)")
                elif live:
                    self._report(f"{group.spec.job} {rid}: {seen.describe()}")
                elif self.clock() - group.since_s > self.drain_timeout_s:
                    self.kill(group.spec.job, [rid], f"not serving {self.drain_timeout_s:g} s after its start")
                continue
            self._update(group, seen, now_min)
            if group.member and group.state in ("joining", "running"):
                out.setdefault(group.spec.job, []).append(seen)
        for rid, group in list(self.groups.items()):
            if group.state == "draining" and self.clock() - group.since_s > self.drain_timeout_s:
                self.kill(group.spec.job, [rid], f"drain not done after {self.drain_timeout_s:g} s")
        return out

    def keep_standbys(self, capacity: Mapping[str, int]) -> None:
        """Start or drain warm standbys so each (job, pool) has its configured
        number where the pool has room: ``capacity`` (pool -> nodes available
        after announced reclaims) minus the nodes of member groups and of
        groups still draining. Standbys yield first: the newest beyond the
        room are drained (killed while not serving yet)."""
        for pool, cap in capacity.items():
            left = cap - sum(g.spec.nodes for g in self.groups.values() if g.spec.pool == pool
                             and (g.member or g.state == "draining"))
            for group in sorted(self._spares(pool), key=lambda g: g.since_s):
                if left >= group.spec.nodes:
                    left -= group.spec.nodes
                else:
                    self.drain(group.spec.job, [group.spec.replica_id], f"standby: {pool} has no room for it")
            for (job, p), want in sorted(self.standbys.items()):
                have = sum(1 for g in self._spares(pool) if g.spec.job == job)
                nodes = self.nodes_per_group[(job, pool)]
                while p == pool and have < want and left >= nodes:
                    self._launch(job, pool, standby=True, reason=f"keep {want} warm standby(s) of {job} on {pool}")
                    have += 1
                    left -= nodes

    def _spares(self, pool: str) -> list[Group]:
        """Warm standbys on ``pool`` not taken by a grow and not leaving."""
        return [g for g in self.groups.values() if g.spec.pool == pool and g.standby and not g.join_pending
                and g.state != "draining"]

    def recover(self, candidates: Iterable[tuple[GroupSpec, dict]]) -> list[str]:
        """Adopt groups an earlier scheduler process started: each ``(spec, last)``
        (``last``: what that process knew, e.g. ``{"state": "draining",
        "join_pending": True}``) whose launcher does not say it exited and whose
        socket answers, in the state the socket reports (``draining`` if either
        says so). One that does not answer yet is adopted as ``starting`` (killed
        if it never serves). Returns the adopted ids."""
        adopted = []
        for spec, last in candidates:
            if spec.replica_id in self.groups:
                continue
            adopt = getattr(self.launcher, "adopt", None)
            if adopt is not None:
                adopt(spec)
            if self._exit_code(Group(spec)) is not None:
                continue
            group = Group(spec, "starting", standby=spec.standby, join_pending=bool(last.get("join_pending")),
                          join_reason="a grow of the earlier scheduler process", since_s=self.clock())
            seen = observe(spec.job, self.launcher.address(spec), attempts=1, timeout_s=self.command_timeout_s,
                           token=self.token, sleep=self.sleep, quiet=True)
            if seen.reachable:
                group.last = seen
                self._update(group, seen, 0.0)
            if last.get("state") == "draining":
                group.state = "draining"
            self.groups[spec.replica_id] = group
            adopted.append(spec.replica_id)
            self._log(f"{spec.job} adopt {spec.replica_id} on {spec.pool} ({group.state}"
                      f"{', warm standby' if group.standby and not group.join_pending else ''}): "
                      "started by an earlier scheduler process")
        return adopted

    def close(self, reason: str) -> None:
        """Kill every group still known (and retry pending kills), then let the launcher remove the rest
        of what it started (its ``close``). For a scheduler that stops on an error."""
        for rid, group in list(self.groups.items()):
            self.kill(group.spec.job, [rid], reason)
        for rid, spec in list(self.pending_kills.items()):
            if self._launcher("kill", spec):
                self.pending_kills.pop(rid)
        close = getattr(self.launcher, "close", None)
        if close is not None:
            try:
                close()
            except (OSError, subprocess.SubprocessError) as e:
                self._report(f"launcher close failed: {type(e).__name__}: {e}")

    def shutdown(self, reason: str) -> None:
        """Drain every group (the scheduler is stopping); groups whose socket fails are killed."""
        for rid, group in list(self.groups.items()):
            if group.state != "draining":
                self.drain(group.spec.job, [rid], reason)
            if rid in self.groups and self.groups[rid].state != "draining":
                self.kill(group.spec.job, [rid], reason + " (could not drain)")

    # ------------------------------------------------------------ internals
    def _launch(self, job: str, pool: str, standby: bool, reason: str) -> Optional[Group]:
        """Start a new group; None (reported) when the launcher's command never went through."""
        rid = f"{job}-r{next(self._serial.setdefault(job, itertools.count()))}"
        spec = GroupSpec(job, rid, pool, self.nodes_per_group[(job, pool)], standby)
        self._log(f"{job} start {rid} on {pool} ({'warm standby' if standby else 'cold start'}): {reason}")
        if not self._launcher("start", spec):
            self._launcher("kill", spec, attempts=1, report=False)  # whatever part of it may have started
            return None
        group = self.groups[rid] = Group(spec, "starting", standby=standby, since_s=self.clock())
        return group

    def _launcher(self, op: str, spec: GroupSpec, attempts: Optional[int] = None, report: bool = True) -> bool:
        """``launcher.<op>(spec)`` with backoff; False (reported unless ``report`` is false) if it failed every
        time. Never raises on a command failure."""
        attempts = attempts or self.backoff.attempts
        error = ""
        for attempt in range(1, attempts + 1):
            try:
                getattr(self.launcher, op)(spec)
                return True
            except Exception as e:  # noqa: BLE001 - a launcher is a plug-in: none of its failures may stop the loop
                stderr = getattr(e, "stderr", None)
                tail = stderr.strip().splitlines()[-1] if isinstance(stderr, str) and stderr.strip() else ""
                error = f"{type(e).__name__}: {e}" + (f" ({tail})" if tail else "")
            if attempt < attempts:
                self.sleep(min(self.backoff.max_s, self.backoff.first_s * 2 ** (attempt - 1)))
        line = f"{spec.job} {spec.replica_id}: launcher {op} failed after {attempts} attempt(s): {error}"
        if report:
            self._report(line)
        else:
            log.warning("%s", line)
        return False

    def _exit_code(self, group: Group) -> Optional[int]:
        """The launcher's ``exited``; a query that fails is reported and counts as still running."""
        try:
            return self.launcher.exited(group.spec)
        except Exception as e:  # noqa: BLE001 - as in _launcher
            self._report(f"{group.spec.job} {group.spec.replica_id}: cannot tell whether it exited: "
                         f"{type(e).__name__}: {e}")
            return None

    def _after_exit(self, group: Group, code: int) -> None:
        """A hung group (EXIT_HUNG) is replaced on its pool now. A failed pre-flight (EXIT_PREFLIGHT_FAILED, or any
        exit with a failed ``preflight.json``: torchrun exits 1 when a worker exits 44) keeps the result's
        ``failed_nodes`` out of further starts. Any other exit: the policy sees the job smaller next tick."""
        spec = group.spec
        self._launcher("kill", spec, attempts=1)  # leftovers of the group (other nodes' processes, the Slurm job)
        if code == EXIT_HUNG:
            self._launch(spec.job, spec.pool, standby=group.standby and not group.join_pending,
                         reason=f"replaces {spec.replica_id}, ended by its hang watchdog (exit code {EXIT_HUNG})")
            return
        report = self._preflight_report(spec)
        if report is None and code != EXIT_PREFLIGHT_FAILED:
            return
        nodes = report.failed_nodes if report is not None else []
        exclude = getattr(self.launcher, "exclude", None)
        for node in nodes if exclude is not None else ():
            exclude(node)
            self._log(f"{spec.job} exclude node {node}: {spec.replica_id} failed its pre-flight checks "
                      f"(exit code {code})")
        if report is not None and report.group_failed:
            self._report(f"{spec.job} {spec.replica_id} failed a group-wide pre-flight check (the interconnect of "
                         f"the whole group): no node to exclude, the next group is placed as before")
        elif not nodes or exclude is None:
            self._report(f"{spec.job} {spec.replica_id} failed its pre-flight checks but its preflight.json names "
                         f"no node{'' if exclude is not None else ' (or the launcher cannot exclude one)'}")

    def _preflight_report(self, spec: GroupSpec) -> Optional[PreflightReport]:
        """The failed pre-flight result of ``spec`` (``<group output dir>/preflight.json``), None if there is none,
        it passed, or it cannot be read (reported)."""
        jobs = getattr(self.launcher, "jobs", {})
        if spec.job not in jobs:
            return None
        path = os.path.join(jobs[spec.job].output_dir(spec.replica_id), "preflight.json")
        if not os.path.exists(path):
            return None
        try:
            report = read_report(path)
        except ValueError as e:
            self._report(f"{spec.job} {spec.replica_id}: {e}")
            return None
        return None if report.ok else report

    def _join(self, group: Group, reason: str) -> bool:
        reply = self._command(group, "join")
        if reply is None:
            return False
        group.join_pending, group.state = True, "joining"
        self._log(f"{group.spec.job} grow: join standby {group.spec.replica_id} on {group.spec.pool} "
                  f"(at step {reply.get('step')}): {reason}")
        return True

    def _update(self, group: Group, seen: Observation, now_min: float) -> None:
        state = seen.state or ""
        if state == "standby":
            group.state = "standby"
            if group.join_pending:
                self._join(group, f"{group.join_reason} (the grow waited for the standby to come up)")
        elif state in ("running", "paused"):
            group.state = "running" if seen.step is not None and seen.metrics else "joining"
        elif state in ("draining", "finished"):
            group.state, group.since_s = "draining", group.since_s if group.state == "draining" else self.clock()
        flagged = bool(seen.metrics.get("straggler_count"))
        if not flagged:
            group.straggler_since_min = None
        elif group.straggler_since_min is None:
            group.straggler_since_min = now_min

    def _command(self, group: Group, cmd: str) -> Optional[dict]:
        """Send ``cmd`` to ``group`` with backoff; None (reported) if it never got through."""
        error = ""
        address = self.launcher.address(group.spec)
        for attempt in range(1, self.backoff.attempts + 1):
            try:
                with ControlClient(address, token=self.token, timeout_s=self.command_timeout_s) as client:
                    return client.call(cmd)
            except ControlError as e:  # refused: retrying would not change the answer
                if cmd == "drain" and e.code == "unavailable":  # already draining (an earlier reply was lost)
                    return {"state": "draining", "step": None}
                error = str(e)
                break
            except (OSError, ConnectionError, ProtocolError, ValueError) as e:
                error = f"{type(e).__name__}: {e}"
            if attempt < self.backoff.attempts:
                self.sleep(min(self.backoff.max_s, self.backoff.first_s * 2 ** (attempt - 1)))
        self._report(f"{group.spec.job} {group.spec.replica_id}: {cmd} failed: {error}")
        return None

    def _report(self, line: str) -> None:
        self.unreachable.append(line)
        log.error("%s", line)
        self._record(line)

    def _log(self, line: str) -> None:
        log.info("%s", line)
        self._record(line)
