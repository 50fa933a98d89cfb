"""Cross-replica gradient sums overlapped with backward (make test-all)
(``parallel.overlap_grad_reduce=true``): each bucket group's sum starts from
megatron's backward hook as soon as its inner reduction started
(:mod:`megascale_omni.elastic.cross_replica`).

- Two replica groups (TP1 x PP2, fp32) together from step 0: every step's
  loss and gradient norm equal those of the same job without the overlap,
  bit for bit, and with the overlap the sums did start during backward.
- Join, heal and drain with the overlap on: the join makes
  the running group recompute a step whose quorum changed (MembershipChanged,
  raised after backward; nothing was sent before the quorum was confirmed),
  and every step's loss matches the fixed-membership run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.elastic_helpers import start_lighthouse, start_replica, step_records
from tests.dist.test_elastic_membership import Job, join_heal_drain
from tests.launcher import finish, kill_group

OVERLAP = "parallel.overlap_grad_reduce=true"
STEPS = 5
TIMEOUT_S = 600


def _two_groups(out: Path, overlap: bool) -> dict[str, list[dict]]:
    """r0 and r1 from step 0 for STEPS steps (neither commits alone); their step records."""
    lighthouse, addr = start_lighthouse(TIMEOUT_S, min_replicas=2)
    args = [f"train.steps={STEPS}", "logging.progress_bar=false", "checkpoint.save_at_end=false",
            "elastic.min_replicas=2", f"parallel.overlap_grad_reduce={str(overlap).lower()}"]
    procs = {rid: start_replica(rid, addr, out, args, timeout=TIMEOUT_S) for rid in ("r0", "r1")}
    try:
        for rid, proc in procs.items():
            res = finish(proc, TIMEOUT_S)
            assert res.returncode == 0, f"{rid} exited {res.returncode}:\n{res.stderr[-4000:]}"
    finally:
        for proc in [*procs.values(), lighthouse]:
            kill_group(proc)
    return {rid: step_records(out / rid) for rid in procs}


# make test-all (~50 s: two runs of two groups); make test covers the order and
# the waits in tests/unit/test_elastic_buckets.py.
@pytest.mark.slow
@pytest.mark.timeout(2 * TIMEOUT_S)
def test_overlapped_sums_equal_the_sums_after_backward(tmp_path):
    after = _two_groups(tmp_path / "after", overlap=False)
    overlapped = _two_groups(tmp_path / "overlapped", overlap=True)
    for rid in ("r0", "r1"):
        assert [r["step"] for r in after[rid]] == [r["step"] for r in overlapped[rid]] == list(range(1, STEPS + 1))
        assert all(r["participants"] == 2 for r in after[rid] + overlapped[rid])
        for a, o in zip(after[rid], overlapped[rid]):
            assert (a["loss"], a["grad_norm"], a["cross_replica_bytes"]) == \
                (o["loss"], o["grad_norm"], o["cross_replica_bytes"]), (rid, a["step"])
        # megatron learns which gradients fill each bucket in step 1 and
        # starts bucket reductions from backward hooks from step 2 on.
        assert all(r["cross_replica_early_buckets"] == 0 for r in after[rid])
        assert all(r["cross_replica_early_buckets"] >= 1 for r in overlapped[rid][1:]), overlapped[rid]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_overlapped_sums_through_join_heal_drain_match_fixed_membership(tmp_path):
    job = Job(tmp_path, timeout=900, layout=[OVERLAP])
    merged = join_heal_drain(job)
    assert "membership changed during step" in job.results["r0"].stderr
    shared = [r for r in job.records("r0") if r["participants"] == 2]
    assert shared and all(r["cross_replica_early_buckets"] >= 1 for r in shared), shared
    assert merged
