"""Config sections of how a job runs around the training loop: logging,
the control socket, checkpoints and elastic replica groups.

Every field carries its meaning in the comment above it; ``__post_init__``
does the cheap, local checks (cross-section checks: :mod:`.validate`).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Literal, Optional

from megascale_omni.config.constraints import check_fields, checked
from megascale_omni.config.errors import ConfigError


@dataclass
class LoggingConfig:
    """Where metrics and logs go."""

    #: Run directory for JSONL metrics, TensorBoard events and checkpoints by default.
    output_dir: str = "runs/default"
    #: Log one line (and write TensorBoard scalars) every N steps; JSONL and
    #: Prometheus get every step.
    log_interval: int = checked(1, gt=0)
    #: Write TensorBoard event files under ``output_dir/tensorboard``.
    tensorboard: bool = True
    #: Peak TFLOP/s of one device for MFU; 0 = the dense bf16 peak of the exact
    #: CUDA device name (metrics/flops.py; a family-only match is logged as
    #: guessed), and no MFU where unknown (e.g. CPU).
    peak_tflops: float = checked(0.0, ge=0)
    #: CUDA only: cap this process's caching allocator at this fraction of
    #: device memory (``torch.cuda.set_per_process_memory_fraction``); 0 = no cap.
    memory_fraction_cap: float = checked(0.0, ge=0, le=1, note="(0 = no cap)")
    #: Flag a rank whose busy time (data + compute, no waits) exceeds this
    #: multiple of the other ranks' median ...
    straggler_factor: float = checked(2.0, gt=1, note="(e.g. 2.0)")
    #: ... for this many consecutive steps ...
    straggler_patience: int = checked(3, gt=0)
    #: ... and the median by at least this many seconds.
    straggler_min_excess_s: float = checked(0.01, ge=0)
    #: Python logging level.
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    #: Show a progress bar on the logging rank.
    progress_bar: bool = True
    #: Serve the step record as Prometheus gauges at ``http://<prometheus_host>:<port>/metrics``
    #: from the loss-owning rank (one endpoint per replica group); 0 = off.
    #: Several jobs or replica groups on one host need one port each.
    prometheus_port: int = checked(0, ge=0, le=65535, note="(0 turns the exporter off)")
    #: Bind address of that endpoint; loopback by default. Anything else exposes
    #: the metrics to the network (step numbers only: no secrets, no config).
    prometheus_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        check_fields(self, "logging")
        if not self.output_dir.strip():
            raise ConfigError("logging.output_dir", self.output_dir, "must name a directory, e.g. runs/my-job")
        if not self.prometheus_host:
            raise ConfigError("logging.prometheus_host", self.prometheus_host, "must be an address, e.g. 127.0.0.1")


#: Stands for ``logging.output_dir`` in ``checkpoint.dir``/``checkpoint.local_dir``.
OUTPUT_DIR_PLACEHOLDER = "{output_dir}"


@dataclass
class ControlConfig:
    """Control socket of the replica group (served by its rank 0).

    See ``docs/control-protocol.md``. There is deliberately no inline token
    field: the resolved config is written to ``output_dir/config.yaml``.
    """

    #: Serve the control socket and apply commands at step boundaries.
    enabled: bool = True
    #: Unix socket path; ``null`` = ``<logging.output_dir>/control.sock``. Mode 0600.
    socket_path: Optional[str] = None
    #: Also listen on TCP at this port (0 = any free port); ``null`` = no TCP.
    #: TCP requests must carry the token (``token_file`` or ``token_env``).
    tcp_port: Optional[int] = checked(None, ge=0, le=65535, note="(0 = any free port) or null")
    #: TCP bind address; loopback by default. Anything else exposes the job to the network.
    tcp_host: str = "127.0.0.1"
    #: File holding the shared secret for TCP clients (first line; >= 16 characters).
    token_file: Optional[str] = None
    #: Environment variable holding the token when ``token_file`` is null.
    token_env: str = "MEGASCALE_CONTROL_TOKEN"
    #: While paused, ranks meet in one small collective every this many
    #: seconds (keeps them far from the collective timeout), and rank 0
    #: notices ``resume`` at most this late.
    pause_poll_s: float = checked(0.5, gt=0)
    #: Concurrent client connections; more are answered ``busy`` and closed.
    max_connections: int = checked(16, gt=0)
    #: Close a client connection idle for this long, seconds (between
    #: requests, once it has sent a complete one).
    idle_timeout_s: float = checked(300.0, gt=0)
    #: A new connection must deliver its first whole request within this many
    #: seconds of connecting, and every later request within this many
    #: seconds of its first byte; otherwise it is answered ``request_timeout``
    #: and closed, so slow or silent clients cannot hold connection slots.
    request_timeout_s: float = checked(10.0, gt=0)
    #: Deferred commands waiting for a step boundary (identical ones coalesce
    #: and count once, each answering at most this many requests); more are
    #: answered ``busy`` and their connection is closed.
    max_pending: int = checked(64, gt=0)

    def __post_init__(self) -> None:
        check_fields(self, "control")
        if not self.token_env:
            raise ConfigError("control.token_env", self.token_env, "must name an environment variable")


@dataclass
class CheckpointConfig:
    """Sharded async checkpoints: where, when, how many (see docs/checkpoints.md)."""

    #: Persistent checkpoint directory; empty disables checkpointing.
    #: ``{output_dir}`` in it (and in ``local_dir``) stands for
    #: ``logging.output_dir``, e.g. ``{output_dir}/checkpoints``.
    dir: str = ""
    #: Optional fast node-local directory: saves land here first and are
    #: replicated to ``dir`` in the background. Must be visible to every rank
    #: of the job (one node, or a shared fast file system).
    local_dir: str = ""
    #: Save every N optimizer steps (0 = off).
    interval: int = checked(0, ge=0)
    #: Also save when this many minutes passed since the last save (0 = off).
    interval_minutes: float = checked(0.0, ge=0)
    #: Complete checkpoints kept per tier; older ones are pruned.
    keep_last: int = checked(3, gt=0)
    #: Training blocks only for the host copy; a background writer does the rest.
    async_save: bool = True
    #: Save when training finishes.
    save_at_end: bool = True
    #: One SIGUSR1 burst saves once: a rank that missed the signal at the
    #: vote that saved for it treats its own SIGUSR1, received within this
    #: many seconds after that vote, as the same burst. 0 = every signal
    #: seen at a different boundary saves again.
    signal_coalesce_s: float = checked(60.0, ge=0)
    #: ``auto`` = newest complete checkpoint of either tier (fresh start if
    #: none), ``none`` = always fresh, or a checkpoint directory path.
    resume: str = "auto"
    #: Verify file checksums (sha256) before loading, not only sizes.
    verify_checksums: bool = True
    #: Model weights to start from when no checkpoint is resumed (fresh
    #: optimizer, step 0): a tools/hf_import.py output directory, or any
    #: checkpoint of the same model (a root or a step_NNNNNNNN directory),
    #: e.g. a stage-1 run's for stage 2. Loads under any TP/PP/VPP.
    pretrained: str = ""

    def __post_init__(self) -> None:
        check_fields(self, "checkpoint")
        if self.local_dir and not self.dir:
            raise ConfigError(
                "checkpoint.local_dir", self.local_dir,
                "the fast tier needs a persistent tier: set checkpoint.dir as well",
            )
        if self.local_dir and self.dir and os.path.abspath(self.local_dir) == os.path.abspath(self.dir):
            raise ConfigError("checkpoint.local_dir", self.local_dir, "must differ from checkpoint.dir")
        if not self.resume:
            raise ConfigError("checkpoint.resume", self.resume, "use auto, none or a checkpoint path")
        if not self.dir:
            for name, off in (("interval", 0), ("interval_minutes", 0.0), ("resume", "auto")):
                if getattr(self, name) != off and not (name == "resume" and self.resume == "none"):
                    raise ConfigError(f"checkpoint.{name}", getattr(self, name),
                                      "needs checkpoint.dir (checkpointing is off without it); set checkpoint.dir, "
                                      "e.g. {output_dir}/checkpoints")

    @property
    def enabled(self) -> bool:
        return bool(self.dir)


@dataclass
class ElasticConfig:
    """Elastic data parallelism across replica groups through torchft (see docs/elastic.md).

    One torchrun job is one replica group (a full model copy: tp x pp x cp,
    optionally an inner dp). Replica groups find each other through a torchft
    lighthouse; gradients are summed across the current participants and the
    optimizer steps only when the quorum commits.
    """

    #: Join the lighthouse's quorum instead of training alone.
    enabled: bool = False
    #: Lighthouse address, ``http://host:port`` (``torchft_lighthouse --bind``).
    lighthouse: str = ""
    #: This replica group's id: letters, digits, ``-`` and ``_``; unique among live groups.
    replica_id: str = ""
    #: Fewest participating replica groups with which a step may commit.
    min_replicas: int = checked(1, gt=0)
    #: Seconds a step waits for the quorum (covers a join or a dead peer's heartbeat timeout).
    quorum_timeout_s: float = checked(120.0, gt=0)
    #: Seconds for each cross-replica collective and peer state transfer before the step is abandoned.
    timeout_s: float = checked(60.0, gt=0)
    #: Directory for the sample ledger (JSONL per replica and inner DP rank):
    #: which samples each committed step consumed. Also written without
    #: ``enabled`` (one fixed group, across resumes). Empty disables it.
    ledger_dir: str = ""
    #: Start as a warm standby: build everything, serve the control socket, but
    #: stay out of the quorum until ``omni-ctl join`` (or exit 0 on ``drain``).
    standby: bool = False
    #: After a committed step, compute the next one's share assuming the same
    #: participation while the quorum is requested (its lighthouse round trip
    #: overlaps forward/backward); a step whose quorum differs is recomputed.
    overlap_quorum: bool = True
    #: How a joining group fetches a live peer's state: ``http`` (torchft's
    #: HTTP server on every rank, state staged in host memory) or ``pg`` (send
    #: and receive over the cross-replica process group: gloo on CPU, NCCL
    #: device to device on GPU). See docs/elastic.md for the measured choice.
    heal_transport: Literal["http", "pg"] = "http"
    #: A group alone in the same quorum as its last committed step commits
    #: without torchft's per-step vote (a round trip through the group's
    #: manager server whose outcome is then fixed); torchft's step count
    #: advances as the vote would advance it.
    lone_commit: bool = True

    def __post_init__(self) -> None:
        check_fields(self, "elastic")
        if not self.enabled:
            return
        if not re.fullmatch(r"https?://[^\s/:]+:[0-9]+/?", self.lighthouse):
            raise ConfigError(
                "elastic.lighthouse", self.lighthouse,
                "must be the lighthouse address http://host:port (printed by torchft_lighthouse)",
            )
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.replica_id):
            raise ConfigError(
                "elastic.replica_id", self.replica_id,
                "must be 1-64 letters, digits, '-' or '_' and unique per replica group, e.g. replica_id=r1",
            )


@dataclass
class WatchdogConfig:
    """Per-rank hang detection (see docs/hang-detection.md).

    Every rank publishes a heartbeat (committed step, phase, time in phase)
    in its replica group's c10d store, and a watchdog thread in every rank
    judges its own progress and its peers'. A rank over a limit below is
    named in one log line, its stack goes to its log (when it can still
    run), and the replica group exits with code 43 (``EXIT_HUNG``).
    """

    #: Run the watchdog thread on every rank.
    enabled: bool = True
    #: A rank that ended no step (committed or not) for this many seconds is
    #: stuck, whatever its phase. Sized for GPUs at scale (a first step that
    #: compiles, a long evaluation or a synchronous save count too); seconds in tests.
    step_timeout_s: float = checked(1800.0, gt=0)
    #: A rank waiting this long in a collective (pipeline send/receive, DP
    #: gradient sync, the cross-replica sums and commit) while a peer is not
    #: in one names that peer; the whole group waiting this long names the
    #: collective; a peer whose heartbeat stopped (its process does not run,
    #: e.g. SIGSTOP) for this long is named by the others. Below the process
    #: groups' own timeout (300 s, ``MEGASCALE_DIST_TIMEOUT_S``), past which a
    #: blocked collective raises without naming anyone.
    collective_timeout_s: float = checked(240.0, gt=0)
    #: A rank waiting this long for its micro-batches (a wedged data read or loader worker).
    data_wait_timeout_s: float = checked(600.0, gt=0)
    #: A peer whose heartbeat stopped for this long (its watchdog thread has
    #: not published: SIGSTOP, a frozen machine, a call holding the
    #: interpreter) does not run and is named by the others, whatever its
    #: phase; its collective limit is not waited for. At least three polls (a
    #: healthy peer is seen up to two polls late).
    heartbeat_timeout_s: float = checked(60.0, gt=0)
    #: Seconds between two checks (and heartbeat publications) of the watchdog
    #: thread; a hang is reported at most about two of these after its limit.
    poll_s: float = checked(5.0, gt=0)

    def __post_init__(self) -> None:
        check_fields(self, "watchdog")
        for name in ("step_timeout_s", "collective_timeout_s", "data_wait_timeout_s", "heartbeat_timeout_s", "poll_s"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ConfigError(f"watchdog.{name}", value, "must be a finite number of seconds > 0, e.g. 600")
        limits = min(self.step_timeout_s, self.collective_timeout_s, self.data_wait_timeout_s)
        if self.poll_s >= limits:
            raise ConfigError("watchdog.poll_s", self.poll_s,
                              f"must be below every watchdog limit (the smallest is {limits:g} s), e.g. a tenth of it")
        if self.heartbeat_timeout_s < 3 * self.poll_s:
            raise ConfigError("watchdog.heartbeat_timeout_s", self.heartbeat_timeout_s,
                              f"must be at least 3 x watchdog.poll_s = {3 * self.poll_s:g} s (a healthy peer's "
                              "heartbeat is seen up to two polls late); raise it or lower poll_s")
