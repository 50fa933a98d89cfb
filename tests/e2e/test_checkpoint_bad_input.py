"""Broken checkpoints, incompatible configs and tier fallback give clear
outcomes: fall back with a warning, or exit with one readable line."""

from __future__ import annotations

import shutil
import sys

import pytest

from megascale_omni.checkpoint import layout
from tests.launcher import run

pytestmark = pytest.mark.timeout(300)


def _smoke(out, *args, steps=12):
    return run(
        [sys.executable, "-m", "megascale_omni.smoke", "--config", "examples/gpt/tiny.yaml", f"train.steps={steps}",
         f"logging.output_dir={out}", "logging.tensorboard=false", "logging.progress_bar=false", *args],
        timeout=200,
    )


@pytest.fixture(scope="module")
def two_tiers(tmp_path_factory):
    """Checkpoints at steps 5 and 10 in a fast and a persistent tier."""
    root = tmp_path_factory.mktemp("tiers")
    res = _smoke(root / "run", f"checkpoint.local_dir={root / 'fast'}", f"checkpoint.dir={root / 'slow'}",
                 "checkpoint.interval=5", steps=10)
    assert res.returncode == 0, res.stderr[-3000:]
    for tier in ("fast", "slow"):
        assert [c.step for c in layout.scan_tier(root / tier, tier) if c.complete] == [5, 10]
    return root


@pytest.fixture
def tiers(two_tiers, tmp_path):
    for tier in ("fast", "slow"):
        shutil.copytree(two_tiers / tier, tmp_path / tier)
    return tmp_path


def _args(root):
    return [f"checkpoint.local_dir={root / 'fast'}", f"checkpoint.dir={root / 'slow'}"]


def _payload(root, tier, step):
    return next((root / tier / layout.step_dir_name(step)).glob("*.distcp"))


def test_resume_prefers_the_fast_tier(tiers):
    res = _smoke(tiers / "run", *_args(tiers))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {tiers / 'fast' / layout.step_dir_name(10)} at step 10" in res.stderr


def test_lost_fast_tier_resumes_from_persistent(tiers):
    shutil.rmtree(tiers / "fast")
    res = _smoke(tiers / "run", *_args(tiers))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {tiers / 'slow' / layout.step_dir_name(10)} at step 10" in res.stderr


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "missing"])
def test_broken_newest_falls_back_to_previous_complete(tiers, damage):
    for tier in ("fast", "slow"):
        f = _payload(tiers, tier, 10)
        data = f.read_bytes()
        if damage == "truncate":
            f.write_bytes(data[: len(data) // 2])
        elif damage == "bitflip":
            f.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
        else:
            f.unlink()
    res = _smoke(tiers / "run", *_args(tiers))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "is broken" in res.stderr and "falling back to the previous complete checkpoint" in res.stderr
    assert {"truncate": "truncated", "bitflip": "sha256 mismatch", "missing": "missing file"}[damage] in res.stderr
    assert "at step 5" in res.stderr


def test_all_broken_exits_4_with_every_problem(tiers):
    for tier in ("fast", "slow"):
        for step in (5, 10):
            _payload(tiers, tier, step).write_bytes(b"")
    res = _smoke(tiers / "run", *_args(tiers))
    assert res.returncode == 4, res.stderr[-3000:]
    [line] = [ln for ln in res.stderr.splitlines() if ln.startswith("checkpoint error:")]
    assert "no intact checkpoint" in line and line.count("truncated") == 4
    assert "checkpoint.resume=none" in line
    assert "Traceback" not in res.stderr


def test_incompatible_model_exits_2_listing_differences(tiers):
    res = _smoke(tiers / "run", *_args(tiers), "model.hidden_size=128", "model.num_layers=2")
    assert res.returncode == 2, res.stderr[-3000:]
    [line] = [ln for ln in res.stderr.splitlines() if ln.startswith("config error:")]
    assert "model.hidden_size: checkpoint 64, config 128" in line
    assert "model.num_layers: checkpoint 4, config 2" in line
    assert "Traceback" not in res.stderr


def test_explicit_resume_of_a_non_checkpoint_exits_4(tiers):
    res = _smoke(tiers / "run", *_args(tiers), f"checkpoint.resume={tiers / 'run'}")
    assert res.returncode == 4, res.stderr[-3000:]
    assert "is not a checkpoint directory" in res.stderr


def test_resume_none_starts_fresh_and_keeps_old_checkpoints(tiers):
    res = _smoke(tiers / "run", *_args(tiers), "checkpoint.resume=none", "checkpoint.save_at_end=false", steps=2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed" not in res.stderr
    assert [c.step for c in layout.scan_tier(tiers / "slow", "slow") if c.complete] == [5, 10]
