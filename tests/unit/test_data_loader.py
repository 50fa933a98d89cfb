"""StepLoader: worker-built micro-batches equal the in-process ones, bit for
bit, through elastic DP changes and retries; bad samples are counted the
same; fatal data errors keep their type; no worker outlives ``close``.

The workers are real (spawned) processes: each loader start costs a few
seconds, so the module builds one small dataset and two loaders.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil

import numpy as np
import pytest
import torch

from megascale_omni.data.errors import DataFileError
from megascale_omni.data.health import SkipCounter
from megascale_omni.data.llava.batches import LlavaBatcher, LlavaEncoder, plan_sample
from megascale_omni.data.llava.steps import LlavaSteps
from megascale_omni.data.loader import StepLoader
from megascale_omni.data.sample_plan import PackedEpochPlan
from megascale_omni.data.shard_writer import encode_sample, write_member_shards
from megascale_omni.data.shards import ShardedSampleReader
from megascale_omni.data.tokenizer import build_word_tokenizer
from megascale_omni.demo.shapes import dataset_vocabulary, generate_samples

pytestmark = pytest.mark.timeout(120)

SEQ, TOKENS_PER_IMAGE, GLOBAL_BATCH, MBS, STEPS = 64, 4, 4, 2, 6
#: Sample whose image member is corrupt: planned (its JSON is fine), skipped when read.
CORRUPT = 3


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    records = [encode_sample(s) for s in generate_samples(48, seed=11)]
    png = next(k for k in records[CORRUPT] if k.endswith(".png"))
    records[CORRUPT][png] = records[CORRUPT][png][:40]
    write_member_shards(records, root / "split", samples_per_shard=16)
    tok = build_word_tokenizer(dataset_vocabulary(), root / "tokenizer.json")
    return root, tok


def _steps(split, tok) -> LlavaSteps:
    reader = ShardedSampleReader(split)
    encoder = LlavaEncoder(tok, TOKENS_PER_IMAGE)
    lengths = np.array([plan_sample(reader, encoder, i)[0] for i in range(len(reader))])
    plan = PackedEpochPlan(lengths, SEQ, GLOBAL_BATCH, seed=3)
    batcher = LlavaBatcher(reader, encoder, SEQ, tok.pad_id, image_size=32, counter=SkipCounter())
    return LlavaSteps(plan, np.arange(len(reader)), batcher, MBS)


def _assert_equal(got: list[dict], want: list[dict], key) -> None:
    assert len(got) == len(want), key
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), key
        for name in w:
            assert g[name].dtype == w[name].dtype and torch.equal(g[name], w[name]), (key, name)


def _children() -> set[int]:
    return {p.pid for p in mp.active_children()}


# Step keys as the trainer asks for them: steady DP2 rank 1, a retried step,
# an elastic shrink to DP1, a grow back to DP2 as rank 0, a resume-like jump.
REQUESTS = [(0, 1, 2), (1, 1, 2), (2, 1, 2), (2, 1, 2), (3, 0, 1), (4, 0, 2), (5, 0, 2), (1, 0, 2)]


def test_workers_build_what_the_training_process_builds(dataset):
    root, tok = dataset
    before = _children()
    reference = _steps(root / "split", tok)
    workers = _steps(root / "split", tok)
    loader = StepLoader(workers, num_workers=2, prefetch_steps=3, last_step=STEPS)
    try:
        assert len(_children() - before) == 2  # the workers run from construction on
        for key in REQUESTS:
            _assert_equal(loader.get(*key), reference(*key), key)
            # Counts flow back with each step: the same totals as building here.
            assert (workers.counter.seen, workers.counter.skipped) == (reference.counter.seen,
                                                                       reference.counter.skipped), key
        assert reference.counter.skipped > 0  # the corrupt sample was in these steps and skipped
        # The same reasons, in order (PIL names a buffer's address in its message).
        assert [r.split(" at 0x")[0] for r in workers.counter.reasons] == [
            r.split(" at 0x")[0] for r in reference.counter.reasons]
        # Past train.steps: built in this process, same result.
        _assert_equal(loader.get(STEPS, 0, 1), reference(STEPS, 0, 1), "past the end")
    finally:
        loader.close()
    assert _children() == before  # no worker outlives close
    loader.close()  # idempotent
    _assert_equal(loader.get(0, 0, 1), reference(0, 0, 1), "after close")


def test_fatal_data_error_in_a_worker_keeps_its_type(dataset, tmp_path):
    root, tok = dataset
    shutil.copytree(root / "split", tmp_path / "split")
    before = _children()
    loader = StepLoader(_steps(tmp_path / "split", tok), num_workers=1, prefetch_steps=1, last_step=STEPS)
    try:
        # The workers hold no open shard (the reader pickles without its fds): they see the loss.
        for shard in (tmp_path / "split").glob("*.tar"):
            shard.unlink()
        with pytest.raises(DataFileError) as info:
            loader.get(0, 0, 1)
        assert info.value.path.endswith(".tar") and "shard missing" in info.value.problem
    finally:
        loader.close()
    assert _children() == before
