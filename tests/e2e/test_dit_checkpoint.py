"""DiT checkpoints: a resumed TP2 run reproduces the uninterrupted one bit for
bit (per-step losses, EMA weights and every other checkpointed tensor), and
tools/sample_dit.py samples a TP2 checkpoint in one process, giving the
images the training job sampled in-process."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megascale_omni.checkpoint import layout
from megascale_omni.demo.dit_eval import color_prompts
from megascale_omni.demo.dit_shapes import ensure_dit_shapes_dataset
from tests.launcher import read_metrics, run, torchrun

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

STEPS = 6
SEED = 1234
ARGS = ["--config", "examples/dit/tiny_cpu.yaml", f"train.steps={STEPS}", f"train.seed={SEED}", "parallel.tp=2",
        "model.num_layers=2", "train.global_batch_size=4", "train.lr=1e-2", "train.lr_warmup_steps=1",
        "dit.sample_steps=2", "dit.eval_samples_per_prompt=1",
        "dit.eval_resolutions=[[16,16]]", "logging.tensorboard=false", "logging.progress_bar=false"]


def _train(data: Path, out: Path, fail_at_step=None):
    res = torchrun(2, "pretrain_dit.py", [*ARGS, f"data.path={data}", f"logging.output_dir={out}"], timeout=280,
                   fail_at_step=fail_at_step)
    return res, {r["step"]: r["loss"] for r in read_metrics(out)} if (out / "metrics.jsonl").exists() else {}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return ensure_dit_shapes_dataset(tmp_path_factory.mktemp("dit") / "d", num_train=200, num_val=10, seed=3)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data):
    """The uninterrupted TP2 run (its run directory and per-step losses)."""
    out = tmp_path_factory.mktemp("straight")
    res, losses = _train(data, out)
    assert res.returncode == 0, res.stderr[-4000:]
    assert sorted(losses) == list(range(1, STEPS + 1))
    return out, losses


def _final_tensors(run_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the run's newest checkpoint, whole (TP shards joined)."""
    info = layout.resolve(run_dir / "checkpoints")
    assert info.step == STEPS
    flat = tmp / f"{run_dir.name}.pt"
    dcp_to_torch_save(info.path, flat)
    return {k: v for k, v in torch.load(flat, weights_only=False).items() if isinstance(v, torch.Tensor)}


# slow (make test-all): ~80 s on 2 cores; the GPT SIGTERM resume stays in make test.
@pytest.mark.slow
def test_resumed_run_reproduces_losses_and_ema(tmp_path, data, straight):
    ref_dir, reference = straight
    out = tmp_path / "run"
    res, _ = _train(data, out, fail_at_step=4)
    assert res.returncode != 0 and "injected failure at step 4" in res.stderr, res.stderr[-3000:]
    [saved] = layout.scan_tier(out / "checkpoints", "persistent")
    assert saved.complete and saved.step == 3 and saved.commit["reason"] == "failure"

    res, losses = _train(data, out)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resumed from" in res.stderr and "at step 3" in res.stderr
    # Bit-identical: the same float for every step's loss, the same bits
    # for the EMA weights (and every other tensor of the final checkpoint:
    # weights, optimizer moments).
    assert losses == reference, [(s, losses.get(s), reference[s]) for s in reference if losses.get(s) != reference[s]]

    want, got = _final_tensors(ref_dir, tmp_path), _final_tensors(out, tmp_path)
    ema_keys = sorted(k for k in want if k.startswith("ema."))
    assert ema_keys and sorted(want) == sorted(got)
    differ = [k for k in sorted(want) if not torch.equal(got[k], want[k])]
    assert not differ, differ
    # The EMA is an average, not a copy of the final weights.
    assert max((want[k] - want[k[len("ema."):]]).abs().max().item() for k in ema_keys) > 1e-4
    print(f"\nDiT TP2 resume: {len(reference)} losses and {len(want)} checkpoint tensors "
          f"({len(ema_keys)} EMA) bit-identical")


def _sample(checkpoint: Path, out: Path, *extra: str):
    prompts = [a for p, _ in color_prompts(1) for a in ("--prompt", p)]
    return run([sys.executable, "tools/sample_dit.py", "--checkpoint", str(checkpoint), *prompts, "--size", "16x16",
                "--per-prompt", "1", "--steps", "2", "--seed", str(SEED), "--out", str(out), *extra], timeout=200)


def test_sample_tool_loads_tp2_checkpoint_in_one_process(tmp_path, straight):
    """Same prompts, noise and EMA weights as the training job's end-of-run
    evaluation (TP2): the same images, up to fp32 rounding of TP2 vs TP1."""
    ref_dir, _ = straight
    res = _sample(ref_dir / "checkpoints", tmp_path / "ema.png")
    assert res.returncode == 0, res.stderr[-4000:]
    assert "saved with tp2 pp1 dp1" in res.stderr and "EMA weights" in res.stderr
    in_process = np.asarray(Image.open(ref_dir / f"samples-step{STEPS}.png")).astype(int)
    tool = np.asarray(Image.open(tmp_path / "ema.png")).astype(int)
    assert tool.shape == in_process.shape
    assert np.abs(tool - in_process).max() <= 2, np.abs(tool - in_process).max()

    print(f"\nsample_dit.py on a TP2 checkpoint vs in-process TP2 sampling: max pixel difference "
          f"{np.abs(tool - in_process).max()}")


def _load_both(checkpoint: Path) -> dict[str, dict[str, torch.Tensor]]:
    """A checkpoint's EMA and trained weights, loaded into a one-process model
    the way tools/sample_dit.py does (in this process: its one-rank group,
    megatron state and rendezvous variables are undone afterwards)."""
    import os

    from megascale_omni.models.dit.model import build_dit_chunks
    from megascale_omni.parallel import ParallelDims
    from megascale_omni.parallel.state import destroy_parallel, initialize_parallel
    from megascale_omni.platform import init_platform
    from megascale_omni.platform.device import init_distributed
    from megascale_omni.tasks.dit_checkpoint import load_dit_weights, open_dit_checkpoint

    ckpt = open_dit_checkpoint(checkpoint)
    cfg = ckpt.single_process_config()
    saved_env = dict(os.environ)
    init_distributed(init_platform())
    try:
        initialize_parallel(ParallelDims.from_config(cfg.parallel, 1), 0)
        divisible = cfg.model.make_vocab_size_divisible_by
        vocab = -(-ckpt.tokenizer().vocab_size // divisible) * divisible
        [chunk] = build_dit_chunks(cfg, torch.float32, vocab)
        out = {}
        for which in ("ema", "raw"):
            load_dit_weights([chunk], ckpt, ema=which == "ema")
            out[which] = {k: v.clone() for k, v in chunk.state_dict().items() if isinstance(v, torch.Tensor)}
        return out
    finally:
        destroy_parallel()
        os.environ.clear()
        os.environ.update(saved_env)


def test_tp2_checkpoint_weights_load_whole_into_one_process(tmp_path, straight):
    """EMA and trained weights of a TP2 checkpoint, resharded to TP1, equal
    the checkpoint's tensors (TP shards joined)."""
    ref_dir, _ = straight
    loaded = _load_both(ref_dir / "checkpoints")
    saved = _final_tensors(ref_dir, tmp_path)
    assert loaded["ema"].keys() == loaded["raw"].keys() and len(loaded["raw"]) > 20
    for name in loaded["raw"]:
        assert torch.equal(loaded["raw"][name], saved[name]), name
        assert torch.equal(loaded["ema"][name], saved["ema." + name]), name
    assert any(not torch.equal(loaded["raw"][n], loaded["ema"][n]) for n in loaded["raw"])


def _rewrite_common(step_dir: Path, edit) -> None:
    """Edit a checkpoint's non-tensor state and re-commit it (checksums updated)."""
    common = torch.load(step_dir / "common.pt", weights_only=False)
    edit(common)
    torch.save(common, step_dir / "common.pt")
    (step_dir / layout.COMMIT_FILE).unlink()
    layout.write_commit(step_dir, STEPS, {"reason": "test"})


# slow (make test-all): ~65 s of tool start-ups on 2 cores
@pytest.mark.slow
def test_sample_tool_rejects_bad_checkpoints(tmp_path, straight):
    ref_dir, _ = straight
    src = ref_dir / "checkpoints" / layout.step_dir_name(STEPS)

    def copy(name: str) -> Path:
        dst = tmp_path / name / src.name
        shutil.copytree(src, dst)
        return dst

    def fails(path: Path, code: int, *fragments: str, extra=()) -> None:
        res = run([sys.executable, "tools/sample_dit.py", "--checkpoint", str(path), "--prompt", "a red square",
                   "--out", str(tmp_path / "x.png"), *extra], timeout=120)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == code and "Traceback" not in res.stderr, res.stderr[-3000:]
        assert all(f in lines[-1] for f in fragments), lines[-1]

    fails(tmp_path / "nowhere", 2, "--checkpoint", "does not exist")
    (tmp_path / "empty").mkdir()
    fails(tmp_path / "empty", 4, "no complete checkpoint")

    broken = copy("broken")
    with open(broken / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    fails(broken, 4, "is broken", "truncated")
    fails(broken.parent, 4, "no intact checkpoint", "truncated")

    gpt = copy("gpt")
    _rewrite_common(gpt, lambda c: c["config"]["model"].update(family="gpt"))
    fails(gpt, 2, "--checkpoint", "holds a 'gpt' model but this run trains 'dit'")

    no_ema = copy("no-ema")
    _rewrite_common(no_ema, lambda c: c["task"].pop("ema"))
    fails(no_ema, 2, "has no EMA weights", "--raw")
    res = run([sys.executable, "tools/sample_dit.py", "--checkpoint", str(no_ema), "--prompt", "a red square",
               "--size", "12x20", "--per-prompt", "1", "--steps", "1", "--out", str(tmp_path / "raw.png"), "--raw"],
              timeout=200)
    assert res.returncode == 0 and "loaded the trained weights" in res.stderr, res.stderr[-3000:]
    assert Image.open(tmp_path / "raw.png").height > 12 * 4
