"""Where a data module's dataset and tokenizer come from (every rank)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from megascale_omni.config import ConfigError, JobConfig
from megascale_omni.data.tokenizer import TextTokenizer

#: ``cfg -> dataset directory``: a family's embedded default dataset, built on
#: first use (the registry's ``default_dataset``, e.g. the shapes demo).
DefaultDataset = Callable[[JobConfig], Path]


def resolve_dataset_root(cfg: JobConfig, build_default: Optional[DefaultDataset], how_to_make: str) -> Path:
    """The dataset directory (every rank): ``data.path``, which must have a
    ``train/`` split, or the embedded default built on first use by
    ``build_default(cfg)`` when ``data.path`` is null (ConfigError without one)."""
    if cfg.data.path is None:
        if build_default is None:
            raise ConfigError("data.path", None, f"this model family has no embedded default; build a dataset with "
                              f"{how_to_make} and set data.path to it")
        return Path(build_default(cfg))
    root = Path(cfg.data.path)
    if not (root / "train").is_dir():
        raise ConfigError(
            "data.path", str(root),
            f"has no train/ split; build one with {how_to_make} or set data.path: null for the embedded default",
        )
    return root


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
