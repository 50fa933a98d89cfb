"""The pipeline planner tool and the training entry point's refusal of an
infeasible split (exit 2, one line, before any process group starts)."""

from __future__ import annotations

import os
import sys

from megascale_omni.config import load_job_config
from megascale_omni.parallel.memory import format_memory_table
from megascale_omni.tasks.registry import estimate_memory_per_gpu
from tests.launcher import REPO, run

EXAMPLE = "examples/llava/pp4_vit_heavy.yaml"


def test_plan_tool_prints_uniform_beside_auto():
    res = run([sys.executable, "tools/plan_pipeline.py", "--config", EXAMPLE], timeout=280)
    assert res.returncode == 0, res.stderr
    assert "uniform layers" in res.stdout and "auto layers" in res.stdout
    assert "uniform: layers per chunk [4, 4, 4, 4]  max/mean 1.476" in res.stdout
    assert "auto: layers per chunk [2, 5, 5, 4]" in res.stdout
    # The configured (auto) split's memory per GPU, as estimate_memory_per_gpu computes it.
    cfg = load_job_config(["--config", EXAMPLE])
    table = format_memory_table(estimate_memory_per_gpu(cfg, cuda=False))
    assert "memory per GPU of the configured split (model.recompute=none" in res.stdout
    assert table in res.stdout and table.count("\n") == 4


def test_infeasible_memory_exits_2_before_any_process_group():
    """The training entry point rejects the plan with one line and exit code 2."""
    res = run(
        [sys.executable, "pretrain_llava.py", "--config", EXAMPLE, "parallel.pipeline_memory_gib=0.01"],
        timeout=280, env={"WORLD_SIZE": "4"},
    )
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("config error")]
    assert len(lines) == 1 and "parallel.pipeline_memory_gib=0.01" in lines[0] and "GiB" in lines[0]
    assert "Traceback" not in res.stderr
    assert not os.path.exists(REPO / "runs/llava-pp4-vit-heavy")  # nothing started


def test_plan_tool_plans_a_job_whose_data_lives_elsewhere(tmp_path):
    """Planning needs the model and layout only: a recipe whose data, tokenizer
    and pretrained weights are not on this host still gets its memory table
    (the training entry point would refuse those paths)."""
    recipe = REPO / "examples/recipes/llava15_7b_stage2.yaml"
    res = run([sys.executable, str(REPO / "tools/plan_pipeline.py"), "--config", str(recipe), "--world-size", "8",
               "--device", "cuda"], timeout=280, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert not (tmp_path / "data").exists()
    table = format_memory_table(estimate_memory_per_gpu(load_job_config(["--config", str(recipe)]), cuda=True,
                                                        world_size=8))
    assert "use_distributed_optimizer=True" in res.stdout and table in res.stdout
