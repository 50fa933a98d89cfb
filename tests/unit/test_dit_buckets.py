"""Aspect-ratio buckets, dynamic batch size, the step-indexed plan and the
token-balanced DP split, on the mixed default data."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from megascale_omni.config import ConfigError, JobConfig, from_dict, load_yaml
from megascale_omni.data.dit.buckets import BucketPlan, BucketTable, bucket_report, split_packages
from megascale_omni.demo.dit_shapes import SPLIT_STREAMS, generate

CFG = load_yaml("examples/dit/tiny_cpu.yaml")["dit"]


def _table(budget: int = CFG["token_budget"]) -> BucketTable:
    return BucketTable(CFG["buckets"], CFG["patch_size"], budget)


@pytest.fixture(scope="module")
def default_sizes():
    """(height, width) of the first 3000 samples of the embedded default data."""
    return [generate(i, 1234, SPLIT_STREAMS["train"])[0].shape[:2] for i in range(3000)]


def test_assign_picks_closest_aspect_without_upsampling():
    t = BucketTable([[16, 16], [24, 24], [16, 32], [12, 24]], 4, 144)
    assert t.assign(17, 18) == 0          # square, too small for 24x24
    assert t.assign(26, 25) == 1          # square: the larger bucket it covers
    assert t.assign(17, 33) == 2          # 1:2
    assert t.assign(13, 30) == 3          # 1:2.3 -> 12x24 (16x32 would need upsampling)
    assert t.assign(10, 40) is None       # smaller than every bucket in height
    assert t.assign(15, 15) is None


def test_dynamic_batch_size_fills_the_token_budget():
    t = _table()
    for tokens, n in zip(t.tokens, t.batch_sizes):
        assert n == t.token_budget // tokens and n * tokens > t.token_budget - tokens
    # small images come in larger batches
    assert t.batch_sizes[t.tokens.index(min(t.tokens))] > t.batch_sizes[t.tokens.index(max(t.tokens))]


def test_bucket_table_that_cannot_fit_the_budget_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        from_dict(JobConfig, {"dit": {**CFG, "token_budget": 30}})
    assert err.value.field == "dit.token_budget" and "24x24" in err.value.hint and ">= " in err.value.hint


def test_plan_is_a_pure_function_of_the_step_and_covers_each_sample_once(default_sizes):
    t = _table()
    ids = [t.assign(h, w) for h, w in default_sizes]
    a, b = BucketPlan(ids, t, 4, seed=3), BucketPlan(ids, t, 4, seed=3)
    assert [p.sample_ids for p in a.global_batch(57)] == [p.sample_ids for p in b.global_batch(57)]
    seen = collections.Counter(s for p in a.epoch_packages(1) for s in p.sample_ids)
    assert sorted(seen) == list(range(len(ids))) and set(seen.values()) == {1}
    for p in a.epoch_packages(0):
        assert {ids[s] for s in p.sample_ids} == {p.bucket} and len(p.sample_ids) <= p.slots
    assert [p.sample_ids for p in a.global_batch(0)] != [p.sample_ids for p in a.global_batch(a.steps_per_epoch)]


def test_padding_waste_and_rank_balance_vs_naive(default_sizes):
    """The headline numbers, printed side by side (run with -s to see them)."""
    t = _table()
    ids = [t.assign(h, w) for h, w in default_sizes]
    plan = BucketPlan(ids, t, packages_per_step=4, seed=1234)
    report = bucket_report(plan, dp_size=2)
    print(f"\n{report.table()}")
    assert report.bucket_padding_waste <= 0.02
    assert report.pad_to_largest_waste > 0.3
    assert report.balanced_imbalance_max <= 1.05
    assert report.naive_imbalance_max > report.balanced_imbalance_max


def test_split_gives_every_rank_equal_counts_and_all_packages(default_sizes):
    t = _table()
    plan = BucketPlan([t.assign(h, w) for h, w in default_sizes], t, 8, seed=0)
    batch = plan.global_batch(5)
    parts = split_packages(batch, 4)
    assert sorted(i for p in parts for i in p) == list(range(8)) and {len(p) for p in parts} == {2}
    loads = [sum(batch[i].computed_tokens for i in p) for p in parts]
    assert max(loads) / np.mean(loads) <= 1.05
