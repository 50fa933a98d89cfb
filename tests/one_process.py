"""A tiny GPT Trainer in the test process itself (a gloo world of one), for
tests that patch the library in-process and need no launcher."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

import pytest

from megascale_omni.entry import parse_for_family
from megascale_omni.training.trainer import Trainer

#: Launcher variables that would make the Trainer join another world.
ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def tiny_gpt_trainer(monkeypatch: pytest.MonkeyPatch, run: Path, *overrides: str) -> Iterator[Trainer]:
    """``examples/gpt/tiny.yaml`` writing into ``run`` with ``overrides``;
    closed, and the variables its process group set removed, on exit."""
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    cfg, family = parse_for_family("gpt", [
        "--config", "examples/gpt/tiny.yaml", f"logging.output_dir={run}", "logging.tensorboard=false",
        "logging.progress_bar=false", *overrides,
    ], world_size=1)
    trainer = Trainer(cfg, family)
    try:
        yield trainer
    finally:
        trainer.close()
        for var in ENV:
            os.environ.pop(var, None)
