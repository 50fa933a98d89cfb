"""Dataset blending (data/blend.py): the mix follows the weights within
+-2% over 10 000 samples and in every global batch window, sources repeat
only after a full pass, the order is a pure function of (seed, epoch), and
any split of a step among data-parallel participants consumes each planned
sample exactly once."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from megascale_omni.config import ConfigError, JobConfig, from_dict
from megascale_omni.data.balance import split_balanced_counts
from megascale_omni.data.blend import BlendedOrder, split_counts
from megascale_omni.data.sample_plan import PackedEpochPlan
from megascale_omni.tasks.registry import get_family


def _sources(sizes: list[int]) -> np.ndarray:
    return np.concatenate([np.full(n, d) for d, n in enumerate(sizes)])


def test_split_counts_is_exact_and_sums():
    assert split_counts(10, [0.7, 0.3]) == [7, 3]
    assert split_counts(10, [1, 1, 1]) == [4, 3, 3]
    assert sum(split_counts(9999, [0.55, 0.3, 0.15])) == 9999


def test_mix_within_two_percent_over_10000_samples_and_in_windows():
    # A large source, a small one (upsampled) and a text-only share.
    sources = _sources([6000, 500, 3500])
    weights = [0.5, 0.3, 0.2]
    order = BlendedOrder(sources, weights, seed=3, epoch_size=10_000)
    items = order(0)
    share = np.bincount(sources[items], minlength=3) / items.size
    assert np.abs(share - weights).max() <= 0.02 and items.size == 10_000
    for start in range(0, 10_000, 500):  # every window of 500 carries the mix too
        window = np.bincount(sources[items[start:start + 500]], minlength=3) / 500
        assert np.abs(window - weights).max() <= 0.02, (start, window)
    # The small source (500 samples, 3000 draws) repeats only after full passes.
    small = items[sources[items] == 1]
    for k in range(6):
        assert sorted(small[500 * k:500 * (k + 1)]) == list(range(6000, 6500))


def test_order_is_a_pure_function_of_seed_and_epoch():
    sources = _sources([40, 25])
    a, b = BlendedOrder(sources, [2, 1], seed=5), BlendedOrder(sources, [2, 1], seed=5)
    assert (a(3) == b(3)).all() and not (a(3) == a(4)).all()
    assert not (a(0) == BlendedOrder(sources, [2, 1], seed=6)(0)).all()
    with pytest.raises(ValueError, match="no usable samples"):
        BlendedOrder(_sources([10]), [1, 1], seed=0)


@pytest.mark.parametrize("participants", [[1], [2], [3], [1, 2, 3, 2, 1]])
def test_blended_plan_steps_split_among_participants_consume_each_planned_sample_once(participants):
    """However a step's packs are dealt among participants (as many as the
    elastic quorum has), together they take exactly the step's planned
    samples: every planned draw once, none twice, none lost."""
    rng = np.random.default_rng(0)
    sources = _sources([300, 120])
    lengths = rng.integers(4, 30, size=sources.size)
    order = BlendedOrder(sources, [0.6, 0.4], 1)
    plan = PackedEpochPlan(lengths, 64, global_batch_size=6, seed=1, order=order)
    taken, planned = Counter(), Counter()
    for step in range(plan.steps_in_epoch(0)):
        packs = plan.global_batch(step)
        dp = participants[step % len(participants)]
        counts = [len(packs) // dp + (r < len(packs) % dp) for r in range(dp)]
        for share in split_balanced_counts(list(range(len(packs))), [p.cost for p in packs], counts):
            taken.update(sid for i in share for sid in packs[i].sample_ids)
        planned.update(sid for p in packs for sid in p.sample_ids)
    assert taken == planned and sum(taken.values()) > 300
    # Source 0 (300 samples, 252 draws per epoch) never repeats; source 1 (120, 168 draws) is upsampled.
    assert max(taken[i] for i in range(300)) == 1 and max(taken[i] for i in range(300, 420)) == 2
    share = sum(taken[i] for i in range(300)) / sum(taken.values())
    assert abs(share - 0.6) <= 0.02


def test_blend_config_is_validated_and_only_llava_supports_it():
    cfg = from_dict(JobConfig, {"model": {"family": "llava"}, "data": {"blend": [{"path": "a", "weight": 2},
                                                                                  {"path": "b"}]}})
    assert [(b.path, b.weight) for b in cfg.data.blend] == [("a", 2.0), ("b", 1.0)]
    with pytest.raises(ConfigError, match=r"data.blend\[1\].weight"):
        from_dict(JobConfig, {"data": {"blend": [{"path": "a"}, {"path": "b", "weight": 0}]}})
    with pytest.raises(ConfigError, match=r"data.blend\[0\].path"):
        from_dict(JobConfig, {"data": {"blend": [{"weight": 1}]}})
    gpt = from_dict(JobConfig, {"data": {"blend": [{"path": "a"}]}})
    with pytest.raises(ConfigError, match="does not support data blend"):
        get_family("gpt").validate(gpt, 1)


def test_blend_pieces_cross_to_loader_workers(tmp_path):
    """data.num_workers sends the plan and the reader to worker processes:
    both pickle and keep answering the same."""
    import pickle

    from megascale_omni.data.blend import ConcatReader
    from megascale_omni.demo.llava_shapes import make_shapes_dataset, open_shapes_split

    order = BlendedOrder(_sources([30, 12]), [1, 2], seed=4)
    assert (pickle.loads(pickle.dumps(order))(2) == order(2)).all()
    for name, seed in (("a", 1), ("b", 2)):
        make_shapes_dataset(tmp_path / name, num_train=6, num_val=2, seed=seed, samples_per_shard=3)
    reader = ConcatReader([open_shapes_split(tmp_path / "a", "train"), open_shapes_split(tmp_path / "b", "train")])
    copy = pickle.loads(pickle.dumps(reader))
    assert len(copy) == 12 and copy.read_metadata(7) == reader.read_metadata(7)
    assert copy[7].conversation == reader[7].conversation and copy.locate(7) == (1, 1)


def test_scheduled_blend_changes_the_mix_at_epoch_starts_and_resumes_mid_run():
    """A stage applies from the first blended epoch starting at or after its
    step; sources never repeat before a full pass across stages; a fresh
    plan (a resumed run) and a loader worker's copy serve every step alike."""
    import pickle

    sources = _sources([3000, 3000])

    def plan():
        # 16 samples of 100 tokens per step (4 rows of 4), 320 per epoch: epoch e starts at step 20 e.
        order = BlendedOrder(sources, [3, 1], seed=9, epoch_size=320, schedule=[(30, [1, 3]), (60, [0, 1])])
        return PackedEpochPlan(np.full(6000, 100), 400, 4, seed=9, order=order, window=None)

    a = plan()
    share = []
    for step in range(100):
        ids = [s for p in a.global_batch(step) for s in p.sample_ids]
        share.append(float(np.mean(sources[ids] == 0)))
    per_epoch = [np.mean(share[e * 20:(e + 1) * 20]) for e in range(5)]
    assert per_epoch == [0.75, 0.75, 0.25, 0.0, 0.0]  # stage 30 waits for epoch 2 (step 40), stage 60 starts epoch 3
    seen = [s for step in range(100) for p in a.global_batch(step) for s in p.sample_ids if sources[s] == 1]
    assert len(seen) == len(set(seen)) == 80 + 80 + 240 + 320 + 320  # stream positions carry across stages
    fresh = plan()
    for step in (87, 3, 45):  # a resumed run asks for a late step first
        assert fresh.global_batch(step) == a.global_batch(step)
    worker = pickle.loads(pickle.dumps(a))
    assert worker.global_batch(61) == a.global_batch(61)
    with pytest.raises(ValueError, match="needs the first steps of epochs 0..2"):
        BlendedOrder(sources, [1, 1], seed=0, schedule=[(5, [1, 0])])(2)


def test_blend_schedule_is_validated_and_recorded_in_the_plan():
    from megascale_omni.data.plan_record import CHECKPOINT_KEY, check_resumed_plan, plan_record, plan_settings

    def cfg(schedule, blend=({"path": "a"}, {"path": "b"})):
        return from_dict(JobConfig, {"model": {"family": "llava"},
                                     "data": {"blend": list(blend), "blend_schedule": schedule}})

    good = cfg([{"step": 0, "weights": [1, 0]}, {"step": 100, "weights": [0.5, 2]}])
    assert [(s.step, s.weights) for s in good.data.blend_schedule] == [(0, [1, 0]), (100, [0.5, 2])]
    for schedule, blend, field, why in (
        ([{"step": 5, "weights": [1]}], (), "data.blend_schedule", "data.blend, which is empty"),
        ([{"step": -1, "weights": [1, 1]}], None, r"data.blend_schedule\[0\].step", "must be an int >= 0"),
        ([{"step": 5, "weights": [1, 1]}, {"step": 5, "weights": [1, 1]}], None, r"data.blend_schedule\[1\].step",
         "must be an int > 5"),
        ([{"step": 5, "weights": [1]}], None, r"data.blend_schedule\[0\].weights", "one weight per data.blend source"),
        ([{"step": 5, "weights": [1, -1]}], None, r"data.blend_schedule\[0\].weights", "finite numbers >= 0"),
        ([{"step": 5, "weights": [0, 0]}], None, r"data.blend_schedule\[0\].weights", "must not all be 0"),
    ):
        with pytest.raises(ConfigError, match=f"^config error: {field}=.*{why}") as err:
            cfg(schedule, *(() if blend is None else (blend,)))
        assert "\n" not in str(err.value)
    settings = plan_settings(good)
    assert settings["data.blend_schedule"] == [{"step": 0, "weights": [1, 0]}, {"step": 100, "weights": [0.5, 2]}]
    assert settings["data.blend_epoch_size"] == 0
    common = {CHECKPOINT_KEY: plan_record(good, {})}
    with pytest.raises(ConfigError, match=r"^config error: data.blend_schedule=.*the checkpoint's run planned with"):
        check_resumed_plan(common, cfg([{"step": 0, "weights": [1, 0]}]), {})
