"""The Trainer: set up distributed state, build, then loop.

Reads top to bottom: platform -> process groups -> megatron parallel state ->
task (model + data) -> layout-invariant init -> DDP -> optimizer -> loop.
Model families plug in through :class:`Task`; the loop never branches on them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

from megatron.core import parallel_state as mpu
from megatron.core.transformer.module import MegatronModule

from megascale_omni.checkpoint import CheckpointError
from megascale_omni.checkpoint.manager import Checkpointer
from megascale_omni.config import JobConfig, to_dict, validate_platform
from megascale_omni.control.plane import ControlPlane
from megascale_omni.metrics import MetricSink
from megascale_omni.models.init import init_layout_invariant
from megascale_omni.parallel import ParallelDims, destroy_parallel, initialize_parallel, is_loss_rank
from megascale_omni.parallel.pipeline_plan import format_plan_table, plan_if_needed, resolve_partition
from megascale_omni.platform import Platform, init_distributed, init_platform, seed_everything
from megascale_omni.platform.logging_setup import setup_logging
from megascale_omni.training.optimizer import build_optimizer, wrap_ddp
from megascale_omni.training.faults import injected_fault_step, maybe_fail
from megascale_omni.training.step import StepProgress, StepStats, train_step

if TYPE_CHECKING:
    from megascale_omni.training.elastic import ElasticTrainer

logger = logging.getLogger(__name__)


class Task(Protocol):
    """What a model family provides to the Trainer (built on every rank)."""

    #: Tokens per sequence as seen by the pipeline (the p2p tensor length).
    seq_length: int

    def build_model(self) -> list[MegatronModule]:
        """This rank's model chunks (``vpp`` of them when interleaved)."""

    def forward_step(self, data_iterator: Any, model: MegatronModule) -> tuple[Any, Callable]:
        """megatron ``forward_step_func``: returns (output, loss_func)."""

    def microbatches(self, step: int, dp_rank: int, dp_size: int) -> list[dict]:
        """This DP rank's share of global batch ``step``, as micro-batches."""

    def global_batch_size_of(self, step: int) -> tuple[int, int]:
        """(samples, non-padding tokens) in global batch ``step`` over all DP
        ranks, for throughput reporting."""

    def evaluate(self, trainer: "Trainer") -> Optional[dict[str, float]]:
        """Held-out evaluation (every rank); metrics on the loss rank, else None."""

    def data_stats(self) -> dict[str, float]:
        """Cumulative data-health counters (e.g. skipped samples) for the step record."""

    # Optional, for the elastic sample ledger:
    #   sample_ids(step, dp_rank, dp_size) -> list[int]
    #                                    dataset ids in microbatches(step, dp_rank, dp_size)
    # Optional, for checkpoints (see megascale_omni/checkpoint/state.py):
    #   checkpoint_state() -> dict       the task's state: plain values, or
    #                                    megatron ShardedTensor/ShardedObject
    #                                    (e.g. EMA weights); same on every call
    #   load_checkpoint_state(dict)      the loaded counterpart
    # The data position needs neither: it is the trainer's step.
    # Optional: ``after_step(trainer)``, called on every rank after each
    # optimizer step, with ``trainer.step`` already counting it (e.g. DiT's
    # EMA update). Tasks without it are fine.


TaskFactory = Callable[[JobConfig, Platform, ParallelDims], Task]


class Trainer:
    """Owns the distributed set-up, the model/optimizer and the training loop."""

    def __init__(self, cfg: JobConfig, task_factory: TaskFactory):
        setup_logging(cfg.logging.level)
        self.platform = init_platform()
        validate_platform(cfg, self.platform.is_cuda)
        # Before any process group: an infeasible split exits 2 on every rank.
        self.pipeline_plan = plan_if_needed(
            cfg, cuda=self.platform.is_cuda, world_size=int(os.environ.get("WORLD_SIZE", "1"))
        )
        self.cfg = cfg = resolve_partition(cfg, self.pipeline_plan)
        if self.platform.cpu_patches:
            logger.info("megatron-core CPU mode: %d targeted patches active", len(self.platform.cpu_patches))
        rank, world_size = init_distributed(self.platform)
        self.dims = ParallelDims.from_config(cfg.parallel, world_size)
        initialize_parallel(self.dims, cfg.train.seed)
        seed_everything(cfg.train.seed)
        self.dp_rank = mpu.get_data_parallel_rank()
        self.task = task_factory(cfg, self.platform, self.dims)
        chunks = self.task.build_model()
        n = init_layout_invariant(
            chunks, seed=cfg.train.seed, std=cfg.model.init_method_std, num_layers=cfg.model.num_layers
        )
        total = sum(p.numel() for c in chunks for p in c.parameters())
        trainable = sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)
        logger.info(
            "initialised %d parameter tensors (layout-invariant); parameters on this rank: %d, trainable %d",
            n, total, trainable,
        )
        self.chunks = wrap_ddp(chunks, chunks[0].config, cfg.parallel)
        self.dtype = self.platform.default_dtype(cfg.train.precision)
        self.optimizer, self.scheduler = build_optimizer(self.chunks, cfg.train, cfg.parallel, self.dtype)
        self.step = 0
        self.is_loss_rank = is_loss_rank()
        if self.pipeline_plan is not None and self.dims.pp > 1 and rank == 0:
            logger.info(
                "pipeline partition (%s, %s): layers per chunk %s\n%s", self.pipeline_plan.mode,
                self.pipeline_plan.source, list(self.pipeline_plan.counts), format_plan_table([self.pipeline_plan]),
            )
        self.sink = MetricSink(cfg.logging.output_dir, enabled=self.is_loss_rank, tensorboard=cfg.logging.tensorboard)
        if self.is_loss_rank:
            _write_config(cfg)
        self.history: list[dict] = []
        self._fault_step = injected_fault_step()
        self.checkpointer = (
            Checkpointer(cfg.checkpoint, cfg.logging.output_dir, shared=cfg.elastic.enabled)
            if cfg.checkpoint.enabled else None
        )
        if self.checkpointer is not None:
            self.checkpointer.resume(self)
        # A standby replica group enters the quorum only on `omni-ctl join` (train()).
        self.elastic: Optional[ElasticTrainer] = None
        if cfg.elastic.enabled and not cfg.elastic.standby:
            self._start_elastic()
        self.control = ControlPlane(
            cfg, _layout(self.dims), sends_metrics=self.is_loss_rank,
            checkpoint=self._control_checkpoint if self.checkpointer is not None else None,
            replica_info=self._replica_info if cfg.elastic.enabled else None,
        )

    def _start_elastic(self) -> None:
        from megascale_omni.training.elastic import ElasticTrainer

        self.elastic = ElasticTrainer(self)
        if self.checkpointer is not None:
            # Replica groups share the checkpoint directories; one writes.
            self.checkpointer.writes = self.elastic.is_writer

    def _replica_info(self) -> dict:
        if self.elastic is not None:
            return self.elastic.describe()
        e = self.cfg.elastic
        return {"replica_id": e.replica_id, "lighthouse": e.lighthouse, "standby": True, "pid": os.getpid()}

    def _join_when_told(self) -> bool:
        """Standby replica group: wait for `omni-ctl join`, then enter the
        quorum (every rank). False when drained before joining."""
        # Pay torchft's import (seconds) while standing by, not after `join`.
        from megascale_omni.parallel.elastic import import_torchft

        import_torchft()

        if not self.control.stand_by(self.step):
            logger.info("elastic: drained while standing by; replica %s never joined", self.cfg.elastic.replica_id)
            return False
        t0 = time.perf_counter()
        self._start_elastic()
        logger.info("elastic: replica %s left standby; torchft manager up in %.3f s",
                    self.cfg.elastic.replica_id, time.perf_counter() - t0)
        return True

    def request_checkpoint(self, reason: str = "api") -> None:
        """Save at the next step boundary (thread-safe; e.g. the control socket)."""
        if self.checkpointer is None:
            raise CheckpointError("checkpointing is disabled: set checkpoint.dir to enable it")
        self.checkpointer.request(reason)

    def _control_checkpoint(self, step: int) -> dict:
        # Every rank, at the control boundary just before the checkpointer's.
        self.request_checkpoint("control")
        writer = self.checkpointer is not None and self.checkpointer.writes()
        return {"requested_at_step": step, "dir": self.cfg.checkpoint.dir, "writer": writer}

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict]:
        """Run ``train.steps`` optimizer steps (every rank). Returns per-step
        records on the loss rank (empty elsewhere)."""
        cfg = self.cfg
        if cfg.elastic.enabled and self.elastic is None and not self._join_when_told():
            self.sink.close()
            return self.history
        bar = self._progress_bar()
        stopped = drained = False
        try:
            with _redirect_logging_for(bar):
                while self.step < cfg.train.steps:
                    record = self._guarded_step()
                    if record is None:
                        continue  # elastic step not committed: retry it with the same samples
                    if bar is not None:
                        bar.update(1)
                    if cfg.train.eval_interval and self.step % cfg.train.eval_interval == 0:
                        self._evaluate()
                    # Control commands (pause, drain, config set, checkpoint) apply here on every rank.
                    if not self.control.step_boundary(self.step, record):
                        drained = True
                        break
                    if self.checkpointer is not None and self.checkpointer.at_step_boundary(self):
                        stopped = True
                        break
                if not (stopped or drained) and (not cfg.train.eval_interval or self.step % cfg.train.eval_interval):
                    self._evaluate()
                if self.checkpointer is not None:
                    self.checkpointer.finish(self, save=cfg.checkpoint.save_at_end and not stopped)
        finally:
            if self.elastic is not None:
                self.elastic.leave()
            if bar is not None:
                bar.close()
            self.sink.close()
        return self.history

    def _guarded_step(self) -> Optional[dict]:
        """One step; if it raises, save the last good state first (when possible).
        Returns the step record, or None when an elastic step was not committed."""
        progress = StepProgress()
        try:
            return self._one_step(progress)
        except Exception as exc:
            if self.checkpointer is not None:
                self.checkpointer.save_after_failure(self, exc, progress.optimizer_started)
            raise

    def _one_step(self, progress: StepProgress) -> Optional[dict]:
        t0 = time.perf_counter()
        share = self.elastic.begin_step() if self.elastic is not None else None
        t_quorum = time.perf_counter() - t0
        if share is None:
            mbs = self.task.microbatches(self.step, self.dp_rank, self.dims.dp)
        else:
            mbs = self.elastic.microbatches(share)
        t_data = time.perf_counter() - t0 - t_quorum
        maybe_fail(self.step + 1, self._fault_step)
        stats = train_step(
            self.chunks,
            self.optimizer,
            self.scheduler,
            self.task.forward_step,
            mbs,
            self.task.seq_length,
            self.cfg.train.micro_batch_size,
            progress,
            cross_replica=self.elastic.replica if self.elastic is not None else None,
        )
        step_s = time.perf_counter() - t0
        if share is not None:
            self.elastic.end_step(share, stats.committed)
            if not stats.committed:
                return None
        self.step += 1
        after_step = getattr(self.task, "after_step", None)
        if after_step is not None:
            after_step(self)
        record = self._record(stats, t_data, step_s)
        if share is not None:
            record.update(participants=share.participation.size, quorum_s=t_quorum,
                          healed=not share.participation.participating)
        if self.is_loss_rank:
            self.history.append(record)
            self.sink.log(record, self.step)
            if self.step % self.cfg.logging.log_interval == 0 or self.step == self.cfg.train.steps:
                logger.info(_format_line(record, self.cfg.train.steps))
        return record

    def _record(self, stats: StepStats, t_data: float, step_s: float) -> dict:
        samples, tokens = self.task.global_batch_size_of(self.step - 1)
        return {
            "step": self.step,
            "loss": stats.loss,
            "lr": stats.lr,
            "grad_norm": stats.grad_norm,
            "skipped": not stats.update_successful,
            "loss_tokens": stats.num_loss_tokens,
            "tokens": tokens,
            "samples": samples,
            "tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
            "samples_per_s": samples / step_s if step_s > 0 else 0.0,
            "step_s": step_s,
            "data_s": t_data,
            "fwd_bwd_s": stats.fwd_bwd_s,
            "optimizer_s": stats.optimizer_s,
            "microbatches": stats.num_microbatches,
            **self.task.data_stats(),
        }

    def _evaluate(self) -> None:
        result = self.task.evaluate(self)
        if result and self.is_loss_rank:
            record = {"step": self.step, **{f"eval/{k}": v for k, v in result.items()}}
            self.sink.log(record, self.step)
            self.history.append(record)

    def _progress_bar(self):
        if not (self.is_loss_rank and self.cfg.logging.progress_bar and sys.stderr.isatty()):
            return None
        from tqdm import tqdm

        return tqdm(total=self.cfg.train.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)

    def close(self) -> None:
        """Stop background writers and the control server, destroy process groups (every rank)."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.control.close()
        destroy_parallel()


def _layout(dims: ParallelDims) -> dict:
    return {"tp": dims.tp, "pp": dims.pp, "cp": dims.cp, "dp": dims.dp, "vpp": dims.vpp}


def _format_line(r: dict, total: int) -> str:
    loss = f"{r['loss']:.4f}" if r["loss"] is not None else "-"
    gn = f"{r['grad_norm']:.3f}" if r["grad_norm"] is not None else "-"
    skipped = " SKIPPED" if r["skipped"] else ""
    if "participants" in r:
        skipped += f" | replicas {r['participants']}" + (" (healed)" if r["healed"] else "")
    return (
        f"step {r['step']}/{total} | loss {loss} | lr {r['lr']:.2e} | grad_norm {gn} | "
        f"tok/s {r['tokens_per_s']:.0f} | samples/s {r['samples_per_s']:.1f} | "
        f"step {r['step_s']:.3f}s (data {r['data_s']:.3f} fwd/bwd {r['fwd_bwd_s']:.3f} opt {r['optimizer_s']:.3f})"
        f"{skipped}"
    )


@contextlib.contextmanager
def _redirect_logging_for(bar):
    if bar is None:
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm():
        yield


def _write_config(cfg: JobConfig) -> None:
    import yaml

    os.makedirs(cfg.logging.output_dir, exist_ok=True)
    with open(os.path.join(cfg.logging.output_dir, "config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)


def run_training(cfg: JobConfig, task_factory: TaskFactory) -> list[dict]:
    """Build a Trainer, train, tear down (every rank). Entry points call this."""
    trainer = Trainer(cfg, task_factory)
    try:
        return trainer.train()
    finally:
        trainer.close()
