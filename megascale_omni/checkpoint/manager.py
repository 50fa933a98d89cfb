"""The Checkpointer: save (async, triggered, two-tier, atomic) and resume.

Lifecycle, all on every rank of the job; ``state`` is the
:class:`~megascale_omni.checkpoint.train_state.TrainState`::

    ckpt = Checkpointer(cfg.checkpoint, run_dir)
    ckpt.resume(state)                    # newest complete checkpoint, if any
    loop:
        train one step
        if ckpt.at_step_boundary(state):  # triggers agreed; may save
            break                         # SIGTERM: saved, stop
    ckpt.finish(state, save=True)         # final save, wait for writes

With ``checkpoint.dir`` unset the Checkpointer is disabled: every method is a
no-op (``request`` raises), so the loop calls it unconditionally.

A save blocks training for building the state dict, megatron's planning
(cached from the third save on) and the host copy into buffers allocated
once (:mod:`~megascale_omni.checkpoint.staging`); the writer thread writes
the files; at a later step boundary every rank runs megatron's collective
finalisers; then rank 0's committer thread writes the run's Hugging Face
tokenizer and processor files into the step directory
(:mod:`~megascale_omni.checkpoint.hf_assets`), hashes the files, publishes
``commit.json``, replicates the fast tier to the persistent tier and prunes
old checkpoints.
The next save waits for the previous one's files to be written and
finalised (its staging buffers are reused), not for its commit: commits
run in save order on the one committer thread, and pruning never touches
a save newer than the newest committed one.
"""

from __future__ import annotations

import datetime
import errno
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megascale_omni.checkpoint import layout
from megascale_omni.checkpoint.errors import CheckpointError
from megascale_omni.checkpoint.hf_assets import ASSET_DIR, HFAssets
from megascale_omni.checkpoint.save_strategy import SaveStrategy
from megascale_omni.checkpoint.staging import HostStaging
from megascale_omni.checkpoint.state import DIST_OPT_FORMAT, describe_layout, incompatibilities, shape_mismatches
from megascale_omni.checkpoint.train_state import TrainState
from megascale_omni.checkpoint.triggers import Triggers
from megascale_omni.checkpoint.write_workers import WriteWorkers
from megascale_omni.checkpoint.writer import AsyncWriter, InflightSave, prepare_request, storage_error
from megascale_omni.config import CheckpointConfig, ConfigError
from megascale_omni.metrics.writers import JsonlWriter

logger = logging.getLogger(__name__)

#: How long ranks wait for each other before saving after a failed step.
FAILURE_BARRIER_S = 30.0


class Checkpointer:
    """Owns the writer, the triggers and the tiers of one job (every rank).

    ``shared=True`` is for elastic jobs, whose replica groups share the
    checkpoint directories: only the group for which ``writer()`` returns
    True saves (the replica membership's predicate: participant rank 0 of
    the last quorum; same answer on every rank of a group), and no group
    deletes another's unfinished save directory.
    """

    def __init__(self, cfg: CheckpointConfig, run_dir: str, shared: bool = False,
                 writer: Callable[[], bool] = lambda: True):
        self.cfg = cfg
        self.enabled = cfg.enabled
        self.shared = shared
        #: Whether this replica group saves at the current step boundary (same on its ranks).
        self.writes: Callable[[], bool] = lambda: self.enabled and writer()
        if not self.enabled:
            return
        self.tiers: list[tuple[str, str]] = ([("local", cfg.local_dir)] if cfg.local_dir else []) + [
            ("persistent", cfg.dir)
        ]
        self.save_tier, self.save_root = self.tiers[0][0], Path(self.tiers[0][1])
        self.rank = dist.get_rank()
        # Flags, decisions and failure barriers run on gloo whatever the
        # training backend: host tensors, and monitored_barrier needs gloo.
        self.group = dist.new_group(backend="gloo")
        self.triggers = Triggers(cfg.interval, cfg.interval_minutes, self.group, cfg.signal_coalesce_s)
        self.triggers.install_signal_handlers()
        #: Host buffers of the tensors this rank writes, reused by every save.
        self.staging = HostStaging()
        # One writer process (megatron writes one bucket per rank here, see
        # save_strategy) when async saves can hand it shared-memory buffers,
        # started before the first of them; otherwise every write runs in this process.
        self.writer = AsyncWriter(WriteWorkers(1 if cfg.async_save and not self.staging.pin else 0))
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit")
        #: (step, commit) submitted to the committer thread and not yet collected (rank 0), oldest first.
        self._commits: list[tuple[int, Future]] = []
        #: megatron's strategy, kept across saves for its cached plan and save split.
        self.strategy = SaveStrategy(self.group)
        # Buffers are reserved ahead of time only for periodic async saves;
        # a requested save allocates them itself.
        self._periodic_async = cfg.async_save and bool(cfg.interval or cfg.interval_minutes)
        self._reserved = False
        #: One record per committed save (rank 0): step, reason, blocking_s, total_s, bytes, phases.
        self.saves: list[dict] = []
        #: Saves abandoned because a rank could not write (every rank) or rank 0 could not commit.
        self.failed_saves = 0
        # Written by the committer thread only (one writer per file).
        self._log = JsonlWriter(os.path.join(run_dir, "checkpoints.jsonl")) if self.rank == 0 else None

    # --------------------------------------------------------------- resume
    def resume(self, state: TrainState) -> Optional[Path]:
        """Load the newest loadable checkpoint into ``state`` (every rank).

        Returns the directory loaded, or None for a fresh start (or when
        disabled). Raises CheckpointError when checkpoints exist but none is
        intact, and ConfigError when the model no longer matches them.
        """
        if not self.enabled:
            return None
        if self.rank == 0 and not self.shared:  # shared: another group may be writing
            for tier, root in self.tiers:
                for step in layout.remove_incomplete(root, tier):
                    logger.warning("removed incomplete checkpoint %s/step %d (a save that never finished)", root, step)
        if self.cfg.resume == "none":
            return None
        payload: list = [None]
        if self.rank == 0:
            try:
                path, error = self._choose(state)
            except (CheckpointError, ConfigError) as e:
                path, error = None, e
            payload = [(path, _portable(error))]
        dist.broadcast_object_list(payload, src=0, group=self.group)
        path, error = payload[0]
        if error is not None:
            raise _rebuild(error)
        if path is None:
            logger.info("no checkpoint under %s; starting from step 0", " or ".join(r for _, r in self.tiers))
            return None
        self._load(state, Path(path))
        return Path(path)

    def _choose(self, state: TrainState) -> tuple[Optional[str], Optional[Exception]]:
        """Rank 0: the newest checkpoint that verifies and matches the model
        and the sample plan (:meth:`TrainState.check_resume`)."""
        if self.cfg.resume != "auto":
            info = _info_for(Path(self.cfg.resume))
            problems = layout.verify(info, self.cfg.verify_checksums)
            if problems:
                return None, CheckpointError(f"checkpoint.resume={self.cfg.resume} is broken: " + "; ".join(problems))
            candidates = [info]
        else:
            candidates = layout.newest_complete(self.tiers)
        info, rejected = layout.first_intact(candidates, self.cfg.verify_checksums)
        if info is None:
            if rejected:
                return None, CheckpointError(
                    "no intact checkpoint to resume from: " + " | ".join(rejected)
                    + ". Repair or remove them, or start fresh with checkpoint.resume=none"
                )
            return None, None
        common = dist_checkpointing.load_common_state_dict(str(info.path))
        diffs = incompatibilities(common.get("config", {}), state.cfg)
        if diffs:
            return None, ConfigError(
                "checkpoint.resume", str(info.path),
                "the model differs from this checkpoint (" + "; ".join(diffs) + "): restore those settings, "
                "point checkpoint.dir elsewhere, or start fresh with checkpoint.resume=none",
            )
        try:
            state.check_resume(common)  # the same sample plan for the remaining steps
        except ConfigError as e:
            return None, e
        return str(info.path), None

    def _load(self, state: TrainState, path: Path) -> None:
        t0 = time.perf_counter()
        common = dist_checkpointing.load_common_state_dict(str(path))
        saved_layout = common.get("layout", {})
        now = state.layout()
        # Layouts saved before expert parallelism existed had none (ep 1).
        saved_ep = saved_layout.get("ep", 1)
        same_mp = all(saved_layout.get(k, saved_ep if k == "ep" else None) == now[k] for k in ("tp", "pp", "ep"))
        # Written before the format was recorded: megatron's bucket-space dp_reshardable.
        opt_format = common.get("dist_opt_format", DIST_OPT_FORMAT)
        if saved_ep != now["ep"] and state.cfg.parallel.use_distributed_optimizer and opt_format == DIST_OPT_FORMAT:
            # Its expert state is flattened per EP rank's buffer.
            raise ConfigError(
                "parallel.ep", now["ep"],
                f"{path} holds distributed-optimizer state of expert buffers laid out for ep={saved_ep}; resume "
                f"with parallel.ep={saved_ep} (the regular optimizer's checkpoints load under any ep)",
            )
        template = state.sharded_state_dict(is_loading=True, include_rng=same_mp, opt_format=opt_format)
        # Model and task tensors (e.g. EMA weights) must exist with the same
        # global shapes; optimizer keys follow the model's.
        checked = {k: v for k, v in template.items() if k.startswith("model") or k == "task"}
        mismatches = shape_mismatches(checked, dist_checkpointing.load_tensors_metadata(str(path)))
        bad = torch.tensor([int(bool(mismatches))])
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        if bad.item():
            raise ConfigError(
                "checkpoint.resume", str(path),
                "model or task tensors differ from the checkpoint ("
                + ("; ".join(mismatches[:8]) if mismatches else "on another rank") + ")",
            )
        loaded = dist_checkpointing.load(template, str(path))
        state.load_sharded_state_dict(loaded)
        # A checkpoint written before its run carried tokenizer files keeps
        # those of checkpoint.pretrained, if any.
        assets = HFAssets.from_checkpoint(path, layout.step_info(path).commit)
        state.hf_assets = assets if assets.enabled else state.hf_assets
        logger.info(
            "resumed from %s at step %d in %.2f s (saved with %s, now %s%s)",
            path, state.step, time.perf_counter() - t0, describe_layout(saved_layout), describe_layout(now),
            "" if same_mp else "; RNG state not restored across a tp/pp/ep change",
        )

    # ----------------------------------------------------------------- save
    def request(self, reason: str = "api") -> None:
        """Public API: save at the next step boundary (thread-safe, any rank)."""
        if not self.enabled:
            raise CheckpointError("checkpointing is disabled: set checkpoint.dir to enable it")
        self.triggers.request(reason)

    def at_step_boundary(self, state: TrainState) -> bool:
        """Agree on triggers, finish a completed write, maybe save (every rank).
        Returns True when training must stop (SIGTERM; the state is saved)."""
        if not self.enabled:
            return False
        decision = self.triggers.agree(state.step, writer_busy=not self.writer.done_locally())
        if self.writer.inflight is not None and not decision.writer_busy:
            self._finalize()
        saving = bool(decision.save_reason) and self.writes()
        if saving:
            self.save(state, decision.save_reason, wait=decision.stop)
        elif decision.save_reason:
            # Restart the wall-clock timer as if saved: otherwise a due timer
            # fires (and logs) at every step of a group that never writes.
            self.triggers.saved()
            if decision.save_reason != "interval":
                logger.info("checkpoint (%s) at step %d: another replica group writes the shared checkpoints",
                            decision.save_reason, state.step)
        elif self._periodic_async and not self._reserved and state.step > 0 and self.writes():
            self._reserve(state)
        if decision.stop and saving:
            logger.warning("SIGTERM: checkpoint at step %d written; stopping", state.step)
        elif decision.stop:
            logger.warning("SIGTERM: stopping at step %d (another replica group writes the checkpoints)", state.step)
        return decision.stop

    def save(self, state: TrainState, reason: str, wait: bool = False) -> None:
        """Save ``state`` at its current step (every rank).

        Blocks for the host copy and planning only, unless ``wait`` or
        ``checkpoint.async_save=false``; then returns after the commit.
        """
        if not self.enabled:
            return
        t_request = time.perf_counter()
        self._wait_written()  # at most one save writing: the staging buffers are reused
        t0 = time.perf_counter()
        waited = t0 - t_request
        if waited > 0.01:
            logger.info("checkpoint: waited %.2f s for the previous save's files", waited)
        step = state.step
        if any(pending == step for pending, _ in self._commits):
            self.wait()  # the same step again (e.g. the final save): decide once it is committed
        target = self.save_root / layout.step_dir_name(step)
        skip = [self._prepare_target(target, step) if self.rank == 0 else None]
        dist.broadcast_object_list(skip, src=0, group=self.group)
        if skip[0] is True:
            logger.info("checkpoint for step %d already committed; not saving again", step)
            return
        if skip[0]:  # rank 0 could not create the step directory
            self.triggers.saved()
            self._abandon(step, [skip[0]])
            return
        synchronous = wait or not self.cfg.async_save
        clock = _PhaseClock(t0 - waited, wait=waited)
        clock.lap("target")
        state.sync_params()
        snapshot = state.sharded_state_dict()
        clock.lap("state_dict")
        strategy, validate = self.strategy.prepare(snapshot)
        clock.lap("split")
        # A synchronous save writes the live tensors: training waits for it.
        staged = 0 if synchronous else self.staging.stage(snapshot)
        if not synchronous:
            self.writer.files.start()
        self._reserved = self._reserved or not synchronous
        clock.lap("host_copy")
        request = dist_checkpointing.save(
            snapshot, str(target), sharded_strategy=strategy, async_sharded_save=True,
            validate_access_integrity=validate,
        )
        request = prepare_request(request)
        clock.lap("plan")
        blocking_s = waited + time.perf_counter() - t0
        meta = {"layout": state.layout(), "mode": "sync" if synchronous else "async"}
        self.writer.submit(step, reason, request, started=t0, blocking_s=blocking_s, meta=meta, phases=clock.phases,
                           assets=state.hf_assets)
        self.triggers.saved()
        if not synchronous:
            logger.info(
                "checkpoint step %d (%s): training blocked %.3f s (host copy of %.1f MB on this rank); "
                "writing in background", step, reason, blocking_s, staged / 2**20,
            )
            return
        self.wait()

    def _reserve(self, state: TrainState) -> None:
        """Plan the save split and allocate the staging buffers ahead of the
        first async save (every rank of a writing group, once, after a step:
        Adam state exists). The buffers fill on a background thread."""
        snapshot = state.sharded_state_dict()
        self.strategy.prepare(snapshot, saving=False)
        self.staging.reserve(snapshot)
        self.writer.files.start()  # its interpreter starts while the buffers fill
        self._reserved = True

    def _prepare_target(self, target: Path, step: int) -> bool | str:
        """Rank 0: True if ``step`` is already committed; else an empty
        ``target`` and False, or why it could not be made (an ``OSError``)."""
        for tier, root in self.tiers:
            if any(c.step == step and c.complete for c in layout.scan_tier(root, tier)):
                return True
        try:
            if target.exists():
                layout.remove(layout.CheckpointInfo(target, step, self.save_tier))
            target.mkdir(parents=True)
        except OSError as e:
            return _describe_failure(self.rank, e)
        return False

    def wait(self) -> None:
        """Block until every save so far is committed (every rank)."""
        if not self.enabled:
            return
        self._wait_written()
        while self._commits:
            self._commits.pop(0)[1].result()

    def _wait_written(self) -> None:
        """Block until the in-flight save's files are written and finalised
        (every rank; collective). Its commit may still be running; a commit
        that failed since the last call raises here."""
        if self.writer.inflight is not None:
            self.writer.wait_locally()
            self._finalize()
        while self._commits and self._commits[0][1].done():
            self._commits.pop(0)[1].result()

    def _finalize(self) -> None:
        """Finalise the in-flight save if every rank wrote its files, else
        abandon it (every rank; collective)."""
        failures = self._agree_failures(storage_error(self.writer.local_error(), self.save_root))
        if failures:
            self._abandon(self.writer.abandon().step, failures)
            return
        save = self.writer.finalize()
        if self.rank == 0:
            self._commits.append((save.step, self._committer.submit(self._publish, save)))

    def _agree_failures(self, error: Optional[BaseException]) -> list[str]:
        """Every rank's write failures, the same list on every rank (collective:
        one flag all-reduce; the descriptions are gathered only on a failure).

        A write that failed for lack of space or any other ``OSError`` is
        abandoned (see :meth:`_abandon`); any other exception is a bug and
        raises CheckpointError on every rank, failing the job."""
        failed = torch.tensor([int(error is not None)])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
        if not failed.item():
            return []
        gathered: list = [None] * dist.get_world_size(self.group)
        mine = None if error is None else (isinstance(error, OSError), _describe_failure(self.rank, error))
        dist.all_gather_object(gathered, mine, group=self.group)
        reports = [g for g in gathered if g is not None]
        if not all(is_os for is_os, _ in reports):
            raise CheckpointError("writing a checkpoint failed: " + "; ".join(text for _, text in reports))
        return [text for _, text in reports]

    def _abandon(self, step: int, failures: list[str]) -> None:
        """Give up the save of ``step`` that some rank could not write (every
        rank, after agreeing; or rank 0 alone when its commit failed): its
        marker is never written, so resume and ``tools/ckpt.py verify`` never
        pick it and the last committed checkpoint stays the newest; rank 0
        removes its files. Training goes on; the next save tries again."""
        self.failed_saves += 1
        path = self.save_root / layout.step_dir_name(step)
        logger.error(
            "checkpoint step %d abandoned, not committed (%d failed save(s) so far): %s in %s; free space there "
            "or point checkpoint.%s elsewhere; training goes on, the newest committed checkpoint stays the "
            "resume point and the next save tries again",
            step, self.failed_saves, "; ".join(failures), self.save_root,
            "local_dir" if self.save_tier == "local" else "dir",
        )
        if self.rank == 0:
            try:
                layout.remove(layout.CheckpointInfo(path, step, self.save_tier))
            except OSError as e:  # left without a marker: readers skip it, resume's clean-up removes it
                logger.warning("could not remove the abandoned %s: %s", path, e)

    def _publish(self, save: InflightSave) -> None:
        """Rank 0, committer thread: tokenizer files, checksum, commit marker, replicate, prune."""
        path = self.save_root / layout.step_dir_name(save.step)
        try:
            save.assets.write(path / ASSET_DIR, durable=True)
            commit = layout.write_commit(path, save.step, {"reason": save.reason, **save.meta})
        except OSError as e:  # e.g. ENOSPC: the marker is written atomically or not at all
            self._abandon(save.step, [_describe_failure(self.rank, e) + " (committing)"])
            return
        info = layout.CheckpointInfo(path, save.step, self.save_tier, commit)
        total_s = time.perf_counter() - save.started
        # A synchronous save blocks training until its commit.
        blocking_s = total_s if save.meta.get("mode") == "sync" else save.blocking_s
        record = {
            "step": save.step, "reason": save.reason, "mode": save.meta.get("mode"), "blocking_s": blocking_s,
            "total_s": total_s, "bytes": info.size_bytes, "path": str(path), "phases": save.phases,
        }
        logger.info(
            "checkpoint step %d committed: %s, %.1f MB, blocked %.3f s, total %.2f s",
            save.step, path, info.size_bytes / 2**20, blocking_s, total_s,
        )
        for tier, root in self.tiers[1:]:
            t0 = time.perf_counter()
            layout.replicate(info, root, tier)
            record["replicated_s"] = time.perf_counter() - t0
            logger.info("checkpoint step %d replicated to %s in %.2f s", save.step, root, record["replicated_s"])
        for tier, root in self.tiers:
            removed = layout.prune(root, tier, self.cfg.keep_last, remove_abandoned=not self.shared)
            if removed:
                logger.info("pruned %s checkpoints %s (keep_last=%d)", tier, removed, self.cfg.keep_last)
        self.saves.append(record)
        if self._log is not None:
            self._log.write(record)

    # ------------------------------------------------------------- failures
    def save_after_failure(self, state: TrainState, exc: BaseException, optimizer_started: bool) -> bool:
        """Save the last good state after ``exc`` escaped a training step.

        The state is the one before the failing step, so nothing is saved if
        the optimizer had started updating. Every rank must reach this call
        within FAILURE_BARRIER_S; otherwise (a failure on some ranks only,
        the rest blocked in a collective) nothing is saved. Returns True if saved.
        """
        if not self.enabled:
            return False
        if optimizer_started:
            logger.error("step failed inside the optimizer update (%s); state is mixed, not saving", exc)
            return False
        if self.shared:
            logger.error("step failed (%s); elastic: the other replica groups carry on and keep checkpointing", exc)
            return False
        try:
            dist.monitored_barrier(
                group=self.group, timeout=datetime.timedelta(seconds=FAILURE_BARRIER_S), wait_all_ranks=True
            )
        except RuntimeError as err:
            logger.error("not every rank failed at this step (%s); not saving", err)
            return False
        logger.error("step %d failed (%s: %s); saving the state after step %d", state.step + 1,
                     type(exc).__name__, exc, state.step)
        self.save(state, "failure", wait=True)
        return True

    def finish(self, state: TrainState, save: bool) -> None:
        """Optionally save the final state, then wait for every write (every rank)."""
        if save and self.writes():
            self.save(state, "end", wait=True)
        self.wait()

    def close(self) -> None:
        if not self.enabled:
            return
        self.triggers.restore_signal_handlers()
        self.writer.close()
        self._committer.shutdown(wait=True)
        if self._log is not None:
            self._log.close()


class _PhaseClock:
    """Seconds spent in each blocking phase of one save (``lap`` after each)."""

    def __init__(self, start: float, **phases: float):
        self.phases = dict(phases)
        self._last = start + sum(phases.values())

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self._last
        self._last = now


def _describe_failure(rank: int, e: BaseException) -> str:
    """One rank's write failure in a log line: its errno's name for an OSError."""
    if isinstance(e, OSError) and e.errno is not None:
        where = f" writing {e.filename}" if e.filename else ""
        return f"rank {rank}: {errno.errorcode.get(e.errno, e.errno)} ({e.strerror}){where}"
    return f"rank {rank}: {type(e).__name__}: {e}"


def _portable(e: Optional[Exception]) -> Optional[tuple]:
    """An error as plain data for broadcast_object_list (ConfigError's
    constructor does not survive pickle's default reconstruction)."""
    if e is None:
        return None
    if isinstance(e, ConfigError):
        return ("config", (e.field, e.value, e.hint))
    return ("checkpoint", (str(e),))


def _rebuild(portable: tuple) -> Exception:
    kind, args = portable
    return ConfigError(*args) if kind == "config" else CheckpointError(*args)


def _info_for(path: Path) -> layout.CheckpointInfo:
    info = layout.step_info(path)
    if info is None:
        # Validation refused it at start; it vanished or changed since.
        raise CheckpointError(f"checkpoint.resume={path} is not a checkpoint directory (expected <dir>/step_NNNNNNNN)")
    return info
