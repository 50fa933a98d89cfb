"""The Trainer: set up distributed state, build, then loop.

Reads top to bottom: platform -> pipeline plan -> process groups ->
pre-flight checks (``preflight.enabled``) -> megatron
parallel state -> task (model + data) -> layout-invariant init -> DDP ->
optimizer -> TrainState -> services (checkpoints, replica membership,
control, metrics, the hang watchdog) -> loop.

Model families plug in through their declaration (:class:`FamilySpec`, see
:mod:`megascale_omni.tasks.registry`) and their task; the loop never branches
on them. Services are always present and disabled when not configured, so
the loop never branches on them either.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import Any, Optional, Protocol

import torch

from megascale_omni.checkpoint.manager import Checkpointer
from megascale_omni.checkpoint.pretrained import Pretrained, load_pretrained
from megascale_omni.checkpoint.train_state import TrainState
from megascale_omni.config import JobConfig, to_dict, validate_platform
from megascale_omni.control.plane import ControlPlane
from megascale_omni.elastic.service import build_membership
from megascale_omni.metrics import MetricSink
from megascale_omni.metrics.breakdown import PHASES, install_dispatch_timer, install_pipeline_timer
from megascale_omni.metrics.clock import events_for
from megascale_omni.metrics.exchange import MetricsExchange
from megascale_omni.metrics.flops import StepFlops, device_peak, vision_token_cost
from megascale_omni.metrics.record import StepRecorder, StepTiming, format_line
from megascale_omni.metrics.replica_group import ReplicaGroupMetrics, rank_row
from megascale_omni.models.init import init_layout_invariant
from megascale_omni.models.precision import cast_chunks
from megascale_omni.parallel import (
    ParallelDims,
    data_parallel_rank,
    destroy_parallel,
    initialize_parallel,
    is_loss_rank,
)
from megascale_omni.parallel.pipeline_plan import format_plan_table, resolve_partition
from megascale_omni.platform import init_distributed, init_platform, seed_everything
from megascale_omni.platform.device import dist_timeout_s
from megascale_omni.platform.logging_setup import setup_logging
from megascale_omni.preflight.runner import preflight_before_training
from megascale_omni.training.optimizer import (
    build_optimizer,
    optimizer_state_bytes,
    overlaps_grad_reduce,
    overlaps_param_gather,
    wrap_ddp,
)
from megascale_omni.training.param_gather import ParamGather
from megascale_omni.training.step import StepProgress, StepStats, train_step
from megascale_omni.watchdog import Watchdog

logger = logging.getLogger(__name__)


class FamilySpec(Protocol):
    """What the Trainer needs of a model family's declaration
    (:class:`megascale_omni.tasks.registry.ModelFamily`)."""

    name: str
    #: ``"module:function"`` of the family's pipeline cost model, or None.
    cost_model: Optional[str]

    def cost_model_fn(self, cfg: JobConfig) -> Any:
        """The cost model function (model FLOPs per step come from it)."""

    def plan_pipeline(self, cfg: JobConfig, cuda: bool, world_size: int) -> Any:
        """The pipeline plan (or None), before any process group exists."""

    def build_task(self, cfg: JobConfig, platform: Any, dims: ParallelDims) -> Any:
        """The family's task (:class:`megascale_omni.tasks.base.Task`) on this rank."""


class Trainer:
    """Owns the distributed set-up, the TrainState, the services and the loop."""

    def __init__(self, cfg: JobConfig, family: FamilySpec):
        #: What close() undoes, last built first; also run when __init__ fails
        #: part-way (a bad resume path exits 4 with its process groups and
        #: workers shut down, not torn apart by interpreter exit).
        self._teardown = contextlib.ExitStack()
        try:
            self._build(cfg, family)
        except BaseException:
            try:
                self._teardown.close()
            except Exception:  # the start-up error is the one to report
                logger.exception("tear-down after a failed start-up also failed")
            raise

    def _build(self, cfg: JobConfig, family: FamilySpec) -> None:
        setup_logging(cfg.logging.level)
        self.platform = init_platform(cfg.platform.device)
        validate_platform(cfg, self.platform.is_cuda)
        # Before any process group: an infeasible split exits 2 on every rank.
        self.pipeline_plan = family.plan_pipeline(
            cfg, cuda=self.platform.is_cuda, world_size=int(os.environ.get("WORLD_SIZE", "1"))
        )
        self.cfg = cfg = resolve_partition(cfg, self.pipeline_plan)
        if self.platform.cpu_patches:
            logger.info("megatron-core CPU mode: %d targeted patches active", len(self.platform.cpu_patches))
        rank, world_size = init_distributed(self.platform)
        self._teardown.callback(destroy_parallel)
        # Every rank, before the model, the data and any quorum: a bad node exits 44 (docs/preflight.md).
        preflight_before_training(cfg, self.platform)
        install_pipeline_timer()
        install_dispatch_timer()
        # The step's clock: CUDA events on CUDA (kernels run asynchronously), host time elsewhere.
        PHASES.use(events_for(self.platform.device))
        if cfg.logging.memory_fraction_cap:
            torch.cuda.set_per_process_memory_fraction(cfg.logging.memory_fraction_cap, self.platform.device)
        self.dims = ParallelDims.from_config(cfg.parallel, world_size)
        initialize_parallel(self.dims, cfg.train.seed)
        seed_everything(cfg.train.seed)
        self.is_loss_rank = is_loss_rank()
        self.task = family.build_task(cfg, self.platform, self.dims)
        self._teardown.callback(self.task.close)
        chunks, pretrained = self._build_model()
        optimizer, scheduler = build_optimizer(
            chunks, cfg.train, cfg.parallel, self.platform.default_dtype(cfg.train.precision), self.task.lr_mult()
        )
        gather = ParamGather(chunks, chunks[0].ddp_config.overlap_param_gather, serves_peers=cfg.elastic.enabled)
        self.state = TrainState(chunks, optimizer, scheduler, self.task, cfg, self.dims, param_gather=gather)
        self.state.provenance, self.state.hf_assets = pretrained.provenance, pretrained.assets
        if self.pipeline_plan is not None and self.dims.pp > 1 and rank == 0:
            logger.info(
                "pipeline partition (%s, %s): layers per chunk %s\n%s", self.pipeline_plan.mode,
                self.pipeline_plan.source, list(self.pipeline_plan.counts), format_plan_table([self.pipeline_plan]),
            )
        self.recorder = self._build_recorder(family, world_size)
        #: Time spent after the last step (its record, the boundary), reported with the next step.
        self._boundary = _idle_boundary()
        log = cfg.logging
        self.group_metrics = ReplicaGroupMetrics(log.straggler_factor, log.straggler_patience,
                                                 log.straggler_min_excess_s, announce=self.is_loss_rank)
        # Services, each always present and disabled when not configured.
        self.sink = MetricSink.from_config(cfg.logging, enabled=self.is_loss_rank,
                                           labels={"replica_group": cfg.elastic.replica_id}
                                           if cfg.elastic.enabled else None)
        self._teardown.callback(self.sink.close)
        if self.is_loss_rank:
            _write_config(cfg)
        self.history: list[dict] = []
        #: This rank's optimizer state in bytes, measured once Adam has state (after the first step).
        self._optimizer_state_bytes = 0
        #: Whether this process has received micro-batches once (its data workers are up).
        self._data_started = False
        # Enters the quorum in train() (a standby replica group on `omni-ctl join`).
        self.membership = build_membership(self.state, cfg.elastic, data_parallel_rank())
        # Replica groups share the checkpoint directories; one writes.
        self.checkpointer = Checkpointer(cfg.checkpoint, cfg.logging.output_dir, shared=cfg.elastic.enabled,
                                         writer=self.membership.is_writer)
        self._teardown.callback(self.checkpointer.close)
        self.checkpointer.resume(self.state)
        self.group_exchange = MetricsExchange.for_replica_group(sends_record=self.is_loss_rank)
        self._teardown.callback(self.group_exchange.close)
        self.control = ControlPlane(
            cfg, self.dims.layout(),
            checkpoint=self._control_checkpoint if self.checkpointer.enabled else None,
            replica_info=self.membership.describe,
            straggler_info=self.group_metrics.describe, settle_records=self.group_exchange.settle,
        )
        self._teardown.callback(self.control.close)
        # Started when the loop starts stepping (a standby group waits for `join` first).
        self.watchdog = Watchdog(
            cfg.watchdog, rank, world_size, cfg.elastic.replica_id if cfg.elastic.enabled else "job",
            elastic=cfg.elastic.enabled, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), held=lambda: self.control.paused,
            dist_timeout_s=dist_timeout_s(),
        )
        PHASES.listen(self.watchdog.heartbeat)
        self._teardown.callback(PHASES.listen, None)
        self._teardown.callback(self.watchdog.close)

    def _build_recorder(self, family: FamilySpec, world_size: int) -> StepRecorder:
        """The step recorder, counting each step's model FLOPs with the family's cost model."""
        cfg = self.cfg
        flops_of = (StepFlops(cfg, family.cost_model_fn(cfg), vocab_size=self.task.vocab_size)
                    if family.cost_model is not None else None)
        name = torch.cuda.get_device_name(self.platform.device) if self.platform.is_cuda else None
        peak = device_peak(cfg.logging.peak_tflops, name)
        if flops_of is not None and self.is_loss_rank:
            logger.info("model FLOPs: per step's global batch (cost model); MFU against %s",
                        f"{peak.tflops:g} TFLOP/s per device ({peak.source})" if peak.tflops
                        else "no known peak (set logging.peak_tflops)")
        # The scheduler weighs a step's vision tokens by this model's tower cost (docs/scheduler.md).
        tower_cost = (vision_token_cost(cfg, family.cost_model_fn(cfg), vocab_size=self.task.vocab_size)
                      if flops_of is not None and cfg.model.family == "llava" else None)
        return StepRecorder(self.platform.device, world_size, flops_of, peak.tflops, self.dims.pp,
                            self.dims.num_model_chunks, vision_token_cost=tower_cost)

    def _build_model(self) -> tuple[list, Pretrained]:
        """This rank's model chunks: built by the task, initialised identically
        under any layout (then overwritten by ``checkpoint.pretrained`` when
        set), moved to ``platform.device`` and cast to the params dtype
        (``train.precision``), wrapped in megatron DDP (every rank). Also returns the
        pretrained weights' provenance record and tokenizer files."""
        chunks = self.task.build_model()
        n = init_layout_invariant(
            chunks, seed=self.cfg.train.seed, std=self.cfg.model.init_method_std, num_layers=self.cfg.model.num_layers
        )
        pretrained = load_pretrained(chunks, self.cfg)
        # megatron builds the weights on the host (use_cpu_initialization) and a few in fp32
        # whatever params_dtype says; train on the platform's device, every weight in params_dtype.
        cast_chunks(chunks, self.platform.device, self.platform.default_dtype(self.cfg.train.precision))
        total = sum(p.numel() for c in chunks for p in c.parameters())
        trainable = sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)
        logger.info(
            "initialised %d parameter tensors (layout-invariant); parameters on this rank: %d, trainable %d",
            n, total, trainable,
        )
        parallel, cuda, dp = self.cfg.parallel, self.platform.is_cuda, self.dims.dp
        overlap, gather = overlaps_grad_reduce(parallel, cuda, dp), overlaps_param_gather(parallel, cuda, dp)
        return wrap_ddp(chunks, chunks[0].config, parallel, overlap, gather), pretrained

    @property
    def step(self) -> int:
        """Committed optimizer steps (the data position)."""
        return self.state.step

    def request_checkpoint(self, reason: str = "api") -> None:
        """Save at the next step boundary (thread-safe; e.g. the control socket).
        Raises CheckpointError when checkpointing is disabled."""
        self.checkpointer.request(reason)

    def _control_checkpoint(self, step: int) -> dict:
        # Every rank, at the control boundary just before the checkpointer's.
        self.request_checkpoint("control")
        return {"requested_at_step": step, "dir": self.cfg.checkpoint.dir, "writer": self.checkpointer.writes()}

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict]:
        """Run ``train.steps`` optimizer steps (every rank). Returns per-step
        records on the loss rank (empty elsewhere)."""
        cfg = self.cfg
        if not self.membership.enter(self.control):
            self.sink.close()
            return self.history
        bar = self._progress_bar()
        stopped = drained = False
        beat = self.watchdog.heartbeat
        self.watchdog.start()
        try:
            with _redirect_logging_for(bar):
                while self.state.step < cfg.train.steps:
                    record = self.train_one_step()
                    if record is None:
                        continue  # elastic step not committed: retry it with the same samples
                    bar.update(1)
                    if cfg.train.eval_interval and self.state.step % cfg.train.eval_interval == 0:
                        beat.enter("evaluation")
                        self._evaluate()
                    beat.enter("step-boundary")
                    # Control commands (pause, drain, config set, checkpoint) apply here on every rank.
                    t0 = time.perf_counter()
                    loss_record = self.group_exchange(self.state.step, record, rank_row(record))
                    serving = self.control.step_boundary(self.state.step, loss_record)
                    t1 = time.perf_counter()
                    beat.enter("checkpoint")
                    stop = self.checkpointer.at_step_boundary(self.state)
                    # Reported in the next step's record (its step_s starts here).
                    self._boundary.update(control_s=t1 - t0, checkpoint_s=time.perf_counter() - t1)
                    if not serving:
                        drained = True
                        break
                    if stop:
                        stopped = True
                        break
                if not (stopped or drained) and (not cfg.train.eval_interval or self.state.step % cfg.train.eval_interval):
                    beat.enter("evaluation")
                    self._evaluate()
                beat.enter("checkpoint")
                self.checkpointer.finish(self.state, save=cfg.checkpoint.save_at_end and not stopped)
        finally:
            self.watchdog.close()
            self.membership.leave()
            bar.close()
            self.sink.close()
        return self.history

    def train_one_step(self) -> Optional[dict]:
        """One optimizer step (every rank); if it raises, the last good state is
        saved first (when possible). Returns the step record, or None when an
        elastic attempt was not committed (retry it: same step, same samples)."""
        progress = StepProgress()
        try:
            return self._step(progress)
        except Exception as exc:
            self.checkpointer.save_after_failure(self.state, exc, progress.optimizer_started)
            raise

    def _train_step(self, mbs: list[dict], progress: StepProgress) -> StepStats:
        # An elastic step may be attempted again (membership change, no commit): count its last attempt only.
        self.task.discard_model_stats()
        return train_step(self.state.chunks, self.state.optimizer, self.state.scheduler, self.task.forward_step, mbs,
                          *self.task.pipeline_shape(), progress, cross_replica=self.membership.cross_replica)

    def _step(self, progress: StepProgress) -> Optional[dict]:
        """Quorum (elastic), this rank's micro-batches, the step, the record (every rank)."""
        beat = self.watchdog.heartbeat
        t0 = time.perf_counter()
        beat.enter("quorum")
        share = self.membership.begin_step()
        t_quorum = time.perf_counter()
        # The first wait of this process includes its data-loader workers' start-up (tens of seconds on a
        # loaded host): a start, not a hang, bounded by step_timeout_s (watchdog/heartbeat.py).
        beat.enter("data-wait" if self._data_started else "data-start")
        mbs = self.membership.microbatches(share)
        self._data_started = True
        t_data = time.perf_counter() - t_quorum
        # What ran since the previous step (its record, the boundary; not
        # evaluation) counts toward this one.
        boundary_s = sum(self._boundary.values())
        share, stats = self.membership.run_step(share, mbs, lambda mbs: self._train_step(mbs, progress))
        # With parallel.overlap_param_gather the optimizer left the weights' all-gather pending.
        self.state.param_gather.step_done(stats.update_successful)
        t_end = time.perf_counter()
        self.membership.end_step(share, stats.committed)
        beat.step_ended(self.state.step + int(stats.committed))
        membership_s = (t_quorum - t0) + (time.perf_counter() - t_end)
        if not stats.committed:
            return None
        self.state.step += 1
        if self.task.reads_weights_after_step:
            self.state.sync_params()
        self.task.after_step(self.state.step)
        extra: dict = self.task.data_stats()
        extra.update(self.task.batch_stats(self.state.step - 1))
        extra.update(self.task.model_stats())
        self.membership.annotate(extra, share)
        if not self._optimizer_state_bytes:
            self._optimizer_state_bytes = optimizer_state_bytes(self.state.optimizer, self.state.chunks)
        extra["optimizer_state_bytes"] = self._optimizer_state_bytes
        if self.checkpointer.enabled:
            extra["checkpoint_failed_saves"] = self.checkpointer.failed_saves
        t_record = time.perf_counter()
        step_s = t_record - t0 + boundary_s
        timing = StepTiming(step_s, t_data, membership_s, **self._boundary)
        self._boundary = _idle_boundary()
        samples, tokens = self.task.global_batch_size_of(self.state.step - 1)
        record = self.recorder.build(self.state.step, stats, timing, samples, tokens,
                                     self.task.images_of(self.state.step - 1), extra,
                                     self.task.batch_shape(self.state.step - 1))
        record["busy_s"] = record["data_s"] + record["compute_s"]
        # Every rank's numbers of the previous step (the metrics exchange, completed now).
        rows = self.group_exchange.rank_rows()
        record.update(self.group_metrics.observe(rows.step, rows.rows) if rows else self.group_metrics.observe(0, None))
        if self.is_loss_rank:
            self.history.append(record)
            self.sink.log(record, self.state.step)
            if self.state.step % self.cfg.logging.log_interval == 0 or self.state.step == self.cfg.train.steps:
                logger.info(format_line(record, self.cfg.train.steps))
        self._boundary["metrics_s"] = time.perf_counter() - t_record
        return record

    def _evaluate(self) -> None:
        self.state.sync_params()
        result = self.task.evaluate(self.state.chunks, self.state.step)
        if result and self.is_loss_rank:
            record = {"step": self.state.step, **{f"eval/{k}": v for k, v in result.items()}}
            self.sink.log(record, self.state.step)
            self.history.append(record)

    def _progress_bar(self):
        """A tqdm bar on the loss rank attached to a TTY; a disabled (no-op) bar elsewhere."""
        from tqdm import tqdm

        show = self.is_loss_rank and self.cfg.logging.progress_bar and sys.stderr.isatty()
        return tqdm(total=self.cfg.train.steps, initial=self.state.step, desc="train", unit="step",
                    dynamic_ncols=True, disable=not show)

    def close(self) -> None:
        """Stop the control server, background writers and data workers, destroy
        process groups (every rank; idempotent)."""
        self._teardown.close()


def _idle_boundary() -> dict[str, float]:
    return {"metrics_s": 0.0, "control_s": 0.0, "checkpoint_s": 0.0}


@contextlib.contextmanager
def _redirect_logging_for(bar):
    if bar.disable:
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


def run_training(cfg: JobConfig, family: FamilySpec) -> list[dict]:
    """Build a Trainer, train, tear down (every rank). Entry points call this."""
    trainer = Trainer(cfg, family)
    try:
        return trainer.train()
    finally:
        trainer.close()
