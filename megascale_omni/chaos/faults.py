"""Fault injectors, one per fault class (:data:`megascale_omni.chaos.plan.FAULT_CLASSES`).

Each injector is driven by the harness's single thread: :meth:`Injector.fire`
once, then :meth:`Injector.tick` at every poll until :meth:`Injector.recovered`
(or the harness's per-fault deadline). :meth:`Injector.detected` says when
the *system* noticed the fault (the event named in the class's
``detected``); classes with nothing to detect (a straggler, a flood) answer
None and are timed only for recovery. An injector undoes what it started
(a stopped rank is continued or killed, a flood stopped, ballast removed)
in :meth:`Injector.cleanup`, which the harness calls whatever happened.
"""

from __future__ import annotations

import abc
import os
import random
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megascale_omni.chaos.observe import LogTail, Progress
from megascale_omni.chaos.plan import Fault
from megascale_omni.chaos.scheduled import SchedulerProcess, recovery
from megascale_omni.chaos.supervisor import Supervisor


@dataclass
class Context:
    """What an injector may touch: the supervisor, the observed progress,
    the run's paths and the job's size."""

    sup: Supervisor
    progress: Progress
    data_dir: Path
    ckpt_dir: Path
    slots: int
    rng: random.Random
    #: Seconds a stall-type fault (straggler, flood) lasts.
    stall_s: float = 5.0
    #: checkpoint.interval of the job (steps between saves).
    checkpoint_interval: int = 25
    #: The live scheduler keeping some of the job's groups (None: the run has none).
    scheduler: Optional["SchedulerProcess"] = None


@dataclass
class Injector(abc.ABC):
    """Base: the fault, when it fired, and what it hit (``target``).
    Each fault class implements :meth:`fire` and :meth:`recovered`."""

    fault: Fault
    fired: float = 0.0
    target: str = ""
    replica_id: str = ""
    note: str = ""
    _detected: Optional[float] = field(default=None, repr=False)

    # The interface the harness drives.
    @abc.abstractmethod
    def fire(self, ctx: Context) -> None:
        """Inject the fault (once); set ``fired``, ``target`` and ``replica_id``."""

    def tick(self, ctx: Context) -> None:
        """Called at every poll while the fault is active."""

    def detected(self, ctx: Context) -> Optional[float]:
        """Monotonic time the system noticed the fault, or None (not yet, or nothing to notice)."""
        return self._detected

    @abc.abstractmethod
    def recovered(self, ctx: Context) -> bool:
        """Whether the system is whole again after the fault."""

    def cleanup(self, ctx: Context) -> None:
        """Undo whatever is still in effect (called once, always)."""

    #: Runs beside the next faults (it only starts a group that must be refused) instead of being waited out.
    background = False

    def conflicts(self, kind: str) -> bool:
        """Whether a fault of class ``kind`` must wait until this active background fault is over."""
        return False

    # Shared predicates.
    def full_membership_since(self, ctx: Context, t: float) -> bool:
        """A step committed after ``t`` with every slot participating."""
        return any(c.participants == ctx.slots for c in ctx.progress.commits_after(t))


class GroupLoss(Injector):
    """Base of the faults that take a group out (kill, hang): detected when
    the survivors commit a step without it or it exits, recovered when a
    step commits with every slot again (its replacement healed and joined)."""

    def _hit(self, ctx: Context) -> None:
        inc = ctx.sup.current[self.fault.slot]
        self.replica_id = inc.replica_id
        self.fired = time.monotonic()

    def detected(self, ctx: Context) -> Optional[float]:
        if self._detected is None:
            inc = next(i for i in ctx.sup.history if i.replica_id == self.replica_id)
            without = [c.t for c in ctx.progress.commits_after(self.fired)
                       if c.participants < ctx.slots and c.replica_id != self.replica_id]
            times = [*without[:1], *([inc.exited] if inc.exited is not None else [])]
            self._detected = min(times) if times else None
        return self._detected

    def recovered(self, ctx: Context) -> bool:
        t = self.detected(ctx)
        return t is not None and self.full_membership_since(ctx, t)


class KillRank(GroupLoss):
    def fire(self, ctx: Context) -> None:
        ranks = ctx.sup.ranks(self.fault.slot)
        rank = ctx.rng.choice(sorted(ranks))
        self._hit(ctx)
        os.kill(ranks[rank], signal.SIGKILL)
        self.target = f"{self.replica_id} rank {rank}"


class KillGroup(GroupLoss):
    def fire(self, ctx: Context) -> None:
        self._hit(ctx)
        ctx.sup.kill_group(self.fault.slot)
        self.target = self.replica_id


class HangRank(GroupLoss):
    """SIGSTOP one rank; it stays stopped until its group is torn down
    (the supervisor's SIGKILL of the exited group's leftovers reaches it)."""

    def fire(self, ctx: Context) -> None:
        ranks = ctx.sup.ranks(self.fault.slot)
        rank = ctx.rng.choice(sorted(ranks))
        self._hit(ctx)
        self.pid = ranks[rank]
        os.kill(self.pid, signal.SIGSTOP)
        self.target = f"{self.replica_id} rank {rank} (pid {self.pid})"

    def cleanup(self, ctx: Context) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)  # still stopped only if nothing tore its group down
        except (ProcessLookupError, AttributeError):
            pass


class HangDataWorker(HangRank):
    """SIGSTOP one data-loader worker of a rank: the rank waits for its batch."""

    def fire(self, ctx: Context) -> None:
        workers = {r: pids for r, pids in ctx.sup.data_workers(self.fault.slot).items() if pids}
        if not workers:
            raise RuntimeError(f"slot {self.fault.slot}: no data-loader worker processes found")
        rank = ctx.rng.choice(sorted(workers))
        self._hit(ctx)
        self.pid = workers[rank][0]
        os.kill(self.pid, signal.SIGSTOP)
        self.target = f"{self.replica_id} rank {rank} data worker (pid {self.pid})"


class KillLighthouse(Injector):
    """SIGKILL the lighthouse; the supervisor restarts it on the same port
    at its next poll (detection: that poll). Recovered once the restarted
    lighthouse formed a quorum and a step with every slot committed after
    that (a step committed right after the kill may still ride on a quorum
    of the old one)."""

    def fire(self, ctx: Context) -> None:
        self.old = ctx.sup.lighthouse
        self.log = ctx.sup.run_dir / "lighthouse.log"
        self.tail = LogTail()
        self.tail.mark([self.log])
        self.quorum: Optional[float] = None
        self.fired = time.monotonic()
        ctx.sup.kill_lighthouse()
        self.target = f"lighthouse (pid {self.old.pid})"

    def detected(self, ctx: Context) -> Optional[float]:
        if self._detected is None and ctx.sup.lighthouse is not self.old:
            self._detected = time.monotonic()
        return self._detected

    def tick(self, ctx: Context) -> None:
        if self.quorum is None and self.detected(ctx) is not None and self.tail.grep([self.log], "Quorum!"):
            self.quorum = time.monotonic()

    def recovered(self, ctx: Context) -> bool:
        return self.quorum is not None and self.full_membership_since(ctx, self.quorum)


class KillScheduler(Injector):
    """SIGKILL the live scheduler (``omni-sched run``); its groups keep
    training. Detected when the harness, as the scheduler's supervisor,
    sees it gone and restarts it on the same ``out`` directory; recovered
    once the restarted scheduler adopted every group the killed one had,
    started none of them again, completed a tick listing them
    (:func:`~megascale_omni.chaos.scheduled.recovery`), and a step committed
    with every group after that."""

    def fire(self, ctx: Context) -> None:
        sched = ctx.scheduler
        if sched is None:
            raise RuntimeError("this run has no live scheduler")
        state = sched.state() or {}
        self.before = set(state.get("groups", {}))
        self.mark = sched.decisions.stat().st_size if sched.decisions.exists() else 0
        self.restarts = len(sched.starts)
        self.fired, self.fired_wall = time.monotonic(), time.time()
        self.target = f"omni-sched (pid {sched.kill()}) with groups {sorted(self.before)}"
        self.ticked: Optional[float] = None

    def detected(self, ctx: Context) -> Optional[float]:
        sched = ctx.scheduler
        if self._detected is None and sched is not None and len(sched.starts) > self.restarts:
            self._detected = sched.starts[self.restarts]
        return self._detected

    def tick(self, ctx: Context) -> None:
        if self.ticked is not None or self.detected(ctx) is None:
            return
        with open(ctx.scheduler.decisions, "rb") as f:
            f.seek(self.mark)
            lines = f.read().decode(errors="replace").splitlines()
        state = ctx.scheduler.state()
        if state is not None and (ctx.scheduler.out / "state.json").stat().st_mtime <= self.fired_wall:
            state = None  # the killed process's last state, not the successor's
        ok, self.note = recovery(self.before, lines, state)
        if ok:
            self.ticked = time.monotonic()

    def recovered(self, ctx: Context) -> bool:
        return self.ticked is not None and self.full_membership_since(ctx, self.ticked)


class Straggler(Injector):
    """One rank stopped and continued in turns (``duty`` of each
    ``period_s`` stopped) for the context's ``stall_s``: a slow node."""

    period_s = 0.5
    duty = 0.5

    def fire(self, ctx: Context) -> None:
        ranks = ctx.sup.ranks(self.fault.slot)
        rank = ctx.rng.choice(sorted(ranks))
        self.replica_id = ctx.sup.current[self.fault.slot].replica_id
        self.pid, self.fired, self.stopped = ranks[rank], time.monotonic(), False
        self.target = f"{self.replica_id} rank {rank} at {1 - self.duty:.0%} speed for {ctx.stall_s:g}s"
        self.start_step = ctx.progress.last_step()

    def tick(self, ctx: Context) -> None:
        elapsed = time.monotonic() - self.fired
        stop = elapsed < ctx.stall_s and (elapsed % self.period_s) < self.duty * self.period_s
        if stop != self.stopped:
            self._signal(signal.SIGSTOP if stop else signal.SIGCONT)
            self.stopped = stop

    def _signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def detected(self, ctx: Context) -> Optional[float]:
        return None

    def recovered(self, ctx: Context) -> bool:
        over = self.fired + ctx.stall_s
        if time.monotonic() < over:
            return False
        self.note = f"{ctx.progress.last_step() - self.start_step} steps committed while slowed"
        return self.full_membership_since(ctx, over)

    def cleanup(self, ctx: Context) -> None:
        if hasattr(self, "pid"):
            self._signal(signal.SIGCONT)


class ControlFlood(Injector):
    """For ``stall_s``: threads open connection after connection to one
    group's control socket and send garbage, oversized lines and ``status``
    requests. Recovered once the flood is over, the group answers
    ``status`` and every slot commits a step again (the steps committed
    during the flood are reported: on a host at load average 100 a step
    can take longer than the flood, so none is required)."""

    threads = 4

    def fire(self, ctx: Context) -> None:
        from megascale_omni.control.client import endpoint_of_run

        inc = ctx.sup.current[self.fault.slot]
        self.replica_id, self.fired = inc.replica_id, time.monotonic()
        self.address = endpoint_of_run(inc.output_dir)
        self.stop = threading.Event()
        self.sent = [0] * self.threads
        self.start_step = ctx.progress.last_step()
        self.workers = [threading.Thread(target=self._flood, args=(i,), daemon=True) for i in range(self.threads)]
        for w in self.workers:
            w.start()
        self.target = f"{self.replica_id} control socket"

    def _flood(self, i: int) -> None:
        payloads = [b"garbage\n", b"{" * 100000 + b"\n", b'{"id": 1, "cmd": "status", "args": {}}\n',
                    os.urandom(512) + b"\n", b'{"id": 2, "cmd": "nosuch", "args": {}}\n']
        family = socket.AF_UNIX if isinstance(self.address, str) else socket.AF_INET
        while not self.stop.is_set():
            try:
                with socket.socket(family, socket.SOCK_STREAM) as s:
                    s.settimeout(1.0)
                    s.connect(self.address)
                    s.sendall(payloads[self.sent[i] % len(payloads)])
                    self.sent[i] += 1
                    s.recv(4096)
            except OSError:
                time.sleep(0.01)  # refused or reset: the server defends itself; keep flooding

    def detected(self, ctx: Context) -> Optional[float]:
        return None

    def tick(self, ctx: Context) -> None:
        if time.monotonic() - self.fired >= ctx.stall_s and not self.stop.is_set():
            self.stop.set()
            for w in self.workers:
                w.join()
            self.during = ctx.progress.last_step() - self.start_step

    def recovered(self, ctx: Context) -> bool:
        from megascale_omni.control.client import ControlClient

        if not self.stop.is_set():
            return False
        if not getattr(self, "answered", False):
            try:
                with ControlClient(self.address, timeout_s=30) as client:
                    self.answered = client.request("status", {}).get("ok", False)
            except OSError:
                return False
            self.over = time.monotonic()
        self.note = f"{sum(self.sent)} flood messages; {self.during} steps committed during the flood"
        return self.answered and self.full_membership_since(ctx, self.over)

    def cleanup(self, ctx: Context) -> None:
        if hasattr(self, "stop"):
            self.stop.set()


class CheckpointOutOfSpace(Injector):
    """Fill the (size-limited) checkpoint file system with a ballast file
    until a group reports a failed save for lack of space (detection), or
    the job is a few steps past the next save's step without one (its
    failure would have shown), or ``max_full_s``; then free it; recovered
    when a newer checkpoint is complete and every slot participates again."""

    needle = "No space left on device"
    max_full_s = 60.0
    #: Steps past the next save's step after which the disk is freed although no failure was seen.
    grace_steps = 5

    def fire(self, ctx: Context) -> None:
        self.fired = time.monotonic()
        self.ballast = ctx.ckpt_dir / ".chaos-ballast"
        free = os.statvfs(ctx.ckpt_dir)
        left = 64 * 1024
        size = max(free.f_bavail * free.f_frsize - left, 0)
        with open(self.ballast, "wb") as f:
            chunk = b"\0" * (1 << 20)
            try:
                while size > 0:
                    n = f.write(chunk[:min(len(chunk), size)])
                    size -= n
            except OSError:
                pass  # full a little earlier than statvfs said
        self.logs = [ctx.sup.run_dir / f"{i.replica_id}.log" for i in ctx.sup.history]
        self.tail = LogTail()
        self.tail.mark(self.logs)
        self.newest_before = self._newest(ctx)
        last = ctx.progress.last_step()
        self.next_save = (last // ctx.checkpoint_interval + 1) * ctx.checkpoint_interval
        self.freed: Optional[float] = None
        self.target = f"{ctx.ckpt_dir} full ({self.ballast.stat().st_size >> 20} MiB ballast)"

    @staticmethod
    def _newest(ctx: Context) -> int:
        from megascale_omni.checkpoint import layout

        complete = [c.step for c in layout.scan_tier(ctx.ckpt_dir, str(ctx.ckpt_dir)) if c.complete]
        return max(complete, default=0)

    def tick(self, ctx: Context) -> None:
        logs = [ctx.sup.run_dir / f"{i.replica_id}.log" for i in ctx.sup.history]
        if self._detected is None and self.tail.grep(logs, self.needle):
            self._detected = time.monotonic()
        past = ctx.progress.last_step() >= self.next_save + self.grace_steps
        if self.freed is None and (self._detected is not None or past
                                   or time.monotonic() - self.fired > self.max_full_s):
            self.ballast.unlink(missing_ok=True)
            self.freed = time.monotonic()

    def recovered(self, ctx: Context) -> bool:
        return (self.freed is not None and self._newest(ctx) > self.newest_before
                and self.full_membership_since(ctx, self.freed))

    def cleanup(self, ctx: Context) -> None:
        if hasattr(self, "ballast"):
            self.ballast.unlink(missing_ok=True)


class ProbeGroup(Injector):
    """Base of the faults that start one extra replica group which must be
    refused: it runs in a slot of its own that the supervisor never
    restarts; detected when it exits with ``expected_code``."""

    expected_code = 0

    def start_probe(self, ctx: Context, extra: tuple[str, ...] = ()) -> None:
        self.fired = time.monotonic()
        self.slot = ctx.slots + 100 + self.fault.index
        ctx.sup.hold(self.slot)
        self.inc = ctx.sup.start_group(self.slot, extra)
        self.replica_id = self.inc.replica_id

    def probe_exit(self, ctx: Context, needle: str) -> Optional[bool]:
        """None while the probe runs; then whether it exited ``expected_code`` with ``needle`` in its log."""
        if self.inc.exit_code is None:
            return None
        if self._detected is None:
            self._detected = self.inc.exited
            log = (ctx.sup.run_dir / f"{self.replica_id}.log").read_text(errors="replace")
            self.ok = self.inc.exit_code == self.expected_code and needle in log
            self.note = (f"{self.replica_id} exited {self.inc.exit_code} (expected {self.expected_code}"
                         f"{', naming ' + needle if needle else ''})")
        return self.ok

    def cleanup(self, ctx: Context) -> None:
        if hasattr(self, "inc"):
            ctx.sup.current.pop(self.slot, None)
            from megascale_omni.utils.processes import kill_process_tree

            kill_process_tree(self.inc.proc)


class ShardCorrupt(ProbeGroup):
    """Replace one training shard by a copy with a flipped byte (a new file
    at the same path, as a bad re-copy leaves it) and start one more
    replica group on the data. Running groups keep their verified
    descriptors and train on; the new group must refuse the shard (exit 3,
    naming it) when it first reads it. The shard is then restored from the
    pristine copy: the named action of docs/operations.md, done by the
    harness in the person's place (a group refused for a data error is not
    restarted by the supervisor, see supervisor.NO_RESTART)."""

    expected_code = 3
    background = True

    def conflicts(self, kind: str) -> bool:
        """A group started while the shard is bad refuses it too: no fault that makes the job start one (a
        lost group, a lighthouse kill), and no second probe, until the shard is restored."""
        return kind in GROUP_LOSS or kind in ("shard_corrupt", "preflight_fail")

    def fire(self, ctx: Context) -> None:
        shards = sorted((ctx.data_dir / "train").glob("*.tar"))
        self.shard = ctx.rng.choice(shards)
        self.pristine = ctx.sup.run_dir / f"pristine-{self.shard.name}"
        data = bytearray(self.shard.read_bytes())
        self.pristine.write_bytes(data)
        data[len(data) // 2] ^= 0xFF
        tmp = self.shard.with_suffix(".chaos-tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.shard)
        self.restored: Optional[float] = None
        self.start_probe(ctx)
        self.target = f"{self.shard.name}; {self.replica_id} started on it"

    def tick(self, ctx: Context) -> None:
        if self.restored is None and self.probe_exit(ctx, self.shard.name) is not None:
            self._restore(ctx)

    def _restore(self, ctx: Context) -> None:
        """Put the pristine shard back and let the supervisor restart every
        slot it held for a data error meanwhile (a standby started while the
        shard was bad refuses it too when it joins)."""
        os.replace(self.pristine, self.shard)
        self.restored = time.monotonic()
        for slot in range(ctx.slots):
            ctx.sup.release(slot)

    def recovered(self, ctx: Context) -> bool:
        return self.restored is not None and self.ok and self.full_membership_since(ctx, self.restored)

    def cleanup(self, ctx: Context) -> None:
        if hasattr(self, "pristine") and self.pristine.exists():
            self._restore(ctx)
        super().cleanup(ctx)


class PreflightFail(ProbeGroup):
    """Start one more replica group whose pre-flight cannot pass
    (:func:`~megascale_omni.chaos.capabilities.preflight_failing_overrides`):
    it must exit :data:`~megascale_omni.chaos.capabilities.EXIT_PREFLIGHT_FAILED`
    before joining (no step record of it) while the job trains on."""

    background = True

    def conflicts(self, kind: str) -> bool:
        """A lighthouse kill takes every group down (its recovery, a step with every group, would wait for
        the whole job's); a corrupt shard or a second probe would blur which group was refused for what."""
        return kind in ("kill_lighthouse", "shard_corrupt", "preflight_fail")

    def fire(self, ctx: Context) -> None:
        from megascale_omni.chaos.capabilities import EXIT_PREFLIGHT_FAILED, preflight_failing_overrides

        self.expected_code = EXIT_PREFLIGHT_FAILED
        self.start_probe(ctx, tuple(preflight_failing_overrides()))
        self.target = f"{self.replica_id} (pre-flight thresholds unreachable)"

    def tick(self, ctx: Context) -> None:
        self.probe_exit(ctx, "")

    def recovered(self, ctx: Context) -> bool:
        return (self._detected is not None and self.ok and not ctx.progress.records.get(self.replica_id)
                and self.full_membership_since(ctx, self._detected))


#: Classes that take a group out of the job (or all of them): the job then starts replacements.
GROUP_LOSS = frozenset({"kill_rank", "kill_group", "kill_lighthouse", "hang_rank", "hang_data_worker"})

INJECTORS: dict[str, type[Injector]] = {
    "kill_rank": KillRank, "kill_group": KillGroup, "kill_lighthouse": KillLighthouse,
    "kill_scheduler": KillScheduler, "hang_rank": HangRank,
    "hang_data_worker": HangDataWorker, "straggler": Straggler, "ckpt_enospc": CheckpointOutOfSpace,
    "shard_corrupt": ShardCorrupt, "control_flood": ControlFlood, "preflight_fail": PreflightFail,
}
