"""omni-run inside a Slurm allocation (megascale_omni/slurm.py): the compact
nodelist parser against Slurm's documented syntax, and which torchrun
arguments are derived, kept or refused. The two-agent run is
tests/dist/test_multinode_launch.py."""

from __future__ import annotations

import os
import stat

import pytest
from torch.distributed.run import parse_args

from megascale_omni.config import ConfigError
from megascale_omni.slurm import BASE_PORT, apply_slurm, expand_nodelist

ENTRY = ["-m", "megascale_omni.smoke", "--config", "examples/gpt/tiny.yaml"]
# Node 1 of a two-node srun step of job 731 with 8 GPUs per node.
SLURM = {"SLURM_JOB_ID": "731", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]",
         "SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "1", "SLURM_STEP_NUM_TASKS": "2"}


@pytest.fixture(autouse=True)
def no_slurm_client(monkeypatch):
    """A PATH without scontrol, no torchrun PET_* defaults, and none of the
    Slurm variables of an allocation these tests may run in."""
    for name in [n for n in os.environ if n.startswith(("PET_", "SLURM_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PATH", "/nonexistent")


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("tux[0-5,12,20-25]", [f"tux{i}" for i in [0, 1, 2, 3, 4, 5, 12, 20, 21, 22, 23, 24, 25]]),
    ("b[8-11]", ["b8", "b9", "b10", "b11"]),  # no padding without a leading zero
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("rack[1-2]-node[01,05]", ["rack1-node01", "rack1-node05", "rack2-node01", "rack2-node05"]),
    ("node[1-2]-ib", ["node1-ib", "node2-ib"]),
    ("login", ["login"]),
    ("10.0.0.[1-2],h.example.org", ["10.0.0.1", "10.0.0.2", "h.example.org"]),
])
def test_nodelist_expands_like_slurm(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist, why", [
    ("node[01-03", "unexpected '[' at character 4"),
    ("node[a-b]", "[a-b] holds 'a-b', not a number or a lo-hi range"),
    ("node[5-3]", "range 5-3 runs backwards"),
    ("node1,,node2", "empty or malformed host name at character 6"),
    ("node1,", "trailing comma"),
    ("node1 node2", "unexpected ' ' at character 5"),
    ("", "empty nodelist"),
])
def test_a_nodelist_it_cannot_parse_names_the_variable(nodelist, why):
    with pytest.raises(ConfigError) as e:
        expand_nodelist(nodelist, "SLURM_STEP_NODELIST")
    assert str(e.value) == (f"config error: SLURM_STEP_NODELIST={nodelist!r}: {why}; expected Slurm's compact form "
                            "such as node[01-03,07],gpu5 (check the value, or install scontrol on this host)")


def _derive(flags: list[str], env: dict) -> tuple[dict, str | None]:
    argv = [*flags, *ENTRY]
    args = parse_args(argv)
    line = apply_slurm(args, argv, env)
    return vars(args), line


def test_everything_left_out_comes_from_slurm():
    args, line = _derive([], SLURM)
    port = BASE_PORT + 731
    assert (args["nnodes"], args["nproc_per_node"], args["rdzv_backend"], args["rdzv_id"], args["rdzv_endpoint"]) == (
        "2", "8", "c10d", "731", f"gpu07:{port}")
    assert args["node_rank"] == 0  # c10d numbers nodes by join order; torchrun would ignore it
    assert line == (f"Slurm job 731, node 1 of 2: derived --nproc-per-node 8 --nnodes 2 --rdzv-backend c10d "
                    f"--rdzv-id 731 --rdzv-endpoint gpu07:{port}")


def test_the_step_variables_come_before_the_jobs():
    # srun -N1 inside the two-node allocation: a one-node step on the second node.
    env = {**SLURM, "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "gpu08", "SLURM_NODEID": "0",
           "SLURM_STEP_NUM_TASKS": "1"}
    args, _ = _derive([], env)
    assert (args["nnodes"], args["rdzv_endpoint"]) == ("1", f"gpu08:{BASE_PORT + 731}")


def test_explicit_flags_win():
    flags = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-id=mine", "--rdzv-endpoint=head:1234"]
    args, line = _derive(flags, SLURM)
    assert (args["nnodes"], args["nproc_per_node"], args["rdzv_id"], args["rdzv_endpoint"]) == (
        "2", "2", "mine", "head:1234")
    assert line == ("Slurm job 731, node 1 of 2: derived --rdzv-backend c10d; given --nnodes --nproc-per-node "
                    "--rdzv-id --rdzv-endpoint")


def test_master_addr_and_port_make_the_endpoint():
    args, _ = _derive(["--master-addr=10.1.1.1", "--master-port=29999"], SLURM)
    assert args["rdzv_endpoint"] == "10.1.1.1:29999"
    args, _ = _derive(["--master-port=29999"], SLURM)
    assert args["rdzv_endpoint"] == "gpu07:29999"


def test_torchruns_environment_defaults_count_as_given(monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")
    args, line = _derive([], SLURM)
    assert args["nproc_per_node"] == "4" and line.endswith("; given --nproc-per-node")


def test_static_rendezvous_takes_the_node_rank_from_slurm():
    args, line = _derive(["--rdzv-backend=static"], SLURM)
    assert (args["node_rank"], args["rdzv_endpoint"]) == (1, f"gpu07:{BASE_PORT + 731}")
    assert "--node-rank 1" in line


def test_tasks_per_node_without_gpus():
    env = {**SLURM, "SLURM_GPUS_ON_NODE": "0", "SLURM_NTASKS_PER_NODE": "4"}
    assert _derive([], env)[0]["nproc_per_node"] == "4"
    env = {k: v for k, v in SLURM.items() if k not in ("SLURM_GPUS_ON_NODE", "SLURM_NTASKS_PER_NODE")}
    assert _derive([], env)[0]["nproc_per_node"] == "1"  # torchrun's default stays


def test_standalone_is_one_job_per_node():
    args, line = _derive(["--standalone"], SLURM)
    assert (args["nnodes"], args["nproc_per_node"], args["rdzv_endpoint"]) == ("1:1", "8", "")
    assert line == "Slurm job 731, node 1 of 2: --standalone, one single-node job per node; derived --nproc-per-node 8"


def test_an_elastic_node_range_that_admits_the_step_is_kept():
    args, _ = _derive(["--nnodes=1:4"], SLURM)
    assert args["nnodes"] == "1:4"


def test_outside_slurm_nothing_changes():
    argv = ["--nproc-per-node=2", *ENTRY]
    args = parse_args(argv)
    before = dict(vars(args))
    assert apply_slurm(args, argv, {"SLURM_NNODES": "2"}) is None  # no SLURM_JOB_ID: not an allocation
    assert vars(args) == before


@pytest.mark.parametrize("flags, env, error", [
    (["--nnodes=4"], SLURM,
     "config error: --nnodes='4': this Slurm step has SLURM_NNODES=2 nodes with one omni-run each; leave --nnodes "
     "out (or give 2), or use --standalone for one job per node"),
    (["--nnodes=3:4"], SLURM, "config error: --nnodes='3:4': this Slurm step has SLURM_NNODES=2 nodes"),
    (["--nnodes=1"], SLURM, "config error: --nnodes='1': this Slurm step has SLURM_NNODES=2 nodes"),
    ([], {**SLURM, "SLURM_NODEID": "2"},
     "config error: SLURM_NODEID=2: must be below SLURM_NNODES=2; start omni-run through srun so each node gets "
     "its own id"),
    ([], {**SLURM, "SLURM_JOB_NODELIST": "gpu[07-09]"},
     "config error: SLURM_JOB_NODELIST='gpu[07-09]': names 3 host(s) but SLURM_NNODES=2; they must agree"),
    ([], {**SLURM, "SLURM_JOB_NODELIST": "gpu[07-08"},
     "config error: SLURM_JOB_NODELIST='gpu[07-08': unexpected '['"),
    ([], {**SLURM, "SLURM_NNODES": "two"},
     "config error: SLURM_NNODES='two': must be an integer >= 1, as Slurm sets it; unset or fix it"),
    ([], {**SLURM, "SLURM_GPUS_ON_NODE": "-1"}, "config error: SLURM_GPUS_ON_NODE='-1': must be an integer >= 1"),
    # srun inherited #SBATCH --ntasks-per-node=8: sixteen agents on two nodes.
    ([], {**SLURM, "SLURM_STEP_NUM_TASKS": "16"},
     "config error: SLURM_STEP_NUM_TASKS=16: srun started 16 omni-run tasks on 2 node(s); start one per node: "
     "srun --ntasks-per-node=1 omni-run ..."),
    ([], {k: v for k, v in SLURM.items() if k != "SLURM_NODEID"},
     "config error: SLURM_JOB_ID='731': is set but SLURM_NNODES, SLURM_JOB_NODELIST or SLURM_NODEID is not"),
])
def test_contradictions_name_the_flag_or_variable(flags, env, error):
    with pytest.raises(ConfigError) as e:
        _derive(flags, env)
    assert str(e.value).startswith(error)


def test_a_bad_value_exits_2_with_one_line(monkeypatch, capsys):
    from megascale_omni.launch import main

    for name, value in {**SLURM, "SLURM_NODEID": "5"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        main(ENTRY)
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "config error: SLURM_NODEID=5: must be below SLURM_NNODES=2; start omni-run through srun so each node gets "
        "its own id"]


def test_scontrol_expands_the_nodelist_when_installed(tmp_path, monkeypatch):
    """scontrol is not installed on this host: a script of that name on PATH
    answers as ``scontrol show hostnames`` does (one host a line), to prove
    omni-run asks it rather than its own parser (which could not read this)."""
    script = tmp_path / "scontrol"
    script.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames weird{1,2}" ] || exit 1\nprintf "w1\\nw2\\n"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(tmp_path))
    args, _ = _derive([], {**SLURM, "SLURM_JOB_NODELIST": "weird{1,2}"})
    assert args["rdzv_endpoint"] == f"w1:{BASE_PORT + 731}"
    # A client that cannot run (no cluster configured on this host) leaves it to our parser...
    args, _ = _derive([], {**SLURM, "SLURM_JOB_NODELIST": "other[3-4]"})
    assert args["rdzv_endpoint"] == f"other3:{BASE_PORT + 731}"
    # ...and what both reject is one line naming the variable.
    with pytest.raises(ConfigError, match=r"^config error: SLURM_JOB_NODELIST='other\[3-': scontrol show hostnames "
                                          r"rejected it \(no host names\), and so does Slurm's hostlist grammar; "
                                          r"check the value$"):
        _derive([], {**SLURM, "SLURM_JOB_NODELIST": "other[3-"})
