"""Video samples, data side (issue 32): frame choice equal to transformers'
LLaVA-OneVision video processor, ingestion of clips (mp4, mkv, webm: the
last two report no frame count) and frame folders mixed with image and
text records, the index's frame counts and sizes, the reader's
``[frames, H, W, 3]`` arrays, the batcher's per-frame tower inputs and
video placeholders, the plan's video tokens equal to what the model lays
out (it consumes the batch; a placeholder count off by one is refused), and
every rejection reason counted. Clips are a few 32x48 frames, made here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from megascale_omni.config import ConfigError
from megascale_omni.data.costs import SampleCost, video_tokens
from megascale_omni.data.image_preprocess import ImagePreprocessor, PreprocessorSpec
from megascale_omni.data.llava.batches import LlavaBatcher, LlavaEncoder
from megascale_omni.data.llava.ingest import REJECTED_FILE, REPORT_FILE, IngestInputs, ingest
from megascale_omni.data.llava.plan_scan import PlanScanner
from megascale_omni.data.packing import Pack
from megascale_omni.data.shards import INDEX_FILENAME, ShardedSampleReader
from megascale_omni.data.tokenizer import build_word_tokenizer
from megascale_omni.data.video import VideoSampling, sample_indices, subsample
from megascale_omni.demo.clips import frame_pixels, level, write_audio_only, write_clip

FRAMES = 12  # per generated clip
KEEP = 5  # --video-frames
H, W = 32, 48
WORDS = "what happens in the clip a ball rolls and then stops look at this <video>".split()


def _conv(question: str, answer: str = "a ball rolls") -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


def _frame_folder(path: Path, suffix: str, frames: int = FRAMES) -> Path:
    path.mkdir(parents=True)
    for i in range(frames):  # names sort in frame order; a stray file is ignored
        Image.fromarray(frame_pixels(i, frames, H, W)).save(path / f"frame_{i:04d}{suffix}", quality=90)
    (path / "notes.txt").write_text("not a frame")
    return path


@pytest.fixture(scope="module")
def ingested(tmp_path_factory):
    """One ingestion of every kind of record; returns (split dir, media root, report)."""
    root = tmp_path_factory.mktemp("video")
    media = root / "media"
    media.mkdir()
    for suffix in (".mp4", ".mkv", ".webm"):
        write_clip(media / f"clip{suffix}", FRAMES, H, W)
    write_clip(media / "empty_stream.avi", 0, H, W)
    write_clip(media / "short.mp4", 3, H, W)
    whole = (media / "clip.mkv").read_bytes()
    (media / "cut.mkv").write_bytes(whole[: len(whole) // 2])  # header intact, the stream cut mid-way
    _frame_folder(media / "png_frames", ".png")
    _frame_folder(media / "jpg_frames", ".jpg")
    (media / "no_frames").mkdir()
    write_audio_only(media / "audio.mka")
    (media / "zero.mp4").write_bytes(b"")
    (media / "garbage.webm").write_bytes(bytes(range(256)) * 8)
    Image.fromarray(frame_pixels(0, 1, H, W)).save(media / "still.png")
    q = "<video>\nwhat happens in the clip"
    records = [
        {"id": "mp4", "video": "clip.mp4", "conversations": _conv(q)},
        {"id": "mkv", "video": "clip.mkv", "conversations": _conv(q)},
        {"id": "webm", "video": "clip.webm", "conversations": _conv(q)},
        {"id": "png", "video": "png_frames", "conversations": _conv(q)},
        {"id": "jpg", "videos": ["jpg_frames"], "conversations": _conv(q)},
        {"id": "mixed", "image": "still.png", "video": "short.mp4",
         "conversations": _conv("look at this <image> and <video> what happens")},
        {"id": "text", "conversations": _conv("what happens")},
        {"id": "cut", "video": "cut.mkv", "conversations": _conv(q)},
        # rejected, one of each reason
        {"id": "r-zero", "video": "zero.mp4", "conversations": _conv(q)},
        {"id": "r-audio", "video": "audio.mka", "conversations": _conv(q)},
        {"id": "r-garbage", "video": "garbage.webm", "conversations": _conv(q)},
        {"id": "r-noframes", "video": "empty_stream.avi", "conversations": _conv(q)},
        {"id": "r-folder", "video": "no_frames", "conversations": _conv(q)},
        {"id": "r-missing", "video": "gone.mp4", "conversations": _conv(q)},
        {"id": "r-markers", "video": "clip.mp4", "conversations": _conv("<video> <video> what happens")},
        {"id": "r-nomarker", "video": "clip.mp4", "conversations": _conv("what happens")},
    ]
    (root / "records.json").write_text(json.dumps(records))
    out = root / "data" / "train"
    report = ingest(IngestInputs(llava_json=[str(root / "records.json")], image_root=str(media)), out,
                    samples_per_shard=4, video=VideoSampling(frames=KEEP))
    build_word_tokenizer(sorted(WORDS), root / "data" / "tokenizer.json")
    return out, media, report


def test_frame_choice_equals_transformers_llava_onevision():
    """uniform N: ``i * total // N`` (transformers' default_sample_indices_fn,
    which LlavaOnevisionVideoProcessor.sample_frames calls; not linspace over
    [0, total - 1]); fps F: ``max(1, int(total / clip_fps * F))`` of them."""
    from types import SimpleNamespace

    from transformers.models.llava_onevision.video_processing_llava_onevision import LlavaOnevisionVideoProcessor
    from transformers.video_utils import VideoMetadata

    # The processor's own method on a stand-in for its instance: instantiating
    # it needs torchvision, which this environment lacks; the method does not.
    defaults = SimpleNamespace(num_frames=None, fps=None)
    proc = SimpleNamespace(sample_frames=lambda meta, **kw: LlavaOnevisionVideoProcessor.sample_frames(
        defaults, meta, **kw))
    for total in (1, 7, 12, 31, 300):
        meta = VideoMetadata(total_num_frames=total, fps=30.0)
        for n in (1, 4, 8, 16, 32):
            if n <= total:
                want = proc.sample_frames(meta, num_frames=n)
                assert np.array_equal(sample_indices(total, VideoSampling(frames=n), 30.0), want), (total, n)
            else:  # transformers refuses a clip shorter than N; we keep all of its frames
                with pytest.raises(ValueError, match="exceeds total_num_frames"):
                    proc.sample_frames(meta, num_frames=n)
                assert sample_indices(total, VideoSampling(frames=n)).tolist() == list(range(total))
        for fps in (0.5, 1.0, 2.0):
            want = proc.sample_frames(meta, fps=fps)
            got = sample_indices(total, VideoSampling("fps", frames=10_000, fps=fps), 30.0)
            assert np.array_equal(got, want), (total, fps)
    assert sample_indices(300, VideoSampling(frames=8), 30.0).tolist() == [0, 37, 75, 112, 150, 187, 225, 262]
    assert sample_indices(300, VideoSampling("fps", frames=4, fps=1.0), 30.0).tolist() == [0, 75, 150, 225]
    assert subsample(np.arange(5)[:, None], 2)[:, 0].tolist() == [0, 2]


def test_ingest_counts_every_rejection_by_reason(ingested):
    out, _, report = ingested
    assert (report.inputs, report.kept, report.rejected) == (16, 8, 8)
    assert report.reasons == {
        "video is empty (0 bytes)": 1, "video has no video stream": 1, "video cannot be opened as a video": 1,
        "video has no frames": 1, "video is a folder without JPEG or PNG frames": 1, "video not found": 1,
        "<video> markers do not match the videos": 2,
    }
    rejected = {r["id"]: r["reason"] for r in map(json.loads, (out / REJECTED_FILE).read_text().splitlines())}
    assert rejected["r-markers"] == "2 <video> marker(s) for 1 video(s)"
    assert rejected["r-nomarker"] == "0 <video> marker(s) for 1 video(s)"
    assert rejected["r-noframes"] == "video has no frames: empty_stream.avi"
    assert rejected["r-zero"] == "video is empty (0 bytes): zero.mp4"
    assert rejected["r-garbage"].startswith("video cannot be opened as a video: garbage.webm (InvalidDataError")
    assert json.loads((out / REPORT_FILE).read_text())["rejected_by_reason"] == dict(sorted(report.reasons.items()))


def test_index_records_frames_and_size_and_the_reader_returns_the_chosen_frames(ingested):
    out, media, _ = ingested
    index = json.loads((out / INDEX_FILENAME).read_text())
    assert index["format_version"] == 4  # sets with videos only; format-3 code refuses them by number
    costs = [s["cost"] for s in index["samples"]]
    # A clip cut mid-stream keeps the frames that decode, and the choice is made on those.
    cut_frames = ShardedSampleReader(out)[7].videos[0].shape[0]
    assert 1 <= cut_frames <= KEEP
    assert [c.get("videos") for c in costs] == [[[KEEP, H, W]]] * 5 + [[[3, H, W]], None, [[cut_frames, H, W]]]
    assert costs[5]["images"] == [[H, W]]
    reader = ShardedSampleReader(out)
    chosen = (np.arange(KEEP) * FRAMES // KEEP).tolist()  # [0, 2, 4, 7, 9]
    for i in range(3):  # mp4, mkv (no frame count in the container), webm: frames counted by decoding
        (video,) = reader[i].videos
        assert video.shape == (KEEP, H, W, 3) and video.dtype == np.uint8
        means = video.reshape(KEEP, -1).mean(axis=1)
        assert np.abs(means - [level(j, FRAMES) for j in chosen]).max() < 3, (i, means)
    png = reader[3].videos[0]  # a folder's frames are stored as their own bytes: PNG exactly
    assert np.array_equal(png, np.stack([frame_pixels(j, FRAMES, H, W) for j in chosen]))
    _, _, members = reader.read_members(4)
    assert members["v0.1.jpg"] == (media / "jpg_frames" / "frame_0002.jpg").read_bytes()
    mixed = reader[5]
    assert (mixed.kind, mixed.num_images, mixed.num_videos, mixed.videos[0].shape[0]) == ("video", 1, 1, 3)
    assert reader[6].videos == [] and reader[6].kind == "text_only"


#: The tiny tower of these tests: 32 px, 8 px patches (4 x 4 features a frame,
#: pooled to 2 x 2), OneVision's newline after each image and video.
VISION = {"image_size": 32, "patch_size": 8, "num_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
          "image_newline": True}


def _cfg():
    from megascale_omni.config import JobConfig, from_dict

    return from_dict(JobConfig, {"model": {"family": "llava", "num_layers": 1, "hidden_size": 32,
                                           "num_attention_heads": 2, "seq_length": 256,
                                           "position_embedding_type": "rope"}, "vision": VISION})


def _batcher(out: Path, video_frames: int, preprocess=None) -> LlavaBatcher:
    from megascale_omni.data.tokenizer import TextTokenizer

    v = _cfg().vision
    tok = TextTokenizer.from_path(out.parent / "tokenizer.json")
    encoder = LlavaEncoder(tok, v.image_tokens, tok.token_to_id("<video>"), v.video_tokens)
    return LlavaBatcher(ShardedSampleReader(out), encoder, 256, 0, image_size=32, preprocess=preprocess,
                        video_frames=video_frames)


def test_batcher_gives_per_frame_tower_inputs_and_the_model_lays_them_out(ingested):
    from megascale_omni.models.standalone import build_model, one_process

    out, _, _ = ingested
    pre = ImagePreprocessor("resize_crop", PreprocessorSpec.plain(32), 32)
    batcher = _batcher(out, video_frames=3, preprocess=pre)
    batch = batcher.microbatch([Pack((0, 1), (0, 0), (0, 0))], [0, 5])  # mp4 (5 stored), mixed (3 stored)
    assert batch["video_frames"].tolist() == [3, 3]
    assert batch["videos"].shape == (6, 3, 32, 32) and batch["images"].shape == (1, 3, 32, 32)
    stored = batcher.reader[0].videos[0]
    want = torch.cat([pre(f) for f in stored[[0, 1, 3]]])  # 3 of 5: i * 5 // 3
    assert torch.equal(batch["videos"][:3], want)
    anyres = ImagePreprocessor("anyres", PreprocessorSpec.plain(32), 32)
    assert anyres(stored[0]).shape[0] > 1 and anyres.frame(stored[0]).shape == (1, 3, 32, 32)
    # Placeholders: 3 frames x 2 x 2 pooled + 1 newline per video, 16 + 1 per image, in text order.
    video_id, image_id = batcher.encoder.video_token_id, batcher.encoder.tok.image_token_id
    tokens = batch["tokens"][0].tolist()
    assert tokens.count(video_id) == 2 * (3 * 4 + 1) and tokens.count(image_id) == 17
    mixed = tokens[tokens.index(image_id):]  # "look at this <image> and <video> ...": the image first
    assert mixed[:17] == [image_id] * 17 and mixed[18:31] == [video_id] * 13
    text_only = batcher.microbatch([Pack((0,), (0,), (0,))], [6])
    assert "videos" not in text_only

    cfg = _cfg()
    with one_process():
        model = build_model(cfg, cfg.model.padded_vocab_size(64), image_id, video_id)
        for p in model.parameters():  # zeros leave nothing to tell features from embeddings
            torch.nn.init.normal_(p, std=0.2)
        b = {k: batch[k] for k in ("tokens", "position_ids")}
        emb = model.embed(b["tokens"], b["position_ids"], batch["images"], None, batch["videos"],
                          batch["video_frames"])[:, 0]  # [s, h]
        image_seq, video_seq = model.vision_features(batch["images"], batch["videos"], [3, 3])
        assert torch.equal(emb[batch["tokens"][0] == video_id], video_seq)
        assert torch.equal(emb[batch["tokens"][0] == image_id], image_seq)
        assert torch.equal(video_seq[12], model.image_newline) and torch.equal(image_seq[16], model.image_newline)
        with pytest.raises(ValueError, match=r"26 video placeholder tokens but 2 videos of \[3, 2\] frames "
                                             r"\(22 tokens\)"):
            model.embed(b["tokens"], b["position_ids"], batch["images"], None, batch["videos"][:5],
                        torch.tensor([3, 2]))


def test_a_video_marker_without_a_video_token_is_a_bad_sample_with_its_reason(ingested):
    from megascale_omni.data.shards import BadSampleError
    from megascale_omni.data.tokenizer import TextTokenizer

    out, _, _ = ingested
    encoder = LlavaEncoder(TextTokenizer.from_path(out.parent / "tokenizer.json"), 17)  # no video token given
    with pytest.raises(BadSampleError, match="the tokenizer has no <video> token for video placeholders"):
        encoder.encode(ShardedSampleReader(out)[0])


def test_plan_costs_videos_from_the_index_alone(ingested):
    out, _, _ = ingested
    cost = SampleCost(10, ((32, 32),), ((5, 32, 48), (3, 32, 48)))
    v = _cfg().vision
    assert video_tokens(cost, 4, v.video_tokens) == (4 * 4 + 1) + (3 * 4 + 1)
    assert video_tokens(cost, 0, v.video_tokens) == (8 * 4 + 2)
    assert SampleCost.from_json(cost.to_json()) == cost and "videos" not in SampleCost(1, ()).to_json()
    reader = ShardedSampleReader(out)
    batcher = _batcher(out, video_frames=4)
    for frames in (0, 4):
        scan = PlanScanner(batcher.encoder, v.image_tokens, 256, 1, video_frames=frames,
                           video_tokens=v.video_tokens).scan(reader)
        assert scan.video_samples == 7 and scan.bad == 0
        text = [batcher.encoder.length_from_metadata(reader.read_metadata(i), [1] * reader[i].num_images)
                for i in range(8)]
        stored = [KEEP] * 5 + [3, 0, reader[7].videos[0].shape[0]]
        per_video = [min(f, frames or f) for f in stored]
        assert scan.lengths.tolist() == [t + (4 * f + 1 if f else 0) for t, f in zip(text, per_video)]
        assert scan.frames.tolist() == per_video  # tower inputs besides the images, for the model FLOPs
        # What the batcher lays out is what the plan counted.
        built = _batcher(out, video_frames=frames)
        for i in (0, 5, 7):
            assert len(built.encoder.encode(reader[i], frames_per_video=[per_video[i]]).tokens) == scan.lengths[i]


def test_rerun_with_other_video_settings_is_refused(ingested, tmp_path):
    out, media, _ = ingested
    copy = tmp_path / "train"
    shutil.copytree(out, copy)
    records = out.parent.parent / "records.json"
    with pytest.raises(ConfigError, match="holds an ingestion of other inputs or settings"):
        ingest(IngestInputs(llava_json=[str(records)], image_root=str(media)), copy, samples_per_shard=4,
               video=VideoSampling(frames=KEEP + 1))


def test_ingest_tool_video_flags(ingested, tmp_path):
    from tests.launcher import run_tool_in_process

    _, media, _ = ingested
    records = tmp_path / "r.json"
    records.write_text(json.dumps([{"id": "a", "video": "clip.webm", "conversations": _conv("<video> what")}]))
    out = tmp_path / "train"
    r = run_tool_in_process("tools/ingest_llava.py", "--out", out, "--image-root", media, "--llava-json", records,
                            "--workers", 1, "--video-frames", 4, "--video-fps", 5)
    assert r.returncode == 0, r.output
    # 12 frames at 10 fps = 1.2 s; 5 frames a second -> int(6.0) = 6, capped at 4: frames 0, 3, 6, 9
    video = ShardedSampleReader(out)[0].videos[0]
    means = video.reshape(len(video), -1).mean(axis=1)
    assert len(video) == 4 and np.abs(means - [level(j, FRAMES) for j in (0, 3, 6, 9)]).max() < 3, means
    r = run_tool_in_process("tools/ingest_llava.py", "--out", tmp_path / "x", "--llava-json", records,
                            "--video-frames", 0)
    assert r.returncode == 2 and r.stderr.strip() == ("config error: --video-frames=0: must be an int > 0 "
                                                      "(e.g. 8, 32)"), r.output
    r = run_tool_in_process("tools/ingest_llava.py", "--out", tmp_path / "x", "--llava-json", records,
                            "--video-fps", 0)
    assert r.returncode == 2 and r.stderr.strip() == "config error: --video-fps=0.0: must be > 0 (e.g. 1.0)", r.output
    assert not (tmp_path / "x").exists()


def test_ingest_length_check_counts_video_tokens(ingested, tmp_path):
    """``--seq-length`` counts each video as ``--tokens-per-frame`` per kept
    frame plus ``--video-newline``: a clip whose text alone fits is rejected
    one token over, kept at exactly the length; without the per-frame count a
    record with a video is rejected with that reason, never passed unchecked."""
    from megascale_omni.data.conversation import ChatEncoder
    from megascale_omni.data.llava.ingest import LengthCheck
    from tests.hf_models import chat_tokenizer
    from tests.launcher import run_tool_in_process

    _, media, _ = ingested
    tok_dir = tmp_path / "tok"
    tok = chat_tokenizer(tok_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<image>", "<video>"]})
    tok.save_pretrained(str(tok_dir))
    conv = _conv("<video>\nwhat happens in the clip")
    records = tmp_path / "r.json"
    records.write_text(json.dumps([{"id": "a", "video": "clip.mp4", "conversations": conv}]))
    check = LengthCheck(str(tok_dir), 0, tokens_per_image=4, tokens_per_frame=9, video_newline=1)
    text_only = len(ChatEncoder(tok, "<image>", 4).encode(conv, 0).tokens)
    full = len(ChatEncoder(tok, "<image>", 4, "<video>", check.video_tokens).encode(
        conv, 0, frames_per_video=[KEEP]).tokens)
    assert full == text_only + KEEP * 9 + 1

    def reasons(seq_length: int, *flags) -> list[str]:
        out = tmp_path / f"out-{seq_length}-{len(flags)}"
        r = run_tool_in_process("tools/ingest_llava.py", "--out", out, "--image-root", media, "--llava-json",
                                records, "--workers", 1, "--video-frames", KEEP, "--tokenizer", tok_dir,
                                "--seq-length", seq_length, "--tokens-per-image", 4, *flags)
        assert r.returncode == 0, r.output
        return [json.loads(line)["reason"] for line in (out / REJECTED_FILE).read_text().splitlines()]

    counted = ("--tokens-per-frame", 9, "--video-newline")
    assert reasons(full, *counted) == []
    assert reasons(full - 1, *counted) == [f"longer than seq_length {full - 1}: the first round alone is {full} "
                                           f"tokens > max length {full - 1}"]
    assert reasons(full) == ["video length unknown: the length check needs --tokens-per-frame"]
    r = run_tool_in_process("tools/ingest_llava.py", "--out", tmp_path / "x", "--llava-json", records,
                            "--tokens-per-frame", 9)
    assert r.returncode == 2 and r.stderr.strip() == (
        "config error: --tokens-per-frame/--video-newline='9/False': only count with --seq-length (the length "
        "check)"), r.output


def test_chat_encoder_lays_out_videos_and_images_in_text_order(tmp_path):
    from megascale_omni.data.conversation import ChatEncoder, ConversationError
    from tests.hf_models import chat_tokenizer

    tok = chat_tokenizer(tmp_path)
    v = _cfg().vision
    with pytest.raises(ConversationError, match="the tokenizer has no '<video>' token for video placeholders"):
        ChatEncoder(tok, "<image>", v.image_tokens, "<video>", v.video_tokens).encode(
            _conv("<video> what"), 0, frames_per_video=[3])
    tok.add_special_tokens({"additional_special_tokens": ["<image>", "<video>"]})
    enc = ChatEncoder(tok, "<image>", v.image_tokens, "<video>", v.video_tokens)
    image_id, video_id = enc.image_token_id, enc.video_token_id
    conv = _conv("<video> and then <image> compare them", "the first") + _conv("and <video>", "a ball")
    out = enc.encode(conv, 1, frames_per_video=[3, 2])
    ids = out.tokens
    first_video, first_image = ids.index(video_id), ids.index(image_id)
    assert ids[first_video : first_video + 13] == [video_id] * 13 and first_video + 13 < first_image
    assert ids[first_image : first_image + 17] == [image_id] * 17
    assert ids.count(video_id) == 13 + 9 and out.num_videos == 2
    # The text-only count (the index's cost.tokens) leaves the videos out; the plan adds vision.video_tokens.
    assert len(enc.encode(conv, 1).tokens) == len(ids) - 22
    # Truncation drops the last round with its video.
    cut = enc.encode(conv, 1, max_length=len(ids) - 5, frames_per_video=[3, 2])
    assert (cut.num_videos, cut.truncated, cut.tokens.count(video_id)) == (1, True, 13)
    with pytest.raises(ConversationError, match="text has 2 <video> markers but the sample has 1 videos"):
        enc.encode(conv, 1, frames_per_video=[3])


def test_checkpoints_from_before_the_video_fields_still_resume():
    from megascale_omni.checkpoint.state import PRETRAINED_FREE_FIELDS, incompatibilities
    from megascale_omni.config import JobConfig, from_dict, to_dict

    cfg = from_dict(JobConfig, {"model": {"family": "llava"}})
    old = to_dict(cfg)
    del old["vision"]["video_pool_stride"], old["vision"]["image_newline"]  # as main wrote them before issue 32
    assert incompatibilities(old, cfg) == []
    onevision = from_dict(JobConfig, {"model": {"family": "llava"}, "vision": {"image_newline": True,
                                                                              "video_pool_stride": 3}})
    assert incompatibilities(old, onevision) == ["vision.image_newline: checkpoint False, config True",
                                                 "vision.video_pool_stride: checkpoint 2, config 3"]
    # Starting from weights: the pooling may change (no tensor depends on it), the newline parameter not.
    assert incompatibilities(old, onevision, PRETRAINED_FREE_FIELDS) == [
        "vision.image_newline: checkpoint False, config True"]


def test_image_newline_with_anyres_is_refused_in_one_line():
    from megascale_omni.config import JobConfig, from_dict
    from megascale_omni.config.validate import validate_job

    cfg = from_dict(JobConfig, {"model": {"family": "llava"}, "vision": {"image_newline": True},
                                "data": {"image_mode": "anyres"}})
    with pytest.raises(ConfigError) as err:
        validate_job(cfg, 1)
    assert str(err.value).startswith("config error: vision.image_newline=True: is not built for "
                                     "data.image_mode=anyres (LLaVA-OneVision puts a newline after every row")
