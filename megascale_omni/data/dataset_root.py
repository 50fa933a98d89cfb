"""Where a data module's dataset and tokenizer come from (every rank)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from megascale_omni.config import ConfigError, JobConfig
from megascale_omni.data.tokenizer import TextTokenizer

#: ``cfg -> dataset directory``: a family's embedded default dataset, built on
#: first use (the registry's ``default_dataset``, e.g. the shapes demo).
DefaultDataset = Callable[[JobConfig], Path]


def check_dataset_root(cfg: JobConfig, default_available: bool, how_to_make: str) -> Optional[Path]:
    """``data.path`` as a directory with a ``train/`` split, or None when it is
    null and the family has an embedded default (ConfigError otherwise).
    Stat calls only: validation runs it before any process group."""
    if cfg.data.path is None:
        if not default_available:
            raise ConfigError("data.path", None, f"this model family has no embedded default; build a dataset with "
                              f"{how_to_make} and set data.path to it")
        return None
    root = Path(cfg.data.path)
    if not root.exists():
        raise ConfigError("data.path", str(root), f"does not exist; build a dataset there with {how_to_make} "
                          "or set data.path: null for the embedded default")
    if not (root / "train").is_dir():
        raise ConfigError(
            "data.path", str(root),
            f"has no train/ split; build one with {how_to_make} or set data.path: null for the embedded default",
        )
    return root


def check_paths(cfg: JobConfig, default_available: bool, how_to_make: str) -> Optional[Path]:
    """:func:`check_dataset_root`, and ``data.tokenizer`` must exist when set."""
    root = check_dataset_root(cfg, default_available, how_to_make)
    if cfg.data.tokenizer and not Path(cfg.data.tokenizer).exists():
        raise ConfigError("data.tokenizer", cfg.data.tokenizer,
                          "does not exist; point it at a tokenizer.json or directory")
    return root


def resolve_dataset_root(cfg: JobConfig, build_default: Optional[DefaultDataset], how_to_make: str) -> Path:
    """The dataset directory (every rank): ``data.path`` (see
    :func:`check_dataset_root`), or the embedded default built on first use by
    ``build_default(cfg)`` when ``data.path`` is null."""
    root = check_dataset_root(cfg, build_default is not None, how_to_make)
    return Path(build_default(cfg)) if root is None else root


def load_tokenizer(cfg: JobConfig, root: Path) -> TextTokenizer:
    """``data.tokenizer``, or ``<root>/tokenizer.json`` beside the shards.

    Raises ConfigError (exit 2) when the path does not exist or is a
    directory without a tokenizer, DataFileError (exit 3) when the file is
    not a usable tokenizer."""
    path = Path(cfg.data.tokenizer) if cfg.data.tokenizer else root / "tokenizer.json"
    if not path.exists():
        raise ConfigError("data.tokenizer", str(path), "does not exist; point it at a tokenizer.json or directory")
    try:
        return TextTokenizer.from_path(path)
    except FileNotFoundError as err:  # a directory without a tokenizer in it: a wrong path
        raise ConfigError("data.tokenizer", str(path), str(err)) from None
