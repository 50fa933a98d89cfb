"""Cost-balanced split of one global batch among data-parallel participants.

The global batch (from :mod:`megascale_omni.data.sample_plan`) is fixed per
step; *how* it is divided among the current participants is decided here,
every step, from per-item costs. Splits are deterministic - every rank
computes the same split locally from the same inputs, so no communication is
needed to agree on it.

Count policy: megatron's schedules run the same number of micro-batches on
every data-parallel rank (gradient all-reduce is collective, and uneven
counts would deadlock or skew the loss average). :func:`split_balanced`
therefore gives every participant exactly ``len(items) / num_participants``
items and refuses batches that do not divide. :func:`split_balanced_uneven`
is for callers that can weight per-rank losses by their item counts; it lets
counts differ by at most one (the first ``len(items) % num_participants``
participants take the extra item).

Algorithm: longest-processing-time greedy under per-participant count caps,
then pairwise swaps (largest-load participant vs. any other) while a swap
strictly lowers the larger of the two loads. Each accepted swap strictly
decreases the sum of squared loads, so refinement terminates. The same
refinement also runs from the contiguous split (same count caps) and the
lower max load wins, so the result is never worse than :func:`split_contiguous`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np

logger = logging.getLogger(__name__)

#: Relative cost of one ViT patch vs. one LLM token, in token-equivalents.
#: Training FLOPs per position are ~6 x params for trainable weights, so a
#: trainable ViT-L (~0.3B) next to a 7B LLM costs ~0.3 / 7 ~= 0.043 per patch;
#: rounded up because ViT kernels (short sequences, full attention) run at a
#: lower MFU than the LLM's. Recalibrate from profiles for other model pairs.
DEFAULT_VIT_COST_PER_PATCH = 0.05

# Relative slack below which a swap is not considered an improvement; guards
# against float round-off ping-pong between equal loads.
_SWAP_REL_EPS = 1e-12


def sample_cost(
    num_tokens: int,
    num_images: int = 0,
    patches_per_image: int = 0,
    vit_cost_per_patch: float = DEFAULT_VIT_COST_PER_PATCH,
    attention_cost_per_token_pair: float = 0.0,
) -> float:
    """Estimated training cost of one sample, in LLM token-equivalents.

    One token-equivalent is the (fwd + bwd) cost of one LLM position through
    the dense layers. Image placeholder tokens are already part of
    ``num_tokens`` (they run through the LLM like text); the vision encoder
    adds ``num_images * patches_per_image * vit_cost_per_patch``.

    ``attention_cost_per_token_pair`` adds a quadratic ``num_tokens ** 2``
    term. In packed rows attention cost is ``sum(L_i ** 2)`` over members, not
    ``seq_length ** 2``, so this is what distinguishes a row of one long
    sample from a row of many short ones. For a transformer with hidden size
    ``h`` the ratio of causal attention to dense-layer FLOPs per token pair is
    about ``1 / (12 * h)`` (~2e-5 at h=4096); it is 0 by default because at
    LLaVA's sample lengths it is negligible.

    Returns:
        Non-negative float cost.
    """
    if num_tokens < 0 or num_images < 0 or patches_per_image < 0:
        raise ValueError(
            f"counts must be non-negative, got tokens={num_tokens}, images={num_images}, "
            f"patches_per_image={patches_per_image}"
        )
    if vit_cost_per_patch < 0 or attention_cost_per_token_pair < 0:
        raise ValueError("cost coefficients must be non-negative")
    return (
        float(num_tokens)
        + num_images * patches_per_image * vit_cost_per_patch
        + attention_cost_per_token_pair * float(num_tokens) ** 2
    )


def _check_costs(items: Sequence[int], costs: Sequence[float], num_participants: int) -> np.ndarray:
    if num_participants <= 0:
        raise ValueError(f"num_participants must be positive, got {num_participants}")
    cost_arr = np.asarray(costs, dtype=np.float64)
    if cost_arr.shape != (len(items),):
        raise ValueError(f"costs shape {cost_arr.shape} must match {len(items)} items")
    if not np.all(np.isfinite(cost_arr)) or np.any(cost_arr < 0):
        raise ValueError("costs must be finite and non-negative")
    return cost_arr


def _lpt_with_caps(costs: np.ndarray, caps: list[int]) -> list[list[int]]:
    """LPT greedy: heaviest item first onto the lightest participant with room.

    Ties: items by ascending position (stable sort), participants by
    ascending index. Returns item positions per participant.
    """
    p = len(caps)
    loads = np.zeros(p, dtype=np.float64)
    counts = [0] * p
    parts: list[list[int]] = [[] for _ in range(p)]
    for pos in np.argsort(-costs, kind="stable").tolist():
        best = -1
        for r in range(p):
            if counts[r] < caps[r] and (best < 0 or loads[r] < loads[best]):
                best = r
        parts[best].append(pos)
        loads[best] += costs[pos]
        counts[best] += 1
    return parts


def _refine_by_swaps(costs: np.ndarray, parts: list[list[int]], max_rounds: int) -> None:
    """In place: swap items between the max-load participant and others.

    Each round picks, over all partners ``q`` and item pairs ``(a in max,
    b in q)`` with ``0 < c[a] - c[b] < load[max] - load[q]``, the swap that
    minimises ``max(new load[max], new load[q])``; ties go to the lowest
    ``(q, a, b)`` positions. Stops when no such swap exists.
    """
    loads = np.array([costs[part].sum() if part else 0.0 for part in parts])
    scale = max(float(loads.max(initial=0.0)), 1.0)
    for _ in range(max_rounds):
        m = int(np.argmax(loads))  # lowest index among ties
        src = np.asarray(parts[m], dtype=np.int64)
        if src.size == 0:
            return
        best: tuple[float, int, int, int] | None = None  # (new_max, q, i_a, i_b)
        for q in range(len(parts)):
            gap = loads[m] - loads[q]
            if q == m or gap <= _SWAP_REL_EPS * scale or not parts[q]:
                continue
            dst = np.asarray(parts[q], dtype=np.int64)
            delta = costs[src][:, None] - costs[dst][None, :]  # [|src|, |dst|]
            ok = (delta > _SWAP_REL_EPS * scale) & (delta < gap - _SWAP_REL_EPS * scale)
            if not ok.any():
                continue
            new_max = np.where(ok, np.maximum(loads[m] - delta, loads[q] + delta), np.inf)
            flat = int(np.argmin(new_max))  # row-major: lowest (a, b) on ties
            cand = (float(new_max.flat[flat]), q, *divmod(flat, dst.size))
            if best is None or cand[0] < best[0]:
                best = cand
        if best is None:
            return
        _, q, i_a, i_b = best
        a, b = parts[m][i_a], parts[q][i_b]
        parts[m][i_a], parts[q][i_b] = b, a
        loads[m] += costs[b] - costs[a]
        loads[q] += costs[a] - costs[b]
    logger.debug("swap refinement hit max_rounds=%d", max_rounds)


def _split(items: Sequence[int], cost_arr: np.ndarray, caps: list[int]) -> list[list[int]]:
    # Two refined starts: LPT, and the contiguous split (which has the same
    # per-participant caps). Keeping the better one makes "never worse than
    # the naive baseline" a guarantee rather than an empirical hope.
    starts, begin = [_lpt_with_caps(cost_arr, caps)], 0
    contiguous = []
    for cap in caps:
        contiguous.append(list(range(begin, begin + cap)))
        begin += cap
    starts.append(contiguous)
    best, best_max = starts[0], np.inf
    for parts in starts:
        # Bound is generous: refinement usually converges in a few rounds.
        _refine_by_swaps(cost_arr, parts, max_rounds=4 * len(items) + 16)
        max_load = max((float(cost_arr[part].sum()) for part in parts), default=0.0)
        if max_load < best_max:  # strict: LPT wins ties
            best, best_max = parts, max_load
    # Positions sorted so each participant sees its items in global-batch order.
    return [[items[pos] for pos in sorted(part)] for part in best]


def split_balanced(
    items: Sequence[int], costs: Sequence[float], num_participants: int
) -> list[list[int]]:
    """Split ``items`` into ``num_participants`` equal-count, cost-balanced groups.

    Args:
        items: the global batch (e.g. pack indices), in plan order.
        costs: cost per item, aligned with ``items`` (token-equivalents).
        num_participants: current data-parallel size.

    Returns:
        ``num_participants`` lists of items; each has ``len(items) //
        num_participants`` entries kept in their global-batch order; together
        they contain every item exactly once. Deterministic in the inputs.

    Raises:
        ValueError: if ``len(items)`` is not divisible by ``num_participants``
            (see :func:`split_balanced_uneven`), or on invalid costs.
    """
    cost_arr = _check_costs(items, costs, num_participants)
    n = len(items)
    if n % num_participants != 0:
        raise ValueError(
            f"global batch of {n} items cannot be split evenly among {num_participants} "
            f"participants (equal micro-batch counts are required); choose a global batch size "
            f"divisible by the participant count or use split_balanced_uneven"
        )
    return _split(items, cost_arr, [n // num_participants] * num_participants)


def split_balanced_uneven(
    items: Sequence[int], costs: Sequence[float], num_participants: int
) -> list[list[int]]:
    """Like :func:`split_balanced`, but counts may differ by one.

    Participant ``r`` receives ``len(items) // num_participants + (r <
    len(items) % num_participants)`` items - a fixed rule rather than a
    cost-driven one, so every rank can predict its micro-batch count.
    """
    cost_arr = _check_costs(items, costs, num_participants)
    base, extra = divmod(len(items), num_participants)
    return _split(items, cost_arr, [base + (r < extra) for r in range(num_participants)])


def microbatch_shares(num_items: int, micro_batch_size: int, num_participants: int) -> list[int]:
    """Items per participant when whole micro-batches are dealt out.

    The global batch holds ``num_items / micro_batch_size`` micro-batches;
    participant ``r`` gets ``m // P + (r < m % P)`` of them (the first ones
    take the extra), possibly zero when ``P > m``. Equal shares whenever
    ``P`` divides ``m``. Pipeline p2p buffers are ``[seq, micro_batch_size,
    hidden]``, so shares are never split below a micro-batch.
    """
    if num_participants <= 0:
        raise ValueError(f"num_participants must be positive, got {num_participants}")
    if num_items % micro_batch_size:
        raise ValueError(f"{num_items} items are not whole micro-batches of {micro_batch_size}")
    base, extra = divmod(num_items // micro_batch_size, num_participants)
    return [(base + (r < extra)) * micro_batch_size for r in range(num_participants)]


def split_balanced_counts(
    items: Sequence[int], costs: Sequence[float], counts: Sequence[int]
) -> list[list[int]]:
    """Like :func:`split_balanced`, with participant ``r`` receiving exactly
    ``counts[r]`` items (e.g. from :func:`microbatch_shares`)."""
    cost_arr = _check_costs(items, costs, len(counts))
    if sum(counts) != len(items):
        raise ValueError(f"counts {list(counts)} do not add up to {len(items)} items")
    return _split(items, cost_arr, list(counts))


def split_contiguous(items: Sequence[int], num_participants: int) -> list[list[int]]:
    """Naive baseline: consecutive chunks, sizes differing by at most one (first ones larger)."""
    if num_participants <= 0:
        raise ValueError(f"num_participants must be positive, got {num_participants}")
    base, extra = divmod(len(items), num_participants)
    out, start = [], 0
    for r in range(num_participants):
        stop = start + base + (r < extra)
        out.append(list(items[start:stop]))
        start = stop
    return out


def participant_loads(
    parts: Sequence[Sequence[int]], items: Sequence[int], costs: Sequence[float]
) -> list[float]:
    """Total cost per participant for a split of ``items`` (items must be unique)."""
    cost_of = dict(zip(items, costs))
    if len(cost_of) != len(items):
        raise ValueError("participant_loads needs unique items")
    return [float(sum(cost_of[i] for i in part)) for part in parts]


def imbalance(loads: Sequence[float]) -> float:
    """``max(loads) / mean(loads)``; 1.0 is perfect. Defined as 1.0 when all loads are zero."""
    arr = np.asarray(loads, dtype=np.float64)
    if arr.size == 0:
        raise ValueError("imbalance of zero participants is undefined")
    mean = float(arr.mean())
    return 1.0 if mean == 0.0 else float(arr.max()) / mean


@dataclass(frozen=True)
class SplitReport:
    """Balanced vs contiguous split of one global batch, for logging."""

    num_items: int
    num_participants: int
    balanced_imbalance: float
    contiguous_imbalance: float


def compare_splits(
    items: Sequence[int], costs: Sequence[float], num_participants: int
) -> SplitReport:
    """Imbalance of :func:`split_balanced_uneven` next to :func:`split_contiguous`."""
    balanced = split_balanced_uneven(items, costs, num_participants)
    naive = split_contiguous(items, num_participants)
    return SplitReport(
        num_items=len(items),
        num_participants=num_participants,
        balanced_imbalance=imbalance(participant_loads(balanced, items, costs)),
        contiguous_imbalance=imbalance(participant_loads(naive, items, costs)),
    )
