"""Launchers for replica groups: local processes, Slurm (``srun``) and
Kubernetes (a JobSet applied with ``kubectl``).

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
import logging
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Protocol, Sequence

import yaml

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
        """The group's exit code once it is known to have exited, else None (running or unknown)."""


class CommandRunner(Protocol):
    def __call__(self, argv: Sequence[str], stdin: Optional[str] = None, background: bool = False
                 ) -> Optional[subprocess.Popen]:
        """Run ``argv`` (feeding ``stdin``); ``background``: return at once with the
        process (None in a dry run), else wait and raise on failure."""


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
        subprocess.run(list(argv), input=stdin, text=True, check=True, capture_output=True)
        return None


@dataclass
class RecordingRunner:
    """Dry run: records ``(argv, stdin)`` and logs the shell line; runs nothing."""

    commands: list[tuple[list[str], Optional[str]]] = field(default_factory=list)

    def __call__(self, argv: Sequence[str], stdin: Optional[str] = None, background: bool = False) -> None:
        self.commands.append((list(argv), stdin))
        log.info("dry run: %s%s", shlex.join(argv), "  <<EOF\n" + stdin + "EOF" if stdin else "")
        return None


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
        becomes the job's ``elastic.lighthouse``. Returns the address."""
        port = free_port()
        binary = str(Path(self.python).parent / "torchft_lighthouse")
        template = self.jobs[job]
        os.makedirs(template.run_dir, exist_ok=True)
        with open(os.path.join(template.run_dir, "lighthouse.log"), "w") as out:
            self.lighthouses[job] = subprocess.Popen(
                [binary, "--min_replicas", "1", "--bind", f"[::]:{port}", "--join_timeout_ms", str(join_timeout_ms),
                 "--heartbeat_timeout_ms", str(heartbeat_timeout_ms), "--quorum_tick_ms", "50"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=self.env)
        address = f"http://localhost:{port}"
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
            self.procs[(group.job, group.replica_id)] = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=self.env, cwd=self.cwd)

    def kill(self, group: GroupSpec) -> None:
        proc = self.procs.get((group.job, group.replica_id))
        if proc is not None:
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


def group_name(job: str, replica_id: str) -> str:
    """``omni-<replica>`` when the replica id starts with ``<job>-`` (the actuator's ids do), else
    ``omni-<job>-<replica>``: the Slurm job name of a group."""
    return f"omni-{replica_id}" if replica_id.startswith(f"{job}-") else f"omni-{job}-{replica_id}"


def k8s_name(job: str, replica_id: str) -> str:
    """A DNS-1123 name for a group's JobSet: :func:`group_name` in lower case, other characters -> ``-``."""
    return re.sub(r"[^a-z0-9-]", "-", group_name(job, replica_id).lower())[:63].strip("-")


class SlurmLauncher:
    """Replica groups as Slurm jobs: one ``srun`` per group, run in the
    background (``srun`` lasts as long as the group, and its exit code is
    the group's), ``scancel`` to kill.

    Pools map to partitions (``partitions``; default: the pool's name) and
    to GPUs per node (``gpus_per_node``, also torchrun's ranks per node). On
    every node torchrun rendezvouses at the group's first node. The control
    socket listens on TCP (``control.tcp_host=0.0.0.0``, a free port) and the
    group publishes it in ``<run_dir>/<id>/control.json`` on the shared file
    system; TCP clients need the token (``$MEGASCALE_CONTROL_TOKEN``).
    """

    RDZV_PORT = 29500

    def __init__(self, jobs: Mapping[str, JobTemplate], gpus_per_node: Mapping[str, int],
                 partitions: Mapping[str, str] = (),
                 srun_args: Sequence[str] = (), runner: Optional[CommandRunner] = None, dry_run: bool = False):
        self.jobs = dict(jobs)
        self.gpus_per_node = dict(gpus_per_node)
        self.partitions = dict(partitions)
        self.srun_args = list(srun_args)
        self.runner: CommandRunner = RecordingRunner() if dry_run else runner or SubprocessRunner()
        #: Group name -> its ``srun`` process (None in a dry run).
        self.steps: dict[str, Optional[subprocess.Popen]] = {}

    def name(self, group: GroupSpec) -> str:
        return group_name(group.job, group.replica_id)

    def command(self, group: GroupSpec) -> list[str]:
        job = self.jobs[group.job]
        gpus = self.gpus_per_node[group.pool]
        torchrun = ["torchrun", f"--nnodes={group.nodes}", f"--nproc-per-node={gpus}", "--rdzv-backend=c10d", f"--rdzv-id={self.name(group)}"]
        inner = shlex.join(torchrun) + ' --rdzv-endpoint="$(scontrol show hostnames "$SLURM_STEP_NODELIST" ' \
            f'| head -n1):{self.RDZV_PORT}" ' \
            + shlex.join([*group_args(job, group), "control.tcp_host=0.0.0.0", "control.tcp_port=0"])
        return ["srun", f"--job-name={self.name(group)}", f"--partition={self.partitions.get(group.pool, group.pool)}",
                f"--nodes={group.nodes}", "--ntasks-per-node=1", f"--gpus-per-node={gpus}",
                "--kill-on-bad-exit=1", f"--output={job.output_dir(group.replica_id)}.log", *self.srun_args,
                "bash", "-c", inner]

    def start(self, group: GroupSpec) -> None:
        self.steps[self.name(group)] = self.runner(self.command(group), background=True)

    def kill(self, group: GroupSpec) -> None:
        self.runner(["scancel", "--signal=KILL", "--full", f"--name={self.name(group)}"])

    def address(self, group: GroupSpec) -> Address:
        return endpoint_of_run(self.jobs[group.job].output_dir(group.replica_id), prefer="tcp")

    def exited(self, group: GroupSpec) -> Optional[int]:
        """``srun``'s exit code (the group's) once it has returned; None while it runs or in a dry run."""
        proc = self.steps.get(self.name(group))
        return None if proc is None else proc.poll()


class KubernetesLauncher:
    """Replica groups as JobSets (jobset.x-k8s.io/v1alpha2): one JobSet per
    group, ``nodes`` indexed pods of the pool's ``gpus_per_node`` GPUs each, applied with
    ``kubectl apply -f -`` and removed with ``kubectl delete``.

    ``node_selectors`` maps a pool to the node labels that place pods on it.
    The control socket listens on TCP port ``control_port`` of pod 0, reached
    as ``<jobset>-group-0-0.<jobset>`` (the JobSet's headless service); the
    token comes from the Secret ``token_secret`` (key ``token``). The run and
    ledger directories must be on a volume every pod mounts (``volumes``).
    """

    CONTROL_PORT = 7700
    RDZV_PORT = 29500

    def __init__(self, jobs: Mapping[str, JobTemplate], image: str, gpus_per_node: Mapping[str, int],
                 namespace: str = "default",
                 node_selectors: Mapping[str, Mapping[str, str]] = (), token_secret: str = "omni-control-token",
                 volumes: Sequence[dict] = (), volume_mounts: Sequence[dict] = (),
                 runner: Optional[CommandRunner] = None, dry_run: bool = False):
        self.jobs = dict(jobs)
        self.image, self.gpus_per_node, self.namespace = image, dict(gpus_per_node), namespace
        self.node_selectors = {k: dict(v) for k, v in dict(node_selectors).items()}
        self.token_secret = token_secret
        self.volumes, self.volume_mounts = list(volumes), list(volume_mounts)
        self.runner: CommandRunner = RecordingRunner() if dry_run else runner or SubprocessRunner()

    def manifest(self, group: GroupSpec) -> dict:
        """The JobSet for ``group`` as a plain dict (what ``kubectl apply`` receives as YAML)."""
        job, name = self.jobs[group.job], k8s_name(group.job, group.replica_id)
        gpus = self.gpus_per_node[group.pool]
        command = ["torchrun", f"--nnodes={group.nodes}", f"--nproc-per-node={gpus}",
                   "--node-rank=$(JOB_COMPLETION_INDEX)", f"--master-addr={name}-group-0-0.{name}",
                   f"--master-port={self.RDZV_PORT}", *group_args(job, group), "control.tcp_host=0.0.0.0",
                   f"control.tcp_port={self.CONTROL_PORT}"]
        container = {
            "name": "trainer", "image": self.image, "command": command,
            "env": [{"name": "MEGASCALE_CONTROL_TOKEN",
                     "valueFrom": {"secretKeyRef": {"name": self.token_secret, "key": "token"}}}],
            "ports": [{"name": "control", "containerPort": self.CONTROL_PORT}],
            "resources": {"limits": {"nvidia.com/gpu": gpus}},
        }
        if self.volume_mounts:
            container["volumeMounts"] = self.volume_mounts
        pod = {"restartPolicy": "Never", "containers": [container]}
        if group.pool in self.node_selectors:
            pod["nodeSelector"] = self.node_selectors[group.pool]
        if self.volumes:
            pod["volumes"] = self.volumes
        labels = {"megascale-omni/job": group.job, "megascale-omni/replica": group.replica_id,
                  "megascale-omni/pool": group.pool, "megascale-omni/standby": str(group.standby).lower()}
        return {
            "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": name, "namespace": self.namespace, "labels": labels},
            "spec": {
                "failurePolicy": {"maxRestarts": 0},
                "replicatedJobs": [{"name": "group", "replicas": 1, "template": {"spec": {
                    "parallelism": group.nodes, "completions": group.nodes, "completionMode": "Indexed",
                    "backoffLimit": 0, "template": {"metadata": {"labels": dict(labels)}, "spec": pod}}}}],
            },
        }

    def start(self, group: GroupSpec) -> None:
        self.runner(["kubectl", "apply", "--namespace", self.namespace, "-f", "-"],
                    stdin=yaml.safe_dump(self.manifest(group), sort_keys=False))

    def kill(self, group: GroupSpec) -> None:
        self.runner(["kubectl", "delete", "jobset", k8s_name(group.job, group.replica_id), "--namespace",
                     self.namespace, "--ignore-not-found", "--grace-period=0", "--force", "--wait=false"])

    def address(self, group: GroupSpec) -> Address:
        name = k8s_name(group.job, group.replica_id)
        return f"{name}-group-0-0.{name}.{self.namespace}.svc", self.CONTROL_PORT

    def exited(self, group: GroupSpec) -> Optional[int]:
        return None  # Kubernetes is not asked; a drained group is gone once its socket stops answering
