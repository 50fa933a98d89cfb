"""Elastic replica groups whose model has experts: groups of EP2 (TP1 x PP1,
two processes each; the dense parameters are inner DP2, each rank holds two
of the four experts, expert-DP 1). A joining group's rank r heals rank r's
experts (and their Adam state) from rank r of a live group; the cross-replica
sum covers the expert-parallel bucket groups like the dense ones.

Checked with :meth:`Job.check` (sample ledger exactly-once, constant global
batch) against a fixed-membership run of one process (EP1, every expert on
one rank): per-step losses within ``MEMBERSHIP_REL_TOL`` (1e-5, the
membership tests' tolerance) through the join, the heal and the drain, and
every step's tokens per expert equal to the reference's (summed over the
participating groups): a lost or doubled expert gradient changes the
routing within a few steps.
"""

from __future__ import annotations

import re

import pytest

from tests.dist.elastic_helpers import step_records
from tests.dist.test_elastic_membership import MEMBERSHIP_REL_TOL, Job, join_heal_drain

#: examples/gpt/tiny_moe.yaml's experts on the elastic GPT (4 experts, top-2, aux + z-loss, dropless).
MOE = ["model.add_bias_linear=false", "moe.num_experts=4", "moe.topk=2", "moe.ffn_hidden_size=128",
       "moe.z_loss_coeff=1e-3", "parallel.pp=1"]


# make test-all (4 processes at once, ~2-3 minutes on a loaded 2-core host).
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ep2_groups_join_heal_drain_match_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASCALE_LOG_ALL_RANKS", "1")  # rank 1's heal line too
    job = Job(tmp_path, timeout=900, layout=[*MOE, "parallel.ep=2"], reference=(1, MOE), inner_dp=2,
              rel_tol=MEMBERSHIP_REL_TOL)
    merged = join_heal_drain(job)
    r1 = job.results["r1"].stderr
    # Both EP ranks of r1 healed their own experts from the same rank of r0.
    assert sorted(re.findall(r"\[rank (\d)\].*healed from a live peer", r1)) == ["0", "1"], r1[-3000:]
    assert "ep=2" in r1, r1[-3000:]
    # Routing: a group's record counts its own tokens (summed over its EP ranks); the
    # groups of a step together route the reference's global batch to the same experts.
    reference = {r["step"]: r for r in step_records(tmp_path / "reference")}
    per_step: dict[int, list] = {}
    for rid in job.procs:
        for r in job.records(rid):
            if not r["healed"]:
                per_step.setdefault(r["step"], []).append(r["moe_expert_tokens"])
    for step, groups in per_step.items():
        assert len(groups) == merged[step]["participants"], (step, groups)
        summed = [[sum(g[layer][e] for g in groups) for e in range(4)] for layer in range(len(groups[0]))]
        assert summed == reference[step]["moe_expert_tokens"], (step, summed, reference[step]["moe_expert_tokens"])
