"""The Hugging Face files a model needs besides its weights: tokenizer, chat
template and image processor config. They travel inside every checkpoint of
a run that started from an import::

    step_00000120/tokenizer/tokenizer.json
    step_00000120/tokenizer/tokenizer_config.json      (chat template inside, or
    step_00000120/tokenizer/chat_template.jinja         in a file of its own)
    step_00000120/tokenizer/processor_config.json      (LLaVA: image processor)
    ...

Copies, not references: a checkpoint stays self-contained (copy one step
directory and it exports), and the commit marker lists the files with their
sha256 like every other file of the checkpoint, so verification covers them.
They are a few MB at most, against the model's hundreds.

The files are held in memory (:class:`HFAssets`) from the moment the run reads
them (the import, ``checkpoint.pretrained`` or the resumed checkpoint), so a
source deleted during a long run does not lose them. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from megascale_omni.checkpoint.errors import CheckpointError
from megascale_omni.utils.files import atomic_write_bytes

logger = logging.getLogger(__name__)

#: The sub-directory of a step directory (and of an import output) that holds them.
ASSET_DIR = "tokenizer"
#: Files that define the tokenizer; one of them makes a directory a tokenizer source.
TOKENIZER_MODEL_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
#: Image preprocessing files (``processor_config.json``: transformers >= 5 embeds the image processor).
PREPROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
#: Every file that travels, whichever of them the source has.
ASSET_FILES = (*TOKENIZER_MODEL_FILES, "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
               "merges.txt", "chat_template.jinja", "chat_template.json", *PREPROCESSOR_FILES)


@dataclass(frozen=True)
class HFAssets:
    """File name -> content. Empty (``enabled`` False) for a run that did not
    start from a Hugging Face import: nothing is written then."""

    files: dict[str, bytes] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.files)

    @classmethod
    def from_sources(cls, sources: Iterable[Path]) -> "HFAssets":
        """The tokenizer files of the first source with a tokenizer, and the
        preprocessor files of the first source with one (an LLM + tower
        import: the LLM's tokenizer and chat template, the tower's
        ``preprocessor_config.json``)."""
        sources = list(sources)
        chosen: dict[str, Path] = {}
        for src in sources:
            found = [src / n for n in ASSET_FILES if (src / n).is_file()]
            if any(f.name in TOKENIZER_MODEL_FILES for f in found):
                chosen.update({f.name: f for f in found})
                break
        for src in sources:
            found = [src / n for n in PREPROCESSOR_FILES if (src / n).is_file()]
            if found:
                for f in found:
                    chosen.setdefault(f.name, f)
                break
        return cls({name: f.read_bytes() for name, f in sorted(chosen.items())})

    @classmethod
    def from_checkpoint(cls, step_dir: Path, commit: dict) -> "HFAssets":
        """The files ``commit`` (the step directory's parsed ``commit.json``)
        lists under ``tokenizer/``, each checked against its sha256: what the
        run reads is exactly what was committed. A file added after the
        commit is not one of them. Raises CheckpointError naming a file that
        changed."""
        files = {}
        prefix = f"{ASSET_DIR}/"
        for rel, meta in sorted(commit.get("files", {}).items()):
            if not rel.startswith(prefix) or "/" in rel[len(prefix):]:
                continue
            try:
                data = (step_dir / rel).read_bytes()
            except OSError as e:
                raise CheckpointError(f"checkpoint {step_dir}: cannot read {rel} ({e}); restore the checkpoint "
                                      "from another tier or a copy") from None
            if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
                raise CheckpointError(f"checkpoint {step_dir}: {rel}: sha256 mismatch (changed after the commit); "
                                      "restore the checkpoint from another tier or a copy")
            files[rel[len(prefix):]] = data
        return cls(files)

    def write(self, directory: Path, durable: bool = False) -> None:
        """Write every file into ``directory`` (created), each atomically."""
        if not self.files:
            return
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in self.files.items():
            atomic_write_bytes(directory / name, data, durable=durable)

    def has_chat_template(self) -> bool:
        """Whether a chat template travels (a file of its own or inside ``tokenizer_config.json``)."""
        if "chat_template.jinja" in self.files or "chat_template.json" in self.files:
            return True
        try:
            config = json.loads(self.files.get("tokenizer_config.json", b"{}"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return False
        return isinstance(config, dict) and bool(config.get("chat_template"))

    def missing(self, image_processor: bool) -> list[str]:
        """What a Hugging Face directory of this model lacks, as readable
        names (empty: ``AutoTokenizer``/``AutoProcessor`` have what they read)."""
        missing = []
        if not any(n in self.files for n in TOKENIZER_MODEL_FILES):
            missing.append("tokenizer (tokenizer.json)")
        if "tokenizer_config.json" not in self.files:
            missing.append("tokenizer_config.json")
        if not self.has_chat_template():
            missing.append("chat template")
        if image_processor and not any(n in self.files for n in PREPROCESSOR_FILES):
            missing.append("image processor (preprocessor_config.json)")
        return missing
