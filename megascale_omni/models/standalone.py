"""One-process models for tools (import, export, generation): the same
megatron modules training builds, at TP1/PP1 in a one-rank process group.

    with one_process(seed=0):
        model = build_model(cfg, padded_vocab, image_token_id)

Checkpoints written or read here reshard to and from any training layout
through dist_checkpointing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch

from megascale_omni.config import JobConfig, ParallelConfig
from megascale_omni.config.errors import ConfigError


def single_process_config(cfg: JobConfig) -> JobConfig:
    """``cfg`` with a one-process layout (TP1, PP1, no VPP, no sequence parallelism)."""
    return dataclasses.replace(cfg, parallel=ParallelConfig())


@contextlib.contextmanager
def one_process(seed: int = 0) -> Iterator[None]:
    """A one-rank process group and megatron's TP1/PP1 parallel state for the
    duration of the block (plain ``python``, not torchrun). A process group
    and rendezvous variables created here are removed at the end, so a
    caller (e.g. a test) can start other processes afterwards. Torn down
    with the default process group: not for use inside a training process."""
    import os

    import torch.distributed as dist

    from megascale_omni.parallel import ParallelDims
    from megascale_omni.parallel.state import destroy_parallel, initialize_parallel
    from megascale_omni.platform import init_platform
    from megascale_omni.platform.device import init_distributed

    owns_group = not dist.is_initialized()
    saved_env = {k: os.environ.get(k) for k in _RENDEZVOUS_ENV}
    platform = init_platform()
    _, world = init_distributed(platform)
    if world != 1:
        raise ConfigError("WORLD_SIZE", world, "run this tool with plain python (one process); checkpoints are "
                          "resharded to one process whatever layout wrote them")
    initialize_parallel(ParallelDims.from_config(ParallelConfig(), 1), seed)
    try:
        yield
    finally:
        destroy_parallel()  # the default group too
        if owns_group:
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


_RENDEZVOUS_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def build_model(cfg: JobConfig, padded_vocab: int, image_token_id: int = -1, video_token_id: int = -1
                ) -> torch.nn.Module:
    """The fp32 model of ``cfg.model.family`` (``gpt`` or ``llava``) at TP1/PP1,
    inside :func:`one_process`."""
    cfg = single_process_config(cfg)
    family = cfg.model.family
    if family == "llava":
        from megascale_omni.models.llava import build_llava_chunks

        return build_llava_chunks(cfg, torch.float32, padded_vocab, image_token_id, video_token_id)[0]
    if family == "gpt":
        from megascale_omni.models.gpt import build_gpt_chunks, transformer_config

        config = transformer_config(cfg.model, cfg.parallel, torch.float32, cfg.moe)
        return build_gpt_chunks(cfg.model, config, vocab_size=padded_vocab,
                                max_sequence_length=cfg.model.seq_length)[0]
    raise ConfigError("model.family", family, "this tool handles the gpt and llava families")
