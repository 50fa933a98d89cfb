"""The Task base: what a model family plugs into the training loop, and the
plumbing every family shares.

A task is built on every rank (:meth:`megascale_omni.tasks.registry.ModelFamily.build_task`)
and owns the family's model builder, its data (a step-indexed plan: the
global batch of step ``s`` is a pure function of (seed, s)), its loss and its
evaluation. The loop in :mod:`megascale_omni.training` calls the methods
below and nothing else; optional hooks have no-op defaults here, so nobody
probes for them.

Shared plumbing: dataset and tokenizer resolution (:func:`resolve_dataset_root`,
:func:`load_tokenizer`), job-wide bad-sample accounting
(:class:`BadSampleAccount`) and the forward-only pass used by evaluations
(:meth:`Task.forward_only`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megascale_omni.config import ConfigError, JobConfig
from megascale_omni.data.health import SkipCounter, check_bad_fraction
from megascale_omni.data.tokenizer import TextTokenizer
from megascale_omni.parallel import ParallelDims
from megascale_omni.parallel.batch_shape import BatchShape
from megascale_omni.parallel.schedules import run_forward_backward
from megascale_omni.platform import Platform


class Task(ABC):
    """Base of every model family's task (every rank).

    Subclasses set :attr:`seq_length` and implement :meth:`build_model`,
    :meth:`forward_step`, :meth:`microbatches` and
    :meth:`global_batch_size_of`; the rest is optional.
    """

    #: Tokens per sequence as seen by the pipeline (the p2p tensor length).
    seq_length: int
    #: Vocabulary rows the language model was built with when the task
    #: resolved them (LLaVA's ``model.vocab_size: 0`` takes the tokenizer's);
    #: 0: ``model.vocab_size``. The step record's model FLOPs count with it.
    vocab_size: int = 0
    #: Job-wide bad-sample totals; families that read samples set one (and
    #: update it in :meth:`microbatches`), elastic jobs sum it across replicas.
    bad_samples: Optional["BadSampleAccount"] = None

    def __init__(self, cfg: JobConfig, platform: Platform, dims: ParallelDims):
        self.cfg = cfg
        self.platform = platform
        self.dims = dims
        self.dtype = platform.default_dtype(cfg.train.precision)

    # ------------------------------------------------------------ required
    @abstractmethod
    def build_model(self) -> list[torch.nn.Module]:
        """This rank's model chunks (``vpp`` of them when interleaved)."""

    @abstractmethod
    def forward_step(self, data_iterator: Any, model: torch.nn.Module) -> tuple[Any, Callable]:
        """megatron ``forward_step_func``: returns (output, loss_func)."""

    @abstractmethod
    def microbatches(self, step: int, dp_rank: int, dp_size: int) -> list[dict]:
        """DP rank ``dp_rank``'s share of global batch ``step``, as micro-batches
        (every rank; all TP/PP ranks of a replica build the same ones)."""

    @abstractmethod
    def global_batch_size_of(self, step: int) -> tuple[int, int]:
        """(samples, non-padding tokens) in global batch ``step`` over all DP
        ranks, for throughput reporting."""

    # ------------------------------------------------------ optional hooks
    def images_of(self, step: int) -> Optional[int]:
        """Images in global batch ``step`` (None: a text-only family)."""
        return None

    def batch_shape(self, step: int) -> Optional[BatchShape]:
        """What global batch ``step`` holds (all DP ranks), for its model FLOPs
        (:class:`megascale_omni.metrics.flops.StepFlops`); None: not counted."""
        return None

    def sample_ids(self, step: int, dp_rank: int, dp_size: int) -> list[int]:
        """Dataset ids in ``microbatches(step, dp_rank, dp_size)``, for the
        elastic sample ledger. Families that support elastic jobs implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not report sample ids (elastic.ledger_dir)")

    #: :meth:`after_step` reads the weights (the Trainer completes a pending
    #: parameter gather first, ``parallel.overlap_param_gather``).
    reads_weights_after_step: bool = False

    def after_step(self, step: int) -> None:
        """Called on every rank after each committed optimizer step; ``step``
        already counts it (e.g. DiT's EMA update)."""

    def evaluate(self, chunks: Sequence[torch.nn.Module], step: int) -> Optional[dict[str, float]]:
        """Held-out evaluation of ``chunks`` after ``step`` steps (every rank);
        metrics on the loss rank, None elsewhere or when there is nothing to evaluate."""
        return None

    def lr_mult(self) -> dict[str, float]:
        """Learning-rate factors by parameter-name pattern (fnmatch) for
        :func:`~megascale_omni.training.optimizer.build_optimizer` (every rank)."""
        return {}

    def data_stats(self) -> dict[str, float]:
        """Cumulative data-health counters for the step record."""
        return {}

    def data_identity(self) -> dict[str, dict]:
        """Content digests of the data the training plan is built from
        (:mod:`megascale_omni.data.identity`), compared before a replica group
        joins an elastic job. Computed at construction from what was already
        read: no I/O here (torchft's quorum thread calls it). Empty: nothing
        beyond the config decides the samples."""
        return {}

    def state_dict(self, sharded: bool) -> dict:
        """The task's own state (data counters, EMA weights, ...), the same on
        every call. ``sharded``: for a checkpoint, where tensors that are split
        like the model are megatron ShardedTensors; else plain tensors of this
        rank (a joining replica's same rank receives them). The data position
        is not here: it is the step."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Inverse of :meth:`state_dict` (loaded tensors are in this rank's layout)."""

    def pipeline_shape(self) -> tuple[int, int]:
        """``(seq_length, micro_batch_size)`` for megatron's schedules, which
        size the p2p buffers between stages ``[seq, batch, hidden]``: rows of
        :attr:`seq_length` by default. Language-model families override it
        for THD micro-batches (:func:`megascale_omni.models.attention.thd_pipeline_shape`)."""
        return self.seq_length, self.cfg.train.micro_batch_size

    def close(self) -> None:
        """Release background resources (data loader workers); every rank, once,
        at teardown after training or a failure."""

    # ------------------------------------------------------- shared helpers
    def padded_vocab_size(self, vocab: int) -> int:
        return self.cfg.model.padded_vocab_size(vocab)

    def cp_local(self, batch: dict) -> dict:
        """This CP rank's share of a THD micro-batch (``batch`` itself without
        CP; see :func:`megascale_omni.models.attention.cp_shard_batch`)."""
        if self.dims.cp == 1:
            return batch
        from megatron.core import parallel_state as mpu

        from megascale_omni.models.attention import cp_shard_batch

        return cp_shard_batch(batch, self.dims.cp, mpu.get_context_parallel_rank())

    def forward_only(
        self, chunks: Sequence[torch.nn.Module], forward_step: Callable, microbatches: Sequence[dict]
    ) -> list[dict]:
        """Run ``forward_step`` over ``microbatches`` without gradients through
        the pipeline schedule, in eval mode (every rank of the replica).
        Returns the last stage's loss reports."""
        for chunk in chunks:
            chunk.eval()
        try:
            with torch.no_grad():
                return run_forward_backward(
                    chunks, forward_step, microbatches, *self.pipeline_shape(), forward_only=True,
                )
        finally:
            for chunk in chunks:
                chunk.train()


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


def resolve_dataset_root(cfg: JobConfig, build_default: Callable[[JobConfig], Path], how_to_make: str) -> Path:
    """The dataset directory (every rank): ``data.path``, which must have a
    ``train/`` split, or the embedded default built on first use by
    ``build_default(cfg)`` when ``data.path`` is null."""
    if cfg.data.path is None:
        return Path(build_default(cfg))
    root = Path(cfg.data.path)
    if not (root / "train").is_dir():
        raise ConfigError(
            "data.path", str(root),
            f"has no train/ split; build one with {how_to_make} or set data.path: null for the embedded default",
        )
    return root


def load_tokenizer(cfg: JobConfig, root: Path) -> TextTokenizer:
    """``data.tokenizer``, or ``<root>/tokenizer.json`` beside the shards.

    Raises ConfigError (exit 2) when the path does not exist or is a
    directory without a tokenizer, DataFileError (exit 3) when the file is
    not a usable tokenizer."""
    path = Path(cfg.data.tokenizer) if cfg.data.tokenizer else root / "tokenizer.json"
    if not path.exists():
        raise ConfigError("data.tokenizer", str(path), "does not exist; point it at a tokenizer.json or directory")
    try:
        return TextTokenizer.from_path(path)
    except FileNotFoundError as err:  # a directory without a tokenizer in it: a wrong path
        raise ConfigError("data.tokenizer", str(path), str(err)) from None
