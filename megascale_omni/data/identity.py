"""Content identity of a job's training data, compared before a replica group
joins an elastic job (:func:`megascale_omni.elastic.peer_state.check_peer_state`)
and when a run resumes from a checkpoint, which records it
(:mod:`megascale_omni.data.plan_record`).

Exactly-once holds job-wide only when every replica group plans the same
samples for a step, and the plan is a function of the data itself besides
the data config, seed and global batch. The config is compared field by
field; the data is compared as digests of what the loader already read and
validated at start-up, never of the shards (they can be terabytes):

- a sharded split: the sha256 of its ``index.json``
  (:attr:`~megascale_omni.data.shards.ShardedSampleReader.index_digest`).
  The index records every shard's name, size and sha256 and every sample's
  id, location and cost, so a shard added, removed or rewritten, another
  sample count or a re-ingest changes it, while a byte-identical copy
  mounted at another path does not;
- the tokenizer: the fingerprint of the index's ``cost_basis``
  (:func:`~megascale_omni.data.costs.fingerprint` of the vocabulary and
  rules, and for ``data.format=chat`` the chat template and special tokens):
  token counts decide how samples pack into rows, hence each step's samples;
- DiT's ``dataset.json`` (pixels or latents, channels, text): a
  :func:`~megascale_omni.data.costs.fingerprint` of its parsed content.

Synthetic data (the GPT smoke task) needs no digest: its generating
parameters are config fields, compared as such.

Covered: what decides the training samples of a step, i.e. each ``train``
split read (``data.path``'s, or every ``data.blend`` member's) and the
tokenizer. Not covered: the ``val`` split (evaluation changes no weight and
no step's samples). The embedded default datasets are identified by their
files like any other: a build is byte-identical for the same PIL, zlib and
tokenizers versions.

An identity is ``{key: source}``, each source a plain dict (it travels in
the peer state) made by :func:`data_source`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from megascale_omni.config import ConfigError

#: Hex digits of a digest shown in messages.
SHORT = 12


def data_source(field: str, value: Optional[str], what: str, digest: str) -> dict[str, Any]:
    """One entry of a data identity: the config ``field`` that selects the
    data (``data.path``, ``data.blend[i].path``, ``data.tokenizer``), its
    ``value`` in this group's config, ``what`` was digested (for messages)
    and the hex ``digest``."""
    return {"field": field, "value": value, "what": what, "digest": digest}


def short(digest: Optional[str]) -> str:
    """The first :data:`SHORT` hex digits of ``digest`` (``"none"`` when absent)."""
    return digest[:SHORT] if digest else "none"


def check_data_identity(own: Mapping[str, dict], other: Mapping[str, dict], against: str = "the running job",
                        why: str = "every replica group must train on the same samples",
                        alternative: str = "") -> None:
    """Raise ConfigError (one line, naming the field) unless every source of
    ``own`` has the same digest in ``other``, the identity of ``against``
    (a joiner's running job, or a checkpoint's run: ``why`` it matters,
    ``alternative`` to the fix); reads only, any thread."""
    for key, mine in own.items():
        theirs = other.get(key) or {}
        if theirs.get("digest") == mine["digest"]:
            continue
        field = mine["field"]
        fix = (f"point data.tokenizer at {against}'s tokenizer" if field == "data.tokenizer"
               else f"point {field} at {against}'s copy of the dataset")
        raise ConfigError(
            field, mine["value"],
            f"{mine['what']} differs from {against}'s (digest {short(mine['digest'])} here, "
            f"{short(theirs.get('digest'))} in {against}): {why}; {fix}{alternative}",
        )


def dataset_source(field: str, value: Optional[str], name: str, digest: str) -> dict[str, Any]:
    """The source of ``name`` (e.g. ``"dataset.json"``) in the dataset
    directory that ``field`` selects (``value``; None: the embedded default)."""
    return data_source(field, value, f"{_whose(value)} {name}", digest)


def train_split_source(field: str, value: Optional[str], digest: str) -> dict[str, Any]:
    """The source of the ``train`` split of the dataset ``field`` selects."""
    return dataset_source(field, value, "train split (train/index.json)", digest)


def tokenizer_source(tokenizer: Optional[str], dataset: Optional[str], digest: str) -> dict[str, Any]:
    """The source of the tokenizer: ``data.tokenizer`` when set (``tokenizer``),
    else the one beside the dataset (``data.path``, ``dataset``)."""
    if tokenizer:
        return data_source("data.tokenizer", tokenizer, "its tokenizer", digest)
    return dataset_source("data.path", dataset, "tokenizer", digest)


def _whose(dataset: Optional[str]) -> str:
    return "its" if dataset is not None else "the embedded default's"
