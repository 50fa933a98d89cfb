"""A local Hugging Face model directory: its config and its safetensors weights.

Nothing is downloaded: the directory is what ``save_pretrained`` wrote
(``config.json`` plus ``model.safetensors`` or ``model.safetensors.index.json``
and its shards). Tensors are read lazily, one at a time, so a large model is
never held in memory twice.

Errors a user can fix raise :class:`ConfigError` (exit 2: not a model
directory, unsupported architecture); a broken directory (missing shard,
unreadable file, missing tensor) raises :class:`CheckpointError` (exit 4).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

import torch

from megascale_omni.checkpoint.errors import CheckpointError
from megascale_omni.config.errors import ConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class HFDirectory:
    """Read access to one Hugging Face model directory (``field`` names the
    command-line option it came from, for error messages)."""

    def __init__(self, path: str | Path, field: str):
        self.path = Path(path)
        self.field = field
        if not self.path.is_dir():
            raise ConfigError(field, str(self.path), "is not a directory; pass a local Hugging Face model "
                              "directory (what save_pretrained writes)")
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise ConfigError(field, str(self.path), "is not a Hugging Face model directory (no config.json); "
                              "pass the directory save_pretrained wrote")
        try:
            self.config: dict = json.loads(config_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{config_file}: unreadable config ({e}); re-save the model") from None
        self._where = self._locate_tensors()
        self._open: dict[Path, object] = {}
        #: Names of the tensors :meth:`tensor` handed out (what a mapping used).
        self.read: set[str] = set()

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or []
        return archs[0] if archs else ""

    def _locate_tensors(self) -> dict[str, Path]:
        """Tensor name -> the safetensors file that holds it."""
        index = self.path / INDEX_FILE
        single = self.path / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: unreadable safetensors index ({e!r}); re-save the model") from None
            where = {name: self.path / shard for name, shard in weight_map.items()}
            for shard in sorted(set(where.values())):
                if not shard.is_file():
                    raise CheckpointError(f"{shard}: shard listed in {INDEX_FILE} is missing; copy the complete "
                                          "model directory")
            return where
        if single.is_file():
            return {name: single for name in self._keys_of(single)}
        if any(self.path.glob("*.bin")):
            raise ConfigError(self.field, str(self.path), "holds PyTorch .bin weights; we read safetensors only "
                              "(re-save with save_pretrained(..., safe_serialization=True))")
        raise CheckpointError(f"{self.path}: no {SINGLE_FILE} or {INDEX_FILE}; copy the model's weights too")

    @staticmethod
    def _keys_of(file: Path) -> list[str]:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(file), framework="pt") as f:
                return list(f.keys())
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: unreadable safetensors file ({e}); re-download or re-save it") from None

    def names(self) -> list[str]:
        return list(self._where)

    def find_prefix(self, suffix: str, exclude: Iterable[str] = ()) -> Optional[str]:
        return find_prefix(self._where, suffix, exclude)

    def has(self, name: str) -> bool:
        return name in self._where

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor (a fresh CPU copy). Raises CheckpointError when missing."""
        file = self._where.get(name)
        if file is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the weights "
                                  f"({len(self._where)} tensors); the directory does not match its config.json")
        from safetensors import SafetensorError, safe_open

        try:
            handle = self._open.get(file)
            if handle is None:
                handle = self._open[file] = safe_open(str(file), framework="pt")
            tensor = handle.get_tensor(name).clone()
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: cannot read tensor {name!r} ({e}); the file is damaged") from None
        self.read.add(name)
        return tensor


def with_defaults(config: dict, field: str) -> dict:
    """``config`` as ``transformers`` reads it: every field its config class
    (by ``model_type``) fills in, nested ``text_config`` / ``vision_config``
    too. Published ``config.json`` files leave defaults out
    (google/siglip-so400m-patch14-384's ``vision_config`` has no
    ``hidden_act``; llava-hf/llava-1.5-7b-hf's ``text_config`` no
    ``hidden_size``), so reading the raw file would refuse or misread them.
    An unknown ``model_type`` comes back unchanged for the caller to refuse."""
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        raise ConfigError(field, config.get("model_type"), "reading Hugging Face configs needs transformers: "
                          "pip install -e '.[hf]'") from None
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return dict(config)
    try:
        return CONFIG_MAPPING[model_type](**config).to_dict()
    except (KeyError, TypeError, ValueError) as e:  # e.g. a sub-config of a model_type transformers lacks
        first = str(e).splitlines()[0].split(". ")[0] if str(e) else type(e).__name__
        raise ConfigError(field, model_type, f"transformers cannot read this config ({first}); check config.json "
                          "against the transformers version installed") from None


def find_prefix(names: Iterable[str], suffix: str, exclude: Iterable[str] = ()) -> Optional[str]:
    """The prefix ``p`` of the one tensor in ``names`` named ``p + suffix``
    (the shortest when several are; None if absent), skipping names that
    start with any of ``exclude``."""
    exclude = tuple(exclude)
    hits = [n[: -len(suffix)] for n in names if n.endswith(suffix) and not n.startswith(exclude)]
    hits = [h for h in hits if h == "" or h.endswith(".")]
    return min(hits, key=len) if hits else None


def expect_shape(tensor: torch.Tensor, shape: tuple[int, ...], name: str, source: Path) -> torch.Tensor:
    """``tensor`` if its shape is ``shape``; CheckpointError naming ``name`` otherwise."""
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)} but config.json implies "
                              f"{tuple(shape)}; the weights do not match the config")
    return tensor
