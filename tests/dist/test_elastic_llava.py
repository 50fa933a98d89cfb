"""Elastic LLaVA at the issue's layout: replica groups of PP2 x inner DP2
(4 processes each) with the distributed optimizer. A second group joins a
running one (cold start; each rank heals its own optimizer shard from the
same rank of the live group) and is drained; the first keeps training.

Compared with a fixed-membership run of the same layout (non-elastic, same
seed and global batch, constant LR) over the same steps: per-step losses
within 1e-6 relative through every membership change, and the ledger shows
every committed step consumed its planned global batch exactly once.
"""

from __future__ import annotations

import pytest

from megascale_omni.config import load_job_config
from megascale_omni.config.validate import sequence_multiple
from megascale_omni.data.llava.batches import LlavaEncoder
from megascale_omni.data.llava.plan_scan import PlanScanner
from megascale_omni.data.sample_plan import PackedEpochPlan
from megascale_omni.data.shards import ShardedSampleReader
from megascale_omni.demo.llava_shapes import load_shapes_tokenizer, make_shapes_dataset
from megascale_omni.elastic.ledger import consumed_samples, read_ledger
from tests.dist.elastic_helpers import merged_steps, step_records
from tests.dist.test_elastic_membership import Job, membership_scenario
from tests.launcher import launch_cmd, run, spawn

# Two groups of 4 LLaVA processes, then a 4-process reference: about a minute on 2 cores.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(1800)]

RTOL = 1e-6
NPROC = 4
SEED, SEQ, TOKENS_PER_IMAGE = 1234, 256, 16
#: Steps compared past the last membership change (see _check).
COMPARED_AFTER = 1
ARGS = ["--config", "examples/llava/tiny_cpu.yaml", "parallel.pp=2", "parallel.use_distributed_optimizer=true",
        "model.num_layers=2", "vision.num_layers=1", "train.global_batch_size=4", "train.micro_batch_size=1",
        "train.eval_interval=0", "train.lr_decay_style=constant", "checkpoint.save_at_end=false",
        "logging.tensorboard=false", "logging.progress_bar=false"]


class LlavaGroups(Job):
    """:class:`Job` with LLaVA replica groups of PP2 x inner DP2."""

    def __init__(self, tmp_path, data, timeout: float):
        super().__init__(tmp_path, timeout, inner_dp=2)
        self.common = [*ARGS, f"data.path={data}"]
        self.args = [*self.common, "elastic.enabled=true", f"elastic.lighthouse={self.addr}",
                     f"elastic.ledger_dir={self.ledger}", "elastic.quorum_timeout_s=1200", "elastic.min_replicas=1",
                     "train.steps=100000"]

    def start(self, rid: str, *extra: str) -> None:
        self.procs[rid] = spawn(launch_cmd(NPROC, "pretrain_llava.py", [
            *self.args, f"elastic.replica_id={rid}", f"logging.output_dir={self.run / rid}", *extra,
        ]), timeout=self.timeout)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava") / "d"
    make_shapes_dataset(root, num_train=200, num_val=8, seed=1, samples_per_shard=100)
    return root


def _check(job: LlavaGroups, data, sizes: set[int]) -> None:
    """Losses equal across the groups of a quorum and within RTOL of a
    fixed-membership run of the same steps; every committed step consumed
    exactly its planned global batch, once; every joiner healed first."""
    merged = merged_steps(job.records(rid) for rid in job.procs)
    last = max(merged)
    assert {r["participants"] for r in merged.values()} == sizes
    for rid in job.procs:
        if rid != "r0" and job.records(rid):
            assert job.records(rid)[0]["healed"], rid

    reference = job.tmp / "reference"
    res = run(launch_cmd(NPROC, "pretrain_llava.py", [*job.common, f"train.steps={last}",
                                                      f"logging.output_dir={reference}"]), timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    ref = {r["step"]: r for r in step_records(reference)}
    assert sorted(ref) == sorted(merged)
    # Compared through the last membership change and COMPARED_AFTER steps
    # more: past that, the runs' float summation-order noise (1e-7 per
    # multi-group step) keeps compounding through Adam even with one group
    # (measured: 6e-7 at the last change, 2e-2 ninety single-group steps later).
    changes = [s for s in range(2, last + 1) if merged[s]["participants"] != merged[s - 1]["participants"]]
    upto = min(last, max(changes, default=1) + COMPARED_AFTER)
    diff = {s: abs(merged[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in ref}
    worst = max(diff[s] for s in range(1, upto + 1))
    print(f"\nelastic LLaVA PP2 x DP2 (distributed optimizer): {last} steps, membership changes at {changes}; "
          f"max relative loss difference to the fixed-membership run through step {upto}: {worst:.2e}")
    assert worst < RTOL, {s: diff[s] for s in range(1, upto + 1) if diff[s] >= RTOL}

    reader = ShardedSampleReader(data / "train")
    encoder = LlavaEncoder(load_shapes_tokenizer(data), TOKENS_PER_IMAGE)
    scan = PlanScanner(encoder, TOKENS_PER_IMAGE, SEQ, sequence_multiple(load_job_config(ARGS))).scan(reader)
    plan = PackedEpochPlan(scan.lengths, SEQ, 4, SEED, costs=scan.costs)
    consumed = consumed_samples(read_ledger(job.ledger))
    assert sorted(consumed) == list(range(last))
    for step, ids in consumed.items():
        expected = sorted(int(scan.ids[sid]) for p in plan.global_batch(step) for sid in p.sample_ids)
        assert sorted(ids) == expected, f"step {step}: {sorted(ids)} != {expected}"


def test_pp2_dp2_distopt_groups_join_heal_drain_match_fixed_membership(tmp_path, data):
    job = LlavaGroups(tmp_path, data, timeout=1800)
    try:
        job.start("r0")
        job.wait("r0's first committed steps", lambda: len(job.records("r0")) >= 2)
        job.join("r1", hold="r0")  # cold start: each rank heals its own shard
        job.wait_steps("r0", 3)
        job.drain("r1")
        job.wait("r0 to train alone again", lambda: job.participants("r0") == 1)
        job.wait_steps("r0", 2)
        job.drain("r0")
    finally:
        job.close()
    assert "healed from a live peer" in job.results["r1"].stderr
    _check(job, data, {1, 2})


# make test-all: up to 12 LLaVA processes at once on 2 cores.
@pytest.mark.slow
def test_pp2_dp2_distopt_membership_scenario(tmp_path, data):
    """The issue's scenario: cold join, standby join, drain, SIGKILL in
    flight, a standby drained before joining (membership_scenario)."""
    job = LlavaGroups(tmp_path, data, timeout=1800)
    try:
        membership_scenario(job)
        job.drain("r0")
    finally:
        job.close()
    assert not job.records("r3") and "never joined" in job.results["r3"].stderr
    _check(job, data, {1, 2, 3})
