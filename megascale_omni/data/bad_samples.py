"""Job-wide bad-sample accounting of a training data module (every rank).

:class:`BadSampleAccount` sums what the readers skipped over the replica
group each step (and across replica groups in an elastic job) and stops the
run past ``data.max_bad_sample_fraction``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from megascale_omni.config import JobConfig
from megascale_omni.data.health import SkipCounter, check_bad_fraction
from megascale_omni.parallel import ParallelDims


class BadSampleAccount:
    """Job-wide bad-sample totals of one task, checkpointed with it.

    ``excluded`` counts samples dropped while the plan was built (the same on
    every rank: a pure function of the data); ``skipped`` and ``seen`` count
    what the readers skipped and read in committed steps, over the whole job.
    Both are reported together as ``skipped_samples`` (:meth:`stats`).

    Per step, :meth:`update` starts reducing what this rank's readers counted
    since the last call over the replica group, without waiting for the other
    ranks (the data wait of a step is then its reading alone, not the skew
    between ranks); :meth:`settle` completes it into :attr:`attempt` (this
    replica's share of the step). A fixed replica group settles after the
    step's compute and commits at once. In an
    elastic job (:attr:`job_wide`) the shares of every participant are summed
    across replica groups with the step's gradients and committed only when
    the quorum commits the step (:meth:`commit`); an attempt that does not
    commit is dropped (:meth:`abandon`) and counted again when retried.
    The run stops past ``data.max_bad_sample_fraction`` (read at every check,
    so ``omni-ctl config set`` applies at once).
    """

    def __init__(self, cfg: JobConfig, dims: ParallelDims, device: torch.device = torch.device("cpu")):
        self.data_cfg = cfg.data
        self.dims = dims
        #: Where the per-step reduction runs (the process group's device: CUDA under NCCL).
        self.device = device
        self.counter = SkipCounter()
        self.skipped = 0
        self.seen = 0
        self.excluded = 0
        #: ``[skipped, seen]`` of this replica in the step being attempted (float64, same on its ranks).
        self.attempt = torch.zeros(2, dtype=torch.float64)
        #: Set by elastic jobs: commit only job-wide sums, at the quorum's commit.
        self.job_wide = False
        self._reduced = (0, 0)
        # The reduction update() started and settle() completes: (work, counts).
        self._pending: Optional[tuple[Any, torch.Tensor]] = None

    @property
    def limit(self) -> float:
        return self.data_cfg.max_bad_sample_fraction

    def exclude(self, bad: int, scanned: int, where: str) -> None:
        """Samples dropped while scanning ``where`` (every rank, same counts)."""
        self.excluded += bad
        check_bad_fraction(bad, scanned, self.limit, f"scanning {where}")

    def update(self) -> None:
        """Start reducing this rank's new skip counts over the replica group
        (every rank of the replica group, in the same order: a collective
        launched asynchronously); :meth:`settle` completes it."""
        self.settle()  # at most one reduction in flight
        now = (self.counter.skipped, self.counter.seen + self.counter.skipped)
        delta = torch.tensor([now[0] - self._reduced[0], now[1] - self._reduced[1]], dtype=torch.float64,
                             device=self.device)
        self._reduced = now
        self._pending = (dist.all_reduce(delta, async_op=True), delta)

    def settle(self) -> None:
        """Complete the reduction :meth:`update` started: add it to
        :attr:`attempt` and commit unless :attr:`job_wide` (every rank of the
        replica group; waits for its other ranks; no-op when none is pending).

        Raises:
            DataQualityError: past ``data.max_bad_sample_fraction`` (on every
                rank of the job together: the counts are the same everywhere).
        """
        if self._pending is None:
            return
        work, delta = self._pending
        self._pending = None
        work.wait()
        # Every TP/PP/CP rank of a replica counts the same samples (read there, or
        # counted by the rank that read and broadcast them).
        self.attempt += torch.div(delta.cpu(), self.dims.tp * self.dims.pp * self.dims.cp, rounding_mode="floor")
        if not self.job_wide:
            self.commit(self.attempt)

    def abandon(self) -> None:
        """Drop the counts of an attempt that was not committed (every rank)."""
        if self._pending is not None:
            self._pending[0].wait()  # the collective completes; its counts go with the attempt
            self._pending = None
        self.attempt.zero_()

    def commit(self, counts: torch.Tensor) -> None:
        """Add ``counts`` (``[skipped, seen]``: this replica's :attr:`attempt`,
        or every participant's summed) to the totals and check the limit
        (every rank, same values on every rank of the job)."""
        skipped, seen = (int(c) for c in counts.tolist())
        self.skipped += skipped
        self.seen += seen
        self.attempt.zero_()
        check_bad_fraction(self.skipped, self.seen, self.limit, "training")

    def stats(self) -> dict[str, int]:
        """Counters for the step record (every rank, same values):
        ``skipped_samples`` counts every bad sample, those excluded while
        scanning and those skipped while reading; ``excluded_samples`` is the
        scanned share of it."""
        return {"skipped_samples": self.skipped + self.excluded, "excluded_samples": self.excluded}

    def state_dict(self) -> dict:
        return {"skipped_samples": self.skipped, "seen_samples": self.seen}

    def load_state_dict(self, state: dict) -> None:
        """Job-wide totals of a checkpoint or of a live peer replica."""
        self.skipped, self.seen = int(state.get("skipped_samples", 0)), int(state.get("seen_samples", 0))
