"""Data readability: a sample of each dataset's shards opened and checked.

Each rank takes ``preflight.data_sample_shards`` shards of every training
split (``data.path`` and each ``data.blend`` source), different ranks
different shards, and reads the first sample of each through the training
reader (:class:`~megascale_omni.data.shards.ShardedSampleReader`): the
index is validated, the shard's size and sha256 checked against it
(:func:`~megascale_omni.data.integrity.verify_shard`) and the sample's tar
headers against the index. Family-agnostic: members are read, not decoded.
"""

from __future__ import annotations

from pathlib import Path

from megascale_omni.config.preflight_section import PreflightConfig
from megascale_omni.data.errors import DataQualityError
from megascale_omni.data.shards import BadSampleError, ShardedSampleReader
from megascale_omni.preflight.result import CheckResult, judge, skipped


def sampled_shards(num_shards: int, per_rank: int, rank: int) -> list[int]:
    """The shards rank ``rank`` checks: a window of ``per_rank`` consecutive
    shards starting at ``rank * per_rank`` (mod the count), so ranks
    cover different shards until every shard is taken."""
    k = min(per_rank, num_shards)
    return sorted({(rank * k + j) % num_shards for j in range(k)})


def _check_split(split: Path, per_rank: int, rank: int) -> tuple[int, int, str]:
    """``(shards checked, unreadable, first problem)`` of one split."""
    try:
        reader = ShardedSampleReader(split)
    except (DataQualityError, FileNotFoundError) as exc:
        return 1, 1, str(exc)
    with reader:
        first_sample = {}
        for i, loc in enumerate(reader.index.samples):
            first_sample.setdefault(loc.shard, i)
        shards = sampled_shards(len(reader.index.shards), per_rank, rank)
        bad, problem = 0, ""
        for shard in shards:
            try:
                if shard in first_sample:
                    reader.read_members(first_sample[shard])
            except (DataQualityError, BadSampleError) as exc:
                bad += 1
                problem = problem or str(exc)
        return len(shards), bad, problem


def check_data(pf: PreflightConfig, roots: list[str], rank: int) -> list[CheckResult]:
    """``data``: unreadable shards among those sampled, at most 0."""
    if pf.data_sample_shards == 0:
        return [skipped("data", "preflight.data_sample_shards is 0")]
    if not roots:
        return [skipped("data", "data.path is null: the family's embedded dataset is built at start-up")]
    checked = bad = 0
    problem = ""
    for root in roots:
        n, b, p = _check_split(Path(root) / "train", pf.data_sample_shards, rank)
        checked, bad, problem = checked + n, bad + b, problem or p
    detail = f"{bad} of {checked} sampled shards unreadable: {problem}" if bad else f"{checked} shards sampled"
    return [judge("data", float(bad), "unreadable shards", 0.0, "preflight.data_sample_shards", "<=", detail=detail)]
