"""Two-node launch through Slurm's environment, on one machine.

Two real ``omni-run`` agents act as the two nodes of a Slurm job: each sees
what ``srun --ntasks-per-node=1`` gives its task (job id, two nodes, its
node id, the nodelist) and nothing else about the job, derives the c10d
rendezvous itself, and meets the other through it. The nodelist
``127.0.0.[1-2]`` is a genuine two-host compact list whose hosts are both
loopback addresses, so the first node's endpoint is reachable here; only
the port is given (a free one instead of the per-job default). The job
trains the tiny GPT with DP=2 across the two agents and must match the
one-process run with the same global batch at the layout tolerance.
"""

from __future__ import annotations

import sys
import time

import pytest

from tests.dist.conftest import GPT_CONFIG, GPT_STEPS, LAYOUT_GRAD_RTOL, LAYOUT_RTOL
from tests.launcher import assert_same_training, finish, free_port, kill_group, read_metrics, spawn

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

JOB_ID = "4242"
TIMEOUT = 200


def _node_env(node_id: int) -> dict:
    """The Slurm variables of one node's srun task (spawn() leaves out those of
    an allocation this test may run in)."""
    return {"SLURM_JOB_ID": JOB_ID, "SLURM_NNODES": "2", "SLURM_NODEID": str(node_id),
            "SLURM_JOB_NODELIST": "127.0.0.[1-2]", "SLURM_NTASKS_PER_NODE": "1", "SLURM_STEP_NUM_TASKS": "2"}


def test_two_nodes_from_slurm_train_like_one_process(tmp_path, gpt_baseline):
    port = free_port()
    out = tmp_path / "run"  # one directory for both nodes, as on a shared file system
    cmd = [sys.executable, "-m", "megascale_omni.launch", f"--master-port={port}", "-m", "megascale_omni.smoke",
           "--config", GPT_CONFIG, f"train.steps={GPT_STEPS}", f"logging.output_dir={out}",
           "logging.tensorboard=false"]
    agents = [spawn(cmd, TIMEOUT, env=_node_env(node)) for node in (0, 1)]
    deadline = time.monotonic() + TIMEOUT
    try:
        results = [finish(agent, max(deadline - time.monotonic(), 1)) for agent in agents]
    finally:  # finish() kills what it waited for; the other agent too if the first one failed the wait
        for agent in agents:
            if agent.returncode is None:
                kill_group(agent)
    for node, res in enumerate(results):
        assert res.returncode == 0, f"node {node}:\n{res.output[-4000:]}"
        derived = (f"omni-run: Slurm job {JOB_ID}, node {node} of 2: derived --nproc-per-node 1 --nnodes 2 "
                   f"--rdzv-backend c10d --rdzv-id {JOB_ID} --rdzv-endpoint 127.0.0.1:{port}; given --master-port")
        assert res.stderr.splitlines()[0] == derived
    # Rank 0 (on whichever node joined first) logs the layout: two ranks, both data-parallel.
    assert sum("parallel layout: tp=1 pp=1 cp=1 dp=2 (world=2)" in r.output for r in results) == 1
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, GPT_STEPS + 1))
    assert {r["microbatches"] for r in records} == {2}  # 4 micro-batches of the global batch, 2 per rank
    assert_same_training(gpt_baseline, records, "two nodes from Slurm", LAYOUT_RTOL, LAYOUT_GRAD_RTOL,
                         counters=("loss_tokens",), lr_rtol=1e-9)
