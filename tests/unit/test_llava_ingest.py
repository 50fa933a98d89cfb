"""tools/ingest_llava.py / data/llava/ingest.py: a LLaVA-JSON set with planted
problems is ingested; good samples are kept exactly, every bad one is
reported with its reason and counted; reruns resume; the embedded shapes
data round-trips through LLaVA JSON."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megascale_omni.config import ConfigError
from megascale_omni.data.llava.ingest import REJECTED_FILE, REPORT_FILE, IngestInputs, LengthCheck, ingest
from megascale_omni.data.shards import ShardedSampleReader
from megascale_omni.demo.llava_shapes import make_shapes_llava_json
from megascale_omni.demo.shapes import ShapesConfig, generate_samples
from tests.hf_models import chat_tokenizer

N = 24


@pytest.fixture(scope="module")
def clean_set(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("llava_json")
    make_shapes_llava_json(root, num_train=N, num_val=4, seed=7)
    return root


def _planted(clean: Path, dst: Path) -> tuple[Path, dict[int, str]]:
    """A copy of the train split with one planted problem per record below; returns
    the JSON path and {position: expected reason prefix}."""
    shutil.copytree(clean / "train", dst)
    records = json.loads((dst / "llava.json").read_text())
    image_records = [i for i, r in enumerate(records) if "image" in r]
    text_only = [i for i, r in enumerate(records) if "image" not in r and "images" not in r]
    expected = {}
    a, b, c, d, e = image_records[:5]
    (dst / records[a]["image"]).unlink()
    expected[a] = "image not found"
    png = bytearray((dst / records[b]["image"]).read_bytes())
    png[40] ^= 0xFF  # inside the IHDR/IDAT chunk: its CRC no longer matches
    (dst / records[b]["image"]).write_bytes(bytes(png))
    expected[b] = "image cannot be decoded"
    records[c]["conversations"][0]["value"] = records[c]["conversations"][0]["value"].replace("<image>", "")
    expected[c] = "0 <image> marker(s) for 1 image(s)"
    records[d]["conversations"][0]["value"] += " <image>"
    expected[d] = "2 <image> marker(s) for 1 image(s)"
    records[e]["conversations"] = []
    expected[e] = "empty conversation"
    f = text_only[0]
    records[f]["conversations"][1]["value"] = "\udcff broken"  # written as a raw 0xff byte below
    expected[f] = "not UTF-8"
    text = json.dumps(records, ensure_ascii=False).encode("utf-8", errors="surrogateescape")
    (dst / "llava.json").write_bytes(text)
    return dst / "llava.json", expected


def test_planted_problems_are_reported_and_good_samples_kept(clean_set, tmp_path):
    path, expected = _planted(clean_set, tmp_path / "in")
    out = tmp_path / "out"
    report = ingest(IngestInputs(llava_json=[str(path)], image_root=str(tmp_path / "in")), out, samples_per_shard=5)
    assert (report.inputs, report.kept, report.rejected) == (N, N - len(expected), len(expected))
    rejected = [json.loads(line) for line in (out / REJECTED_FILE).read_text().splitlines()]
    assert {r["position"]: r["reason"] for r in rejected}.keys() == expected.keys()
    for r in rejected:
        assert r["reason"].startswith(expected[r["position"]]), r
        assert r["source"] == f"{path}[{r['position']}]"
    summary = json.loads((out / REPORT_FILE).read_text())
    assert summary["rejected_by_reason"]["image not found"] == 1 and summary["kept"] == N - len(expected)
    # Kept samples are the generator's, pixel for pixel, in order, with their positions as ids.
    originals = list(generate_samples(N, 7, ShapesConfig(), stream=0))
    reader = ShardedSampleReader(out)
    kept = [reader[i] for i in range(len(reader))]
    assert [s.id for s in kept] == [i for i in range(N) if i not in expected]
    for s in kept:
        o = originals[s.id]
        assert s.conversation == o.conversation and len(s.images) == len(o.images)
        assert all((x == y).all() for x, y in zip(s.images, o.images))


def test_rerun_resumes_and_other_inputs_are_refused(clean_set, tmp_path):
    inputs = IngestInputs(llava_json=[str(clean_set / "train" / "llava.json")], image_root=str(clean_set / "train"))
    out = tmp_path / "out"
    first = ingest(inputs, out, samples_per_shard=10, workers=2)  # 3 chunks over 2 worker processes
    assert (first.kept, first.shards, first.chunks_resumed) == (N, 3, 0)
    index = (out / "index.json").read_text()
    (out / ".ingest" / "chunk-000001.json").unlink()  # as if interrupted while writing shard 1
    again = ingest(inputs, out, samples_per_shard=10)
    assert (again.kept, again.chunks_resumed) == (N, 2) and (out / "index.json").read_text() == index
    with pytest.raises(ConfigError, match="other inputs or settings"):
        ingest(inputs, out, samples_per_shard=8)


def test_caption_and_text_only_jsonl_and_bad_lines(clean_set, tmp_path):
    train = json.loads((clean_set / "train" / "llava.json").read_text())
    image = next(r["image"] for r in train if "image" in r)
    captions = tmp_path / "captions.jsonl"
    captions.write_bytes(b"\n".join([
        json.dumps({"image": image, "caption": "a red circle"}).encode(),
        b'{"image": "nope.png", "caption": "x"}',
        b"{not json",
        b'{"caption": "\xff"}',
    ]) + b"\n")
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})
                    + "\n" + json.dumps({"conversations": [{"from": "gpt", "value": "answer first"}]}) + "\n")
    out = tmp_path / "out"
    report = ingest(IngestInputs(captions=[str(captions)], text=[str(text)], image_root=str(clean_set / "train"),
                                 caption_prompt="Describe it."), out)
    reasons = [json.loads(line)["reason"] for line in (out / REJECTED_FILE).read_text().splitlines()]
    assert report.kept == 2 and reasons[0] == "image not found: nope.png"
    assert reasons[1].startswith("not JSON") and reasons[2] == "not UTF-8"
    assert reasons[3] == ("bad conversation: conversations[0] is from 'gpt' (assistant), expected 'user' "
                          "(an optional system turn, then user and assistant alternating)")
    reader = ShardedSampleReader(out)
    assert reader[0].conversation == [{"role": "user", "text": "<image>\nDescribe it."},
                                      {"role": "assistant", "text": "a red circle"}]
    assert reader[1].kind == "text_only"


def test_samples_longer_than_seq_length_are_rejected_with_a_tokenizer(clean_set, tmp_path):
    tok = tmp_path / "tok"
    chat_tokenizer(tok)
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"conversations": [{"from": "human", "value": "What is in the image? " * 40},
                                                  {"from": "gpt", "value": "A red circle on the left."}]}) + "\n"
                    + json.dumps({"conversations": [{"from": "human", "value": "What is in the image?"},
                                                    {"from": "gpt", "value": "A red circle on the left."}]}) + "\n")
    out = tmp_path / "out"
    report = ingest(IngestInputs(text=[str(long)]), out, length=LengthCheck(str(tok), 64, tokens_per_image=4))
    [reason] = [json.loads(line)["reason"] for line in (out / REJECTED_FILE).read_text().splitlines()]
    assert report.kept == 1 and reason.startswith("longer than seq_length 64")


def test_ingest_with_a_tokenizer_writes_token_counts_to_the_index(clean_set, tmp_path):
    from megascale_omni.data.llava.chat import ChatLlavaEncoder
    from megascale_omni.data.llava.ingest import chat_coster
    from tests.launcher import run_tool_in_process

    tok = tmp_path / "tok"
    chat_tokenizer(tok)
    out = tmp_path / "out"
    res = run_tool_in_process("tools/ingest_llava.py", "--out", out, "--image-root", clean_set / "train",
                              "--llava-json", clean_set / "train" / "llava.json", "--tokenizer", tok, "--workers", "1")
    assert res.returncode == 0, res.stderr
    reader = ShardedSampleReader(out)
    encoder = ChatLlavaEncoder.from_pretrained(tok, "<image>", 16, 4096)
    assert reader.index.cost_basis == encoder.cost_basis() == chat_coster(tok).cost_basis()
    for i in range(len(reader)):
        cost, sample = reader.index.samples[i].cost, reader[i]
        assert cost.tokens == encoder.text_tokens(reader.read_metadata(i)) > 0
        assert cost.image_hw == tuple(img.shape[:2] for img in sample.images)
    # Without --tokenizer: image sizes only; --seq-length without a tokenizer is refused.
    bare = run_tool_in_process("tools/ingest_llava.py", "--out", tmp_path / "bare", "--image-root",
                               clean_set / "train", "--llava-json", clean_set / "train" / "llava.json")
    assert bare.returncode == 0 and ShardedSampleReader(tmp_path / "bare").index.cost_basis is None
    refused = run_tool_in_process("tools/ingest_llava.py", "--out", tmp_path / "x", "--llava-json",
                                  clean_set / "train" / "llava.json", "--seq-length", "64")
    assert refused.returncode == 2 and "--tokenizer/--seq-length/--tokens-per-image" in refused.stderr


def test_a_failed_read_leaves_no_fingerprint_and_the_fixed_rerun_runs(clean_set, tmp_path):
    """A broken input used to stamp the output first: the rerun after the fix was
    refused as 'holds an ingestion of other inputs'."""
    shutil.copytree(clean_set / "train", tmp_path / "in")
    path = tmp_path / "in" / "llava.json"
    good = path.read_text()
    path.write_text(good[:-20])  # cut: not valid JSON
    inputs = IngestInputs(llava_json=[str(path)], image_root=str(tmp_path / "in"))
    with pytest.raises(ConfigError, match="is not valid JSON"):
        ingest(inputs, tmp_path / "out", samples_per_shard=10)
    path.write_text(good)
    report = ingest(inputs, tmp_path / "out", samples_per_shard=10)
    assert (report.inputs, report.kept) == (N, N)
