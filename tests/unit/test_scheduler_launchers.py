"""Launcher adapters in dry run: the exact ``srun`` line, JobSet manifest and
``kubectl`` commands for a replica group; the local launcher's torchrun
command; ``omni-sched run --dry-run`` prints them and bad live configs exit 2."""

from __future__ import annotations

import shlex

import pytest
import yaml

from megascale_omni.scheduler.cli import cli
from megascale_omni.scheduler.cluster_launchers import KubernetesLauncher, SlurmLauncher, k8s_name
from megascale_omni.scheduler.launchers import GroupSpec, JobTemplate, LocalLauncher

pytestmark = pytest.mark.timeout(60)

JOB = JobTemplate(name="A", config="examples/elastic/gpt_pp2.yaml", run_dir="/shared/runs/A",
                  lighthouse="http://lh-a:29510", ledger_dir="/shared/runs/A/ledger",
                  overrides=("train.steps=5000",))
GROUP = GroupSpec("A", "A-r3", "vm", nodes=2, standby=True)
ARGS = ("-m megascale_omni.smoke --config examples/elastic/gpt_pp2.yaml train.steps=5000 elastic.enabled=true "
        "elastic.replica_id=A-r3 elastic.lighthouse=http://lh-a:29510 logging.output_dir=/shared/runs/A/A-r3 "
        "elastic.standby=true elastic.ledger_dir=/shared/runs/A/ledger")


def test_slurm_dry_run_srun_and_scancel():
    launcher = SlurmLauncher({"A": JOB}, {"vm": 8}, partitions={"vm": "spot"}, srun_args=["--account=ml"],
                             dry_run=True)
    launcher.start(GROUP)
    launcher.kill(GROUP)
    (start, stdin), (kill, _) = launcher.runner.commands
    assert stdin is None
    assert start[:-1] == ["srun", "--job-name=omni-A-r3", "--partition=spot", "--nodes=2", "--ntasks-per-node=1",
                          "--gpus-per-node=8", "--comment=omni,job=A,replica=A-r3,pool=vm,standby=1",
                          "--kill-on-bad-exit=1", "--output=/shared/runs/A/A-r3.log",
                          "--account=ml", "bash", "-c"]
    assert start[-1] == (
        "torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-id=omni-A-r3 "
        '--rdzv-endpoint="$(scontrol show hostnames "$SLURM_STEP_NODELIST" | head -n1):$((29500 + SLURM_JOB_ID % 1000))" '
        f"{ARGS} control.tcp_host=0.0.0.0 control.tcp_port=0")
    assert kill == ["scancel", "--signal=KILL", "--full", "--name=omni-A-r3"]
    assert launcher.exited(GROUP) is None

    class Srun:  # what a real runner returns for a background command
        def __init__(self):
            self.code = None

        def poll(self):
            return self.code

    srun = Srun()
    live = SlurmLauncher({"A": JOB}, {"vm": 8}, runner=lambda argv, stdin=None, background=False: srun)
    live.start(GROUP)
    assert live.exited(GROUP) is None
    srun.code = 0  # srun returned: the group exited
    assert live.exited(GROUP) == 0
    # The socket is published by the group on the shared file system (TCP preferred).
    assert launcher.address(GROUP) == "/shared/runs/A/A-r3/control.sock"


def test_kubernetes_dry_run_jobset_apply_and_delete():
    launcher = KubernetesLauncher({"A": JOB}, image="registry/omni:1", gpus_per_node={"vm": 8}, namespace="ml",
                                  node_selectors={"vm": {"pool": "spot"}},
                                  volumes=[{"name": "runs", "persistentVolumeClaim": {"claimName": "runs"}}],
                                  volume_mounts=[{"name": "runs", "mountPath": "/shared/runs"}], dry_run=True)
    launcher.start(GROUP)
    launcher.kill(GROUP)
    (apply, manifest_yaml), (delete, none) = launcher.runner.commands
    assert apply == ["kubectl", "apply", "--namespace", "ml", "-f", "-"] and none is None
    labels = {"megascale-omni/job": "A", "megascale-omni/replica": "A-r3", "megascale-omni/pool": "vm",
              "megascale-omni/standby": "true"}
    expected = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": "omni-a-r3", "namespace": "ml", "labels": labels},
        "spec": {"failurePolicy": {"maxRestarts": 0}, "replicatedJobs": [{"name": "group", "replicas": 1, "template": {
            "spec": {"parallelism": 2, "completions": 2, "completionMode": "Indexed", "backoffLimit": 0,
                     "template": {"metadata": {"labels": labels}, "spec": {
                         "restartPolicy": "Never",
                         "containers": [{
                             "name": "trainer", "image": "registry/omni:1",
                             "command": ["torchrun", "--nnodes=2", "--nproc-per-node=8",
                                         "--node-rank=$(JOB_COMPLETION_INDEX)",
                                         "--master-addr=omni-a-r3-group-0-0.omni-a-r3", "--master-port=29500",
                                         *ARGS.split(), "control.tcp_host=0.0.0.0", "control.tcp_port=7700"],
                             "env": [{"name": "MEGASCALE_CONTROL_TOKEN", "valueFrom": {"secretKeyRef": {
                                 "name": "omni-control-token", "key": "token"}}}],
                             "ports": [{"name": "control", "containerPort": 7700}],
                             "resources": {"limits": {"nvidia.com/gpu": 8}},
                             "volumeMounts": [{"name": "runs", "mountPath": "/shared/runs"}]}],
                         "nodeSelector": {"pool": "spot"},
                         "volumes": [{"name": "runs", "persistentVolumeClaim": {"claimName": "runs"}}]}}}}}]},
    }
    assert yaml.safe_load(manifest_yaml) == expected == launcher.manifest(GROUP)
    assert "&id" not in manifest_yaml  # plain YAML, no anchors
    assert manifest_yaml.startswith("apiVersion: jobset.x-k8s.io/v1alpha2\nkind: JobSet\nmetadata:\n  name: omni-a-r3\n")
    assert delete == ["kubectl", "delete", "jobset", "omni-a-r3", "--namespace", "ml", "--ignore-not-found",
                      "--grace-period=0", "--force", "--wait=false"]
    assert launcher.address(GROUP) == ("omni-a-r3-group-0-0.omni-a-r3.ml.svc", 7700)


def test_names_are_dns_labels():
    assert k8s_name("Job_B", "Job_B-r12") == "omni-job-b-r12"
    assert k8s_name("A", "spare_1") == "omni-a-spare-1"


def test_local_launcher_command(tmp_path):
    job = JobTemplate(name="A", config="cfg.yaml", run_dir=str(tmp_path / "A"), lighthouse="http://localhost:1",
                      nproc_per_node=2)
    cmd = LocalLauncher({"A": job}, python="/venv/bin/python").command(GroupSpec("A", "A-r0", "bm"))
    port = next(a for a in cmd if a.startswith("--master-port="))
    assert cmd == ["/venv/bin/python", "-m", "torch.distributed.run", "--nproc-per-node=2",
                   "--master-addr=127.0.0.1", port, "-m", "megascale_omni.smoke", "--config", "cfg.yaml",
                   "elastic.enabled=true", "elastic.replica_id=A-r0", "elastic.lighthouse=http://localhost:1",
                   f"logging.output_dir={tmp_path / 'A' / 'A-r0'}", "elastic.standby=false"]


LIVE = """\
out: {out}
launcher: slurm
tick_s: 0.05
control: {{attempts: 1, backoff_s: 0, timeout_s: 1}}
slurm: {{partitions: {{bare-metal: gpu}}}}
pools:
  - {{name: bare-metal, kind: bare_metal, gpus_per_node: 8, nodes: 2}}
  - {{name: vm, kind: vm, gpus_per_node: 8, nodes: 1}}
jobs:
  - name: A
    config: examples/elastic/gpt_pp2.yaml
    replica_gpus: 8
    replicas: {{min: 1, max: 2}}
    standby: {{vm: 1}}
    lighthouse: http://lh:29510
"""


def _exit(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli(argv)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_omni_sched_run_dry_run_prints_the_commands(tmp_path, capsys):
    path = tmp_path / "live.yaml"
    path.write_text(LIVE.format(out=tmp_path / "out"))
    code, out, err = _exit(["run", "--config", str(path), "--dry-run", "--ticks", "1"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    # A warm standby on vm (kept before the policy runs), then admission: a
    # cold start of the core on bare metal; the groups never serve (dry
    # run), so stopping kills them.
    assert [shlex.split(line)[:3] for line in lines[:4]] == [
        ["srun", "--job-name=omni-A-r0", "--partition=vm"], ["srun", "--job-name=omni-A-r1", "--partition=gpu"],
        ["scancel", "--signal=KILL", "--full"], ["scancel", "--signal=KILL", "--full"]]
    assert "elastic.standby=true" in lines[0] and "elastic.standby=false" in lines[1]
    assert lines[4] == f"1 tick(s); decisions in {tmp_path / 'out' / 'decisions.log'}"
    log = (tmp_path / "out" / "decisions.log").read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in log[:3]] == [
        "A start A-r0 on vm (warm standby): keep 1 warm standby(s) of A on vm",
        "A grow 1 on bare-metal: admit: core of 1 group(s) on bare metal",
        "A start A-r1 on bare-metal (cold start): admit: core of 1 group(s) on bare metal"]


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("launcher: slurm", "launcher: pbs"),
     "omni-sched: config error: launcher='pbs': use one of ['local', 'slurm', 'kubernetes']"),
    (lambda t: t.replace("standby: {vm: 1}", "standby: {cloud: 1}"),
     "omni-sched: config error: jobs[0].standby.cloud=1: unknown key; known: ['bare-metal', 'vm']"),
    (lambda t: t.replace("lighthouse: http://lh:29510", "lighthouse: auto"),
     "omni-sched: config error: jobs.A.lighthouse='auto': the slurm launcher needs the address of a running "
     "lighthouse: http://host:port"),
    (lambda t: t.replace("tick_s: 0.05", "tick_s: 0"), "omni-sched: config error: tick_s=0: must be >= 0.05"),
    (lambda t: t.replace("config: examples/elastic/gpt_pp2.yaml", "config: nowhere.yaml"),
     "omni-sched: config error: jobs[0].config='nowhere.yaml': give the job's training config file (e.g. "
     "examples/elastic/gpt_pp2.yaml)"),
    (lambda t: t + "policy: {grow_above: 0.5}\n",
     "omni-sched: config error: policy.shrink_below=0.85: need 0 < shrink_below < target_load (1.0) < grow_above "
     "(0.5): the gap is the hysteresis band"),
])
def test_bad_live_config_exits_2_with_one_line(tmp_path, capsys, edit, message):
    path = tmp_path / "live.yaml"
    path.write_text(edit(LIVE.format(out=tmp_path / "out")))
    code, out, err = _exit(["run", "--config", str(path), "--ticks", "1"], capsys)
    assert (code, out, err) == (2, "", message + "\n")
    assert not (tmp_path / "out" / "decisions.log").exists()


def test_local_launcher_has_no_dry_run(tmp_path, capsys):
    path = tmp_path / "live.yaml"
    path.write_text(LIVE.format(out=tmp_path / "out").replace("launcher: slurm", "launcher: local"))
    code, _, err = _exit(["run", "--config", str(path), "--dry-run"], capsys)
    assert (code, err) == (2, "omni-sched: config error: --dry-run=True: the local launcher has no dry run; use "
                              "launcher: slurm or kubernetes\n")
