"""Elastic DiT with EMA: a second replica group joins a running one (cold
start, heals from it, EMA included) and is drained while the first keeps
training; compared with a fixed-membership run of the same steps.

Each replica group is one process (TP1 x PP1); the global batch of 2
packages is dealt out among 1 or 2 participants. The shard set holds two
images written corrupt (the index matches them), so the readers skip them
while training and the job-wide ``skipped_samples`` must follow the
fixed-membership run step by step, whichever replica read them.

Checked: the loss of every step equals the fixed-membership run's within
1e-6 relative (only the order of the float sums differs); the ledger shows
every committed step consumed exactly its planned images, once; the EMA
weights of both final checkpoints agree within float summation noise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megascale_omni.checkpoint import layout
from megascale_omni.data.dit.reader import encode_pixel_record, write_dit_dataset
from megascale_omni.data.shard_writer import index_shards
from megascale_omni.demo.dit_shapes import description, generate, vocabulary
from megascale_omni.elastic.ledger import consumed_samples, read_ledger
from megascale_omni.entry import parse_for_family
from megascale_omni.parallel import ParallelDims
from megascale_omni.platform.device import Platform
from tests.dist.elastic_helpers import step_records
from tests.dist.test_elastic_membership import Job
from tests.e2e.test_dit_bad_samples import corrupt_member
from tests.launcher import launch_cmd, run, spawn

# Two DiT start-ups, paced steps and a reference run: about a minute on 2 cores.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(1200)]

CORRUPT = (3, 61)
#: Enough committed steps to read the 124-image epoch (about 7 steps) once.
MIN_STEPS = 9
RTOL = 1e-6
ARGS = ["--config", "examples/dit/tiny_cpu.yaml", "model.num_layers=1", "model.hidden_size=32",
        "model.ffn_hidden_size=64", "dit.ema_decay=0.9", "dit.eval_resolutions=[]", "train.global_batch_size=2",
        "train.lr_decay_style=constant", "train.lr_warmup_steps=0", "train.eval_interval=0",
        "data.max_bad_sample_fraction=0.05", "checkpoint.interval=0", "checkpoint.save_at_end=true",
        "logging.tensorboard=false", "logging.progress_bar=false"]


def _dataset(root: Path) -> Path:
    """124 captioned shapes; the PNGs of :data:`CORRUPT` overwritten, then indexed."""
    records = [encode_pixel_record(i, *generate(i, 0, 0)[:2]) for i in range(124)]
    write_dit_dataset(root, {"train": records}, description(), vocabulary(), samples_per_shard=40)
    split = root / "train"
    for sample_id in CORRUPT:
        corrupt_member(split, "png", sample_id)
    index_shards(split)  # written corrupt: the checksums match, the two samples are bad
    return root


class DitJob(Job):
    """:class:`Job` with DiT replica groups of one process."""

    def __init__(self, tmp_path: Path, data: Path, timeout: float):
        super().__init__(tmp_path, timeout)
        self.data = data
        self.args = [*ARGS, f"data.path={data}", "elastic.enabled=true", f"elastic.lighthouse={self.addr}",
                     f"elastic.ledger_dir={self.ledger}", "elastic.quorum_timeout_s=1200", "elastic.min_replicas=1",
                     "train.steps=100000"]

    def start(self, rid: str, *extra: str) -> None:
        self.procs[rid] = spawn(launch_cmd(1, "pretrain_dit.py", [
            *self.args, f"elastic.replica_id={rid}", f"logging.output_dir={self.run / rid}", *extra,
        ]), timeout=self.timeout)


def _final_tensors(run_dir: Path, step: int, tmp: Path) -> dict[str, torch.Tensor]:
    info = layout.resolve(run_dir / "checkpoints")
    assert info.step == step, (run_dir, info.step, step)
    flat = tmp / f"{run_dir.name}.pt"
    dcp_to_torch_save(info.path, flat)
    return {k: v for k, v in torch.load(flat, weights_only=False).items() if isinstance(v, torch.Tensor)}


def _planned_images(data: Path):
    """Step -> sorted dataset indices of the global batch, as the DiT data module plans it for one rank."""
    cfg, family = parse_for_family("dit", [*ARGS, f"data.path={data}"], world_size=1)
    task = family.build_task(cfg, Platform(torch.device("cpu"), "gloo", ()), ParallelDims.from_config(cfg.parallel, 1))
    return lambda step: sorted(task.sample_ids(step, 0, 1))


def test_join_heal_drain_matches_fixed_membership_with_ema_and_job_wide_skips(tmp_path):
    data = _dataset(tmp_path / "d")
    job = DitJob(tmp_path, data, timeout=1200)
    try:
        job.start("r0")
        job.wait("r0's first committed steps", lambda: len(job.records("r0")) >= 2)
        job.join("r1", hold="r0")  # cold start, heals from r0 (weights, optimizer, EMA, counters)
        job.wait_steps("r0", 3)
        job.drain("r1")
        job.wait("r0 to train alone again", lambda: job.participants("r0") == 1)
        job.wait("r0 to read a whole epoch", lambda: len(job.records("r0")) >= MIN_STEPS)
        job.drain("r0")  # saves its final checkpoint (it writes: participant 0 alone)
    finally:
        job.close()
    merged: dict[int, dict] = {}
    for rid in ("r0", "r1"):
        for r in job.records(rid):
            seen = merged.setdefault(r["step"], r)
            assert r["loss"] == pytest.approx(seen["loss"], rel=1e-12), (rid, r, seen)
            assert r["skipped_samples"] == seen["skipped_samples"], (rid, r, seen)
    last = max(merged)
    assert sorted(merged) == list(range(1, last + 1))
    assert {r["participants"] for r in merged.values()} == {1, 2}
    healed = job.records("r1")[0]
    assert healed["healed"] and healed["step"] > 2, healed
    # r0 computed the step after r1's heal for 1 participant (elastic.overlap_quorum), then for the 2 it got.
    assert "membership changed during step" in job.results["r0"].stderr

    reference = tmp_path / "reference"
    res = run(launch_cmd(1, "pretrain_dit.py", [*ARGS, f"data.path={data}", f"train.steps={last}",
                                                f"logging.output_dir={reference}"]), timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    ref = {r["step"]: r for r in step_records(reference)}
    assert sorted(ref) == sorted(merged)
    worst = max(abs(merged[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in ref)
    print(f"\nelastic DiT: {last} steps, max relative loss difference to the fixed-membership run {worst:.2e}")
    assert worst < RTOL
    # Job-wide bad-sample totals: both corrupt images read and counted once per epoch, on every replica.
    assert [merged[s]["skipped_samples"] for s in ref] == [ref[s]["skipped_samples"] for s in ref]
    assert ref[last]["skipped_samples"] >= len(CORRUPT)

    planned = _planned_images(data)
    consumed = consumed_samples(read_ledger(job.ledger))
    assert sorted(consumed) == list(range(last))
    for step, ids in consumed.items():
        assert sorted(ids) == planned(step), f"step {step}"

    want = _final_tensors(reference, last, tmp_path)
    got = _final_tensors(job.run / "r0", last, tmp_path)
    ema = sorted(k for k in want if k.startswith("ema."))
    assert ema and sorted(k for k in got if k.startswith("ema.")) == ema
    for k in ema:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    # The EMA is an average, not a copy of the final weights.
    assert max((want[k] - want[k[len("ema."):]]).abs().max().item() for k in ema) > 1e-4
    assert all(np.isfinite(r["loss"]) for r in merged.values())
