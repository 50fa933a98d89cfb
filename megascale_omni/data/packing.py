"""Sequence packing: bin encoded samples into fixed-length training rows.

Three concerns live here, all pure CPU and framework-free:

* :func:`pack_samples` decides *which* samples share a row (windowed
  best-fit-decreasing, deterministic).
* :func:`collate_pack` materialises one :class:`Pack` into the fixed-shape
  tensors the model consumes (tokens / shifted labels / loss mask / reset
  position ids / segment ids).
* :func:`packed_cu_seqlens` turns segment ids into the segment boundaries
  (``cu_seqlens``) that THD attention consumes (megatron's ``PackedSeqParams``).

Why windowed best-fit-decreasing rather than greedy-in-order: LLaVA-style
samples are short (~10-80 tokens) relative to ``seq_length``; greedy
next-fit leaves a tail in every row, while sorting a look-ahead window by
length and best-fitting lets short samples fill those tails. Keeping the
window bounded (instead of sorting the whole epoch) preserves the shuffle's
locality, so consecutive packs - and therefore global batches - are not
correlated with sample length.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Literal, Mapping, Optional, Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

OverlongPolicy = Literal["error", "truncate", "drop"]
_OVERLONG_POLICIES = ("error", "truncate", "drop")

#: Segment id given to padding positions in :func:`collate_pack`.
PAD_SEGMENT_ID = -1

#: Default look-ahead window (in samples). For lengths ~U(10, 80) and
#: seq_length 256 a window this size yields ~180 packs per window, so the one
#: or two partially filled rows at each window edge cost well under 1%.
DEFAULT_PACKING_WINDOW = 1024


@dataclass(frozen=True, slots=True)
class Pack:
    """One packed training row.

    Members are stored in the order they appear in the input stream (not
    the length-sorted order used while packing) so that row contents are a
    stable function of the input order.

    Attributes:
        sample_ids: ids of member samples, in row order.
        offsets: start position (token index within the row) of each member.
        lengths: number of tokens each member occupies in the row; equals the
            sample's length unless it was truncated to ``seq_length``.
        cost: sum of member costs (token-equivalents, see
            :func:`megascale_omni.data.balance.sample_cost`).
        vision: sum of member vision-tower tokens (0 when not given).
        deferred: members that a fuller row had room for in tokens but not
            in vision tokens (``max_vision`` of :func:`pack_samples`), so they
            opened or joined a later row.
    """

    sample_ids: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    cost: float = 0.0
    vision: int = 0
    deferred: int = 0

    @property
    def num_tokens(self) -> int:
        """Non-padding tokens in this row."""
        return sum(self.lengths)

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)


def _validate_inputs(
    lengths: np.ndarray,
    sample_ids: Optional[Sequence[int]],
    costs: Optional[Sequence[float]],
    seq_length: int,
    overlong: str,
    window: Optional[int],
) -> tuple[np.ndarray, np.ndarray]:
    if seq_length <= 0:
        raise ValueError(f"seq_length must be positive, got {seq_length}")
    if overlong not in _OVERLONG_POLICIES:
        raise ValueError(f"overlong must be one of {_OVERLONG_POLICIES}, got {overlong!r}")
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive or None, got {window}")
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {lengths.shape}")
    n = lengths.shape[0]
    ids = np.arange(n, dtype=np.int64) if sample_ids is None else np.asarray(sample_ids, dtype=np.int64)
    cost_arr = np.zeros(n, dtype=np.float64) if costs is None else np.asarray(costs, dtype=np.float64)
    if ids.shape != (n,) or cost_arr.shape != (n,):
        raise ValueError(
            f"sample_ids {ids.shape} and costs {cost_arr.shape} must match lengths ({n},)"
        )
    bad = np.flatnonzero(lengths <= 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"sample {int(ids[i])} has non-positive length {int(lengths[i])}")
    return ids, cost_arr


def _best_fit_decreasing(lengths: np.ndarray, capacity: int, vision: Optional[np.ndarray] = None,
                         max_vision: int = 0) -> tuple[list[list[int]], list[int]]:
    """Best-fit-decreasing over one window.

    Args:
        lengths: int array ``[w]`` of lengths, each ``<= capacity``.
        capacity: bin capacity in tokens.
        vision: int array ``[w]`` of vision tokens per item, each ``<=
            max_vision``; with ``max_vision`` > 0 a bin's vision tokens stay
            within ``max_vision`` (an item goes to the tightest bin, by
            tokens, that has room for both).
        max_vision: the bins' vision-token capacity; 0: unbounded.

    Returns:
        ``(bins, deferred)``: bins as lists of window-local positions, each
        list sorted ascending, bins ordered by their first member's position;
        per bin, its members that a tighter bin had token room for but not
        vision room (0 without ``max_vision``).
    """
    # Stable sort on (-length, position): ties keep stream order, which makes
    # the result a pure function of the input sequence.
    order = np.argsort(-lengths, kind="stable")
    bins: list[list[int]] = []
    bin_vision: list[int] = []
    deferred: list[int] = []
    # Open bins keyed by (remaining_capacity, bin_index); bisect finds the
    # tightest bin that still fits, lowest bin index on ties.
    open_bins: list[tuple[int, int]] = []
    for pos in order.tolist():
        length = int(lengths[pos])
        v = int(vision[pos]) if max_vision else 0
        k = first = bisect.bisect_left(open_bins, (length, -1))
        while max_vision and k < len(open_bins) and bin_vision[open_bins[k][1]] + v > max_vision:
            k += 1  # a tighter bin is full of vision tokens: the next tightest
        if k < len(open_bins):
            remaining, b = open_bins.pop(k)
            bins[b].append(pos)
            remaining -= length
        else:
            b = len(bins)
            bins.append([pos])
            bin_vision.append(0)
            deferred.append(0)
            remaining = capacity - length
        bin_vision[b] += v
        deferred[b] += k > first
        if remaining > 0:
            bisect.insort(open_bins, (remaining, b))
    for members in bins:
        members.sort()
    ranks = sorted(range(len(bins)), key=lambda b: bins[b][0])
    return [bins[b] for b in ranks], [deferred[b] for b in ranks]


def pack_samples(
    lengths: Sequence[int] | np.ndarray,
    seq_length: int,
    *,
    sample_ids: Optional[Sequence[int]] = None,
    costs: Optional[Sequence[float]] = None,
    overlong: OverlongPolicy = "error",
    window: Optional[int] = DEFAULT_PACKING_WINDOW,
    vision: Optional[Sequence[int]] = None,
    max_vision: int = 0,
) -> list[Pack]:
    """Pack samples into rows of at most ``seq_length`` tokens.

    The stream is cut into consecutive windows of ``window`` samples; each
    window is packed independently with best-fit-decreasing and its packs are
    emitted ordered by their earliest member. The output is a deterministic
    function of the arguments (no RNG, no hashing).

    Args:
        lengths: token count per sample (including expanded image placeholder
            tokens), in stream order (e.g. an epoch's permuted order).
        seq_length: row capacity in tokens.
        sample_ids: id per sample; defaults to ``range(len(lengths))``.
        costs: cost per sample in token-equivalents; defaults to zeros.
        overlong: what to do with samples longer than ``seq_length``:
            ``"error"`` raises ``ValueError`` naming the sample; ``"truncate"``
            keeps the first ``seq_length`` tokens (unsafe if the cut splits an
            image placeholder block - the dataset must ensure it does not);
            ``"drop"`` skips the sample and logs a warning with the count.
        window: look-ahead window in samples; ``None`` packs the whole input
            as one window (best efficiency, but packs become sorted by length).
        vision: vision-tower tokens per sample (frames and image views times
            the tower's tokens per input); defaults to zeros.
        max_vision: vision tokens a row may hold (a micro-batch's activation
            budget, ``data.max_vision_tokens_per_microbatch``); 0: unbounded.
            A sample that a fuller row cannot take is deferred to another
            row, never dropped (:attr:`Pack.deferred` counts it); a sample
            over ``max_vision`` on its own raises ``ValueError`` (the plan
            excludes those first, with their reason).

    Returns:
        Packs in emission order. Every kept sample appears in exactly one pack.

    Raises:
        ValueError: on invalid arguments, or an overlong sample under
            ``overlong="error"``.
    """
    length_arr = np.asarray(lengths, dtype=np.int64)
    ids, cost_arr = _validate_inputs(length_arr, sample_ids, costs, seq_length, overlong, window)
    vision_arr = np.zeros(length_arr.shape, dtype=np.int64) if vision is None else np.asarray(vision, np.int64)
    if vision_arr.shape != length_arr.shape or (vision_arr < 0).any() or max_vision < 0:
        raise ValueError(f"vision {vision_arr.shape} must be non-negative counts matching lengths "
                         f"{length_arr.shape}, max_vision={max_vision} >= 0")
    if max_vision and (over := np.flatnonzero(vision_arr > max_vision)).size:
        i = int(over[0])
        raise ValueError(f"sample {int(ids[i])} has {int(vision_arr[i])} vision tokens > max_vision {max_vision} "
                         f"({over.size} such sample(s)); exclude them before packing")

    too_long = np.flatnonzero(length_arr > seq_length)
    if too_long.size:
        if overlong == "error":
            i = int(too_long[0])
            raise ValueError(
                f"sample {int(ids[i])} has length {int(length_arr[i])} > seq_length {seq_length} "
                f"({too_long.size} overlong sample(s) in total); pass overlong='truncate' or 'drop'"
            )
        if overlong == "drop":
            logger.warning(
                "dropping %d sample(s) longer than seq_length=%d (first id %d)",
                too_long.size, seq_length, int(ids[too_long[0]]),
            )
            keep = length_arr <= seq_length
            length_arr, ids, cost_arr, vision_arr = length_arr[keep], ids[keep], cost_arr[keep], vision_arr[keep]
        else:
            logger.info("truncating %d sample(s) to seq_length=%d", too_long.size, seq_length)
            length_arr = np.minimum(length_arr, seq_length)

    n = length_arr.shape[0]
    step = n if window is None else window
    packs: list[Pack] = []
    for start in range(0, n, max(step, 1)):
        stop = min(start + step, n)
        bins, deferred = _best_fit_decreasing(length_arr[start:stop], seq_length, vision_arr[start:stop],
                                              max_vision)
        for members, late in zip(bins, deferred):
            idx = np.asarray(members, dtype=np.int64) + start
            member_lengths = length_arr[idx]
            offsets = np.concatenate(([0], np.cumsum(member_lengths)[:-1]))
            packs.append(
                Pack(
                    sample_ids=tuple(ids[idx].tolist()),
                    offsets=tuple(offsets.tolist()),
                    lengths=tuple(member_lengths.tolist()),
                    cost=float(cost_arr[idx].sum()),
                    vision=int(vision_arr[idx].sum()),
                    deferred=late,
                )
            )
    return packs


def collate_pack(
    pack: Pack,
    token_lists: Sequence[Sequence[int]],
    label_lists: Optional[Sequence[Sequence[int]]],
    loss_mask_lists: Optional[Sequence[Sequence[float]]],
    seq_length: int,
    pad_id: int,
    extra_masks: Optional[Mapping[str, Sequence[Sequence[float]]]] = None,
) -> dict[str, torch.Tensor]:
    """Materialise one pack into fixed-shape, already-shifted tensors.

    Per-sample inputs are *unshifted* and aligned with that sample's tokens:
    ``label_lists[i][j]`` is the label of token ``j`` (usually the token id
    itself) and ``loss_mask_lists[i][j]`` says whether token ``j`` is a
    supervised target (e.g. 1 on assistant replies, 0 on prompt/image
    tokens). ``None`` means labels = tokens and every token is a target.

    Output position ``p = offset + j`` predicts token ``j + 1`` of the same
    sample: ``labels[p] = label[j + 1]``, ``loss_mask[p] = mask[j + 1]``. The
    last position of every sample has no in-sample successor, so it gets
    ``labels = pad_id`` and ``loss_mask = 0`` - no prediction ever crosses a
    sample boundary. Padding uses ``labels = pad_id`` (a valid vocab id, as
    vocab-parallel cross-entropy requires) and ``loss_mask = 0``.

    Args:
        pack: the row layout from :func:`pack_samples`.
        token_lists: tokens of each member, in ``pack.sample_ids`` order. A
            list may be longer than its pack length only if the sample was
            truncated to ``seq_length``.
        label_lists: unshifted labels per member, or ``None``.
        loss_mask_lists: unshifted 0/1 target mask per member, or ``None``.
        seq_length: row length; must be ``>= pack.num_tokens``.
        pad_id: token id used for padding tokens and masked labels.
        extra_masks: more unshifted per-member 0/1 masks (e.g. an evaluation
            mask), shifted exactly like ``loss_mask`` and returned under
            their own keys as ``[seq_length]`` float32.

    Returns:
        ``tokens``, ``labels``, ``position_ids``, ``segment_ids``: ``[seq_length]``
        int64; ``loss_mask``: ``[seq_length]`` float32. Position ids restart
        at 0 at each sample start (and at the start of padding); segment ids
        are ``0..k-1`` for the ``k`` members and :data:`PAD_SEGMENT_ID` on
        padding.
    """
    k = pack.num_samples
    if len(token_lists) != k:
        raise ValueError(f"pack has {k} samples but {len(token_lists)} token lists were given")
    for name, lists in (("label_lists", label_lists), ("loss_mask_lists", loss_mask_lists)):
        if lists is not None and len(lists) != k:
            raise ValueError(f"pack has {k} samples but {len(lists)} {name} were given")
    used = pack.num_tokens
    if used > seq_length:
        raise ValueError(f"pack holds {used} tokens > seq_length {seq_length}")

    tokens = np.full(seq_length, pad_id, dtype=np.int64)
    labels = np.full(seq_length, pad_id, dtype=np.int64)
    loss_mask = np.zeros(seq_length, dtype=np.float32)
    position_ids = np.zeros(seq_length, dtype=np.int64)
    segment_ids = np.full(seq_length, PAD_SEGMENT_ID, dtype=np.int64)
    extra_masks = dict(extra_masks or {})
    extras = {name: np.zeros(seq_length, dtype=np.float32) for name in extra_masks}

    for i, (sid, off, length) in enumerate(zip(pack.sample_ids, pack.offsets, pack.lengths)):
        toks = np.asarray(token_lists[i], dtype=np.int64)
        truncated = length == seq_length and toks.shape[0] > length
        if toks.shape[0] != length and not truncated:
            raise ValueError(
                f"sample {sid}: got {toks.shape[0]} tokens but the pack reserves {length}"
            )
        labs = toks if label_lists is None else np.asarray(label_lists[i], dtype=np.int64)
        mask = (
            np.ones(toks.shape[0], dtype=np.float32)
            if loss_mask_lists is None
            else np.asarray(loss_mask_lists[i], dtype=np.float32)
        )
        if labs.shape[0] != toks.shape[0] or mask.shape[0] != toks.shape[0]:
            raise ValueError(
                f"sample {sid}: tokens/labels/loss_mask lengths differ "
                f"({toks.shape[0]}, {labs.shape[0]}, {mask.shape[0]})"
            )
        end = off + length
        tokens[off:end] = toks[:length]
        # Shift within the sample only; position end-1 keeps pad label / mask 0.
        labels[off : end - 1] = labs[1:length]
        loss_mask[off : end - 1] = mask[1:length]
        for name, lists in extra_masks.items():
            extra = np.asarray(lists[i], dtype=np.float32)
            if extra.shape[0] != toks.shape[0]:
                raise ValueError(f"sample {sid}: {name} has {extra.shape[0]} entries for {toks.shape[0]} tokens")
            extras[name][off : end - 1] = extra[1:length]
        position_ids[off:end] = np.arange(length)
        segment_ids[off:end] = i
    position_ids[used:] = np.arange(seq_length - used)

    return {
        "tokens": torch.from_numpy(tokens),
        "labels": torch.from_numpy(labels),
        "loss_mask": torch.from_numpy(loss_mask),
        "position_ids": torch.from_numpy(position_ids),
        "segment_ids": torch.from_numpy(segment_ids),
        **{name: torch.from_numpy(m) for name, m in extras.items()},
    }


def packed_cu_seqlens(segment_ids: torch.Tensor) -> torch.Tensor:
    """Segment boundaries of packed rows for THD attention (megatron's ``cu_seqlens``).

    The rows are flattened row-major into one sequence of ``t = b * s``
    tokens. A segment starts at every row start and wherever the segment id
    changes, so each sample is one segment and each row's padding tail
    (negative ids) is another; no segment crosses a row boundary. Attention
    runs causally inside each segment only (see
    :mod:`megascale_omni.models.attention`), so no token sees another sample
    and real tokens never see padding.

    Args:
        segment_ids: ``[b, s]`` integer tensor from :func:`collate_pack` (or
            zeros for rows that each hold one sample).

    Returns:
        ``[n + 1]`` int32 on ``segment_ids.device``: ``0``, the end of each of
        the ``n`` segments, the last being ``t``.
    """
    if segment_ids.dim() != 2:
        raise ValueError(f"segment_ids must be [b, s], got shape {tuple(segment_ids.shape)}")
    s = segment_ids.shape[1]
    flat = segment_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::s] = True
    ends = torch.tensor([flat.numel()], dtype=torch.int64, device=flat.device)
    return torch.cat([torch.nonzero(starts).flatten(), ends]).to(torch.int32)


def packing_efficiency(packs: Sequence[Pack], seq_length: int) -> float:
    """Fraction of row positions holding real tokens: ``sum(tokens) / (len(packs) * seq_length)``."""
    if not packs:
        raise ValueError("packing_efficiency of zero packs is undefined")
    return sum(p.num_tokens for p in packs) / (len(packs) * seq_length)


def pad_to_max_efficiency(lengths: Sequence[int] | np.ndarray, max_len: Optional[int] = None) -> float:
    """Efficiency of the unpacked baseline: one sample per row, padded to ``max_len``.

    ``max_len`` defaults to the longest sample (pad-to-longest over the
    dataset); samples longer than an explicit ``max_len`` count as truncated.
    """
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.size == 0:
        raise ValueError("pad_to_max_efficiency of zero samples is undefined")
    row = int(arr.max()) if max_len is None else int(max_len)
    if row <= 0:
        raise ValueError(f"max_len must be positive, got {row}")
    return float(np.minimum(arr, row).sum()) / (arr.size * row)


@dataclass(frozen=True)
class PackingReport:
    """Side-by-side packed vs pad-to-max statistics for one length distribution."""

    num_samples: int
    seq_length: int
    num_packs: int
    packed_efficiency: float
    pad_to_max_len: int
    pad_to_max_efficiency: float

    @property
    def row_reduction(self) -> float:
        """How many fewer rows packing needs than pad-to-max (``num_samples / num_packs``)."""
        return self.num_samples / self.num_packs


def packing_report(
    lengths: Sequence[int] | np.ndarray,
    seq_length: int,
    *,
    window: Optional[int] = DEFAULT_PACKING_WINDOW,
    overlong: OverlongPolicy = "error",
) -> PackingReport:
    """Pack ``lengths`` and compare against padding every sample to the longest one."""
    arr = np.asarray(lengths, dtype=np.int64)
    packs = pack_samples(arr, seq_length, overlong=overlong, window=window)
    return PackingReport(
        num_samples=int(arr.size),
        seq_length=seq_length,
        num_packs=len(packs),
        packed_efficiency=packing_efficiency(packs, seq_length),
        pad_to_max_len=int(arr.max()),
        pad_to_max_efficiency=pad_to_max_efficiency(arr),
    )
