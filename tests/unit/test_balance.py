"""Unit tests for megascale_omni.data.balance."""

from __future__ import annotations

import numpy as np
import pytest

from megascale_omni.data.balance import (
    compare_splits,
    imbalance,
    participant_loads,
    sample_cost,
    split_balanced,
    split_balanced_uneven,
    split_contiguous,
)


def _skewed_costs(n: int, seed: int) -> np.ndarray:
    """Heavy-tailed costs: mostly cheap items with a few expensive ones."""
    rng = np.random.default_rng(seed)
    return np.round(rng.lognormal(mean=3.0, sigma=1.2, size=n), 3)


def _assert_partition(parts: list[list[int]], items: list[int]) -> None:
    flat = [i for part in parts for i in part]
    assert sorted(flat) == sorted(items)
    assert len(flat) == len(set(flat))


# ---------------------------------------------------------------- sample_cost


def test_sample_cost_units():
    assert sample_cost(100) == 100.0
    assert sample_cost(100, num_images=2, patches_per_image=576, vit_cost_per_patch=0.05) == (
        pytest.approx(100 + 2 * 576 * 0.05)
    )
    assert sample_cost(10, attention_cost_per_token_pair=0.5) == pytest.approx(10 + 50)
    with pytest.raises(ValueError):
        sample_cost(-1)
    with pytest.raises(ValueError):
        sample_cost(1, vit_cost_per_patch=-0.1)


# ---------------------------------------------------------------- split_balanced


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_resplit_same_batch_among_1_to_4_participants(seed: int):
    # 12 is divisible by 1, 2, 3 and 4: an elastic job can shrink/grow freely.
    items = [100 + i for i in range(12)]
    costs = _skewed_costs(12, seed)
    for p in (1, 2, 3, 4):
        parts = split_balanced(items, costs, p)
        assert len(parts) == p
        assert all(len(part) == 12 // p for part in parts)
        _assert_partition(parts, items)
        # Each participant's items stay in global-batch order.
        assert all(part == sorted(part) for part in parts)


def test_non_divisible_batch_raises_clear_error():
    with pytest.raises(ValueError, match=r"global batch of 10 items .* among 4 participants"):
        split_balanced(list(range(10)), [1.0] * 10, 4)


@pytest.mark.parametrize("seed", range(5))
def test_balanced_not_worse_than_contiguous_on_skewed_costs(seed: int):
    items = list(range(64))
    costs = _skewed_costs(64, seed)
    for p in (2, 4, 8):
        bal = imbalance(participant_loads(split_balanced(items, costs, p), items, costs))
        naive = imbalance(participant_loads(split_contiguous(items, p), items, costs))
        assert bal <= naive + 1e-12


def test_balanced_clearly_better_on_sorted_skew():
    # Adversarial for contiguous: costs sorted, so chunk 0 gets all heavy items.
    items = list(range(32))
    costs = [float(32 - i) ** 2 for i in range(32)]
    report = compare_splits(items, costs, 4)
    assert report.contiguous_imbalance > 2.0
    assert report.balanced_imbalance < 1.02


def test_balanced_matches_optimum_on_small_instance():
    # Exhaustive check: 8 items into 2 equal halves.
    from itertools import combinations

    costs = [9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]
    items = list(range(8))
    total = sum(costs)
    best = min(
        max(sum(costs[i] for i in c), total - sum(costs[i] for i in c))
        for c in combinations(items, 4)
    )
    parts = split_balanced(items, costs, 2)
    assert max(participant_loads(parts, items, costs)) == pytest.approx(best)


def test_split_is_deterministic_with_ties():
    items = list(range(16))
    costs = [1.0] * 16
    a = split_balanced(items, costs, 4)
    assert a == split_balanced(list(items), list(costs), 4)
    # All-equal costs: LPT fills participants round-robin by index.
    assert a == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


@pytest.mark.parametrize("seed", range(4))
def test_randomized_partition_and_determinism(seed: int):
    rng = np.random.default_rng(seed)
    p = int(rng.integers(1, 9))
    n = p * int(rng.integers(1, 20))
    items = rng.permutation(10 * n)[:n].tolist()
    costs = rng.exponential(50.0, size=n)
    parts = split_balanced(items, costs, p)
    _assert_partition(parts, items)
    assert parts == split_balanced(items, costs.copy(), p)
    loads = participant_loads(parts, items, costs)
    # Loose sanity bound (classic LPT guarantee; caps make it heuristic here).
    assert max(loads) <= np.mean(loads) + costs.max() + 1e-9


def test_zero_and_empty_costs():
    assert split_balanced([], [], 3) == [[], [], []]
    parts = split_balanced([1, 2, 3, 4], [0.0] * 4, 2)
    _assert_partition(parts, [1, 2, 3, 4])
    assert imbalance([0.0, 0.0]) == 1.0


def test_invalid_costs_rejected():
    with pytest.raises(ValueError, match="finite and non-negative"):
        split_balanced([0, 1], [1.0, -1.0], 2)
    with pytest.raises(ValueError, match="finite and non-negative"):
        split_balanced([0, 1], [1.0, float("nan")], 2)
    with pytest.raises(ValueError, match="must match"):
        split_balanced([0, 1], [1.0], 2)
    with pytest.raises(ValueError, match="positive"):
        split_balanced([0, 1], [1.0, 1.0], 0)


# ---------------------------------------------------------------- uneven / contiguous


@pytest.mark.parametrize("n,p", [(10, 4), (7, 3), (3, 5), (12, 4)])
def test_uneven_counts_differ_by_at_most_one(n: int, p: int):
    items = list(range(n))
    costs = _skewed_costs(n, n * p)
    parts = split_balanced_uneven(items, costs, p)
    _assert_partition(parts, items)
    counts = [len(part) for part in parts]
    base, extra = divmod(n, p)
    assert counts == [base + (r < extra) for r in range(p)]
    naive = split_contiguous(items, p)
    assert [len(part) for part in naive] == counts
    assert imbalance(participant_loads(parts, items, costs)) <= imbalance(
        participant_loads(naive, items, costs)
    ) + 1e-12


def test_split_contiguous_baseline():
    assert split_contiguous([5, 6, 7, 8, 9], 2) == [[5, 6, 7], [8, 9]]
    assert split_contiguous([], 2) == [[], []]


def test_imbalance_definition():
    assert imbalance([1.0, 1.0, 1.0]) == 1.0
    assert imbalance([3.0, 1.0]) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        imbalance([])
    with pytest.raises(ValueError, match="unique"):
        participant_loads([[1], [1]], [1, 1], [1.0, 1.0])
