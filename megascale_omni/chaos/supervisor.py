"""The process supervisor of a chaos run: a torchft lighthouse and replica
groups as local processes, restarted when they exit (what a cluster's job
controller does: Kubernetes restarting a pod, Slurm requeueing a step).

Why the harness supervises instead of the live scheduler: the scheduler's
own restart after SIGKILL is being made safe elsewhere (branch schedlive),
and a supervisor that only restarts what exited is the minimal automatic
recovery a cluster provides; it never drains, pauses or resumes anything
(docs/operations.md). Every process started here carries
``MEGASCALE_CHAOS_RUN=<token>`` in its environment, so a scan of the
process table finds any leftover (:func:`processes_of_run`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megascale_omni.elastic.lighthouse_main import lighthouse_argv
from megascale_omni.utils.processes import kill_process_tree

#: Environment variable naming the chaos run a process belongs to.
RUN_MARKER = "MEGASCALE_CHAOS_RUN"
#: Exit codes after which a restart would fail the same way (a config, data
#: or pre-flight error): the slot is held until someone fixes the cause.
NO_RESTART = frozenset({2, 3, 44})


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_of_run(token: str) -> list[int]:
    """Pids of live processes (zombies aside) whose environment carries ``RUN_MARKER=token``."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get(RUN_MARKER) == token:
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@dataclass
class Incarnation:
    """One launch of a replica group slot: replica id ``<slot name>-<n>``."""

    slot: int
    replica_id: str
    proc: subprocess.Popen
    started: float
    extra: tuple[str, ...] = ()
    exit_code: Optional[int] = None
    exited: Optional[float] = None

    @property
    def output_dir(self) -> str:
        return self.proc.output_dir  # type: ignore[attr-defined]


@dataclass
class GroupCommand:
    """How to launch a replica group: ``omni-run`` (torchrun that passes a
    failed worker's exit code on: 2 config, 3 data, 4 checkpoint) of
    ``nproc`` ranks running ``entry --config config overrides``."""

    config: str
    overrides: list[str]
    entry: str = "pretrain_llava.py"
    nproc: int = 2
    python: str = sys.executable

    def argv(self, replica_id: str, lighthouse: str, output_dir: str, extra: tuple[str, ...]) -> list[str]:
        entry = [self.entry] if self.entry.endswith(".py") else ["-m", self.entry]
        return [self.python, "-m", "megascale_omni.launch", f"--nproc-per-node={self.nproc}",
                "--master-addr=127.0.0.1", f"--master-port={free_port()}", *entry, "--config", self.config,
                *self.overrides, "elastic.enabled=true", f"elastic.replica_id={replica_id}",
                f"elastic.lighthouse={lighthouse}", f"logging.output_dir={output_dir}", *extra]


@dataclass
class Supervisor:
    """Starts the lighthouse, ``slots`` replica groups and ``spares`` warm
    standbys (``elastic.standby=true``: built, serving the control socket,
    out of the quorum) under ``run_dir``. :meth:`poll` replaces a group
    that exited by a ready standby (``join`` on its control socket: it
    heals from a live peer and trains within seconds) and starts a new
    standby; with no standby ready it restarts the group (after
    ``restart_delay_s``, unless held with :meth:`hold`). The lighthouse is
    restarted on its port. ``env`` is added to every process's environment.
    Called from the harness's single thread."""

    run_dir: Path
    command: GroupCommand
    slots: int
    env: dict[str, str] = field(default_factory=dict)
    heartbeat_timeout_ms: int = 3000
    restart_delay_s: float = 1.0
    spares: int = 1
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    cwd: Optional[str] = None

    def __post_init__(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.lighthouse_addr = f"http://localhost:{self.port}"
        self.lighthouse: Optional[subprocess.Popen] = None
        self.current: dict[int, Incarnation] = {}
        self.history: list[Incarnation] = []
        self.held: set[int] = set()
        #: Warm standbys not yet joined; a standby is ready once it answers ``status`` as standing by.
        self.standbys: list[Incarnation] = []
        self._ready: set[str] = set()
        self.next_extra: dict[int, tuple[str, ...]] = {}
        #: What the supervisor did, with monotonic times: the only actions besides the planned faults.
        self.actions: list[dict] = []
        self._counts: dict[int, int] = {}
        #: Monotonic start time of each lighthouse incarnation: epoch i began at lighthouse_starts[i].
        self.lighthouse_starts: list[float] = []
        #: The same in wall time (time.time()), which ledger lines and step records carry (``quorum_t``).
        self.lighthouse_wall_starts: list[float] = []

    # ----------------------------------------------------------- processes
    def spawn(self, argv: list[str], log_path: Path) -> subprocess.Popen:
        """Start ``argv`` in a session of its own with the run's marker; output appended to ``log_path``."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **self.env, RUN_MARKER: self.token}
        with open(log_path, "ab") as log:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd,
                                    start_new_session=True)

    def start_lighthouse(self) -> None:
        # join_timeout: a quorum waits this long for heartbeating groups that have not asked yet.
        # lighthouse_main: up in about a second (torchft's script imports torch first: tens of seconds
        # on a loaded host, during which no group gets a quorum).
        self.lighthouse = self.spawn(lighthouse_argv(self.command.python, [
            "--min_replicas", "1", "--bind", f"[::]:{self.port}", "--join_timeout_ms", "60000",
            "--heartbeat_timeout_ms", str(self.heartbeat_timeout_ms), "--quorum_tick_ms", "50"]),
            self.run_dir / "lighthouse.log")
        self.lighthouse_starts.append(time.monotonic())
        self.lighthouse_wall_starts.append(time.time())
        self.actions.append({"t": time.monotonic(), "action": "start lighthouse", "port": self.port})

    def start_group(self, slot: int, extra: tuple[str, ...] = (), name: str = "") -> Incarnation:
        n = self._counts.get(slot, 0)
        self._counts[slot] = n + 1
        rid = f"{name or f'g{slot}'}-{n}"
        out = self.run_dir / rid
        out.mkdir(parents=True, exist_ok=True)
        proc = self.spawn(self.command.argv(rid, self.lighthouse_addr, str(out), extra), self.run_dir / f"{rid}.log")
        proc.output_dir = str(out)  # type: ignore[attr-defined]
        inc = Incarnation(slot, rid, proc, time.monotonic(), extra)
        if not name:
            self.current[slot] = inc
        self.history.append(inc)
        self.actions.append({"t": inc.started, "action": "start group", "replica_id": rid, "extra": list(extra)})
        return inc

    def start_standby(self) -> None:
        self.standbys.append(self.start_group(-1, ("elastic.standby=true",), name="s"))

    def start(self) -> None:
        self.start_lighthouse()
        for slot in range(self.slots):
            self.start_group(slot)
        for _ in range(self.spares):
            self.start_standby()

    def _standby_ready(self, inc: Incarnation) -> bool:
        from megascale_omni.control.client import ControlClient, endpoint_of_run

        if inc.replica_id in self._ready:
            return True
        if inc.proc.poll() is not None or not os.path.exists(os.path.join(inc.output_dir, "control.json")):
            return False
        try:
            with ControlClient(endpoint_of_run(inc.output_dir), timeout_s=5) as client:
                reply = client.request("status", {})
        except OSError:
            return False
        if reply.get("ok") and reply["result"].get("state") == "standby":
            self._ready.add(inc.replica_id)
        return inc.replica_id in self._ready

    def _join_standby(self, slot: int) -> Optional[Incarnation]:
        """Join a ready standby in ``slot``'s place; None if none is ready."""
        from megascale_omni.control.client import ControlClient, endpoint_of_run

        for inc in self.standbys:
            if not self._standby_ready(inc):
                continue
            try:
                with ControlClient(endpoint_of_run(inc.output_dir), timeout_s=30) as client:
                    reply = client.request("join", {})
            except OSError:
                continue
            if not reply.get("ok"):
                continue
            self.standbys.remove(inc)
            inc.slot = slot
            self.current[slot] = inc
            self.actions.append({"t": time.monotonic(), "action": "join standby", "replica_id": inc.replica_id,
                                 "slot": slot})
            self.start_standby()
            return inc
        return None

    def hold(self, slot: int) -> None:
        """Do not restart ``slot`` when it exits (until :meth:`release`)."""
        self.held.add(slot)

    def release(self, slot: int, extra: tuple[str, ...] = ()) -> None:
        """Restart ``slot`` again when it is down; its next launch gets ``extra`` overrides."""
        self.held.discard(slot)
        if extra:
            self.next_extra[slot] = extra

    def poll(self) -> list[Incarnation]:
        """Reap exited processes and restart them (groups after
        ``restart_delay_s``); returns the group incarnations that exited now."""
        now = time.monotonic()
        if self.lighthouse is not None and self.lighthouse.poll() is not None:
            self.actions.append({"t": now, "action": "lighthouse exited", "code": self.lighthouse.returncode})
            self.start_lighthouse()
        exited = []
        for slot, inc in list(self.current.items()):
            if inc.exit_code is None and inc.proc.poll() is not None:
                kill_process_tree(inc.proc)  # ranks torchrun left behind (a stopped one, a writer)
                inc.exit_code, inc.exited = inc.proc.returncode, now
                self.actions.append({"t": now, "action": "group exited", "replica_id": inc.replica_id,
                                     "code": inc.exit_code})
                exited.append(inc)
                if inc.exit_code in NO_RESTART:
                    self.hold(slot)
            if inc.exit_code is not None and slot not in self.held:
                # A standby still starting up is ready sooner than a cold start; restart cold only without one.
                if slot not in self.next_extra and self._join_standby(slot):
                    continue
                if (slot in self.next_extra or not self.standbys) and now - inc.exited >= self.restart_delay_s:
                    self.start_group(slot, self.next_extra.pop(slot, ()))
        for inc in list(self.standbys):
            if inc.proc.poll() is not None:
                kill_process_tree(inc.proc)
                inc.exit_code, inc.exited = inc.proc.returncode, now
                self.actions.append({"t": now, "action": "group exited", "replica_id": inc.replica_id,
                                     "code": inc.exit_code})
                self.standbys.remove(inc)
                self.start_standby()
        return exited

    def ranks(self, slot: int) -> dict[int, int]:
        """Global rank -> pid of the live worker processes of ``slot``'s current group."""
        import psutil

        out = {}
        try:
            children = psutil.Process(self.current[slot].proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return out
        for c in children:
            try:
                env = c.environ()
                parent_env = c.parent().environ() if c.parent() else {}
                spawned = "--multiprocessing-fork" in c.cmdline()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            # A data worker inherits RANK from its rank; keep the rank itself (its parent has no RANK).
            # A dead rank's spawned children adopted by omni-run (launch.adopt_orphans) are no ranks either.
            if "RANK" in env and "RANK" not in parent_env and not spawned:
                out[int(env["RANK"])] = c.pid
        return out

    def data_workers(self, slot: int) -> dict[int, list[int]]:
        """Global rank -> pids of that rank's data-loader workers: its spawned
        children (multiprocessing's resource tracker is no spawned child)
        except its checkpoint writers, which name themselves."""
        import psutil

        from megascale_omni.checkpoint.write_workers import PROCESS_NAME

        out = {}
        for rank, pid in self.ranks(slot).items():
            try:
                out[rank] = [c.pid for c in psutil.Process(pid).children()
                             if "--multiprocessing-fork" in c.cmdline() and c.name() != PROCESS_NAME.decode()]
            except psutil.NoSuchProcess:
                continue
        return out

    def signal_rank(self, slot: int, rank: int, sig: int) -> int:
        pid = self.ranks(slot)[rank]
        os.kill(pid, sig)
        return pid

    def kill_group(self, slot: int) -> None:
        kill_process_tree(self.current[slot].proc, reap=False)

    def kill_lighthouse(self) -> None:
        assert self.lighthouse is not None
        self.lighthouse.send_signal(signal.SIGKILL)

    def drain_all(self, timeout_s: float = 120.0) -> None:
        """End the job the normal way: ``drain`` every training group (each
        stops after the step it committed and exits 0), wait up to
        ``timeout_s`` for them to exit; :meth:`stop` kills what is left."""
        from megascale_omni.control.client import ControlClient, endpoint_of_run

        live = [inc for inc in self.current.values() if inc.proc.poll() is None]
        for inc in live:
            try:
                with ControlClient(endpoint_of_run(inc.output_dir), timeout_s=10) as client:
                    client.request("drain", {})
            except OSError:
                pass  # not serving (starting, or gone): killed by stop()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(inc.proc.poll() is None for inc in live):
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGKILL every process of the run (groups, standbys, lighthouse) and reap them."""
        for inc in [*self.current.values(), *self.standbys]:
            kill_process_tree(inc.proc)
        if self.lighthouse is not None:
            kill_process_tree(self.lighthouse)

    def epoch_at(self, t: float) -> int:
        """The lighthouse incarnation (0, 1, ...) that was running at monotonic time ``t``."""
        return max(sum(start <= t for start in self.lighthouse_starts) - 1, 0)

    def write_actions(self, path: Path) -> None:
        path.write_text("".join(json.dumps(a) + "\n" for a in self.actions))
