"""ControlPlane: the Trainer's one seam to the control socket.

Every rank builds one and calls :meth:`ControlPlane.step_boundary` at every
step boundary. Rank 0 of the replica group also runs the
:class:`~megascale_omni.control.server.ControlServer` thread. At each
boundary one small all-reduce (see :mod:`megascale_omni.control.exchange`;
pipelined, so it overlaps the next step) gives every rank rank 0's queued
commands, so all ranks pause, resume, drain, checkpoint and change config at
the same step. With the socket disabled (``control.enabled: false``) no
collective runs at all.

Step records reach rank 0 on the metrics' own exchange
(:mod:`megascale_omni.metrics.exchange`); the Trainer hands each boundary's
record to :meth:`ControlPlane.step_boundary`, and ``settle_records`` lets
the plane finish that exchange when it holds the job (pause, standby) or
closes, so ``status`` and ``metrics`` report the step it holds at.

Elasticity plugs in through two callables, both called by the training
thread only (torchft's Manager is not thread-safe): ``replica_info()``
returns ``{"replica_id": ..., "participants": ..., ...}`` for ``status``,
and ``checkpoint(step)`` saves (a collective on every rank) and returns
where to.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megascale_omni.config import ConfigError, JobConfig, control_socket_path, load_control_token, to_dict
from megascale_omni.control.commands import Op, get_field, set_field
from megascale_omni.control.exchange import MAX_OPS, BoundaryExchange
from megascale_omni.control.handlers import RequestHandler
from megascale_omni.control.protocol import PROTOCOL_VERSION, ErrorCode, error_reply, ok_reply
from megascale_omni.control.server import ControlServer
from megascale_omni.control.state import ControlState, Pending
from megascale_omni.utils.files import atomic_write_json

logger = logging.getLogger(__name__)

#: Written to the run directory by rank 0 so clients find the socket and a TCP port chosen at random.
ENDPOINT_FILE = "control.json"

#: How long close() waits for the last exchange (peers may have died), seconds.
FLUSH_TIMEOUT_S = 30.0

CheckpointFn = Callable[[int], Any]
ReplicaInfoFn = Callable[[], Optional[dict]]
#: Finishes the metrics exchange in flight (every rank, at the same point;
#: waits at most the given seconds, None: no limit) and returns the loss
#: rank's record it brought, or None (see MetricsExchange.settle).
SettleRecordsFn = Callable[[Optional[float]], Optional[dict]]


class ControlPlane:
    """Applies control commands at step boundaries (every rank).

    Construction is a collective when enabled: rank 0 starts the server and
    tells every rank whether that worked, so a bad address fails all ranks
    together with a ConfigError instead of leaving them in a collective.
    """

    def __init__(
        self,
        cfg: JobConfig,
        layout: dict[str, Any],
        checkpoint: Optional[CheckpointFn] = None,
        replica_info: Optional[ReplicaInfoFn] = None,
        straggler_info: Optional[ReplicaInfoFn] = None,
        settle_records: Optional[SettleRecordsFn] = None,
    ):
        self.cfg = cfg
        self.enabled = cfg.control.enabled
        self.paused = False
        self.draining = False
        #: True while a standby replica group waits for ``join`` (see :meth:`stand_by`).
        self.standing_by = False
        self.boundaries = 0
        #: Seconds spent in the per-boundary exchange (excluding pause waits).
        self.exchange_s = 0.0
        self._checkpoint = checkpoint
        self._replica_info = replica_info
        #: The last straggler observation (same on every rank), for ``status``.
        self._straggler_info = straggler_info
        self._settle_records = settle_records
        #: Per exchange call, the commands rank 0 sent that have not come back yet.
        self._transit: collections.deque[list[Pending]] = collections.deque()
        self._server: Optional[ControlServer] = None
        self._endpoint_file: Optional[str] = None
        rank = dist.get_rank() if dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.serves = self.enabled and rank == 0
        if not self.enabled:
            return
        # A gloo group of our own (collective): CPU tensors work on NCCL jobs
        # too, and our background all-reduce never shares a queue with training's.
        group = dist.new_group(backend="gloo") if world_size > 1 else None
        self._exchange = BoundaryExchange(group, world_size, sends_ops=self.serves)
        started = time.time()
        self.state = ControlState(
            {
                "state": "starting", "step": 0, "total_steps": cfg.train.steps, "last_loss": None,
                "layout": layout, "world_size": world_size, "pid": os.getpid(), "host": socket.gethostname(),
                "output_dir": os.path.abspath(cfg.logging.output_dir), "replica": None,
            },
            to_dict(cfg),
            max_pending=cfg.control.max_pending,
        )
        error = self._start_server(started) if self.serves else None
        self._agree_on_start(error, world_size, group)

    # ------------------------------------------------------------ training side
    def step_boundary(self, step: int, record: Optional[dict]) -> bool:
        """Apply queued commands (every rank, same ``step`` everywhere).

        ``record`` is the loss rank's newest step record as this rank received
        it (from the metrics exchange; published on rank 0, ignored
        elsewhere), None when none arrived. Blocks here while paused. Returns
        False once drained: stop training.
        """
        if not self.enabled:
            return True
        t0 = time.perf_counter()
        self._exchange_and_apply(step, record)
        self.exchange_s += time.perf_counter() - t0
        self.boundaries += 1
        self._hold(step, lambda: self.paused)
        return not self.draining

    def stand_by(self, step: int) -> bool:
        """Hold every rank until ``join`` (returns True) or ``drain`` (False).

        For replica groups started with ``elastic.standby``: everything is
        built, the control socket answers (``status`` says ``standby``), and
        the ranks poll the exchange every ``control.pause_poll_s`` at most.
        """
        if not self.enabled:
            raise RuntimeError("a standby replica group needs the control plane (control.enabled)")
        self.standing_by = True
        if self.serves:
            replica = self._replica_info() if self._replica_info is not None else None
            self.state.publish(state="standby", step=step, replica=replica)
        logger.info("control: standing by at step %d; `omni-ctl join` adds this replica group to the quorum", step)
        self._hold(step, lambda: self.standing_by)
        return not self.draining

    def _hold(self, step: int, held: Callable[[], bool]) -> None:
        """Keep exchanging commands at ``step`` while ``held()`` and not draining (every rank)."""
        if held() and not self.draining and self._settle_records is not None:
            # The record of the step we hold at is on its way: publish it now, not after the hold.
            self._publish_record(self._settle_records(None))
        while held() and not self.draining:
            if self.serves and not any(self._transit):  # nothing on its way back: wait for news
                self.state.wait_for_command(self.cfg.control.pause_poll_s)
            # Other ranks wait inside this collective, at most ~pause_poll_s
            # per round: far below the collective timeout, however long the hold.
            self._exchange_and_apply(step, None)

    def close(self) -> None:
        """Finish the exchanges in flight, stop the server, answer commands
        that were never applied (every rank)."""
        if not self.enabled:
            return
        last_record = None
        try:
            self._exchange.flush(timeout_s=FLUSH_TIMEOUT_S)
            if self._settle_records is not None:
                last_record = self._settle_records(FLUSH_TIMEOUT_S)
        except RuntimeError as e:  # a peer died; we are shutting down anyway
            logger.warning("control: last boundary exchange did not complete: %s", e)
        if not self.serves or self._server is None:
            return
        self._publish_record(last_record)
        message = f"training ended at step {self.state.status()['step']} before the command was applied"
        for pending in [*self._transit_items(), *self.state.close()]:
            pending.answer(lambda request_id: error_reply(request_id, ErrorCode.UNAVAILABLE, message))
        self.state.publish(state="finished")
        self._server.stop()
        self._server = None
        if self._endpoint_file and os.path.exists(self._endpoint_file):
            os.unlink(self._endpoint_file)
        if self.boundaries:
            logger.info(
                "control: %d step boundaries, exchange %.1f us per boundary",
                self.boundaries, 1e6 * self.exchange_s / self.boundaries,
            )

    def _publish_record(self, record: Optional[dict]) -> None:
        if self.serves and record is not None:
            self.state.publish(record=record, last_loss=record.get("loss"))

    def _exchange_and_apply(self, step: int, loss_record: Optional[dict]) -> None:
        sent: list[Pending] = self.state.take(MAX_OPS) if self.serves else []
        ops = self._exchange([p.op for p in sent])
        # The ops that came back are the ones sent ``lag`` calls ago.
        self._transit.append(sent)
        taken = self._transit.popleft() if len(self._transit) > self._exchange.lag else []
        try:
            results = [self._apply(op, step) for op in ops]
        except BaseException as e:  # e.g. the checkpoint service failed: answer, then fail the step
            failed = f"failed at step {step}: {e}"
            for pending in taken:
                pending.answer(lambda request_id: error_reply(request_id, ErrorCode.INTERNAL, failed))
            raise
        if not self.serves:
            return
        status: dict[str, Any] = {"step": step, "state": "paused" if self.paused else "running"}
        if self.standing_by:
            status["state"] = "standby"
        if self.draining:
            status["state"] = "draining"
        if loss_record is not None:
            status["last_loss"] = loss_record.get("loss")
        replica = self._replica_info() if self._replica_info is not None else None
        if replica is not None:  # None: not a replica group (static membership)
            status["replica"] = replica
        if self._straggler_info is not None and self._straggler_info() is not None:
            status["stragglers"] = self._straggler_info()
        changed_config = any(op.kind == "config_set" for op in ops)
        status["total_steps"] = self.cfg.train.steps
        self.state.publish(record=loss_record, config=to_dict(self.cfg) if changed_config else None, **status)
        for pending, (result, error) in zip(taken, results):
            if error is None:
                pending.answer(lambda request_id: ok_reply(request_id, result))
            else:
                pending.answer(lambda request_id: error_reply(request_id, ErrorCode.UNAVAILABLE, error))

    def _transit_items(self) -> list[Pending]:
        items = [p for sent in self._transit for p in sent]
        self._transit.clear()
        return items

    def _apply(self, op: Op, step: int) -> tuple[Optional[dict], Optional[str]]:
        """Apply one op (every rank, identically). Returns (result, error)."""
        if self.draining:
            return None, f"the replica is draining since step {step}; {op.kind} not applied"
        if op.kind == "join":
            if not self.standing_by:
                return None, f"the replica group is not standing by at step {step}; join not applied"
            self.standing_by = False
            logger.info("control: join at step %d: entering the elastic quorum", step)
            return {"state": "joining", "step": step}, None
        if self.standing_by and op.kind in ("pause", "resume"):
            return None, f"the replica group is standing by at step {step}; {op.kind} applies once it trains"
        if op.kind in ("pause", "resume"):
            changed = self.paused != (op.kind == "pause")
            self.paused = op.kind == "pause"
            if changed:
                logger.info("control: %s at step %d", "paused" if self.paused else "resumed", step)
            return {"state": "paused" if self.paused else "running", "step": step, "changed": changed}, None
        if op.kind == "drain":
            self.draining = True
            logger.info("control: drain at step %d: stopping after this step on every rank", step)
            return {"state": "draining", "step": step}, None
        if op.kind == "checkpoint":
            assert self._checkpoint is not None, "handler refuses checkpoint without a service"
            where = self._checkpoint(step)
            logger.info("control: checkpoint requested at step %d saved", step)
            return {"step": step, "checkpoint": where if isinstance(where, (str, dict)) else None}, None
        assert op.kind == "config_set" and op.field is not None
        old = get_field(self.cfg, op.field)
        new = set_field(self.cfg, op.field, op.value)
        logger.info("control: %s %r -> %r at step %d", op.field, old, new, step)
        return {"field": op.field, "old": old, "new": new, "step": step}, None

    # ------------------------------------------------------------- rank 0 side
    def _start_server(self, started: float) -> Optional[Exception]:
        control = self.cfg.control
        try:
            handler = RequestHandler(self.state, self.cfg, checkpointing=self._checkpoint is not None,
                                     started_at=started)
            server = ControlServer(
                handler,
                unix_path=control_socket_path(self.cfg),
                tcp=(control.tcp_host, control.tcp_port) if control.tcp_port is not None else None,
                token=load_control_token(control),
                max_connections=control.max_connections,
                idle_timeout_s=control.idle_timeout_s,
                request_timeout_s=control.request_timeout_s,
            )
            server.start()
        except Exception as e:  # reported to every rank below, then raised
            return e
        self._server = server
        # In the run directory, whatever the socket path: `omni-ctl --run-dir` looks there.
        os.makedirs(self.cfg.logging.output_dir, exist_ok=True)
        self._endpoint_file = os.path.join(self.cfg.logging.output_dir, ENDPOINT_FILE)
        atomic_write_json(self._endpoint_file, {
            "protocol_version": PROTOCOL_VERSION, "pid": os.getpid(), **server.addresses,
        })
        logger.info("control: serving %s", " and ".join(f"{k} {v}" for k, v in server.addresses.items() if v))
        return None

    def _agree_on_start(self, error: Optional[Exception], world_size: int, group) -> None:
        failed = 1.0 if error else 0.0
        if world_size > 1:
            flag = torch.tensor([failed], dtype=torch.float64)
            dist.all_reduce(flag, group=group)
            failed = flag.item()
        if isinstance(error, ConfigError):
            raise error
        if error is not None:
            raise ConfigError("control", control_socket_path(self.cfg), f"cannot start the control server: {error}")
        if failed:
            raise ConfigError("control", "rank 0", "could not start the control server; see rank 0's error")

