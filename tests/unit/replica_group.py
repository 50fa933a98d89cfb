"""A one-rank replica group in this process, as torchrun gives one to a
torchft manager (unit tests of the elastic package)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch.distributed as dist

from tests.launcher import free_port


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A gloo default group of one rank whose store is at MASTER_ADDR/PORT,
    where torchft's manager finds its group's store; removed at the end."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MASTER_ADDR", "127.0.0.1")
    mp.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", init_method="env://", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        mp.undo()
