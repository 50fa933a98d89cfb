"""Launchers for replica groups: what every launcher does, the command
runners, and local processes (Slurm and Kubernetes:
:mod:`megascale_omni.scheduler.cluster_launchers`).

A replica group is one torchrun job of an elastic training job
(docs/elastic.md); it reaches the others through the job's torchft
lighthouse and serves its own control socket. A launcher starts a group
(optionally as a warm standby, ``elastic.standby=true``), kills it (every
process of it, now), says where its control socket is and, where it can
tell, whether it has exited. Draining and joining go through the control
socket (:mod:`megascale_omni.scheduler.actuator`), never through the launcher.

The Slurm and Kubernetes launchers build their command lines (and manifest)
as values and hand them to a :class:`CommandRunner`; ``dry_run=True`` only
records and logs them. Called by the live actuator from the scheduler's
single thread; ``start`` returns once the command is launched (it does not
wait for the group to come up).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Protocol, Sequence

from megascale_omni.control.client import Address, endpoint_of_run
from megascale_omni.utils.processes import kill_process_tree

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobTemplate:
    """How to start a replica group of one elastic job.

    ``entry`` is a module run with ``-m`` (or a ``.py`` script); ``config``
    and ``overrides`` are its ``--config`` file and ``section.field=value``
    arguments. Group ``<id>`` writes to ``<run_dir>/<id>`` (metrics.jsonl,
    control.json, its log); the sample ledger goes to ``ledger_dir`` (empty:
    none). ``nproc_per_node``: ranks per node (GPUs per node on a cluster).
    """

    name: str
    config: str
    run_dir: str
    lighthouse: str = ""
    ledger_dir: str = ""
    entry: str = "megascale_omni.smoke"
    overrides: tuple[str, ...] = ()
    nproc_per_node: int = 1

    def output_dir(self, replica_id: str) -> str:
        return os.path.join(self.run_dir, replica_id)


@dataclass(frozen=True)
class GroupSpec:
    """One replica group to launch: ``nodes`` whole nodes of ``pool``."""

    job: str
    replica_id: str
    pool: str
    nodes: int = 1
    standby: bool = False


def group_args(job: JobTemplate, group: GroupSpec, lighthouse: Optional[str] = None) -> list[str]:
    """The entry point and its arguments for ``group`` (after torchrun's own flags)."""
    entry = [job.entry] if job.entry.endswith(".py") else ["-m", job.entry]
    args = [*entry, "--config", job.config, *job.overrides, "elastic.enabled=true",
            f"elastic.replica_id={group.replica_id}", f"elastic.lighthouse={lighthouse or job.lighthouse}",
            f"logging.output_dir={job.output_dir(group.replica_id)}",
            f"elastic.standby={'true' if group.standby else 'false'}"]
    if job.ledger_dir:
        args.append(f"elastic.ledger_dir={job.ledger_dir}")
    return args


class ReplicaLauncher(Protocol):
    """Starts and kills replica groups on pools; the live actuator's only way to create or end processes."""

    def start(self, group: GroupSpec) -> None:
        """Launch ``group`` (returns once launched, not once it serves)."""

    def kill(self, group: GroupSpec) -> None:
        """Stop every process of ``group`` now (the step in flight is retried by the others)."""

    def address(self, group: GroupSpec) -> Address:
        """Where ``group``'s control socket is (it may not listen yet)."""

    def exited(self, group: GroupSpec) -> Optional[int]:
        """The group's exit code once it is known to have exited, else None (running or unknown);
        :data:`EXIT_UNKNOWN` when it is gone and its code cannot be known (a group of an earlier scheduler)."""

    # Optional, found with getattr by the actuator (a launcher without them is still a launcher):
    #   running_groups() -> list[GroupSpec] | None  groups of ours the cluster manager still runs (None: cannot tell)
    #   adopt(group) -> None                 take over a group an earlier scheduler process started
    #   exclude(node) -> None                start no further group on ``node``
    #   close() -> None                      remove everything this launcher started


#: :meth:`ReplicaLauncher.exited` for a group that is gone without a known exit code.
EXIT_UNKNOWN = 255
#: Seconds a foreground launcher command (``scancel``, ``kubectl``) may take before it counts as failed.
COMMAND_TIMEOUT_S = 60.0


class CommandRunner(Protocol):
    def __call__(self, argv: Sequence[str], stdin: Optional[str] = None, background: bool = False
                 ) -> Optional[subprocess.Popen]:
        """Run ``argv`` (feeding ``stdin``); ``background``: return at once with the
        process (None in a dry run), else wait and raise on failure (``CalledProcessError``,
        ``OSError``, ``TimeoutExpired``)."""

    def output(self, argv: Sequence[str]) -> str:
        """Run ``argv`` and return its stdout (a dry run: ""); raises like a foreground call."""


@dataclass
class SubprocessRunner:
    """Runs commands on this host; background ones in a session of their own, output to ``log_path``."""

    log_path: Optional[str] = None
    procs: list = field(default_factory=list)

    def __call__(self, argv: Sequence[str], stdin: Optional[str] = None, background: bool = False
                 ) -> Optional[subprocess.Popen]:
        if background:
            out = open(self.log_path, "a") if self.log_path else subprocess.DEVNULL
            proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            self.procs.append(proc)
            return proc
        subprocess.run(list(argv), input=stdin, text=True, check=True, capture_output=True,
                       timeout=COMMAND_TIMEOUT_S)
        return None

    def output(self, argv: Sequence[str]) -> str:
        return subprocess.run(list(argv), text=True, check=True, capture_output=True,
                              timeout=COMMAND_TIMEOUT_S).stdout


@dataclass
class RecordingRunner:
    """Dry run: records ``(argv, stdin)`` and logs the shell line; runs nothing."""

    commands: list[tuple[list[str], Optional[str]]] = field(default_factory=list)

    def __call__(self, argv: Sequence[str], stdin: Optional[str] = None, background: bool = False) -> None:
        self.commands.append((list(argv), stdin))
        log.info("dry run: %s%s", shlex.join(argv), "  <<EOF\n" + stdin + "EOF" if stdin else "")
        return None

    def output(self, argv: Sequence[str]) -> str:
        """Queries are not recorded (they change nothing); a dry run knows no cluster state."""
        return ""


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalLauncher:
    """Replica groups as local torchrun processes (tests and the demo).

    ``python`` is the interpreter that runs ``torch.distributed.run`` (and
    whose ``bin`` holds ``torchft_lighthouse``); ``env`` is added to this
    process's environment (``OMP_NUM_THREADS=1`` unless given). Pools are
    labels only: every group runs on this host. Each group gets its own
    store port; its output goes to ``<run_dir>/<id>.log``.
    """

    def __init__(self, jobs: Mapping[str, JobTemplate], python: str = sys.executable,
                 env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None):
        self.jobs = dict(jobs)
        self.python = python
        self.env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **os.environ, **(env or {})}
        self.cwd = cwd
        self.procs: dict[tuple[str, str], subprocess.Popen] = {}
        self.lighthouses: dict[str, subprocess.Popen] = {}

    def command(self, group: GroupSpec) -> list[str]:
        job = self.jobs[group.job]
        return [self.python, "-m", "torch.distributed.run", f"--nproc-per-node={job.nproc_per_node}",
                "--master-addr=127.0.0.1", f"--master-port={free_port()}", *group_args(job, group)]

    def start_lighthouse(self, job: str, heartbeat_timeout_ms: int = 2000, join_timeout_ms: int = 60000) -> str:
        """Start a torchft lighthouse for ``job`` on a free port; its address
        becomes the job's ``elastic.lighthouse``. Returns the address. A lighthouse
        an earlier scheduler process started for the job (``<run_dir>/lighthouse.json``)
        that still runs is taken over instead: its groups keep their quorum."""
        template = self.jobs[job]
        os.makedirs(template.run_dir, exist_ok=True)
        record = Path(template.run_dir) / "lighthouse.json"
        try:
            earlier = json.loads(record.read_text())
            proc = _Adopted(int(earlier["pid"]), "torchft_lighthouse")
            if proc.poll() is None:
                self.lighthouses[job] = proc
                self.jobs[job] = dataclasses.replace(template, lighthouse=earlier["address"])
                log.info("%s: lighthouse of the earlier scheduler at %s", job, earlier["address"])
                return earlier["address"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        port = free_port()
        binary = str(Path(self.python).parent / "torchft_lighthouse")
        with open(os.path.join(template.run_dir, "lighthouse.log"), "w") as out:
            self.lighthouses[job] = subprocess.Popen(
                [binary, "--min_replicas", "1", "--bind", f"[::]:{port}", "--join_timeout_ms", str(join_timeout_ms),
                 "--heartbeat_timeout_ms", str(heartbeat_timeout_ms), "--quorum_tick_ms", "50"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=self.env)
        address = f"http://localhost:{port}"
        record.write_text(json.dumps({"address": address, "pid": self.lighthouses[job].pid}))
        self.jobs[job] = dataclasses.replace(template, lighthouse=address)
        log.info("%s: lighthouse at %s", job, address)
        return address

    def start(self, group: GroupSpec) -> None:
        job = self.jobs[group.job]
        out_dir = job.output_dir(group.replica_id)
        os.makedirs(out_dir, exist_ok=True)
        cmd = self.command(group)
        log.info("%s: start %s%s: %s", group.job, group.replica_id, " (standby)" if group.standby else "",
                 shlex.join(cmd))
        with open(f"{out_dir}.log", "w") as out:
            proc = self.procs[(group.job, group.replica_id)] = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=self.env, cwd=self.cwd)
        # For a scheduler restarted after a crash (adopt): torchrun leads a session of its own.
        Path(f"{out_dir}.pid").write_text(str(proc.pid))

    def adopt(self, group: GroupSpec) -> None:
        """Take over ``group`` of an earlier scheduler process through its ``<run_dir>/<id>.pid``
        (no pid file or a pid that is not running: :meth:`exited` says :data:`EXIT_UNKNOWN`)."""
        key = (group.job, group.replica_id)
        if key not in self.procs:
            self.procs[key] = _Adopted.of(f"{self.jobs[group.job].output_dir(group.replica_id)}.pid",
                                          f"elastic.replica_id={group.replica_id}")

    def running_groups(self) -> None:
        """Local processes of an earlier scheduler cannot be listed (the run directories can: see adopt)."""
        return None

    def kill(self, group: GroupSpec) -> None:
        proc = self.procs.get((group.job, group.replica_id))
        if proc is not None and (not isinstance(proc, _Adopted) or proc.poll() is None):  # never a recycled pid
            kill_process_tree(proc)

    def address(self, group: GroupSpec) -> Address:
        return endpoint_of_run(self.jobs[group.job].output_dir(group.replica_id))

    def exited(self, group: GroupSpec) -> Optional[int]:
        proc = self.procs.get((group.job, group.replica_id))
        return None if proc is None else proc.poll()

    def close(self) -> None:
        """Kill every group and lighthouse this launcher started (idempotent)."""
        for proc in [*self.procs.values(), *self.lighthouses.values()]:
            if proc.poll() is None:
                kill_process_tree(proc)


class _Adopted:
    """A process an earlier scheduler started (not our child), recognised by ``marker`` in its command line
    (a recycled pid is not it): ``poll`` is :data:`EXIT_UNKNOWN` once it is gone."""

    def __init__(self, pid: Optional[int], marker: str):
        self.pid, self.marker = pid if pid is not None else -1, marker

    @classmethod
    def of(cls, pid_file: str, marker: str) -> "_Adopted":
        try:
            return cls(int(Path(pid_file).read_text().strip()), marker)
        except (OSError, ValueError):
            return cls(None, marker)

    def poll(self) -> Optional[int]:
        import psutil

        try:
            proc = psutil.Process(self.pid) if self.pid > 1 else None
            alive = proc is not None and proc.status() != psutil.STATUS_ZOMBIE and self.marker in proc.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            alive = False
        return None if alive else EXIT_UNKNOWN

    def wait(self) -> Optional[int]:
        return self.poll()
