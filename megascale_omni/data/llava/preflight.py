"""A LLaVA job's inputs checked from its files alone, before any process group.

The family's ``validate`` runs :func:`check_inputs` on every rank and in
omni-run before any worker starts, so a wrong path or a vocabulary or
sequence too small for the data is one ``config error`` line, never a
failure inside the workers. It reads ``tokenizer.json`` and
``preprocessor_config.json`` only: no dataset is scanned or built, no
``transformers`` tokenizer or model is loaded (what cannot be known that
way, :class:`~megascale_omni.data.llava.module.ConversationData` still
checks when it builds).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Optional

from megascale_omni.config import ConfigError, JobConfig
from megascale_omni.config.validate import sequence_multiple
from megascale_omni.data.dataset_root import check_paths, load_tokenizer
from megascale_omni.data.tokenizer import TOKENIZER_FILENAME

HOW_TO_MAKE = "`python tools/make_shapes_dataset.py --out <dir>` or tools/ingest_llava.py"


def tokenizer_dir(cfg: JobConfig, root: Path) -> Path:
    """The directory of ``data.tokenizer`` (a file's parent), else the dataset's."""
    if not cfg.data.tokenizer:
        return root
    path = Path(cfg.data.tokenizer)
    return path if path.is_dir() else path.parent


def blend_train_split(i: int, path: str) -> Path:
    """The ``train/`` split of ``data.blend[i]`` (ConfigError without its index)."""
    split = Path(path) / "train"
    if not (split / "index.json").is_file():
        raise ConfigError(f"data.blend[{i}].path", path,
                          "has no train/index.json; give a dataset directory written by tools/ingest_llava.py "
                          "or tools/make_shapes_dataset.py")
    return split


def check_vocab_size(cfg: JobConfig, tokenizer_vocab: int) -> None:
    """``model.vocab_size`` (0: the tokenizer's) must hold every tokenizer id."""
    if cfg.model.vocab_size and cfg.model.vocab_size < tokenizer_vocab:
        raise ConfigError(
            "model.vocab_size", cfg.model.vocab_size,
            f"is smaller than the tokenizer's {tokenizer_vocab}; set 0 to use the tokenizer's",
        )


def check_inputs(cfg: JobConfig, default_vocab: Optional[Callable[[JobConfig], int]] = None) -> None:
    """Raise ConfigError for the first LLaVA input that cannot work (every
    rank and omni-run, before any process group): ``data.path`` and each
    ``data.blend`` member without a ``train/`` split, a ``data.tokenizer``
    or ``data.image_processor`` that does not exist, ``model.vocab_size``
    below the tokenizer's (``default_vocab(cfg)``: the embedded default
    dataset's, known without building it), and ``model.seq_length`` with no
    room for one image."""
    root = check_paths(cfg, default_available=True, how_to_make=HOW_TO_MAKE)
    for i, source in enumerate(cfg.data.blend):
        blend_train_split(i, source.path)
    if cfg.data.image_processor and not Path(cfg.data.image_processor).exists():
        raise ConfigError("data.image_processor", cfg.data.image_processor,
                          "does not exist; point it at the tower's preprocessor_config.json (or its directory), "
                          "or set null")
    vocab = _tokenizer_vocab(cfg, root, default_vocab)
    if vocab is not None:
        check_vocab_size(cfg, vocab)
    _check_one_image_fits(cfg, root)


def _tokenizer_vocab(cfg: JobConfig, root: Optional[Path],
                     default_vocab: Optional[Callable[[JobConfig], int]]) -> Optional[int]:
    """The tokenizer's vocabulary size when it can be read cheaply, else None."""
    if root is None and not cfg.data.tokenizer:  # the embedded default dataset, built by the workers
        return default_vocab(cfg) if default_vocab is not None and cfg.model.vocab_size else None
    if cfg.data.format == "words":
        # What the workers load (ConfigError for a wrong path, DataFileError,
        # exit 3, for a file that is no tokenizer); tokenizers only, cheap.
        return load_tokenizer(cfg, root or Path(cfg.data.tokenizer)).vocab_size  # root unused with data.tokenizer
    directory = tokenizer_dir(cfg, root or Path(cfg.data.tokenizer))
    if not directory.is_dir():
        raise ConfigError("data.tokenizer", str(directory),
                          "data.format=chat needs a Hugging Face tokenizer directory; point data.tokenizer at one")
    if not (cfg.model.vocab_size and (directory / TOKENIZER_FILENAME).is_file()):
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(directory / TOKENIZER_FILENAME)).get_vocab_size(with_added_tokens=True)
    except Exception:  # noqa: BLE001 - the Rust backend raises bare Exceptions; the workers report it, exit 3
        return None


def _check_one_image_fits(cfg: JobConfig, root: Optional[Path]) -> None:
    """A sequence must hold one image's tokens (anyres: its fewest views) and
    some text; otherwise every sample with an image is excluded, which ends
    as a data error after the whole dataset was scanned."""
    tokens, views = cfg.vision.tokens_per_image, _fewest_views(cfg, root)
    need = tokens * views
    if cfg.model.seq_length > need:
        return
    multiple = math.lcm(64, sequence_multiple(cfg))
    what = f"{views} anyres views x {tokens}" if views > 1 else f"vision.tokens_per_image={tokens}"
    raise ConfigError(
        "model.seq_length", cfg.model.seq_length,
        f"has no room for one image ({need} tokens: {what}) and its text, so every sample with an image "
        f"would be excluded; use e.g. {(need // multiple + 1) * multiple}, or a smaller vision.image_size",
    )


def _fewest_views(cfg: JobConfig, root: Optional[Path]) -> int:
    """Tower inputs of the smallest image: 1, or with ``anyres`` the overview
    plus the tiles of the smallest grid of ``image_grid_pinpoints``."""
    if cfg.data.image_mode != "anyres":
        return 1
    from megascale_omni.data.image_preprocess import PreprocessorSpec, find_preprocessor_config

    source = cfg.data.image_processor
    beside = tokenizer_dir(cfg, root) if root is not None or cfg.data.tokenizer else None
    if source is None and beside is not None and (found := find_preprocessor_config(beside)) is not None:
        source = str(found)
    try:
        spec = PreprocessorSpec.from_file(source) if source else PreprocessorSpec.plain(cfg.vision.image_size)
    except (OSError, ValueError) as err:
        raise ConfigError("data.image_processor", source, f"cannot be used: {err}") from None
    side = cfg.vision.image_size
    return 1 + min(math.ceil(h / side) * math.ceil(w / side) for h, w in spec.grid_pinpoints)
