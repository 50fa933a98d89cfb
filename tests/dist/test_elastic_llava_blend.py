"""Elastic LLaVA on two blended datasets (``data.blend``): a second replica
group joins a running one (cold start, heals from it) and is drained while
the first keeps training; the sample ledger shows every committed step
consumed exactly the blended plan's global batch, once.

Each replica group is one process (TP1 x PP1); the global batch of 4 packed
rows (micro-batches of 1) is dealt out among 1 or 2 participants. The
expected batches are rebuilt here from the shards as the task builds them
(index costs, blended order, packed plan), so a lost, repeated or
mis-split share, or a plan that depends on the participant count, fails.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import pytest

from megascale_omni.data.blend import BlendedOrder, ConcatReader
from megascale_omni.config import load_job_config
from megascale_omni.config.validate import sequence_multiple
from megascale_omni.data.llava.batches import LlavaEncoder
from megascale_omni.data.llava.plan_scan import PlanScanner
from megascale_omni.data.sample_plan import PackedEpochPlan
from megascale_omni.data.shards import ShardedSampleReader
from megascale_omni.demo.llava_shapes import load_shapes_tokenizer, make_shapes_dataset
from megascale_omni.elastic.ledger import consumed_samples, read_ledger
from tests.dist.control_helpers import omni_ctl
from tests.dist.elastic_helpers import merged_steps
from tests.dist.test_elastic_membership import CTL_TIMEOUT, Job
from tests.launcher import finish, launch_cmd, spawn

# Two LLaVA start-ups and at least 8 paced steps: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.dist, pytest.mark.timeout(1200)]

SEED, GLOBAL_BATCH, SEQ, TOKENS_PER_IMAGE = 1234, 4, 256, 16
WEIGHTS = (1.0, 3.0)


class LlavaJob(Job):
    """:class:`Job` with LLaVA replica groups of one process on the data of ``data_args``."""

    def __init__(self, tmp_path, data_args: Sequence[str], timeout: float):
        super().__init__(tmp_path, timeout)
        self.args = [
            "--config", "examples/llava/tiny_cpu.yaml", "elastic.enabled=true", f"elastic.lighthouse={self.addr}",
            f"elastic.ledger_dir={self.ledger}", "elastic.quorum_timeout_s=1200", "elastic.min_replicas=1",
            *data_args, "model.num_layers=2", "vision.num_layers=1",
            "train.steps=100000", f"train.global_batch_size={GLOBAL_BATCH}", "train.micro_batch_size=1",
            "train.eval_interval=0", "train.lr_decay_style=constant", "checkpoint.save_at_end=false",
            "logging.tensorboard=false", "logging.progress_bar=false",
        ]

    def start(self, rid: str, *extra: str) -> None:
        self.procs[rid] = spawn(launch_cmd(1, "pretrain_llava.py", [
            *self.args, f"elastic.replica_id={rid}", f"logging.output_dir={self.run / rid}", *extra,
        ]), timeout=self.timeout)


def expected_batches(sources, weights: Optional[Sequence[float]] = WEIGHTS) -> Callable[[int], list[int]]:
    """Step -> sorted dataset indices of the global batch, as ConversationData plans
    it: blended over ``sources`` by ``weights``, or ``sources[0]`` alone when None."""
    reader = ConcatReader([ShardedSampleReader(p / "train") for p in sources]) if weights else \
        ShardedSampleReader(sources[0] / "train")
    encoder = LlavaEncoder(load_shapes_tokenizer(sources[0]), TOKENS_PER_IMAGE)
    multiple = sequence_multiple(load_job_config(["--config", "examples/llava/tiny_cpu.yaml"]))
    scan = PlanScanner(encoder, TOKENS_PER_IMAGE, SEQ, multiple).scan(reader)
    assert scan.from_index == len(reader)  # every source carries token counts for this tokenizer
    order = BlendedOrder(reader.source_of(scan.ids), weights, SEED) if weights else None
    plan = PackedEpochPlan(scan.lengths, SEQ, GLOBAL_BATCH, SEED, costs=scan.costs, order=order)
    return lambda step: sorted(int(scan.ids[sid]) for p in plan.global_batch(step) for sid in p.sample_ids)


def check_exactly_once(job: Job, expected: Callable[[int], list[int]]) -> dict[int, list[int]]:
    """Every replica's records agree per step, steps run 1..last with one and
    two participants, and the ledger's committed steps consumed exactly
    ``expected(step)`` once; returns step -> consumed ids."""
    merged = merged_steps(job.records(rid) for rid in job.procs)
    last = max(merged)
    assert {r["participants"] for r in merged.values()} == {1, 2}
    consumed = consumed_samples(read_ledger(job.ledger))
    assert sorted(consumed) == list(range(last))
    for step, ids in consumed.items():
        assert sorted(ids) == expected(step), f"step {step}: {sorted(ids)} != {expected(step)}"
    return consumed


def test_join_and_drain_on_blended_data_keep_the_ledger_exactly_once(tmp_path):
    sources = (tmp_path / "a", tmp_path / "b")
    make_shapes_dataset(sources[0], num_train=120, num_val=8, seed=1, samples_per_shard=60)
    make_shapes_dataset(sources[1], num_train=40, num_val=8, seed=2, samples_per_shard=40)
    blend = ", ".join(f"{{path: {p}, weight: {w}}}" for p, w in zip(sources, WEIGHTS))
    job = LlavaJob(tmp_path, [f"data.path={sources[0]}", f"data.blend=[{blend}]"], timeout=1200)
    try:
        job.start("r0")
        job.wait("r0's first committed steps", lambda: len(job.records("r0")) >= 2)
        job.join("r1", hold="r0")  # cold start, heals from r0
        job.wait_steps("r0", 3)
        job.drain("r1")
        job.wait("r0 to train alone again", lambda: job.participants("r0") == 1)
        job.wait_steps("r0", 2)
        reply = omni_ctl(job.run / "r0", *CTL_TIMEOUT, "drain", timeout_s=330)
        assert reply["ok"], reply
        res = job.results["r0"] = finish(job.procs["r0"], job.timeout)
        assert res.returncode == 0, res.stderr[-4000:]
    finally:
        job.close()
    assert job.records("r1")[0]["healed"]
    consumed = check_exactly_once(job, expected_batches(sources))
    # Both sources are drawn from (ids of b follow a's 120 in the blended item space).
    drawn = [i for ids in consumed.values() for i in ids]
    assert min(drawn) < 120 <= max(drawn)
