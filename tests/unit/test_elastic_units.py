"""Elastic pieces that need no processes: config checks, the micro-batch
split policy, the ledger's exactly-once accounting, the layout check a
joiner runs on a peer's state, and the membership's step retry."""

from __future__ import annotations

import types

import pytest

from megascale_omni.config import ConfigError, JobConfig, from_dict, validate_job
from megascale_omni.data.balance import microbatch_shares, split_balanced_counts
from megascale_omni.elastic.ledger import (
    SampleLedger, committed_quorums, consumed_samples, read_ledger, replay_points, superseded,
)
from megascale_omni.elastic.peer_state import check_peer_state, replica_config

ELASTIC = {"enabled": True, "lighthouse": "http://localhost:29510", "replica_id": "r1"}


def _cfg(elastic: dict, **sections) -> JobConfig:
    return from_dict(JobConfig, {"elastic": elastic, **sections})


@pytest.mark.parametrize(
    "elastic, sections, field, fragment",
    [
        ({**ELASTIC, "lighthouse": "localhost"}, {}, "elastic.lighthouse", "http://host:port"),
        ({**ELASTIC, "replica_id": ""}, {}, "elastic.replica_id", "letters, digits"),
        ({**ELASTIC, "replica_id": "r 1"}, {}, "elastic.replica_id", "unique per replica group"),
        ({**ELASTIC, "min_replicas": 0}, {}, "elastic.min_replicas", "> 0"),
        ({**ELASTIC, "timeout_s": -1}, {}, "elastic.timeout_s", "> 0"),
        (ELASTIC, {"train": {"global_batch_size": 7, "micro_batch_size": 2}}, "train.global_batch_size",
         "multiple of train.micro_batch_size=2"),
        ({**ELASTIC, "standby": True}, {"control": {"enabled": False}}, "elastic.standby", "control.enabled=true"),
        ({"enabled": False, "standby": True}, {}, "elastic.standby", "set elastic.enabled=true"),
    ],
)
def test_invalid_elastic_settings_name_field_and_fix(elastic, sections, field, fragment):
    with pytest.raises(ConfigError) as err:
        validate_job(_cfg(elastic, **sections), world_size=2)
    assert err.value.field == field
    assert fragment in str(err.value)


def test_elastic_accepts_global_batch_not_divisible_by_replicas():
    # 12 samples = 6 micro-batches; any participant count is fine at config time.
    validate_job(_cfg(ELASTIC, train={"global_batch_size": 12, "micro_batch_size": 2}), world_size=2)


def test_elastic_accepts_the_distributed_optimizer():
    # Each inner DP rank heals its own optimizer shard from the same rank of a peer group.
    validate_job(_cfg(ELASTIC, parallel={"use_distributed_optimizer": True}), world_size=2)


def test_elastic_accepts_shared_checkpoints():
    validate_job(_cfg(ELASTIC, checkpoint={"dir": "/shared/ckpt", "interval": 50}), world_size=2)


def test_disabled_elastic_ignores_its_fields():
    validate_job(_cfg({"enabled": False, "lighthouse": "nonsense"}), world_size=1)


@pytest.mark.parametrize(
    "items, mbs, parts, expected",
    [
        (12, 2, 1, [12]),
        (12, 2, 2, [6, 6]),
        (12, 2, 3, [4, 4, 4]),
        (12, 2, 4, [4, 4, 2, 2]),  # 6 micro-batches over 4: first two take the extra
        (12, 2, 7, [2, 2, 2, 2, 2, 2, 0]),  # more participants than micro-batches
    ],
)
def test_microbatch_shares(items, mbs, parts, expected):
    shares = microbatch_shares(items, mbs, parts)
    assert shares == expected
    assert sum(shares) == items and all(s % mbs == 0 for s in shares)


def test_split_balanced_counts_keeps_every_item_once():
    items = list(range(12))
    costs = [float((7 * i) % 5 + 1) for i in items]
    parts = split_balanced_counts(items, costs, microbatch_shares(12, 2, 4))
    assert [len(p) for p in parts] == [4, 4, 2, 2]
    assert sorted(i for p in parts for i in p) == items


def test_ledger_counts_only_committed_quorum(tmp_path):
    a = SampleLedger(str(tmp_path), "r0", 0)
    b = SampleLedger(str(tmp_path), "r1", 0)
    # Step 0 attempted by r0+r1 under quorum 1 (r1 died: no commit from it),
    # r0's allreduce failed too: not committed. Retried alone under quorum 2.
    a.attempt(0, 1, 0, 2, 0, 2, [0, 1])
    b.attempt(0, 1, 1, 2, 1, 2, [2, 3])
    a.commit(0, 1, False)
    a.attempt(0, 2, 0, 1, 0, 1, [0, 1, 2, 3])
    a.commit(0, 2, True)
    # Step 1 under quorum 3 with both; only r0 wrote its commit line.
    a.attempt(1, 3, 0, 2, 0, 2, [4, 5])
    b.attempt(1, 3, 1, 2, 1, 2, [6, 7])
    a.commit(1, 3, True)
    a.close()
    b.close()
    assert consumed_samples(read_ledger(tmp_path)) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}


def test_ledger_rejects_one_step_committed_twice(tmp_path):
    a = SampleLedger(str(tmp_path), "r0", 0)
    a.commit(0, 1, True)
    a.commit(0, 2, True)
    a.close()
    with pytest.raises(ValueError, match="committed under quorums 1 and 2"):
        consumed_samples(read_ledger(tmp_path))


LAYOUT = {"tp": 1, "pp": 1, "cp": 1, "dp": 2, "vpp": 1, "world_size": 2, "distributed_optimizer": True}
BUCKETS = [{0: {"float32": [2048, 512]}}]
GRAD_BUCKETS = {"ddp_bucket_size": None, "numel": [[2560]]}
CONFIG = replica_config(JobConfig())


@pytest.mark.parametrize(
    "peer, field, fragment",
    [
        ({"layout": {**LAYOUT, "pp": 2, "dp": 1}, "optimizer_layout": BUCKETS}, "parallel",
         "differs from the running job's replica groups (tp=1 pp=2 cp=1 dp=1"),
        ({"layout": {**LAYOUT, "distributed_optimizer": False}, "optimizer_layout": [None]}, "parallel",
         "distributed_optimizer=False"),
        ({"layout": LAYOUT, "config": CONFIG, "optimizer_layout": [{0: {"float32": [4096, 512]}}],
          "grad_buckets": GRAD_BUCKETS}, "model",
         "start this group with the running job's model.* config"),
        ({}, "parallel", "(unknown layout)"),
        ({"layout": LAYOUT, "config": {**CONFIG, "model.num_layers": 6}, "optimizer_layout": BUCKETS},
         "model.num_layers", "differs from the running job's (6)"),
        ({"layout": LAYOUT, "config": {**CONFIG, "dit.ema_decay": 0.5}, "optimizer_layout": BUCKETS},
         "dit.ema_decay", "start this group with the running job's dit.ema_decay"),
        ({"layout": LAYOUT, "config": {**CONFIG, "data.blend": [{"weight": 2.0}]}, "optimizer_layout": BUCKETS},
         "data.blend", "differs from the running job's ([{'weight': 2.0}])"),
        ({"layout": LAYOUT, "config": {**CONFIG, "train.seed": 7}, "optimizer_layout": BUCKETS},
         "train.seed", "the same model on the same data"),
        ({"layout": LAYOUT, "optimizer_layout": BUCKETS}, "model.family", "(not set)"),
        ({"layout": LAYOUT, "config": CONFIG, "optimizer_layout": BUCKETS,
          "grad_buckets": {"ddp_bucket_size": 1024, "numel": [[1024, 1024, 512]]}}, "parallel.ddp_bucket_size",
         "the running job's are [[1024, 1024, 512]] (its ddp_bucket_size 1024): replica groups sum gradients "
         "bucket by bucket; start this group with the running job's parallel.ddp_bucket_size"),
    ],
)
def test_peer_state_of_another_layout_model_or_data_is_refused_in_one_line(peer, field, fragment):
    own = {"layout": LAYOUT, "config": CONFIG, "optimizer_layout": BUCKETS, "grad_buckets": GRAD_BUCKETS}
    check_peer_state(own, own)
    with pytest.raises(ConfigError) as err:
        check_peer_state(own, peer)
    assert err.value.field == field
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_replica_groups_may_differ_in_how_they_read_data_and_where_they_log():
    base = JobConfig()
    other = from_dict(JobConfig, {"data": {"num_workers": 2, "prefetch_steps": 4, "max_bad_sample_fraction": 0.5},
                                  "logging": {"output_dir": "runs/elsewhere"}, "train": {"lr": 0.5, "steps": 7},
                                  "elastic": {**ELASTIC, "replica_id": "r9"}})
    assert replica_config(other) == replica_config(base)


def test_dataset_and_tokenizer_paths_are_compared_by_content_not_as_strings():
    """Nodes may mount one dataset at different paths: the task's data digests
    (tests/unit/test_data_identity.py) decide, not the path strings."""
    here = from_dict(JobConfig, {"data": {"path": "/mnt/a/data", "tokenizer": "/mnt/a/tok.json",
                                          "blend": [{"path": "/mnt/a/x", "weight": 1.0}]}})
    there = from_dict(JobConfig, {"data": {"path": "/data", "blend": [{"path": "/x", "weight": 1.0}]}})
    assert replica_config(here) == replica_config(there)
    assert replica_config(here)["data.blend"] == [{"weight": 1.0}]
    assert not {"data.path", "data.tokenizer"} & set(replica_config(here))


def test_run_step_recomputes_a_step_whose_assumed_quorum_changed_for_the_share_it_got():
    from types import SimpleNamespace

    from megascale_omni.config import ElasticConfig
    from megascale_omni.elastic.membership import MembershipChanged, Participation
    from megascale_omni.elastic.service import ElasticMembership, StaticMembership, StepShare

    task = SimpleNamespace(bad_samples=None, microbatches=lambda step, dp_rank, dp_size: [(step, dp_rank, dp_size)])
    state = SimpleNamespace(task=task, dims=SimpleNamespace(dp=2), step=5)
    membership = ElasticMembership(state, ElasticConfig(**ELASTIC), dp_rank=1)
    membership.quorum = SimpleNamespace(current_step=lambda: 5)  # torchft's committed steps
    assumed = StepShare(5, 0 * 2 + 1, 2 * 2)  # participant 0 of 2, inner DP rank 1 of 2
    seen = []

    def attempt(mbs):
        seen.append(mbs)
        if len(seen) == 1:  # a third group joined: this replica is participant 1 of 3
            raise MembershipChanged(Participation(1, 3, quorum_id=8), Participation(0, 2, quorum_id=7))
        return "stats"

    share, stats = membership.run_step(assumed, task.microbatches(5, 1, 4), attempt)
    assert (share, stats) == (StepShare(5, 1 * 2 + 1, 3 * 2), "stats")
    assert seen == [[(5, 1, 4)], [(5, 3, 6)]]

    def changes(mbs):
        raise MembershipChanged(Participation(1, 3, quorum_id=8), Participation(0, 2, quorum_id=7))

    with pytest.raises(MembershipChanged):  # recomputed once; a second change is not absorbed
        membership.run_step(assumed, [], changes)
    static = StaticMembership(SimpleNamespace(task=task, dims=SimpleNamespace(dp=2), step=5), dp_rank=1)
    assert static.run_step(StepShare(5, 1, 2), ["mb"], lambda mbs: mbs) == (StepShare(5, 1, 2), ["mb"])


MOE_LAYOUT = {**LAYOUT, "ep": 2, "etp": 1}
MOE_CONFIG = {**CONFIG, "moe.num_experts": 4, "moe.topk": 2}


@pytest.mark.parametrize(
    "peer, field, fragment",
    [
        ({"layout": {**MOE_LAYOUT, "ep": 1}}, "parallel",
         "'tp=1 pp=1 cp=1 dp=2 vpp=1 world_size=2 distributed_optimizer=True ep=2 etp=1': differs from the "
         "running job's replica groups (tp=1 pp=1 cp=1 dp=2 vpp=1 world_size=2 distributed_optimizer=True ep=1 etp=1)"),
        ({"layout": MOE_LAYOUT, "config": {**MOE_CONFIG, "moe.num_experts": 8}}, "moe.num_experts",
         "moe.num_experts=4: differs from the running job's (8)"),
        ({"layout": MOE_LAYOUT, "config": {**MOE_CONFIG, "moe.topk": 1}}, "moe.topk",
         "start this group with the running job's moe.topk"),
    ],
)
def test_a_joiner_with_another_ep_size_or_expert_count_is_refused_in_one_line(peer, field, fragment):
    """Rank r heals its experts from rank r of a peer group: only under the same EP layout and experts."""
    own = {"layout": MOE_LAYOUT, "config": MOE_CONFIG, "optimizer_layout": BUCKETS}
    check_peer_state(own, own)
    with pytest.raises(ConfigError) as err:
        check_peer_state(own, {**own, **peer})
    assert err.value.field == field
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_replica_config_carries_the_moe_section():
    """A joiner's expert count and routing are compared field by field."""
    cfg = from_dict(JobConfig, {"moe": {"num_experts": 4, "topk": 2}})
    fields = replica_config(cfg)
    assert fields["moe.num_experts"] == 4 and fields["moe.topk"] == 2 and "moe.token_dispatcher" in fields


def test_ledger_infers_a_lost_outcome_from_later_steps(tmp_path):
    """Every participant of step 0 was killed before its commit line; step 1
    on record proves step 0 committed, under its latest quorum without an
    outcome (quorum 2's explicit `false` rules it out; quorum 1 was retried
    in quorum 3). The last step's attempt without outcome did not commit."""
    a = SampleLedger(str(tmp_path), "r0", 0)
    b = SampleLedger(str(tmp_path), "r1", 0)
    a.attempt(0, 1, 0, 2, 0, 2, [0, 1])
    b.attempt(0, 1, 1, 2, 1, 2, [2, 3])
    b.attempt(0, 2, 0, 1, 0, 1, [0, 1, 2, 3])
    b.commit(0, 2, False)
    a.attempt(0, 3, 0, 2, 0, 2, [0, 1])
    b.attempt(0, 3, 1, 2, 1, 2, [2, 3])
    # Step 1 failed in quorum 4 and was retried in it (torchft keeps the id
    # of an unchanged quorum); the retry's outcome died with r0.
    a.attempt(1, 4, 0, 1, 0, 1, [4, 5, 6, 7])
    a.commit(1, 4, False)
    a.attempt(1, 4, 0, 1, 0, 1, [4, 5, 6, 7])
    b.attempt(2, 5, 0, 1, 0, 1, [8, 9, 10, 11])
    a.close()
    b.close()
    records = read_ledger(tmp_path)
    assert consumed_samples(records) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    # A recorded outcome wins over inference; a later step alone proves nothing of its own.
    assert consumed_samples(records + [{"event": "commit", "step": 0, "quorum": 1, "replica": "r1",
                                        "committed": True}]) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}


def test_ledger_replay_rule_supersedes_only_a_rolled_back_timeline():
    """``superseded``: a participating attempt of step S under quorum q0
    supersedes lines of steps >= S under quorums < q0. A normal ledger (steps
    committed under increasing quorums, a failed try retried) loses nothing
    to the rule; a fall-back to step 1 under quorum 9 supersedes steps 1-2
    of quorums 2-3 and keeps step 0."""
    normal = [(0, 1), (1, 2), (1, 4), (2, 4), (3, 5)]  # step 1 failed under 2, retried and committed under 4
    points = [(s, q) for s, q in normal]
    assert [superseded(points, s, q) for s, q in normal] == [False, True, False, False, False]
    points += [(1, 9)]
    assert [superseded(points, s, q) for s, q in [(0, 1), (1, 4), (2, 4), (3, 5), (1, 9), (2, 10)]] == [
        False, True, True, True, False, False]
    lines = [{"event": "attempt", "step": s, "quorum": q, "replica": "r0", "participant": 0, "participants": 1,
              "dp_rank": 0, "dp_size": 1, "samples": [s]} for s, q in [(0, 1), (1, 2), (2, 3), (1, 9), (2, 10)]]
    lines += [{"event": "commit", "step": s, "quorum": q, "replica": "r0", "dp_rank": 0, "committed": True}
              for s, q in [(0, 1), (1, 2), (2, 3), (1, 9), (2, 10)]]
    assert replay_points(lines) == [(0, 1), (1, 2), (2, 3), (1, 9), (2, 10)]
    assert committed_quorums(lines) == {0: 1, 1: 9, 2: 10}
    assert consumed_samples(lines) == {0: [0], 1: [1], 2: [2]}


class _Work:
    def wait(self) -> bool:
        return True


class _Manager:
    """torchft Manager stand-in: a two-replica quorum 7 at step 3; every
    cross-replica sum first reads what the ledger holds at that moment."""

    _quorum_id = 7
    _pending_state_dict = None

    def __init__(self, ledger_dir, rank: int):
        self.ledger_dir, self.rank = ledger_dir, rank
        self.ledger_at_sum: list[list[dict]] = []
        # What adapter.watch_quorum_answers wraps (no quorum is asked here: its answers stay unknown).
        self._client = types.SimpleNamespace()
        self._pg = types.SimpleNamespace(configure=lambda *args, **kwargs: None)

    def start_quorum(self) -> None:
        pass

    def participating_rank(self) -> int:
        return self.rank

    def num_participants(self) -> int:
        return 2

    def is_participating(self) -> bool:
        return True

    def current_step(self) -> int:
        return 3

    def allreduce(self, tensor, reduce_op):
        self.ledger_at_sum.append(read_ledger(self.ledger_dir))
        tensor.mul_(2)  # the other replica holds the same values
        return _Work()


class _Pg:
    def size(self) -> int:
        return 2


class _Killed(BaseException):
    """The replica group dies right after its cross-replica sum."""


@pytest.mark.parametrize("overlap", [False, True], ids=["awaited", "overlapped"])
def test_attempt_is_on_record_before_the_cross_replica_sum(tmp_path, monkeypatch, overlap):
    """Replica r1 (participant 1 of 2) is killed right after the step's
    cross-replica sum, before any outcome: its attempt line was on disk
    when the sum started, and with survivor r0's commit the step consumed
    its global batch exactly once. With elastic.overlap_quorum the quorum
    is awaited at the sum itself, and the line still precedes it."""

    import torch

    from megascale_omni.config import ElasticConfig
    from megascale_omni.elastic import adapter, membership
    from megascale_omni.elastic.cross_replica import CrossReplicaSums
    from megascale_omni.elastic.service import ElasticMembership

    manager = _Manager(tmp_path, rank=1)
    monkeypatch.setattr(adapter, "new_manager", lambda **kwargs: manager)
    monkeypatch.setattr(adapter, "process_group_for", lambda device, timeout: _Pg())
    monkeypatch.setattr(membership, "checkpoint_transport",
                        lambda *args: types.SimpleNamespace(mismatch=None, name="fake"))
    monkeypatch.setattr(membership.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(membership.dist, "get_world_size", lambda: 1)
    batch = list(range(100, 108))  # step 3's global batch, split over 2 participants x 1 inner DP rank
    task = types.SimpleNamespace(bad_samples=None,
                                 sample_ids=lambda step, dp_rank, dp_size: batch[dp_rank::dp_size])
    state = types.SimpleNamespace(task=task, dims=types.SimpleNamespace(dp=1), step=3, sync_params=lambda: None)
    cfg = ElasticConfig(enabled=True, lighthouse="http://localhost:29510", replica_id="r1",
                        overlap_quorum=overlap, ledger_dir=str(tmp_path))

    service = ElasticMembership(state, cfg, dp_rank=0)
    service.ledger = SampleLedger(str(tmp_path), "r1", 0)
    service.quorum = membership.ReplicaQuorum(cfg, dict, lambda sd: None, on_quorum=service._record_attempt)
    service.sums = CrossReplicaSums(service.quorum)
    if overlap:  # as after a committed step of the same participation: the share is assumed
        service.quorum._participation = membership.Participation(1, 2, 6)
        service.last_committed = True
    share = service.begin_step()
    assert (share.step, share.dp_rank, share.dp_size) == (3, 1, 2)
    # Awaited at begin_step, the quorum is known and its attempt written; assumed, not yet.
    assert len(read_ledger(tmp_path)) == (0 if overlap else 1)
    with pytest.raises(_Killed):
        service.sums.reduce_sum(torch.ones(4))
        raise _Killed
    # What the ledger held when the sum started: r1's attempt in quorum 7, once.
    mine = {"event": "attempt", "step": 3, "quorum": 7, "replica": "r1", "participant": 1, "participants": 2,
            "dp_rank": 1, "dp_size": 2, "samples": [101, 103, 105, 107]}
    assert [[{k: v for k, v in r.items() if k != "t"} for r in lines] for lines in manager.ledger_at_sum] == [[mine]]
    assert isinstance(manager.ledger_at_sum[0][0]["t"], float)  # when written; no quorum_t without an answer
    survivor = SampleLedger(str(tmp_path), "r0", 0)
    survivor.attempt(3, 7, 0, 2, 0, 2, batch[0::2])
    survivor.commit(3, 7, True)
    survivor.close()
    consumed = consumed_samples(read_ledger(tmp_path))
    assert sorted(consumed[3]) == batch and list(consumed) == [3]
