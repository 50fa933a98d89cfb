"""The distributed optimizer inside elastic replica groups: groups of inner
DP2 (TP1 x PP1, two processes each) shard Adam state over their two ranks;
a joining group's rank r heals its own shard from rank r of a live group,
and the cross-replica sum covers only each rank's shard of the gradients.

Checked with :meth:`Job.check` (sample ledger exactly-once, constant global
batch) and against a fixed-membership run (one process, whole optimizer):
per-step losses within 1e-6 relative through the join, the heal and the
drain. Also: the bytes each rank hands to the cross-replica all-reduce per
step are half of its fp32 gradients (inner DP2), measured at that seam, and
it holds half of the Adam state.
"""

from __future__ import annotations

import re

import pytest

from tests.dist.control_helpers import omni_ctl
from tests.dist.test_elastic_membership import (
    CTL_TIMEOUT,
    TRANSPORT_CLASS,
    Job,
    check_membership_scenario,
    join_heal_drain,
    membership_scenario,
)

DIST_OPT = ["parallel.pp=1", "parallel.use_distributed_optimizer=true"]
REFERENCE = (1, ["parallel.pp=1"])
REL_TOL = 1e-6


def _distopt_job(tmp_path, timeout: float, transport: str = "http") -> Job:
    return Job(tmp_path, timeout=timeout, layout=[*DIST_OPT, f"elastic.heal_transport={transport}"],
               reference=REFERENCE, inner_dp=2, rel_tol=REL_TOL)


# make test-all (~60-150 s each): one cold join + heal + drain (4 processes at
# most at once), through each heal transport: every rank of the joiner heals
# its own optimizer shard from the same rank of r0 over HTTP or over the
# cross-replica process group. make test keeps the whole-optimizer standby
# join/heal/SIGKILL scenario.
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", ["http", "pg"])
def test_dist_opt_groups_join_heal_drain_match_fixed_membership(tmp_path, transport, monkeypatch):
    monkeypatch.setenv("MEGASCALE_LOG_ALL_RANKS", "1")  # rank 1's heal line too
    job = _distopt_job(tmp_path, timeout=900, transport=transport)
    join_heal_drain(job)
    r1 = job.results["r1"].stderr
    # Both ranks of r1 (inner DP 0 and 1) healed their shard through the transport.
    healed = re.findall(rf"\[rank (\d)\].*healed from a live peer over {TRANSPORT_CLASS[transport]}", r1)
    assert sorted(healed) == ["0", "1"], r1[-3000:]
    # Hierarchical reduction: rank 0 sends its shard (half of its fp32
    # gradient buffer, padded to whole buckets) plus the token count and the
    # loss report, i.e. about 2 bytes per parameter instead of 4.
    params = int(re.search(r"\[rank 0\].*parameters on this rank: (\d+)", job.results["r0"].stderr).group(1))
    sent = {r["cross_replica_bytes"] for r in job.records("r0") if r["participants"] == 2}
    assert len(sent) == 1, sent
    # Alone in the quorum (before r1 joined, after it left), r0 sends nothing across replicas.
    assert job.records("r0")[0]["cross_replica_bytes"] == job.records("r0")[-1]["cross_replica_bytes"] == 0
    ratio = sent.pop() / (4 * params)
    print(f"cross-replica bytes per step / full fp32 gradients: {ratio:.4f}")
    assert 0.5 <= ratio < 0.51
    # Adam moments (8 bytes per parameter) of this rank's shard only.
    state = job.records("r0")[-1]["optimizer_state_bytes"] / (8 * params)
    print(f"optimizer state / whole Adam state: {state:.4f}")
    assert 0.5 <= state < 0.51


# make test-all (~60-150 s): the same join, heal and drain with the gradient reduce-scatter
# overlapped with backward (parallel.overlap_grad_reduce, megatron's GPU default): the
# cross-replica sums start per bucket group from megatron's grad-ready hooks, as soon as the
# group's reduce-scatter inside the replica group is done, and megatron's finish_grad_sync
# must not wait on that reduce-scatter again (on gloo a second wait rewrites the shards with
# the group's own sum: elastic/cross_replica.py). Measured 4.8e-8 to 5.8e-8 relative (1e-3
# within a few steps of the heal with that second wait).
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dist_opt_with_overlapped_grad_reduce_joins_heals_drains(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASCALE_LOG_ALL_RANKS", "1")
    job = Job(tmp_path, timeout=900, layout=[*DIST_OPT, "parallel.overlap_grad_reduce=true"],
              reference=REFERENCE, inner_dp=2, rel_tol=REL_TOL)
    join_heal_drain(job)
    r1 = job.results["r1"].stderr
    assert sorted(re.findall(r"\[rank (\d)\].*healed from a live peer", r1)) == ["0", "1"], r1[-3000:]
    # The sums of the two-group steps did start during backward.
    assert any(r["cross_replica_early_buckets"] for r in job.records("r0") if r["participants"] == 2)


# make test-all (~60-150 s): the same join, heal and drain with the parameter gather overlapped
# (parallel.overlap_param_gather). Elastic groups start each step's gather after the step and
# complete it before the next quorum (training/param_gather.py), so r0 serves whole weights to
# r1, and r1's heal step (no micro-batches, no forward) leaves no gather unmatched.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dist_opt_with_overlapped_param_gather_joins_heals_drains(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASCALE_LOG_ALL_RANKS", "1")
    job = Job(tmp_path, timeout=900, layout=[*DIST_OPT, "parallel.overlap_param_gather=true",
                                             "parallel.overlap_grad_reduce=false"],
              reference=REFERENCE, inner_dp=2, rel_tol=REL_TOL)
    join_heal_drain(job)
    r1 = job.results["r1"].stderr
    assert sorted(re.findall(r"\[rank (\d)\].*healed from a live peer", r1)) == ["0", "1"], r1[-3000:]


#: The full scenario runs about 200 steps, many of them while groups start
#: up; float summation-order noise of its ~70 multi-group steps compounds
#: through Adam (measured 1.1e-6 over 182 steps; without holding r0 for the
#: last joiner, 1.2e-6 at step 250 and 2.3e-4 at step 498, growing smoothly
#: with no step at any membership change; see test_elastic_membership). The
#: 1e-6 bound is asserted on the short run above.
SCENARIO_REL_TOL = 1e-5


# make test-all (~11 minutes on a loaded 2-core host): the full membership
# scenario with sharded optimizer state, plus a joiner of another layout
# that is refused.
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_dist_opt_membership_scenario_and_mismatched_joiner_refused(tmp_path):
    job = _distopt_job(tmp_path, timeout=1800)
    job.rel_tol = SCENARIO_REL_TOL
    try:
        job.start_reference()
        membership_scenario(job)
        # A group of another layout (PP2, whole optimizer) must not join: it
        # exits 2 with one line before sending any gradient; r0 carries on.
        # r0 is held while the joiner starts, as in Job.join.
        assert omni_ctl(job.run / "r0", *CTL_TIMEOUT, "pause", timeout_s=330)["ok"]
        job.start("bad", "parallel.pp=2", "parallel.use_distributed_optimizer=false", omni_run=True)
        job.wait("bad's control server", lambda: (job.run / "bad" / "control.json").exists())
        assert omni_ctl(job.run / "r0", *CTL_TIMEOUT, "resume", timeout_s=330)["ok"]
        res = job.results["bad"] = job.wait_exit("bad")
        assert res.returncode == 2, res.stderr[-3000:]
        assert re.search(r"^config error: parallel='tp=1 pp=2 .*': differs from the running job's replica groups "
                         r"\(tp=1 pp=1 cp=1 dp=2 .*distributed_optimizer=True\)", res.stderr, re.MULTILINE), res.stderr
        job.wait("r0 to train alone again", lambda: job.participants("r0") == 1)
        job.wait_steps("r0", 2)
        last = job.finish()
    finally:
        job.close()
    check_membership_scenario(job, last)
    assert not job.records("bad")
