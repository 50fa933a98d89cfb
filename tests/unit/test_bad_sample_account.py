"""Bad-sample accounting: counts of committed steps only, job-wide in elastic
jobs, the limit read at every check, totals restored from a checkpoint or a
live peer (one process; the replica group is a gloo world of one)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megascale_omni.config import JobConfig, from_dict
from megascale_omni.data.bad_samples import BadSampleAccount
from megascale_omni.data.errors import DataQualityError
from megascale_omni.parallel import ParallelDims
from tests.launcher import free_port


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _account(limit: float = 0.5) -> BadSampleAccount:
    cfg = from_dict(JobConfig, {"data": {"max_bad_sample_fraction": limit}})
    return BadSampleAccount(cfg, ParallelDims(tp=1, pp=1, cp=1, dp=1, vpp=None, world_size=1))


def _read(account: BadSampleAccount, good: int, bad: int) -> None:
    account.counter.seen += good
    account.counter.skipped += bad


def test_a_fixed_group_commits_each_update_when_it_settles(group):
    account = _account()
    _read(account, good=9, bad=1)
    account.update()
    assert (account.skipped, account.seen) == (0, 0)  # in flight while the step computes
    account.settle()
    assert (account.skipped, account.seen) == (1, 10)
    _read(account, good=10, bad=0)
    account.update()
    account.settle()
    account.settle()  # nothing pending: counts once
    assert (account.skipped, account.seen) == (1, 20)
    assert account.state_dict() == {"skipped_samples": 1, "seen_samples": 20}


def test_elastic_counts_wait_for_the_commit_and_an_abandoned_attempt_counts_nothing(group):
    account = _account()
    account.job_wide = True
    _read(account, good=7, bad=1)
    account.update()
    account.settle()
    assert account.attempt.tolist() == [1.0, 8.0] and (account.skipped, account.seen) == (0, 0)
    account.abandon()  # the quorum did not commit: the retry reads the same samples again
    _read(account, good=7, bad=1)
    account.update()
    account.abandon()  # dropped while its reduction was still in flight
    _read(account, good=7, bad=1)
    account.update()
    account.settle()
    assert account.attempt.tolist() == [1.0, 8.0]
    # Committed with every participant's sum (another replica read 16, 2 bad).
    account.commit(account.attempt + torch.tensor([2.0, 16.0], dtype=torch.float64))
    assert (account.skipped, account.seen) == (3, 24) and account.attempt.tolist() == [0.0, 0.0]


def test_the_limit_is_read_at_every_check(group):
    account = _account(limit=0.5)
    _read(account, good=6, bad=4)
    account.update()
    account.settle()  # 40% <= 50%
    account.data_cfg.max_bad_sample_fraction = 0.1  # `omni-ctl config set` at a step boundary
    _read(account, good=1, bad=0)
    account.update()
    with pytest.raises(DataQualityError, match="4 of 11 samples were bad while training"):
        account.settle()


def test_totals_come_back_from_a_checkpoint_or_a_peer(group):
    account = _account()
    account.load_state_dict({"skipped_samples": 3, "seen_samples": 300})
    _read(account, good=9, bad=1)
    account.update()
    account.settle()
    assert (account.skipped, account.seen) == (4, 310)
    assert account.stats() == {"skipped_samples": 4, "excluded_samples": 0}
