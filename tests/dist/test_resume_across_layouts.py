"""A LLaVA run stopped and resumed at other layouts, with default settings,
trains what one uninterrupted process trains: the same samples at every step
and the same losses.

Each chain runs 20 steps in 5 segments of 4. A segment starts from the
previous segment's checkpoint (``checkpoint.resume: auto``), at its own
layout, and stops by a failure injected at its next step, which saves the
state after its last step (the failure save). Nothing but the layout changes
between segments: the padding multiple, packing, seq_length, batch sizes and
seed are the defaults of ``examples/llava/tiny_cpu.yaml``, so a default that
followed the layout (as ``data.pad_to_multiple_of``'s did: 2*cp) changes the
samples of every step of a CP segment, and the checks below fail.

Checked against the uninterrupted one-process run (its own ledger):
- every segment's sample ledger (``elastic.ledger_dir``, written by fixed
  groups too) holds exactly its own steps, each step's samples are the
  uninterrupted run's and the plan's for that step (the plan rebuilt here
  from the dataset), and no sample occurs twice within an epoch of the plan
  (the 20 steps span three): nothing lost, nothing repeated;
- every step's loss within ``LAYOUT_RTOL`` (1e-6) relative and grad norm
  within ``LAYOUT_GRAD_RTOL`` (1e-5): the layout-equivalence tolerances (a
  resume changes nothing but the summation order of the new layout);
- a resume with another ``train.seed`` is refused: exit 2, one line naming it.

Default chain (2-process layouts): CP2 -> TP2 (cp 2 to 1) -> DP2 (TP2 to DP2)
-> PP2 -> one process (PP2 to 1). Slow chain (4 processes): TP2xCP2 ->
PP2xDP2 -> TP2xPP2 -> CP2xDP2 -> TP2xDP2.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import pytest

import torch

from megascale_omni.checkpoint import layout
from megascale_omni.elastic.ledger import consumed_samples, read_ledger
from megascale_omni.entry import parse_for_family
from megascale_omni.parallel import ParallelDims
from megascale_omni.platform.device import Platform
from tests.dist.conftest import LAYOUT_GRAD_RTOL, LAYOUT_RTOL, LLAVA_STEPS, llava_args
from tests.launcher import Result, assert_same_training, finish, launch_cmd, read_metrics, spawn, torchrun

pytestmark = [pytest.mark.dist, pytest.mark.timeout(1200)]

SEGMENTS = 5
SEGMENT_STEPS = LLAVA_STEPS // SEGMENTS
CHAINS = {
    "2proc": [(2, ["parallel.cp=2"]), (2, ["parallel.tp=2"]), (2, []), (2, ["parallel.pp=2"]), (1, [])],
    "4proc": [(4, ["parallel.tp=2", "parallel.cp=2"]), (4, ["parallel.pp=2"]), (4, ["parallel.tp=2", "parallel.pp=2"]),
              (4, ["parallel.cp=2"]), (4, ["parallel.tp=2"])],
}


def _args(llava_dataset: Path, out: Path, *extra: str) -> list[str]:
    return llava_args(llava_dataset, "train.evaluator=none", "logging.tensorboard=false", "logging.progress_bar=false",
                      f"logging.output_dir={out}", *extra)


def _describe(nproc: int, overrides: list[str]) -> str:
    degrees = {k: 1 for k in ("tp", "pp", "cp")}
    degrees.update((o.split("=")[0].split(".")[1], int(o.split("=")[1])) for o in overrides)
    dp = nproc // (degrees["tp"] * degrees["pp"] * degrees["cp"])
    cp = f" cp{degrees['cp']}" if degrees["cp"] != 1 else ""
    return f"tp{degrees['tp']} pp{degrees['pp']}{cp} dp{dp}"


@pytest.fixture(scope="module")
def plan(llava_dataset):
    """The run's data module, built here: its step-indexed plan (every rank's)."""
    cfg, spec = parse_for_family("llava", llava_args(llava_dataset), world_size=1)
    task = spec.build_task(cfg, Platform(torch.device("cpu"), "gloo", ()), ParallelDims.from_config(cfg.parallel, 1))
    yield task.data
    task.close()


def _run_chain(tmp_path: Path, llava_dataset: Path, chain, beside_last: Sequence[str] = ()
               ) -> tuple[list[dict], dict[int, list[int]], Result | None]:
    """Run the segments; returns the steps' records and samples, after
    checking each segment's resume, stop and ledger, and the result of
    ``beside_last``: one more one-process run's arguments, run alongside the
    last segment (which saves nothing, so both read the same checkpoints; with
    a one-process last segment, the two processes use the CI host's two cores)."""
    ckpt, records, consumed, beside_result = tmp_path / "ckpt", [], {}, None
    for k, (nproc, overrides) in enumerate(chain):
        start, end = k * SEGMENT_STEPS, (k + 1) * SEGMENT_STEPS
        out = tmp_path / f"segment{k}"
        last = k == len(chain) - 1
        beside = spawn(launch_cmd(1, "pretrain_llava.py", beside_last), timeout=400) if last and beside_last else None
        try:
            res = torchrun(nproc, "pretrain_llava.py",
                           _args(llava_dataset, out, *overrides, f"checkpoint.dir={ckpt}",
                                 f"elastic.ledger_dir={out / 'ledger'}", "checkpoint.save_at_end=false"),
                           timeout=400, fail_at_step=None if last else end + 1)
        finally:
            if beside is not None:  # waited for (and its group killed) whatever the segment did
                beside_result = finish(beside, timeout=400)
        if last:
            assert res.returncode == 0, res.stderr[-3000:]
        else:
            assert res.returncode != 0 and f"injected failure at step {end + 1}" in res.stderr, res.stderr[-3000:]
            newest = layout.scan_tier(ckpt, "persistent")[-1]
            assert newest.complete and newest.step == end and newest.commit["reason"] == "failure"
        if k:
            before = _describe(*chain[k - 1])
            assert f"at step {start} in" in res.stderr and f"saved with {before}, now {_describe(nproc, overrides)}" \
                in res.stderr, res.stderr[-3000:]
        got = read_metrics(out)
        assert [r["step"] for r in got] == list(range(start + 1, end + 1)), [r["step"] for r in got]
        records += got
        mine = consumed_samples(read_ledger(out / "ledger"))
        assert sorted(mine) == list(range(start, end)), sorted(mine)  # ledger steps are 0-based
        consumed.update(mine)
    return records, consumed, beside_result


def _check_against_uninterrupted(name, records, consumed, baseline, data) -> None:
    reference, reference_samples = baseline
    assert sorted(reference_samples) == sorted(consumed) == list(range(LLAVA_STEPS))
    epochs: dict[int, list[int]] = {}
    for step in range(LLAVA_STEPS):
        planned = sorted(data.sample_ids(step, 0, 1))
        assert sorted(consumed[step]) == sorted(reference_samples[step]) == planned, f"step {step + 1}: other samples"
        epochs.setdefault(data.plan.locate(step)[0], []).extend(consumed[step])
    for epoch, samples in epochs.items():
        assert len(samples) == len(set(samples)), f"a sample was trained twice in epoch {epoch}"
    print(f"\n{name}: samples per epoch {[len(v) for v in epochs.values()]} of {len(data.train_ids)}, none twice")
    assert len(epochs) > 1  # the chain resumes across an epoch boundary too
    assert_same_training(reference, records, name, LAYOUT_RTOL, LAYOUT_GRAD_RTOL,
                         counters=("samples", "loss_tokens"))


def test_resume_across_cp_tp_dp_pp_changes_keeps_samples_and_losses(tmp_path, llava_dataset, llava_baseline, plan):
    # The plan's settings are recorded: another seed would resume on another plan, and is refused (a resume
    # of the checkpoints the chain's last segment resumes from, run beside that segment).
    reseeded = _args(llava_dataset, tmp_path / "reseeded", "train.seed=7", f"checkpoint.dir={tmp_path / 'ckpt'}")
    records, consumed, res = _run_chain(tmp_path, llava_dataset, CHAINS["2proc"], beside_last=reseeded)
    _check_against_uninterrupted("2-process chain", records, consumed, llava_baseline, plan)
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("config error:")]
    assert len(set(errors)) == 1 and re.match(
        r"config error: train.seed=7: the checkpoint's run planned with 1234, and it decides which samples each "
        r"step holds", errors[0]), res.stderr[-3000:]


@pytest.mark.slow
def test_resume_across_4_process_layouts_keeps_samples_and_losses(tmp_path, llava_dataset, llava_baseline, plan):
    records, consumed, _ = _run_chain(tmp_path, llava_dataset, CHAINS["4proc"])
    _check_against_uninterrupted("4-process chain", records, consumed, llava_baseline, plan)
