"""Launchers for replica groups on a cluster manager: Slurm (one ``srun`` per
group) and Kubernetes (a JobSet per group, applied with ``kubectl``).

They build their command lines (and manifest) as values and hand them to a
:class:`~megascale_omni.scheduler.launchers.CommandRunner`; ``dry_run=True``
only records and logs them. Both can list the groups of our jobs the
cluster manager still runs and take them over (a scheduler restarted after a
crash), say how a group ended (Slurm's ``ExitCode``, the pods' container
exit codes), keep further groups off a node (``exclude``) and remove
everything they started (``close``). Called from the scheduler's single
thread; a failing command raises (the actuator retries and reports it).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from typing import Mapping, Optional, Sequence

import yaml

from megascale_omni.control.client import Address, endpoint_of_run
from megascale_omni.scheduler.launchers import (
    EXIT_UNKNOWN,
    CommandRunner,
    GroupSpec,
    JobTemplate,
    RecordingRunner,
    SubprocessRunner,
    group_args,
)


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
    to GPUs per node (``gpus_per_node``, also torchrun's ranks per node;
    ``request_gpus=False``: no ``--gpus-per-node``, for CPU clusters). On
    every node torchrun rendezvouses at the group's first node, port
    ``RDZV_PORT + SLURM_JOB_ID % 1000`` (groups sharing a first node rarely
    collide). The control socket listens on TCP (``control.tcp_host=0.0.0.0``,
    a free port) and the group publishes it in ``<run_dir>/<id>/control.json``
    on the shared file system; TCP clients need the token
    (``$MEGASCALE_CONTROL_TOKEN``). Each job carries ``--comment=omni,job=..,replica=..,pool=..,standby=..``
    so that a restarted scheduler finds its groups in Slurm (:meth:`running_groups`);
    ``scontrol show job`` gives state and exit code of groups this process did
    not start (kept ``MinJobAge`` seconds after they end).
    """

    RDZV_PORT = 29500
    #: The exit code reported for a job Slurm ended without an exit code of its own (128 + SIGKILL).
    EXIT_KILLED_BY_SLURM = 137
    #: Slurm job states in which the group's processes may still run.
    ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING"})
    #: Final job states in which Slurm, not the group, ended the job.
    ENDED_BY_SLURM = frozenset({"CANCELLED", "NODE_FAIL", "TIMEOUT", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
                                "OUT_OF_MEMORY"})

    def __init__(self, jobs: Mapping[str, JobTemplate], gpus_per_node: Mapping[str, int],
                 partitions: Mapping[str, str] = (),
                 srun_args: Sequence[str] = (), runner: Optional[CommandRunner] = None, dry_run: bool = False,
                 request_gpus: bool = True):
        self.jobs = dict(jobs)
        self.gpus_per_node = dict(gpus_per_node)
        self.partitions = dict(partitions)
        self.srun_args = list(srun_args)
        self.request_gpus = request_gpus
        self.runner: CommandRunner = RecordingRunner() if dry_run else runner or SubprocessRunner()
        #: Group name -> its ``srun`` process (None in a dry run or for an adopted group).
        self.steps: dict[str, Optional[subprocess.Popen]] = {}
        #: Nodes no further group may use (``srun --exclude``).
        self.excluded: set[str] = set()

    def name(self, group: GroupSpec) -> str:
        return group_name(group.job, group.replica_id)

    def command(self, group: GroupSpec) -> list[str]:
        job = self.jobs[group.job]
        gpus = self.gpus_per_node[group.pool]
        torchrun = ["torchrun", f"--nnodes={group.nodes}", f"--nproc-per-node={gpus}", "--rdzv-backend=c10d",
                    f"--rdzv-id={self.name(group)}"]
        inner = shlex.join(torchrun) + ' --rdzv-endpoint="$(scontrol show hostnames "$SLURM_STEP_NODELIST" ' \
            f'| head -n1):$(({self.RDZV_PORT} + SLURM_JOB_ID % 1000))" ' \
            + shlex.join([*group_args(job, group), "control.tcp_host=0.0.0.0", "control.tcp_port=0"])
        return ["srun", f"--job-name={self.name(group)}", f"--partition={self.partitions.get(group.pool, group.pool)}",
                f"--nodes={group.nodes}", "--ntasks-per-node=1",
                *([f"--gpus-per-node={gpus}"] if self.request_gpus else []),
                f"--comment=omni,job={group.job},replica={group.replica_id},pool={group.pool},"
                f"standby={int(group.standby)}",
                *([f"--exclude={','.join(sorted(self.excluded))}"] if self.excluded else []),
                "--kill-on-bad-exit=1", f"--output={job.output_dir(group.replica_id)}.log", *self.srun_args,
                "bash", "-c", inner]

    def start(self, group: GroupSpec) -> None:
        if isinstance(self.runner, SubprocessRunner):  # srun runs here and opens --output there (shared FS)
            os.makedirs(self.jobs[group.job].run_dir, exist_ok=True)
        self.steps[self.name(group)] = self.runner(self.command(group), background=True)

    def kill(self, group: GroupSpec) -> None:
        self.runner(["scancel", "--signal=KILL", "--full", f"--name={self.name(group)}"])

    def address(self, group: GroupSpec) -> Address:
        return endpoint_of_run(self.jobs[group.job].output_dir(group.replica_id), prefer="tcp")

    def exited(self, group: GroupSpec) -> Optional[int]:
        """``srun``'s exit code (the group's) once it has returned; Slurm's ``ExitCode`` (``scontrol``) for an
        adopted group once its job ended, and for an ``srun`` that returned 0 from a job Slurm ended otherwise
        (cancelled, failed, timed out: 128 + the signal); :data:`EXIT_UNKNOWN` once Slurm forgot an adopted
        group; None while it runs or in a dry run."""
        name = self.name(group)
        if name not in self.steps:
            return None
        proc = self.steps[name]
        if proc is not None:
            code = proc.poll()
            if code is None:
                return None
            # srun returns 0, or 1 ("job step aborted"), from a cancelled job too: Slurm's final state tells.
            ended = self._slurm_exit(name)
            if code == 0:
                return 0 if ended == EXIT_UNKNOWN else ended
            if ended == EXIT_UNKNOWN:  # no such job: Slurm refused it (srun's own error)
                return code
            if ended is None:  # Slurm has not settled the job yet (completing): ask again next tick
                return None
            return ended if ended == self.EXIT_KILLED_BY_SLURM or ended > 128 else code
        if isinstance(self.runner, RecordingRunner):
            return None
        return self._slurm_exit(name)

    def _slurm_exit(self, name: str) -> Optional[int]:
        """How the newest job called ``name`` ended: None while active or completing (its final state is not known
        yet), EXIT_UNKNOWN if Slurm knows no such job, else its ``ExitCode`` (128 + the signal when one ended it).
        A job Slurm ended itself (cancelled, node failure, time limit, ...) often records ``0:0``: it is reported
        as :attr:`EXIT_KILLED_BY_SLURM`, never as a clean exit."""
        mine = [j for j in self.queue() if j.get("JobName") == name]
        if not mine:
            return EXIT_UNKNOWN
        last = max(mine, key=lambda j: int(j.get("JobId", "0")))
        state = last.get("JobState", "")
        if state in self.ACTIVE or state == "COMPLETING":
            return None
        code, _, sig = last.get("ExitCode", "0:0").partition(":")
        if sig.isdigit() and int(sig):
            return 128 + int(sig)
        if state.split(" ")[0] in self.ENDED_BY_SLURM:  # whatever code its processes left (srun's 1, 0, ...)
            return self.EXIT_KILLED_BY_SLURM
        if not code.isdigit():
            return EXIT_UNKNOWN
        return int(code) if int(code) or state == "COMPLETED" else self.EXIT_KILLED_BY_SLURM

    def adopt(self, group: GroupSpec) -> None:
        """Take over a group an earlier scheduler started: its state comes from ``scontrol``."""
        self.steps.setdefault(self.name(group), None)

    def running_groups(self) -> list[GroupSpec]:
        """Groups of this launcher's jobs Slurm still runs, from their ``--comment`` (node count from ``NumNodes``)."""
        out = []
        for j in self.queue():
            if j.get("JobState") not in self.ACTIVE or not j.get("Comment", "").startswith("omni,"):
                continue
            tags = dict(kv.split("=", 1) for kv in j["Comment"].split(",")[1:] if "=" in kv)
            job, pool, rid = tags.get("job"), tags.get("pool"), tags.get("replica")
            if job in self.jobs and rid and j.get("JobName") == group_name(job, rid):
                nodes = int(j["NumNodes"]) if j.get("NumNodes", "").isdigit() else 1
                out.append(GroupSpec(job, rid, pool, nodes, tags.get("standby") == "1"))
        return out

    def exclude(self, node: str) -> None:
        self.excluded.add(node)

    def close(self) -> None:
        """Cancel every group this launcher started or adopted that may still run."""
        for name in list(self.steps):
            proc = self.steps[name]
            if proc is None or proc.poll() is None:
                self.runner(["scancel", "--signal=KILL", "--full", f"--name={name}"])

    def queue(self) -> list[dict[str, str]]:
        """Every job Slurm knows (``scontrol show job --oneliner``), as ``Key -> value`` (values without spaces)."""
        output = getattr(self.runner, "output", None)  # a runner that cannot query knows no jobs
        text = output(["scontrol", "show", "job", "--oneliner"]) if output is not None else ""
        jobs = []
        for line in text.splitlines():
            if "JobId=" in line:
                jobs.append(dict(kv.split("=", 1) for kv in line.split() if "=" in kv))
        return jobs


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
        #: JobSet names applied (or adopted) and not deleted yet.
        self.applied: dict[str, GroupSpec] = {}
        #: Node names no further pod may use (a ``kubernetes.io/hostname NotIn`` affinity).
        self.excluded: set[str] = set()

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
        if self.excluded:
            pod["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn",
                                                             "values": sorted(self.excluded)}]}]}}}
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
        self.applied[k8s_name(group.job, group.replica_id)] = group

    def kill(self, group: GroupSpec) -> None:
        name = k8s_name(group.job, group.replica_id)
        self.runner(["kubectl", "delete", "jobset", name, "--namespace",
                     self.namespace, "--ignore-not-found", "--grace-period=0", "--force", "--wait=false"])
        self.applied.pop(name, None)

    def address(self, group: GroupSpec) -> Address:
        name = k8s_name(group.job, group.replica_id)
        return f"{name}-group-0-0.{name}.{self.namespace}.svc", self.CONTROL_PORT

    def exited(self, group: GroupSpec) -> Optional[int]:
        """From the group's pods (``kubectl get pods -l``): the first failed container's exit code once a pod
        failed (JobSet ``maxRestarts: 0``: the group is over), 0 once all ``nodes`` pods succeeded,
        :data:`EXIT_UNKNOWN` when a group we applied has no pods left; else None (running, pending, dry run)."""
        if isinstance(self.runner, RecordingRunner):
            return None
        text = self.runner.output(["kubectl", "get", "pods", "--namespace", self.namespace, "-o", "json", "-l",
                                   f"megascale-omni/job={group.job},megascale-omni/replica={group.replica_id}"])
        pods = (json.loads(text or "{}").get("items") or [])
        if not pods:
            return EXIT_UNKNOWN if k8s_name(group.job, group.replica_id) in self.applied and self._gone(group) \
                else None
        for pod in pods:
            if (pod.get("status") or {}).get("phase") == "Failed":
                codes = [((c.get("state") or {}).get("terminated") or {}).get("exitCode")
                         for c in (pod["status"].get("containerStatuses") or [])]
                return next((c for c in codes if c), 1)
        done = [p for p in pods if (p.get("status") or {}).get("phase") == "Succeeded"]
        return 0 if len(done) >= group.nodes else None

    def _gone(self, group: GroupSpec) -> bool:
        """The group's JobSet no longer exists (deleted, or never created)."""
        text = self.runner.output(["kubectl", "get", "jobsets", "--namespace", self.namespace, "-o", "json",
                                   "--ignore-not-found", k8s_name(group.job, group.replica_id)])
        return not text.strip()

    def adopt(self, group: GroupSpec) -> None:
        self.applied.setdefault(k8s_name(group.job, group.replica_id), group)

    def running_groups(self) -> list[GroupSpec]:
        """This launcher's jobs' JobSets in the namespace, from their labels."""
        text = self.runner.output(["kubectl", "get", "jobsets", "--namespace", self.namespace, "-o", "json",
                                   "-l", "megascale-omni/job"])
        out = []
        for item in json.loads(text or "{}").get("items") or []:
            labels = (item.get("metadata") or {}).get("labels") or {}
            job, rid = labels.get("megascale-omni/job"), labels.get("megascale-omni/replica")
            if job in self.jobs and rid:
                spec = item.get("spec", {}).get("replicatedJobs", [{}])[0].get("template", {}).get("spec", {})
                out.append(GroupSpec(job, rid, labels.get("megascale-omni/pool", ""), int(spec.get("parallelism", 1)),
                                     labels.get("megascale-omni/standby") == "true"))
        return out

    def exclude(self, node: str) -> None:
        self.excluded.add(node)

    def close(self) -> None:
        """Delete every JobSet this launcher applied or adopted."""
        for group in list(self.applied.values()):
            self.kill(group)
