"""Device and collective-backend choice, process-group start-up and seeding.

``platform.device: auto`` (the default) picks ``cuda + nccl`` when CUDA is
available, otherwise ``cpu + gloo`` with the megatron-core CPU compatibility
layer installed. ``cuda`` insists on a GPU (a host without one is a config
error, so a GPU job never silently trains on CPU); ``cpu`` forces the CPU
path on a GPU host. Nothing else in the project branches on the device type.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megascale_omni.config.errors import ConfigError
from megascale_omni.platform import cpu_compat

logger = logging.getLogger(__name__)

#: Collective timeout. A hung gloo collective (peer died) must fail fast,
#: never block a job or CI forever. Override with MEGASCALE_DIST_TIMEOUT_S.
DEFAULT_TIMEOUT_S = 300


@dataclass(frozen=True)
class Platform:
    """What this process runs on. Built once per process by :func:`init_platform`."""

    device: torch.device
    backend: str
    #: Names of the megatron-core CPU patches in effect (empty on CUDA).
    cpu_patches: tuple[str, ...]

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def default_dtype(self, precision: str) -> torch.dtype:
        """Parameter/compute dtype for a ``train.precision`` setting."""
        if precision == "fp32" or (precision == "auto" and not self.is_cuda):
            return torch.float32
        return torch.bfloat16


def init_platform(device: str = "auto", cpu_patches: bool = True) -> Platform:
    """Choose device/backend for ``platform.device`` (auto | cuda | cpu) and
    install the CPU patches on CPU (every rank, first thing; ``cpu_patches=False``
    for processes that build no megatron object, e.g. ``omni-preflight``).
    Raises ConfigError for ``cuda`` on a host without CUDA."""
    check_device(device)
    if device != "cpu" and torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return Platform(torch.device("cuda", local_rank), "nccl", ())
    patches = cpu_compat.install() if cpu_patches else []
    return Platform(torch.device("cpu"), "gloo", tuple(patches))


def check_device(device: str) -> None:
    """Raise ConfigError when ``platform.device`` asks for CUDA on a host without it."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("platform.device", device, "CUDA is not available on this host (torch.cuda.is_available() "
                                                     "is False); run on a GPU node, or set platform.device: cpu")


def init_distributed(platform: Platform, timeout_s: int | None = None) -> tuple[int, int]:
    """Start the default process group (every rank). Returns ``(rank, world_size)``.

    Works under ``torchrun`` (env:// rendezvous) and under plain ``python``,
    where it creates a one-rank group on a free loopback port so that the
    same megatron code paths run.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    timeout = datetime.timedelta(seconds=timeout_s or dist_timeout_s())
    store, rank, world_size = attempt_store(timeout)
    dist.init_process_group(backend=platform.backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def attempt_store(timeout: datetime.timedelta) -> tuple[dist.Store, int, int]:
    """``(store, rank, world_size)`` of the env:// rendezvous, the store's keys
    under a prefix of this launch attempt (``TORCHELASTIC_RESTART_COUNT``).

    Why not plain ``init_process_group(init_method="env://")``: under
    ``torchrun --max-restarts`` with a static rendezvous (``--master-addr``/
    ``--master-port``), the agent's store still holds the first attempt's gloo
    keys when the workers restart, and a restarted rank may read a dead peer's
    address from them: ``Gloo connectFullMesh failed ... Connection refused``
    (torch 2.13; 2 of 3 tries of a two-rank restart here). A prefix per
    attempt gives each attempt its own keys, so ``--max-restarts`` works
    (tests/dist/test_hang_detection.py, docs/hang-detection.md).
    """
    from torch.distributed.rendezvous import rendezvous

    store, rank, world_size = next(rendezvous("env://", timeout=timeout))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return dist.PrefixStore(f"/megascale_omni/attempt_{attempt}", store), rank, world_size


def dist_timeout_s() -> int:
    """Seconds a collective of the default process group may block before it
    raises (``MEGASCALE_DIST_TIMEOUT_S``, default :data:`DEFAULT_TIMEOUT_S`)."""
    return int(os.environ.get("MEGASCALE_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) generators (every rank)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
