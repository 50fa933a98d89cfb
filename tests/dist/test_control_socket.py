"""omni-ctl drives a 2-process (PP=2) job: pause longer than the collective
timeout, change config, resume, checkpoint, drain; every rank stops at the same step."""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.dist.control_helpers import omni_ctl, wait_for_server, wait_for_step
from tests.launcher import output_of, read_metrics, spawn_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

#: Collective timeout of the job; the pause below lasts longer than this.
DIST_TIMEOUT_S = 10


def test_omni_ctl_pause_config_resume_drain(tmp_path):
    run = tmp_path / "run"
    args = ["--config", "examples/gpt/tiny.yaml", "parallel.pp=2", "train.steps=100000",
            f"logging.output_dir={run}", "logging.tensorboard=false", "logging.log_interval=1000",
            f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.save_at_end=false", "checkpoint.resume=none"]
    env = {"MEGASCALE_DIST_TIMEOUT_S": str(DIST_TIMEOUT_S), "MEGASCALE_LOG_ALL_RANKS": "1"}
    with spawn_torchrun(2, "megascale_omni.smoke", args, timeout=200, env=env) as proc:
        wait_for_server(run, proc)
        wait_for_step(run, 3)
        status = omni_ctl(run, "status")["result"]
        assert status["layout"]["pp"] == 2 and status["world_size"] == 2
        # Rank 0 serves, rank 1 owns the loss: the step record crossed over.
        assert isinstance(status["last_loss"], float)

        paused = omni_ctl(run, "pause")["result"]
        p = paused["step"]
        held_until = time.monotonic() + DIST_TIMEOUT_S + 2
        while time.monotonic() < held_until:
            s = omni_ctl(run, "status")["result"]
            assert (s["state"], s["step"]) == ("paused", p)
            time.sleep(1.0)
        changed = omni_ctl(run, "config", "set", "logging.log_interval", "5")["result"]
        assert changed == {"field": "logging.log_interval", "old": 1000, "new": 5, "step": p}
        refused = omni_ctl(run, "config", "set", "logging.log_interval", "five")
        assert refused["error"]["code"] == "invalid_value" and refused["error"]["field"] == "logging.log_interval"
        assert omni_ctl(run, "config", "get", "logging.log_interval")["result"]["value"] == 5
        assert omni_ctl(run, "resume")["result"] == {"state": "running", "step": p, "changed": True}
        wait_for_step(run, p + 6)
        metrics = omni_ctl(run, "metrics", "--last", "3")["result"]["records"]
        assert len(metrics) == 3 and all(r["loss"] > 0 for r in metrics)

        requested = omni_ctl(run, "checkpoint")["result"]
        assert requested["checkpoint"] == {
            "requested_at_step": requested["step"], "dir": str(tmp_path / "ckpt"), "writer": True,
        }

        drained = omni_ctl(run, "drain")["result"]
        d = drained["step"]
        assert proc.wait(timeout=60) == 0
        text = output_of(proc)
    assert "Traceback" not in text
    assert [r["step"] for r in read_metrics(run)] == list(range(1, d + 1))
    for rank in (0, 1):
        assert f"[rank {rank}] INFO megascale_omni.control.plane: control: paused at step {p}" in text
        assert f"[rank {rank}] INFO megascale_omni.control.plane: control: drain at step {d}:" in text
    # The new log interval reached the loss rank (rank 1): lines after the pause at multiples of 5 only.
    logged = [int(m) for m in re.findall(r"\[rank 1\] INFO megascale_omni\.training\.trainer: step (\d+)/", text)]
    after = [s for s in logged if s > p]
    assert after and all(s % 5 == 0 for s in after), (p, logged)
    assert not (run / "control.sock").exists()
    saves = [json.loads(line) for line in (run / "checkpoints.jsonl").read_text().splitlines()]
    assert [(s["step"], s["reason"]) for s in saves] == [(requested["step"], "control")]
