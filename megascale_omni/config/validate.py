"""Cross-section checks that need the world size (family-independent; each
model family adds its own, see :mod:`megascale_omni.tasks.registry`).

Called on every rank *before* any process group exists, so a bad layout
fails in milliseconds with the same message on every rank.
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
import tempfile
from typing import Optional

from megascale_omni.config.errors import ConfigError
from megascale_omni.config.schema import ControlConfig, JobConfig

#: ``sizeof(sockaddr_un.sun_path) - 1`` on Linux: longest Unix socket path, bytes.
UNIX_SUN_PATH_BYTES = 107
#: The control server binds ``<path>.<pid>.tmp`` first and renames it into
#: place (control/server.py); a Linux pid has at most 7 digits (pid_max 2**22).
BIND_SUFFIX_BYTES = len(".4194304.tmp")
#: Longest ``control.socket_path`` accepted, bytes: the temporary name must fit too.
MAX_UNIX_SOCKET_PATH = UNIX_SUN_PATH_BYTES - BIND_SUFFIX_BYTES
#: Shortest accepted control token, characters.
MIN_TOKEN_CHARS = 16


def data_parallel_size(cfg: JobConfig, world_size: int) -> int:
    """DP size of one replica group: ``world_size // (tp * pp * cp)``."""
    return world_size // cfg.parallel.model_parallel_size


def validate_job(cfg: JobConfig, world_size: int) -> None:
    """Raise ConfigError for the first setting that cannot run on ``world_size`` ranks."""
    par, model, train = cfg.parallel, cfg.model, cfg.train
    mp = par.model_parallel_size
    if world_size % mp:
        raise ConfigError(
            "parallel",
            f"tp={par.tp} pp={par.pp} cp={par.cp}",
            f"world size {world_size} is not divisible by tp*pp*cp={mp}; "
            f"launch a multiple of {mp} processes or change the degrees",
        )
    # Everything megatron splits across TP ranks.
    for name, value in (
        ("model.num_attention_heads", model.num_attention_heads),
        ("model.num_query_groups", model.query_groups),
        ("model.hidden_size", model.hidden_size),
        ("model.ffn_hidden_size", model.ffn_size),
        ("model.make_vocab_size_divisible_by", model.make_vocab_size_divisible_by),
    ):
        require_divisible_by_tp(name, value, par.tp)
    _validate_pipeline_partition(cfg)
    _validate_experts(cfg, world_size)
    if model.family == "llava" and cfg.vision.image_newline and cfg.data.image_mode == "anyres":
        raise ConfigError("vision.image_newline", True, "is not built for data.image_mode=anyres (LLaVA-OneVision "
                          "puts a newline after every row of unpadded tiles); use data.image_mode=resize_crop or "
                          "pad_square (one view per image, then its newline), or vision.image_newline=false")
    if par.sequence_parallel and model.seq_length % (par.tp * par.cp):
        # Each CP rank's share of a row (seq_length / cp tokens) is split over the TP ranks.
        multiple = par.tp * par.cp
        what = f"parallel.tp={par.tp}" if par.cp == 1 else f"parallel.tp*parallel.cp={multiple}"
        raise ConfigError(
            "model.seq_length", model.seq_length,
            f"must be divisible by {what} with sequence_parallel (every TP rank keeps 1/tp of its tokens); "
            f"use {max(model.seq_length // multiple, 1) * multiple}",
        )
    if par.cp > 1:
        _validate_context_parallel(cfg)
    dp = world_size // mp
    per_step = train.micro_batch_size * dp
    if cfg.elastic.enabled:
        _validate_elastic(cfg)
    elif cfg.elastic.standby:
        raise ConfigError("elastic.standby", True, "applies to elastic jobs only; set elastic.enabled=true")
    elif train.global_batch_size % per_step:
        raise ConfigError(
            "train.global_batch_size",
            train.global_batch_size,
            f"must be divisible by micro_batch_size*dp = {train.micro_batch_size}*{dp} = {per_step}; "
            f"use {max(per_step, train.global_batch_size // per_step * per_step)} or change micro_batch_size",
        )
    if cfg.control.enabled:
        _validate_control(cfg)
    row_vision_budget(cfg)


def row_vision_budget(cfg: JobConfig) -> int:
    """Vision-tower tokens one packed row may hold:
    ``data.max_vision_tokens_per_microbatch // train.micro_batch_size`` (0:
    no budget). ConfigError when that is below one tower input (LLaVA)."""
    budget, mbs = cfg.data.max_vision_tokens_per_microbatch, cfg.train.micro_batch_size
    per_input = cfg.vision.tokens_per_image
    if budget and cfg.model.family == "llava" and budget // mbs < per_input:
        raise ConfigError(
            "data.max_vision_tokens_per_microbatch", budget,
            f"leaves {budget // mbs} per packed row (train.micro_batch_size={mbs}), less than one image or frame "
            f"(vision.tokens_per_image={per_input}); use at least {mbs * per_input}, or 0 for no budget",
        )
    return budget // mbs


def validate_paths(cfg: JobConfig) -> None:
    """Directories the job will write must be creatable and writable: not
    files, not under a file (every rank, before any process group)."""
    for name, path in (("logging.output_dir", cfg.logging.output_dir), ("checkpoint.dir", cfg.checkpoint.dir),
                       ("checkpoint.local_dir", cfg.checkpoint.local_dir)):
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(name, path, "exists and is not a directory; choose a directory path")
        problem = directory_problem(path) if path else None
        if problem:
            raise ConfigError(name, path, f"cannot be created: {problem}; choose another directory")


def _validate_pipeline_partition(cfg: JobConfig) -> None:
    """Layer-count checks of ``parallel.pipeline_partition`` that need no cost
    model (memory feasibility is checked by the planner, also before start-up)."""
    par, layers = cfg.parallel, cfg.model.num_layers
    vpp = par.vpp or 1
    chunks = par.pp * vpp
    if layers < chunks:
        raise ConfigError(
            "model.num_layers",
            layers,
            f"needs at least pp*vpp={chunks} layers (one per model chunk); add layers or use "
            f"parallel.pp <= {max(layers // vpp, 1)}" + (" or a smaller parallel.vpp" if par.vpp else ""),
        )
    partition = par.pipeline_partition
    if partition == "uniform" and layers % chunks:
        raise ConfigError(
            "model.num_layers",
            layers,
            f"must be divisible by pp*vpp={chunks} for a uniform pipeline split; "
            f"or set parallel.pipeline_partition: auto",
        )
    if isinstance(partition, list):
        order = " in megatron layout order (virtual stage-major)" if par.vpp else ""
        if len(partition) != chunks:
            raise ConfigError(
                "parallel.pipeline_partition",
                partition,
                f"needs one layer count per model chunk, pp*vpp={chunks} entries{order}",
            )
        if min(partition) < 1:
            raise ConfigError("parallel.pipeline_partition", partition, "every model chunk needs at least 1 layer")
        if sum(partition) != layers:
            raise ConfigError(
                "parallel.pipeline_partition",
                partition,
                f"sums to {sum(partition)} but model.num_layers={layers}; the counts must add up to it",
            )


#: What ``data.pad_to_multiple_of: 0`` pads every LLaVA sample to, whatever
#: the layout: it serves ``parallel.cp`` 1, 2 and 4 (each sample is cut into
#: ``2 * cp`` chunks), so the packed rows, hence the samples of every step,
#: are the same at each of them and across a resume from one to another.
#: Measured cost on the shapes demo: docs/data.md.
DEFAULT_PAD_MULTIPLE = 8


def _validate_experts(cfg: JobConfig, world_size: int) -> None:
    """``moe`` against the layout (docs/moe.md): megatron splits the experts
    over EP ranks inside each pipeline stage (``ep * expert_tp`` ranks of the
    stage's ``world_size / pp``), the rest of the stage's ranks are the
    expert-data-parallel replicas of each expert."""
    moe, par, model = cfg.moe, cfg.parallel, cfg.model
    if not moe.enabled:
        for name, value, off in (("parallel.ep", par.ep, 1), ("parallel.expert_tp", par.expert_tp, None)):
            if value != off:
                raise ConfigError(name, value, f"applies to MoE models only; set moe.num_experts > 0 or {name}: "
                                               f"{'null' if off is None else off}")
        return
    etp = par.expert_tp_size
    if moe.num_experts % par.ep:
        raise ConfigError("moe.num_experts", moe.num_experts,
                          f"must be divisible by parallel.ep={par.ep} (each EP rank holds num_experts / ep experts)")
    stage_ranks = world_size // par.pp
    if stage_ranks % (par.ep * etp):
        raise ConfigError("parallel.ep", par.ep,
                          f"ep * expert_tp = {par.ep} * {etp} must divide the {stage_ranks} ranks of a pipeline "
                          f"stage (world size {world_size} / pp {par.pp}); change ep, expert_tp or the world size")
    if isinstance(moe.layer_freq, list) and len(moe.layer_freq) != model.num_layers:
        raise ConfigError("moe.layer_freq", moe.layer_freq,
                          f"needs one 0/1 per layer: {model.num_layers} entries (model.num_layers)")
    expert_ffn = moe.ffn_hidden_size or model.ffn_size
    if expert_ffn % etp:
        raise ConfigError("moe.ffn_hidden_size", expert_ffn, f"must be divisible by parallel.expert_tp={etp}")
    require_divisible_by_tp("moe.shared_expert_ffn_hidden_size", moe.shared_expert_ffn_hidden_size, par.tp)
    if model.add_bias_linear:
        # megatron 0.16.1's expert MLP adds its fc2 bias in place to the output of a
        # reduce that returns a view (autograd refuses), and ETP > 1 has no biases at all.
        raise ConfigError("model.add_bias_linear", True,
                          "megatron's routed experts do not train with linear biases; set it false "
                          "(Mixtral, Qwen-MoE and DeepSeek have none)")
    if par.tp > 1 and not par.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel", False,
                          "megatron's MoE layer trains under tp > 1 only with sequence parallelism; set it true")
    if cfg.elastic.enabled:
        _validate_elastic_experts(cfg)


def _validate_elastic_experts(cfg: JobConfig) -> None:
    """Replica groups whose model has experts (docs/moe.md#elastic-jobs)."""
    moe, par, train = cfg.moe, cfg.parallel, cfg.train
    if moe.expert_bias:
        # megatron moves the bias inside finalize_model_grads from the tokens of
        # its own TPxDP group, before the commit vote: another replica's tokens
        # would be missing, and a retried step would move it twice.
        raise ConfigError("moe.expert_bias", True,
                          "the aux-loss-free bias update counts one replica group's tokens and is not "
                          "commit-gated; use moe.load_balancing: aux_loss with elastic.enabled")
    microbatches = train.global_batch_size // train.micro_batch_size
    if microbatches % par.ep:
        # Participants receive whole micro-batches, the first ones one more
        # (data/balance.microbatch_shares): EP ranks of a group run the same
        # micro-batches whatever the participant count iff ep divides their number.
        raise ConfigError(
            "train.global_batch_size", train.global_batch_size,
            f"gives {microbatches} micro-batches of {train.micro_batch_size}, not divisible by parallel.ep="
            f"{par.ep}: every rank of an expert-parallel group must run the same micro-batches (its all-to-all) "
            f"for any participant count; use a multiple of {par.ep * train.micro_batch_size}",
        )


def sequence_multiple(cfg: JobConfig) -> int:
    """What every LLaVA sample is padded to before packing: ``data.pad_to_multiple_of``,
    or :data:`DEFAULT_PAD_MULTIPLE` for 0 (never the layout). Raises
    ConfigError naming ``data.pad_to_multiple_of`` when the default cannot
    serve ``parallel.cp`` (an explicit value is checked with the layout)."""
    if cfg.data.pad_to_multiple_of:
        return cfg.data.pad_to_multiple_of
    chunks = 2 * cfg.parallel.cp
    if DEFAULT_PAD_MULTIPLE % chunks:
        need = math.lcm(DEFAULT_PAD_MULTIPLE, chunks)
        raise ConfigError(
            "data.pad_to_multiple_of", 0,
            f"the default pads samples to {DEFAULT_PAD_MULTIPLE} tokens, which serves parallel.cp 1, 2 and 4 but "
            f"not parallel.cp={cfg.parallel.cp} (each sample is cut into 2*cp={chunks} chunks); set "
            f"data.pad_to_multiple_of={need}, and keep it for every layout and resume of this run",
        )
    return DEFAULT_PAD_MULTIPLE


def _validate_context_parallel(cfg: JobConfig) -> None:
    """CP splits each sequence into ``2 * cp`` equal chunks (docs/context_parallel.md)."""
    par, model = cfg.parallel, cfg.model
    chunks = 2 * par.cp
    if cfg.data.pad_to_multiple_of and cfg.data.pad_to_multiple_of % chunks:
        raise ConfigError(
            "data.pad_to_multiple_of", cfg.data.pad_to_multiple_of,
            f"must be a multiple of 2*parallel.cp={chunks} (each sample is cut into 2*cp chunks); "
            f"use {math.lcm(cfg.data.pad_to_multiple_of, chunks)}",
        )
    if model.attention_dropout and model.layer_impl != "transformer_engine":
        raise ConfigError(
            "model.attention_dropout", model.attention_dropout,
            "ring attention (parallel.cp > 1 with the local layer spec) has no attention dropout; set it to 0, "
            "or use model.layer_impl: transformer_engine on a GPU",
        )


def require_cp_seq_length(cfg: JobConfig) -> None:
    """Language-model families (packed THD batches) under CP: packed rows must
    split into ``2 * cp`` chunks (each sample is padded to a multiple of
    ``2 * cp`` already, :func:`sequence_multiple`, so the row's padding tail
    is one too), and the CP communication must take THD."""
    par, model = cfg.parallel, cfg.model
    if par.cp == 1:
        return
    if par.cp_comm_type == "allgather":
        raise ConfigError(
            "parallel.cp_comm_type", "allgather",
            "transformer-engine's all_gather CP refuses packed (THD) sequences; use p2p, a2a or a2a+p2p",
        )
    chunks = 2 * par.cp
    if model.seq_length % chunks:
        raise ConfigError(
            "model.seq_length", model.seq_length,
            f"must be a multiple of {chunks} (2*parallel.cp) under context parallelism (each packed row is cut "
            f"into 2*cp chunks); use {max(model.seq_length // chunks, 1) * chunks}",
        )


def _validate_elastic(cfg: JobConfig) -> None:
    """Elastic jobs split the global batch at micro-batch granularity among
    a participant count that changes while training (see docs/elastic.md)."""
    train = cfg.train
    if train.global_batch_size % train.micro_batch_size:
        raise ConfigError(
            "train.global_batch_size", train.global_batch_size,
            f"must be a multiple of train.micro_batch_size={train.micro_batch_size} with elastic.enabled "
            "(replicas receive whole micro-batches)",
        )
    if cfg.elastic.standby and not cfg.control.enabled:
        raise ConfigError(
            "elastic.standby", True,
            "needs the control socket (a standby joins on `omni-ctl join`); set control.enabled=true",
        )
    watchdog = cfg.watchdog
    if watchdog.enabled and watchdog.collective_timeout_s <= cfg.elastic.timeout_s:
        # A survivor waits in the cross-replica sums for a lost group until
        # torchft abandons the step (elastic.timeout_s); the watchdog must not
        # tear the survivor down first.
        raise ConfigError(
            "watchdog.collective_timeout_s", watchdog.collective_timeout_s,
            f"must exceed elastic.timeout_s={cfg.elastic.timeout_s:g} (torchft abandons a step whose peer "
            "replica group is lost; survivors must not be torn down first)",
        )
    survivor_wait = watchdog.collective_timeout_s + cfg.elastic.timeout_s
    if watchdog.enabled and watchdog.step_timeout_s <= survivor_wait:
        # A survivor waits in the cross-replica sums (judged by the step
        # deadline) until the stuck group's own watchdog tears it down
        # (collective_timeout_s) and torchft abandons the step (elastic.timeout_s).
        raise ConfigError(
            "watchdog.step_timeout_s", watchdog.step_timeout_s,
            f"must exceed watchdog.collective_timeout_s + elastic.timeout_s = {survivor_wait:g} in an elastic job "
            "(a survivor waits that long for a peer group with a stuck rank; the watchdog must not tear it down "
            "first)",
        )


def require_divisible_by_tp(name: str, value: int, tp: int) -> None:
    if value % tp:
        raise ConfigError(
            name, value, f"must be divisible by parallel.tp={tp} (megatron splits it across TP ranks); "
            f"use a multiple of {tp} or a smaller tp",
        )


def control_socket_path(cfg: JobConfig) -> str:
    """Absolute Unix socket path of the control server.

    ``control.socket_path`` when set; else ``<output_dir>/control.sock``, or,
    when that exceeds the Unix limit, a short path in the temp directory
    derived from the run directory (``control.json`` in the run directory
    always names the socket in use).
    """
    if cfg.control.socket_path:
        return os.path.abspath(cfg.control.socket_path)
    run_dir = os.path.abspath(cfg.logging.output_dir)
    path = os.path.join(run_dir, "control.sock")
    if len(os.fsencode(path)) <= MAX_UNIX_SOCKET_PATH:
        return path
    digest = hashlib.sha256(os.fsencode(run_dir)).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"megascale-{digest}.sock")


def load_control_token(control: ControlConfig) -> Optional[str]:
    """The control token from ``control.token_file``, else from the environment
    variable ``control.token_env``; None when neither is set. Never logged."""
    if control.token_file is not None:
        try:
            with open(control.token_file, encoding="utf-8") as f:
                token = f.readline().strip()
        except OSError as e:
            raise ConfigError(
                "control.token_file", control.token_file, f"cannot be read ({e.strerror}); create it (chmod 600)"
            ) from None
        source = "control.token_file"
    else:
        token = os.environ.get(control.token_env, "").strip()
        source = f"environment variable {control.token_env}"
    if not token:
        return None
    if len(token) < MIN_TOKEN_CHARS:
        # The value itself is a secret: name where it came from, never what it is.
        raise ConfigError(
            "control.token_file" if control.token_file else "control.token_env",
            control.token_file or control.token_env,
            f"the token from {source} is shorter than {MIN_TOKEN_CHARS} characters; "
            "use e.g. `python -c 'import secrets; print(secrets.token_hex(16))'`",
        )
    return token


def directory_problem(directory: str) -> Optional[str]:
    """Why ``directory`` cannot be created or written by this process (None:
    it can): the nearest existing ancestor (or ``directory`` itself) must be a
    directory we may write and enter. Checks only, creates nothing."""
    path = os.path.abspath(directory)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        return f"{path} is a file, not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable by this user"
    return None


def _validate_control(cfg: JobConfig) -> None:
    path = control_socket_path(cfg)
    if len(os.fsencode(path)) > MAX_UNIX_SOCKET_PATH:
        raise ConfigError(
            "control.socket_path",
            path,
            f"Unix socket paths are limited to {MAX_UNIX_SOCKET_PATH} bytes; set a shorter "
            "control.socket_path (e.g. /tmp/<job>.sock) or leave it unset for an automatic one",
        )
    if cfg.control.socket_path:
        # The server creates the socket's directory and binds there after the
        # model is built; a path it cannot use must fail now, naming the field.
        # (The default lives in logging.output_dir, checked by validate_paths.)
        value = cfg.control.socket_path
        problem = directory_problem(os.path.dirname(path))
        if problem:
            raise ConfigError("control.socket_path", value,
                              f"cannot hold the control socket: {problem}; choose another path")
        if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ConfigError("control.socket_path", value,
                              f"{path} exists and is not a socket; remove it or choose another path")
    token = load_control_token(cfg.control)
    if cfg.control.tcp_port is not None and token is None:
        raise ConfigError(
            "control.tcp_port",
            cfg.control.tcp_port,
            f"TCP control needs a token: write one to a file (chmod 600) and set control.token_file, "
            f"or export {cfg.control.token_env}; or set control.tcp_port: null (Unix socket only)",
        )


def validate_platform(cfg: JobConfig, cuda: bool) -> None:
    """Settings that need CUDA (every rank, after the device is known and
    before any process group starts)."""
    if cuda:
        return
    if cfg.moe.enabled and cfg.parallel.expert_tp_size > 1:
        raise ConfigError(
            "parallel.expert_tp", cfg.parallel.expert_tp,
            f"expert TP {cfg.parallel.expert_tp_size} (null means tp) all-gathers uneven token counts, which gloo "
            "refuses; set parallel.expert_tp: 1 on CPU",
        )
    if cfg.logging.memory_fraction_cap:
        raise ConfigError("logging.memory_fraction_cap", cfg.logging.memory_fraction_cap,
                          "caps the CUDA caching allocator; there is none on CPU: set 0")
