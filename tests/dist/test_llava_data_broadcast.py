"""Only TP rank 0 of pipeline stage 0 reads LLaVA samples; the rest receive.

Four gloo processes at TP2 x PP2 build the LLaVA task on a small shapes set
and ask for the micro-batches of three steps, with
``ShardedSampleReader.__getitem__`` (the read that decodes images) counted
per rank. One image sample of step 0 is planted bad (it raises
``BadSampleError`` when read), and step 2's first read raises a fatal
``DataFileError``. Asserted per rank:

* reads: the reader (TP 0, stage 0) reads every sample of steps 0-1; the
  other three ranks read none (before this change every rank read them all);
* the token-level entries are the same bytes on all four ranks, the images
  the same on both stage-0 ranks, and stage 1 has no ``images`` at all;
* skip counts: one skip, the same ``seen``/``skipped`` on every rank, and
  the planted sample is missing from every rank's rows alike;
* step 2: every rank raises ``DataFileError`` with the reader's message
  (no rank waits for a batch).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import multiprocessing as mp
import os
import traceback

import pytest

from tests.launcher import free_port

# make test-all: four processes (~75 s, mostly start-up); the 2-process TP2 and PP2 LLaVA layouts in make
# test run the same broadcast path and match one process.
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(240)]

WORLD = 4


def _digest(t) -> str:
    return f"{t.dtype}{tuple(t.shape)}:{hashlib.sha256(t.contiguous().view(-1).numpy().tobytes()).hexdigest()[:16]}"


def _worker(rank: int, port: int, dataset: str, out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megascale_omni.config import load_job_config
    from megascale_omni.data.errors import DataFileError, DataQualityError
    from megascale_omni.data.shards import BadSampleError, ShardedSampleReader
    from megascale_omni.parallel import ParallelDims, initialize_parallel
    from megascale_omni.platform import init_platform
    from megascale_omni.tasks.registry import get_family

    result = {"rank": rank}
    try:
        platform = init_platform("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=90))
        cfg = load_job_config(["--config", "examples/llava/tiny_cpu.yaml", f"data.path={dataset}",
                               "parallel.tp=2", "parallel.pp=2", "train.steps=10", "logging.level=WARNING",
                               "data.max_bad_sample_fraction=0.5"])
        dims = ParallelDims.from_config(cfg.parallel, WORLD)
        initialize_parallel(dims, cfg.train.seed)
        task = get_family("llava").build_task(cfg, platform, dims)
        result.update(tp=mpu.get_tensor_model_parallel_rank(), pp=mpu.get_pipeline_model_parallel_rank())

        # Every rank knows the plan (metadata only): plant the first image sample of step 0 as bad.
        position = {int(rid): k for k, rid in enumerate(task.data.train_ids)}
        victim = next(i for i in task.sample_ids(0, 0, 1) if task.data.train_images[position[i]] > 0)
        reads = []
        fatal_at = {"step": None}
        original = ShardedSampleReader.__getitem__

        def counted(self, idx):
            reads.append(int(idx))
            if fatal_at["step"] is not None:
                raise DataFileError(self.root / "shard-planted.tar", "planted: sha256 mismatch", "rebuild the shard")
            if int(idx) == victim:
                raise BadSampleError(idx, self.root, "planted undecodable image")
            return original(self, idx)

        ShardedSampleReader.__getitem__ = counted
        result["steps"] = []
        for step in (0, 1):
            before = len(reads)
            batches = task.microbatches(step, 0, 1)
            result["steps"].append({
                "reads": len(reads) - before,
                "planned": len(task.sample_ids(step, 0, 1)),
                "batches": [{k: _digest(v) for k, v in mb.items()} for mb in batches],
            })
        c = task.bad_samples.counter
        result["counter"] = [c.seen, c.skipped, c.reasons]
        result["victim"] = victim
        fatal_at["step"] = 2
        try:
            task.microbatches(2, 0, 1)
            result["fatal"] = None
        except DataQualityError as err:
            result["fatal"] = [type(err).__name__, str(err)]
        task.close()
    except Exception:
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


@pytest.fixture(scope="module")
def results(llava_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("broadcast")
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, port, str(llava_dataset), str(out))) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=200)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    res = []
    for r in range(WORLD):
        path = out / f"rank{r}.json"
        assert path.is_file(), f"rank {r} wrote no result (exit code {procs[r].exitcode})"
        res.append(json.loads(path.read_text()))
        assert "error" not in res[r], f"rank {r}:\n{res[r]['error']}"
    return res


def test_only_tp0_of_stage0_reads_samples(results):
    for r in results:
        reader = r["tp"] == 0 and r["pp"] == 0
        for step in r["steps"]:
            if reader:
                assert step["reads"] == step["planned"] > 0, (r["rank"], step)
            else:
                assert step["reads"] == 0, (r["rank"], step["reads"])


def test_ranks_receive_the_readers_batches(results):
    reader = next(r for r in results if r["tp"] == 0 and r["pp"] == 0)
    for r in results:
        for mine, theirs in zip(r["steps"], reader["steps"]):
            assert len(mine["batches"]) == len(theirs["batches"]) > 0
            for got, want in zip(mine["batches"], theirs["batches"]):
                if r["pp"] == 0:
                    assert got == want  # every entry, images included
                else:
                    assert "images" not in got
                    assert got == {k: v for k, v in want.items() if k != "images"}


def test_skip_counts_and_fatal_errors_are_the_same_everywhere(results):
    reader = next(r for r in results if r["tp"] == 0 and r["pp"] == 0)
    seen, skipped, reasons = reader["counter"]
    assert skipped == 1 and "planted undecodable image" in reasons[0]
    assert seen == sum(s["planned"] for s in reader["steps"]) - 1
    for r in results:
        assert r["counter"] == reader["counter"], r["rank"]
        assert r["fatal"] is not None and r["fatal"][0] == "DataFileError", (r["rank"], r["fatal"])
        assert r["fatal"] == reader["fatal"]
        assert "planted: sha256 mismatch" in r["fatal"][1]
