#!/usr/bin/env python3
"""A single-host Slurm for tests and demos: munge, slurmctld and slurmd on this machine.

    python3 tools/slurm_local.py up   [--dir DIR]   # install if missing, configure, start; prints SLURM_CONF
    python3 tools/slurm_local.py down [--dir DIR]   # stop the daemons this tool started, remove DIR
    make slurm-up / make slurm-down                  # the same, DIR = $(SLURM_DIR)

``up`` installs Debian's packages (``slurmctld slurmd slurm-client munge``)
with apt when a binary is missing (root only; quick when present), writes a
munge key, ``slurm.conf`` and every state, spool, log and pid file under
DIR (nothing under /etc or /var), picks free ports, starts ``munged``,
``slurmctld`` and ``slurmd`` in sessions of their own and waits until the
node is idle. One node (this host's short name, at 127.0.0.1) with
``--cpus`` CPUs (default 16: Slurm counts them, nothing pins them, so a
2-core host can run many one-CPU replica groups) and ``--mem-mb`` MiB, in
one partition ``--partition`` (default ``omni``). No GPUs (no gres): jobs
must not ask for any. Clients (``srun``, ``squeue``, ``scancel``) find this
cluster through ``SLURM_CONF=DIR/slurm.conf``.

Exit codes: 0 up (or down), 1 Slurm could not be installed or started (the
reason on one line, the daemons' logs under DIR). Standard library only, so
it runs before any virtual environment exists. Idempotent: ``up`` on a
running cluster only prints its SLURM_CONF; ``down`` on none does nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "srun", "squeue", "scancel", "sinfo", "munged")
DEFAULT_DIR = os.path.join(tempfile.gettempdir(), "omni-slurm")
READY_TIMEOUT_S = 60.0

SLURM_CONF = """\
# Written by tools/slurm_local.py: a one-host cluster for tests; everything lives under {dir}.
ClusterName=omni
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge/munge.sock
StateSaveLocation={dir}/ctld
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=600
KillWait=2
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName={partition} Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Cluster:
    """A running single-host cluster: ``env`` is what clients need (``SLURM_CONF``)."""

    dir: Path
    partition: str
    node: str

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or started here; the message says why."""


def ensure_installed() -> None:
    """Install the Debian packages when a binary is missing (apt, as root); quick when all are present."""
    missing = [b for b in BINARIES if not _which(b)]
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable(f"{', '.join(missing)} not installed and this is not a root Debian host "
                               f"(apt-get install {' '.join(PACKAGES)})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:  # stale lists: update once, retry
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: "
                                   f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
    missing = [b for b in BINARIES if not _which(b)]
    if missing:
        raise SlurmUnavailable(f"installed {' '.join(PACKAGES)} but {', '.join(missing)} is still missing")


def _which(binary: str) -> Optional[str]:
    return shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/usr/bin:/sbin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def up(directory: str = DEFAULT_DIR, cpus: int = 16, mem_mb: int = 16000, partition: str = "omni") -> Cluster:
    """Start (or find running) the cluster under ``directory``; raises SlurmUnavailable."""
    root = Path(directory).resolve()
    node = socket.gethostname().split(".")[0]
    cluster = Cluster(root, partition, node)
    if (root / "pids.json").exists() and _idle(cluster):
        return cluster
    down(directory)
    ensure_installed()
    for sub in ("munge", "ctld", "spool"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "munge", 0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    os.chmod(key, 0o400)
    user = _user()
    cluster.conf.write_text(SLURM_CONF.format(dir=root, host=node, ctld_port=_free_port(), d_port=_free_port(),
                                              user=user, cpus=cpus, mem_mb=mem_mb, partition=partition))
    env = {**os.environ, "SLURM_CONF": str(cluster.conf)}
    pids = {}
    munge = root / "munge"
    pids["munged"] = _start([_which("munged"), "-F", "--force", f"--socket={munge}/munge.sock",
                             f"--key-file={key}", f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
                             f"--seed-file={munge}/munged.seed"], root / "munged.out", env)
    _wait(lambda: (munge / "munge.sock").exists(), "munged to listen", root / "munged.out")
    pids["slurmctld"] = _start([_which("slurmctld"), "-D", "-c", "-f", str(cluster.conf)], root / "slurmctld.out", env)
    pids["slurmd"] = _start([_which("slurmd"), "-D", "-N", node, "-f", str(cluster.conf)], root / "slurmd.out", env)
    (root / "pids.json").write_text(json.dumps(pids))
    _wait(lambda: _idle(cluster), f"node {node} to be idle in partition {partition}", root / "slurmctld.log")
    return cluster


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name


def _start(argv: list, out: Path, env: dict) -> int:
    if argv[0] is None:
        raise SlurmUnavailable(f"missing binary for {argv}")
    with open(out, "w") as f:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True).pid


def _idle(cluster: Cluster) -> bool:
    try:
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env={**os.environ, **cluster.env},
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and done.stdout.strip().rstrip("*") in ("idle", "mixed", "allocated")


def _wait(ready, what: str, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.3)
    tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else ["(no log)"]
    raise SlurmUnavailable(f"timed out after {READY_TIMEOUT_S:g} s waiting for {what}; {log}: {' | '.join(tail)}")


def down(directory: str = DEFAULT_DIR) -> None:
    """Stop the daemons started under ``directory`` (by their recorded pids) and remove it."""
    root = Path(directory).resolve()
    pids_file = root / "pids.json"
    if pids_file.exists():
        env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
        subprocess.run(["scancel", "--full", "--signal=KILL", "--user", _user()], env=env, capture_output=True,
                       timeout=30)
        pids = json.loads(pids_file.read_text())
        for name in ("slurmd", "slurmctld", "munged"):
            pid = pids.get(name)
            if pid and _alive(pid, name):
                os.killpg(pid, signal.SIGTERM)
                deadline = time.monotonic() + 10
                while _alive(pid, name) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if _alive(pid, name):
                    os.killpg(pid, signal.SIGKILL)
    if root.exists() and (root / "slurm.conf").exists():
        shutil.rmtree(root, ignore_errors=True)


def _alive(pid: int, name: str) -> bool:
    """``pid`` runs and is the daemon ``name`` (not a recycled pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return name[:15] in stat.split(")")[0] and stat.split(") ")[1][:1] != "Z"


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="slurm_local", description=__doc__.split("\n")[0])
    p.add_argument("action", choices=("up", "down"))
    p.add_argument("--dir", default=DEFAULT_DIR, help=f"state directory (default {DEFAULT_DIR})")
    p.add_argument("--cpus", type=int, default=16)
    p.add_argument("--mem-mb", type=int, default=16000)
    p.add_argument("--partition", default="omni")
    args = p.parse_args(argv)
    try:
        if args.action == "down":
            down(args.dir)
            return 0
        cluster = up(args.dir, args.cpus, args.mem_mb, args.partition)
    except (SlurmUnavailable, OSError, subprocess.SubprocessError) as e:
        sys.stderr.write(f"slurm_local: {e}\n")
        return 1
    print(f"export SLURM_CONF={cluster.conf}  # partition {cluster.partition}, node {cluster.node}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
