"""A LLaVA replica group whose dataset copy differs from the running job's is
refused; one reading a byte-identical copy mounted at another path joins.

The job trains on ``a`` (three shards). ``older`` is a copy of ``a`` with
its last shard gone and re-indexed: an older ingest. ``mounted`` is a plain
copy of ``a``. All groups have the same config but ``data.path``, which the
join check no longer compares as a string, so only the content digest of
the train split tells ``older`` apart: without it, ``older`` would join and
plan its steps from 80 samples while the job plans from 120 (lost and
repeated samples). Checked: ``older`` exits 2 with one line naming
``data.path`` and both digests, before any gradient, while the job carries
on; ``mounted`` joins, heals from the running group, and every committed
step consumed the plan of ``a`` exactly once (sample ledger).
"""

from __future__ import annotations

import re
import shutil

import pytest

from megascale_omni.data.llava.batches import LlavaEncoder
from megascale_omni.data.shard_writer import index_shards
from megascale_omni.data.shards import ShardedSampleReader
from megascale_omni.demo.llava_shapes import load_shapes_tokenizer, make_shapes_dataset
from tests.dist.control_helpers import omni_ctl
from tests.dist.test_elastic_llava_blend import LlavaJob, check_exactly_once, expected_batches
from tests.dist.test_elastic_membership import CTL_TIMEOUT

# Three LLaVA start-ups and a handful of paced steps: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.dist, pytest.mark.timeout(1200)]


def test_joiner_on_another_copy_of_the_data_exits_2_and_one_on_the_same_data_elsewhere_joins(tmp_path):
    a, older, mounted = tmp_path / "a", tmp_path / "older", tmp_path / "mnt" / "a"
    make_shapes_dataset(a, num_train=120, num_val=8, seed=1, samples_per_shard=40)
    shutil.copytree(a, older)
    (older / "train" / "shard-000002.tar").unlink()
    index_shards(older / "train", coster=LlavaEncoder(load_shapes_tokenizer(older), tokens_per_image=1))
    assert len(ShardedSampleReader(older / "train")) == 80
    shutil.copytree(a, mounted)
    job = LlavaJob(tmp_path, [f"data.path={a}"], timeout=1200)
    try:
        job.start("r0")
        job.wait("r0's first committed steps", lambda: len(job.records("r0")) >= 2)
        # Held while the joiner starts (as in Job.join), so r0 waits in its quorum.
        assert omni_ctl(job.run / "r0", *CTL_TIMEOUT, "pause", timeout_s=330)["ok"]
        job.start("older", f"data.path={older}")
        job.wait("older's control server", lambda: (job.run / "older" / "control.json").exists())
        assert omni_ctl(job.run / "r0", *CTL_TIMEOUT, "resume", timeout_s=330)["ok"]
        res = job.results["older"] = job.wait_exit("older")
        assert res.returncode == 2, res.stderr[-3000:]
        assert re.search(
            rf"^config error: data.path='{re.escape(str(older))}': its train split \(train/index.json\) differs from "
            r"the running job's \(digest [0-9a-f]{12} here, [0-9a-f]{12} in the running job\): every replica group "
            r"must train on the same samples; point data.path at the running job's copy of the dataset$",
            res.stderr, re.MULTILINE), res.stderr[-3000:]
        job.wait("r0 to train alone again", lambda: job.participants("r0") == 1)
        job.wait_steps("r0", 1)
        job.join("mounted", hold="r0")  # the same bytes at another path: joins and heals from r0
        job.wait_steps("r0", 2)
        job.drain("mounted")
        job.drain("r0")
    finally:
        job.close()
    assert not job.records("older")
    assert job.records("mounted")[0]["healed"]
    check_exactly_once(job, expected_batches([a], weights=None))
