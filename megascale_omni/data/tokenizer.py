"""Text tokenizer loaded from a local ``tokenizer.json`` (HF ``tokenizers``).

The synthetic datasets use a word-level vocabulary: text is split on
whitespace only (so ``<image>``, ``?`` and ``:`` stay single tokens) and every
word maps to exactly one id. That makes "answer word i" and "answer token i"
the same thing, which the image-dependent accuracy metric relies on.

Layout of a tokenizer built by :func:`build_word_tokenizer`::

    0 <pad>   1 <eos>   2 <bos>   3 <unk>   4 <image>   5.. words in given order

:class:`TextTokenizer` only maps text <-> ids; it never adds BOS/EOS or pads,
because where those go is the collator's decision.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from megascale_omni.data.errors import DataFileError

logger = logging.getLogger(__name__)

TOKENIZER_FILENAME = "tokenizer.json"
_TOKENIZER_FIX = ("point data.tokenizer at a Hugging Face tokenizer.json with the special tokens "
                  "<pad> <eos> <bos> <unk> <image>, or rebuild the dataset's (tools/make_shapes_dataset.py)")


@dataclass(frozen=True)
class SpecialTokens:
    """Spellings of the special tokens a :class:`TextTokenizer` requires."""

    pad: str = "<pad>"
    eos: str = "<eos>"
    bos: str = "<bos>"
    unk: str = "<unk>"
    image: str = "<image>"

    def in_id_order(self) -> tuple[str, ...]:
        """Order used by :func:`build_word_tokenizer` (pad first, so pad id is 0)."""
        return (self.pad, self.eos, self.bos, self.unk, self.image)


class TextTokenizer:
    """Thin wrapper over ``tokenizers.Tokenizer`` with the ids the trainer needs.

    Picklable (the backend serialises itself), so it can be shipped to
    DataLoader workers.
    """

    def __init__(self, backend: Tokenizer, special_tokens: SpecialTokens = SpecialTokens()):
        self._tok = backend
        self.special_tokens = special_tokens
        ids = {}
        for name in ("pad", "eos", "bos", "unk", "image"):
            token = getattr(special_tokens, name)
            tid = backend.token_to_id(token)
            if tid is None:
                raise ValueError(f"tokenizer has no {name} token {token!r} in its vocabulary")
            ids[name] = tid
        self._ids = ids

    # ------------------------------------------------------------ construction
    @classmethod
    def from_path(cls, path: str | os.PathLike, special_tokens: SpecialTokens = SpecialTokens()) -> "TextTokenizer":
        """Load from a ``tokenizer.json`` file or a directory containing one.

        A directory without ``tokenizer.json`` is tried as a HF ``transformers``
        tokenizer directory if ``transformers`` is importable.

        Raises:
            FileNotFoundError: ``path`` does not exist, or is a directory with no
                loadable tokenizer; the message names the path.
            DataFileError: the file is not a loadable tokenizer, or lacks one
                of ``special_tokens``; the message names the file.
        """
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(
                f"tokenizer path {str(path)!r} does not exist; expected a {TOKENIZER_FILENAME} "
                f"file or a directory containing one (the shapes dataset tool writes "
                f"<dataset dir>/{TOKENIZER_FILENAME})"
            )
        if path.is_dir():
            candidate = path / TOKENIZER_FILENAME
            if candidate.is_file():
                path = candidate
            else:
                backend = _load_transformers_backend(path)
                if backend is None:
                    raise FileNotFoundError(
                        f"no {TOKENIZER_FILENAME} in directory {str(path)!r} (and it is not a "
                        f"loadable transformers tokenizer directory)"
                    )
                return cls._checked(backend, special_tokens, path)
        logger.debug("loading tokenizer from %s", path)
        try:
            backend = Tokenizer.from_file(str(path))
        # The Rust backend reports every malformed file as a bare Exception.
        except Exception as exc:  # noqa: BLE001
            problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DataFileError(path, f"not a loadable tokenizer file ({problem})", _TOKENIZER_FIX) from None
        return cls._checked(backend, special_tokens, path)

    @classmethod
    def _checked(cls, backend: Tokenizer, special_tokens: SpecialTokens, path: Path) -> "TextTokenizer":
        try:
            return cls(backend, special_tokens)
        except ValueError as exc:
            raise DataFileError(path, str(exc), _TOKENIZER_FIX) from None

    @classmethod
    def from_str(cls, serialized: str, special_tokens: SpecialTokens = SpecialTokens()) -> "TextTokenizer":
        """Inverse of :meth:`to_str` (e.g. a tokenizer stored in a checkpoint)."""
        return cls(Tokenizer.from_str(serialized), special_tokens)

    def to_str(self) -> str:
        """The whole tokenizer as ``tokenizer.json`` text."""
        return self._tok.to_str()

    # ------------------------------------------------------------------- ids
    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (ids are ``0 .. vocab_size-1``)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def pad_id(self) -> int:
        return self._ids["pad"]

    @property
    def eos_id(self) -> int:
        return self._ids["eos"]

    @property
    def bos_id(self) -> int:
        return self._ids["bos"]

    @property
    def unk_id(self) -> int:
        return self._ids["unk"]

    @property
    def image_token_id(self) -> int:
        return self._ids["image"]

    def token_to_id(self, token: str) -> int | None:
        """Id of ``token``, or ``None`` if it is not in the vocabulary."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Token string of ``token_id``, or ``None`` if out of range."""
        return self._tok.id_to_token(token_id)

    # ---------------------------------------------------------- text <-> ids
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS/EOS added. Unknown words map to ``unk_id``."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Inverse of :meth:`encode` for in-vocabulary, single-space-separated text.

        Special tokens are kept by default so that text containing ``<image>``
        round-trips exactly.
        """
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def backend(self) -> Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def __repr__(self) -> str:
        return (f"TextTokenizer(vocab_size={self.vocab_size}, pad={self.pad_id}, eos={self.eos_id}, "
                f"bos={self.bos_id}, image={self.image_token_id})")


def _load_transformers_backend(directory: Path) -> Tokenizer | None:
    """Backend of a HF transformers fast tokenizer dir, or None if unavailable."""
    try:
        from transformers import PreTrainedTokenizerFast  # optional dependency
    except ImportError:
        return None
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(directory)).backend_tokenizer
    except (OSError, ValueError) as exc:
        logger.debug("transformers could not load %s: %s", directory, exc)
        return None


def build_word_tokenizer(words: Iterable[str], path: str | os.PathLike,
                         special_tokens: SpecialTokens = SpecialTokens()) -> TextTokenizer:
    """Build a whitespace-split word-level tokenizer and save it to ``path``.

    Ids: the special tokens first (pad = 0, see module docstring), then
    ``words`` in the given order with duplicates and special spellings dropped.
    Pass a sorted word list for a canonical file; the JSON written is a pure
    function of the arguments.

    Args:
        words: vocabulary words; must not contain whitespace.
        path: output file (parent directories are created). If ``path`` is an
            existing directory, ``path/tokenizer.json`` is written.

    Returns:
        The tokenizer, loaded back from the written file.
    """
    specials = special_tokens.in_id_order()
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(specials)}
    for word in words:
        if not word or any(ch.isspace() for ch in word):
            raise ValueError(f"vocabulary word {word!r} is empty or contains whitespace")
        if word not in vocab:
            vocab[word] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token=special_tokens.unk))
    # WhitespaceSplit, not Whitespace: the latter would split "<image>" into "<", "image", ">".
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    backend.save(str(path))
    logger.info("wrote word-level tokenizer (%d tokens) to %s", len(vocab), path)
    return TextTokenizer.from_path(path, special_tokens)
