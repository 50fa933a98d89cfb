"""Micro-batches of the next steps, built ahead in worker processes, in plan order.

A task's data is a pure function of the step: ``build(step, dp_rank,
dp_size) -> list[dict]`` (the micro-batches of DP rank ``dp_rank`` of
``dp_size`` at ``step``). :class:`StepLoader` calls it in
``data.num_workers`` worker processes for the steps after the one asked
for, so the training loop finds the next step's micro-batches ready instead
of reading, decoding and collating them between optimizer steps.
``data.num_workers: 0`` calls ``build`` in the training process when asked
(the path every rank took before this module).

Why torch's ``DataLoader`` and not a process pool of our own: its workers
are persistent processes fed through per-worker index queues, return
tensors through shared memory, pin them from a background thread when
asked (``pin_memory``), deliver results in request order, notice a worker
that died (the training process raises instead of hanging) and shut the
workers down; a ``ProcessPoolExecutor`` has none of the tensor transport,
pinning or order bookkeeping. The "dataset" here is indexed by step keys
``(step, dp_rank, dp_size)`` that a small sampler yields from the step asked
for up to ``train.steps``, so the loader's prefetch window is the next steps
in plan order. Workers are started with ``spawn``: nothing of the training
process (gloo sockets, CUDA context, threads) is inherited by a fork.

Correctness rules:

* Every result carries its key. A request whose key is not the one
  prefetched next (an elastic step whose ``dp_size`` changed, a retried
  uncommitted step, a resume) drops the prefetched steps and restarts the
  window at the requested key, so a rank never trains on another key's batch.
* The result is bit-identical to the in-process path: the worker runs the
  same ``build`` on a pickled copy of the same state, and a step's tensors
  come back as views of one buffer (:mod:`~megascale_omni.data.step_buffer`).
* Bad samples: ``build`` counts what it skipped in ``build.counter`` (a
  :class:`~megascale_omni.data.health.SkipCounter`). In a worker that counter
  is a copy, so each result carries the counts of its own build and
  :meth:`StepLoader.get` adds them to the training process's counter when
  the step is handed over (a dropped prefetch is never counted): the task's
  job-wide reduction and ``data.max_bad_sample_fraction`` check see the same
  numbers as in-process.
* A :class:`~megascale_omni.data.errors.DataQualityError` raised in a worker
  (a shard failing its checksum) is returned as a value and raised again in
  the training process with its type and fields, so the entry point still
  exits 3 with one line.

On CUDA, ``pin_memory`` pins the returned tensors for asynchronous copies;
that path is thin and untested here (the development machines are CPU-only).
"""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import Iterator, Optional, Protocol

from torch.utils.data import DataLoader, Dataset, Sampler

from megascale_omni.data.errors import DataQualityError
from megascale_omni.data.health import SkipCounter
from megascale_omni.data.step_buffer import pack_step, unpack_step

logger = logging.getLogger(__name__)

#: (step, dp_rank, dp_size): what one result is the micro-batches of.
StepKey = tuple[int, int, int]


class StepBuilder(Protocol):
    """A picklable pure function of the step key (the task's plan, readers and
    batcher), which counts the samples it read and skipped in ``counter``."""

    counter: SkipCounter

    def __call__(self, step: int, dp_rank: int, dp_size: int) -> list[dict]: ...


class _StepBuilds(Dataset):
    """Worker side: one item per step key (runs in the worker processes)."""

    def __init__(self, build: StepBuilder):
        self.build = build

    def __getitem__(self, key: StepKey) -> dict:
        counter = self.build.counter
        seen, skipped, reasons = counter.seen, counter.skipped, len(counter.reasons)
        try:
            batches, error = self.build(*key), None
        except DataQualityError as err:  # fatal data error: re-raised in the training process
            batches, error = [], err
        # A worker's counter caps its reasons like any SkipCounter; only this build's are sent.
        # The step's tensors travel in one shared-memory buffer (see step_buffer).
        return {
            "key": key, "batches": pack_step(batches), "error": error,
            "seen": counter.seen - seen, "skipped": counter.skipped - skipped,
            "reasons": counter.reasons[reasons:],
        }


class _StepKeys(Sampler):
    """The keys to build, in plan order: ``start``'s step up to ``stop``
    (exclusive) with ``start``'s DP rank and size; none before the first request."""

    def __init__(self, stop: int):
        super().__init__()
        self.start: Optional[StepKey] = None
        self.stop = stop

    def __iter__(self) -> Iterator[StepKey]:
        if self.start is None:
            return iter(())
        step, dp_rank, dp_size = self.start
        return ((s, dp_rank, dp_size) for s in range(step, self.stop))


def _init_worker(level: str, worker_id: int) -> None:
    # A spawned worker starts with no logging set up: give skip warnings the rank prefix.
    from megascale_omni.platform.logging_setup import setup_logging

    setup_logging(level)


class StepLoader:
    """This rank's micro-batches by step, prefetched in plan order (every rank,
    called from the training loop through the task's ``microbatches``).

    Args:
        build: the task's step function (see :class:`StepBuilder`); with
            workers it is pickled once into each worker at start.
        num_workers: worker processes; 0 builds in this process when asked.
        prefetch_steps: steps built ahead of the one being trained, rounded
            up to a multiple of ``num_workers`` (the loader keeps the same
            number of steps in flight on every worker).
        last_step: steps at and past it are not prefetched (``train.steps``);
            a request for one is built in this process.
        pin_memory: pin returned tensors (CUDA only).
        log_level: the workers' logging level (``logging.level``).
    """

    def __init__(self, build: StepBuilder, num_workers: int = 0, prefetch_steps: int = 2, last_step: int = 0,
                 pin_memory: bool = False, log_level: str = "INFO"):
        self.build = build
        self.counter = build.counter
        self.num_workers = num_workers
        self._keys = _StepKeys(last_step)
        self._next: Optional[StepKey] = None
        self._iter = None
        self._loader = None
        if num_workers > 0:
            self._loader = DataLoader(
                _StepBuilds(build), batch_size=None, sampler=self._keys, num_workers=num_workers,
                prefetch_factor=max(1, math.ceil(prefetch_steps / num_workers)), persistent_workers=True,
                pin_memory=pin_memory, multiprocessing_context="spawn",
                worker_init_fn=partial(_init_worker, log_level),
            )
            # Starts the workers now (they boot while the model is built); the
            # sampler yields nothing until the first request sets the window.
            self._iter = iter(self._loader)

    def get(self, step: int, dp_rank: int, dp_size: int) -> list[dict]:
        """The micro-batches of ``build(step, dp_rank, dp_size)``; with workers,
        also moves the prefetch window to the steps after ``step``. Skip
        counts of the build are added to ``build.counter`` here."""
        key = (step, dp_rank, dp_size)
        if self._loader is None or step >= self._keys.stop:
            return self.build(*key)
        if key != self._next:
            if self._next is not None:
                logger.info("data loader: step key %s requested, %s was prefetched; rebuilding from it", key,
                            self._next)
            self._keys.start = key
            self._iter = iter(self._loader)  # waits for the workers' stale builds, then refills from `key`
        item = next(self._iter)
        if tuple(item["key"]) != key:
            raise RuntimeError(f"data loader: got step key {tuple(item['key'])} for {key}")
        self._next = (step + 1, dp_rank, dp_size)
        self.counter.seen += item["seen"]
        self.counter.skipped += item["skipped"]
        self.counter.reasons.extend(item["reasons"][: max(0, 20 - len(self.counter.reasons))])
        if item["error"] is not None:
            raise item["error"]
        return unpack_step(item["batches"])

    def close(self) -> None:
        """Stop the workers and wait for them to exit (every rank, at the end
        of training or on failure; idempotent)."""
        if self._iter is not None:
            # torch has no public close for a persistent-worker loader; this is
            # what the iterator's finaliser runs (stop, join, kill stragglers).
            self._iter._shutdown_workers()
        self._iter = self._loader = None
        self._next = None
