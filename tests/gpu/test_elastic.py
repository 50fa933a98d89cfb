"""An elastic heal between two replica groups on the device: r0 trains, r1
starts cold, heals from r0 (weights and optimizer state over torchft's
NCCL group on CUDA) and joins; r1 is drained and r0 trains alone again.

The scenario, checks and harness are tests/dist/test_elastic_membership.py's
(``join_heal_drain``: exactly-once sample ledger, constant global batch,
per-step loss equal to a fixed-membership run) with one process per group
(TP1 x PP1), each group on its own device, at the
:class:`~tests.gpu.conftest.Target`'s layout tolerance.
"""

from __future__ import annotations

import pytest

from tests.dist.test_elastic_membership import Job, join_heal_drain

TIMEOUT = 600


@pytest.mark.dist
@pytest.mark.timeout(TIMEOUT + 60)
def test_join_heals_from_live_group_then_drain(target, tmp_path):
    target.require_processes(2)
    layout = ["parallel.pp=1", *target.overrides()]
    env = {"r0": target.env_for(0, 1), "r1": target.env_for(1, 1), "reference": target.env_for(0, 1)}
    job = Job(tmp_path, timeout=TIMEOUT, layout=layout, reference=(1, layout), inner_dp=1,
              rel_tol=max(target.loss_rtol, 1e-6), nproc=1, env=env)
    join_heal_drain(job)
    assert "healed from a live peer" in job.results["r1"].stderr
