"""The pipeline solver is exact: it matches brute-force enumeration of every
split on small problems, with and without VPP and memory capacities."""

from __future__ import annotations

import itertools
import random

import pytest

from megascale_omni.parallel.pipeline_solver import StageProblem, min_max_allocation, min_memory, solve


def compositions(total: int, parts: int):
    """Every way to write ``total`` as ``parts`` ordered integers >= 1."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def rank_layers(p: StageProblem, counts):
    return [sum(counts[k] for k in p.rank_chunks(r)) for r in range(p.pp)]


def objective(p: StageProblem, counts):
    """(slowest rank, slowest chunk), or None if a rank exceeds the capacity."""
    layers = rank_layers(p, counts)
    if p.capacity is not None and any(p.rank_memory(r, n) > p.capacity for r, n in enumerate(layers)):
        return None
    slowest_rank = max(p.rank_time(r, n) for r, n in enumerate(layers))
    slowest_chunk = max(p.chunk_fixed(k) + p.layer_time * n for k, n in enumerate(counts))
    return slowest_rank, slowest_chunk


def brute_force(p: StageProblem):
    values = [v for c in compositions(p.num_layers, p.num_chunks) if (v := objective(p, c)) is not None]
    return min(values) if values else None


def random_problem(rng: random.Random, integer: bool) -> StageProblem:
    pp = rng.randint(1, 4)
    vpp = rng.choice([1, 1, 2, 3]) if pp > 1 else 1
    chunks = pp * vpp
    layers = rng.randint(chunks, min(chunks + 7, 12))
    draw = (lambda a, b: float(rng.randint(a, b))) if integer else (lambda a, b: rng.uniform(a, b))
    mem_fixed = [draw(0, 20) for _ in range(pp)]
    mem_per_layer = [draw(1, 10) for _ in range(pp)]
    capacity = rng.choice([None, draw(20, 80)])
    return StageProblem(
        num_layers=layers, pp=pp, vpp=vpp, layer_time=draw(1, 5), head_time=draw(0, 15),
        tail_time=draw(0, 6), mem_fixed=mem_fixed, mem_per_layer=mem_per_layer, capacity=capacity,
    )


@pytest.mark.parametrize("integer", [True, False], ids=["integer-costs", "real-costs"])
def test_solver_matches_brute_force(integer):
    rng = random.Random(20261129 + integer)
    checked = infeasible = interleaved = 0
    for _ in range(300):
        p = random_problem(rng, integer)
        expected = brute_force(p)
        counts = solve(p)
        if expected is None:
            assert counts is None, p
            infeasible += 1
            continue
        assert counts is not None, p
        assert len(counts) == p.num_chunks and min(counts) >= 1 and sum(counts) == p.num_layers
        got = objective(p, counts)
        assert got is not None, f"solver split {counts} exceeds the capacity of {p}"
        assert got == pytest.approx(expected, rel=1e-12), (p, counts)
        checked += 1
        interleaved += p.vpp > 1
    # The random cases must cover every branch, or this proves little.
    assert checked > 150 and infeasible > 10 and interleaved > 40


def test_min_max_allocation_matches_brute_force():
    rng = random.Random(7)
    for _ in range(200):
        bins = rng.randint(1, 4)
        total = rng.randint(0, 10)
        lower = [rng.randint(0, 2) for _ in range(bins)]
        upper = [lo + rng.randint(0, 6) for lo in lower]
        slopes = [rng.uniform(0.5, 3) for _ in range(bins)]
        offsets = [rng.uniform(0, 5) for _ in range(bins)]

        def load(k, n):
            return offsets[k] + slopes[k] * n * n  # convex, nondecreasing

        best = None
        for counts in itertools.product(*(range(lo, hi + 1) for lo, hi in zip(lower, upper))):
            if sum(counts) == total:
                value = max(load(k, n) for k, n in enumerate(counts))
                best = value if best is None else min(best, value)
        result = min_max_allocation(total, lower, upper, load)
        if best is None:
            assert result is None
            continue
        value, counts = result
        assert value == pytest.approx(best) and sum(counts) == total
        assert all(lo <= n <= hi for lo, n, hi in zip(lower, counts, upper))
        assert max(load(k, n) for k, n in enumerate(counts)) == pytest.approx(best)


def test_heavy_head_moves_layers_off_stage_zero():
    # Head worth 3 layers on pp=4, 16 layers: uniform puts 7 on rank 0.
    p = StageProblem(16, 4, 1, 1.0, 3.0, 0.0, [0.0] * 4, [1.0] * 4)
    counts = solve(p)
    assert counts[0] < 4 and max(p.rank_time(r, n) for r, n in enumerate(counts)) == 5.0


def test_interleaved_head_chunk_gets_fewest_layers():
    # pp=2, vpp=2: rank 0 holds chunks 0 and 2; chunk 0 carries a head of 2 layers.
    p = StageProblem(12, 2, 2, 1.0, 2.0, 0.0, [0.0] * 2, [1.0] * 2)
    counts = solve(p)
    assert sum(counts) == 12
    assert counts[0] == min(counts)
    assert brute_force(p) == objective(p, counts)


def test_min_memory_is_the_least_peak():
    p = StageProblem(8, 4, 1, 1.0, 0.0, 0.0, [5.0, 0.0, 0.0, 0.0], [4.0, 3.0, 2.0, 1.0], capacity=None)
    value, layers = min_memory(p)
    brute = min(
        max(p.rank_memory(r, n) for r, n in enumerate(c)) for c in compositions(8, 4)
    )
    assert value == brute and sum(layers) == 8
