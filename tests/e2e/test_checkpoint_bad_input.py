"""Broken checkpoints, incompatible configs and tier fallback give clear
outcomes: fall back with a warning, or exit with one readable line.

Every test restarts the same one-process job on its own copy of two
checkpoint tiers. The runs are independent, so the module starts those of
the selected tests two at a time (one busy core each on the 2-core CI host)
in the ``runs`` fixture, and each test checks its own run.
"""

from __future__ import annotations

import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megascale_omni.checkpoint import layout
from tests.launcher import run

# The first test of the module waits for every run (two at a time); each run keeps its own 200 s limit.
pytestmark = pytest.mark.timeout(900)


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


def _args(root):
    return [f"checkpoint.local_dir={root / 'fast'}", f"checkpoint.dir={root / 'slow'}"]


def _payload(root, tier, step):
    return next((root / tier / layout.step_dir_name(step)).glob("*.distcp"))


def _lose_fast_tier(root: Path) -> None:
    shutil.rmtree(root / "fast")


def _damage_newest(root: Path, damage: str) -> None:
    for tier in ("fast", "slow"):
        f = _payload(root, tier, 10)
        data = f.read_bytes()
        if damage == "truncate":
            f.write_bytes(data[: len(data) // 2])
        elif damage == "bitflip":
            f.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
        else:
            f.unlink()


def _break_all(root: Path) -> None:
    for tier in ("fast", "slow"):
        for step in (5, 10):
            _payload(root, tier, step).write_bytes(b"")


def _nothing(root: Path) -> None:
    pass


DAMAGES = ["truncate", "bitflip", "missing"]

#: Test name -> (damage to the copied tiers, extra arguments given the copy's root, steps).
RUNS = {
    "test_resume_prefers_the_fast_tier": (_nothing, lambda root: [], 12),
    "test_lost_fast_tier_resumes_from_persistent": (_lose_fast_tier, lambda root: [], 12),
    **{f"test_broken_newest_falls_back_to_previous_complete[{damage}]":
       (lambda root, damage=damage: _damage_newest(root, damage), lambda root: [], 12) for damage in DAMAGES},
    "test_all_broken_exits_4_with_every_problem": (_break_all, lambda root: [], 12),
    "test_incompatible_model_exits_2_listing_differences":
        (_nothing, lambda root: ["model.hidden_size=128", "model.num_layers=2"], 12),
    "test_explicit_resume_of_a_non_checkpoint_exits_2_naming_the_field":
        (_nothing, lambda root: [f"checkpoint.resume={root}"], 12),
    "test_resume_none_starts_fresh_and_keeps_old_checkpoints":
        (_nothing, lambda root: ["checkpoint.resume=none", "checkpoint.save_at_end=false"], 2),
}


@pytest.fixture(scope="module")
def runs(request, two_tiers, tmp_path_factory):
    """Test name -> (its copy of the tiers, its run's result), for the
    selected tests of this module; two runs at a time."""
    names = [item.name for item in request.session.items if item.module is request.module and item.name in RUNS]

    def one(name):
        damage, extra, steps = RUNS[name]
        root = tmp_path_factory.mktemp("case")
        for tier in ("fast", "slow"):
            shutil.copytree(two_tiers / tier, root / tier)
        damage(root)
        return root, _smoke(root / "run", *_args(root), *extra(root), steps=steps)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(names, pool.map(one, names)))


@pytest.fixture
def outcome(runs, request):
    """This test's (tiers, result)."""
    return runs[request.node.name]


def test_resume_prefers_the_fast_tier(outcome):
    tiers, res = outcome
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {tiers / 'fast' / layout.step_dir_name(10)} at step 10" in res.stderr


def test_lost_fast_tier_resumes_from_persistent(outcome):
    tiers, res = outcome
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {tiers / 'slow' / layout.step_dir_name(10)} at step 10" in res.stderr


@pytest.mark.parametrize("damage", DAMAGES)
def test_broken_newest_falls_back_to_previous_complete(outcome, damage):
    _, res = outcome
    assert res.returncode == 0, res.stderr[-3000:]
    assert "is broken" in res.stderr and "falling back to the previous complete checkpoint" in res.stderr
    assert {"truncate": "truncated", "bitflip": "sha256 mismatch", "missing": "missing file"}[damage] in res.stderr
    assert "at step 5" in res.stderr


def test_all_broken_exits_4_with_every_problem(outcome):
    _, res = outcome
    assert res.returncode == 4, res.stderr[-3000:]
    [line] = [ln for ln in res.stderr.splitlines() if ln.startswith("checkpoint error:")]
    assert "no intact checkpoint" in line and line.count("truncated") == 4
    assert "checkpoint.resume=none" in line
    assert "Traceback" not in res.stderr


def test_incompatible_model_exits_2_listing_differences(outcome):
    _, res = outcome
    assert res.returncode == 2, res.stderr[-3000:]
    [line] = [ln for ln in res.stderr.splitlines() if ln.startswith("config error:")]
    assert "model.hidden_size: checkpoint 64, config 128" in line
    assert "model.num_layers: checkpoint 4, config 2" in line
    assert "Traceback" not in res.stderr


def test_explicit_resume_of_a_non_checkpoint_exits_2_naming_the_field(outcome):
    tiers, res = outcome
    assert res.returncode == 2, res.stderr[-3000:]
    [line] = [ln for ln in res.stderr.splitlines() if ln.startswith("config error:")]
    assert "Traceback" not in res.stderr
    assert line == (f"config error: checkpoint.resume='{tiers}': is not a checkpoint directory; name a "
                    "step_NNNNNNNN directory, or use auto (the newest under checkpoint.dir) or none (start fresh)")
    assert not (tiers / "run").exists()  # refused before anything started


def test_resume_none_starts_fresh_and_keeps_old_checkpoints(outcome):
    tiers, res = outcome
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed" not in res.stderr
    assert [c.step for c in layout.scan_tier(tiers / "slow", "slow") if c.complete] == [5, 10]
