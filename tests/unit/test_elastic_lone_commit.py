"""The lone commit: a replica group alone in an unchanged quorum commits
without torchft's vote and leaves torchft's manager where the vote leaves it
(real lighthouse and manager server, one group of one rank, in process)."""

from __future__ import annotations

import pytest

from megascale_omni.config import ElasticConfig
from megascale_omni.elastic import adapter
from megascale_omni.elastic.membership import ReplicaQuorum
from tests.unit.replica_group import one_rank_group

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def group():
    with one_rank_group():
        yield


def _steps(steps: int, **elastic) -> tuple[list[bool], list[bool], dict, int]:
    """Run ``steps`` quorum + commit rounds of one group against a fresh
    lighthouse; returns (committed, voted, torchft state, commit failures)."""
    lighthouse = adapter.lighthouse_server(min_replicas=1)
    cfg = ElasticConfig(enabled=True, lighthouse=lighthouse.address().replace("[::]", "localhost"),
                        replica_id="r0", timeout_s=20, quorum_timeout_s=20, **elastic)
    replica = ReplicaQuorum(cfg, state_dict=dict, load_state_dict=lambda state: None)
    committed, voted = [], []
    try:
        for _ in range(steps):
            last = replica.participation
            # As ElasticMembership does with overlap_quorum: assume the last participation.
            replica.begin_step(last if committed and committed[-1] else None)
            committed.append(replica.should_commit())
            voted.append(replica.voted)
        # torchft sends this with every quorum request; a vote that passes resets it.
        failures = adapter.commit_failures(replica.manager)
        return committed, voted, replica.manager.state_dict(), failures
    finally:
        replica.leave()
        lighthouse.shutdown()


def test_lone_commit_leaves_torchft_where_its_vote_does(group):
    voted_run = _steps(4, lone_commit=False)
    lone_run = _steps(4, lone_commit=True)
    assert voted_run[:2] == ([True] * 4, [True] * 4)
    # The first step's quorum is new (its process group was configured): it votes.
    assert lone_run[:2] == ([True] * 4, [True, False, False, False])
    assert lone_run[2:] == voted_run[2:] == ({"step": 4, "batches_committed": 4}, 0)


def test_group_below_min_replicas_votes_and_does_not_commit(group):
    committed, voted, state, failures = _steps(2, min_replicas=2, lone_commit=True)
    assert (committed, voted) == ([False, False], [True, True])
    assert state["step"] == 0 and failures == 2

