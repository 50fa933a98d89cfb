"""The chat evaluator (``train.evaluator: chat``) on a conversation dataset
with no shapes vocabulary: its val loss, answer-token accuracy and scored
token count equal a hand computation over the same samples, each run through
the model on its own; ``train.eval_samples`` caps the samples and
``train.eval_shuffled_images`` adds the control pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megascale_omni.config import load_job_config
from megascale_omni.data.llava.batches import LlavaBatcher
from megascale_omni.data.packing import Pack
from megascale_omni.data.sample import KIND_MULTI_IMAGE, KIND_SINGLE_IMAGE, KIND_TEXT_ONLY, Sample
from megascale_omni.data.shard_writer import write_shards
from megascale_omni.demo.llava_eval import ShapesEvaluator
from megascale_omni.evaluation.chat import ChatEvaluator
from megascale_omni.models.attention import thd_inputs
from megascale_omni.models.standalone import one_process
from megascale_omni.parallel import ParallelDims
from megascale_omni.platform import init_platform
from megascale_omni.tasks.registry import get_family
from tests.hf_models import chat_tokenizer

pytest.importorskip("transformers")

SEQ = 160
#: Relative tolerance of the evaluator's loss against the per-sample recomputation
#: (packing several samples into one THD row changes only float summation order).
LOSS_RTOL = 1e-5


def _samples(first_id: int, n: int) -> list[Sample]:
    ask, say = (lambda t: {"role": "user", "text": t}), (lambda t: {"role": "assistant", "text": t})
    rng = np.random.default_rng(first_id)
    out = []
    for k in range(n):
        img = lambda: rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)  # noqa: E731
        if k % 3 == 0:
            out.append(Sample(first_id + k, KIND_TEXT_ONLY, [],
                              [ask("How many shapes are there?"), say(f"There are {k + 2} of them.")]))
        elif k % 3 == 1:
            out.append(Sample(first_id + k, KIND_SINGLE_IMAGE, [img()],
                              [ask("<image> What is in the image?"), say("A red circle."),
                               ask("Which one is bigger?"), say("The first.")]))
        else:
            out.append(Sample(first_id + k, KIND_MULTI_IMAGE, [img(), img()],
                              [ask("<image> <image> Compare the two images."), say("The first image is brighter.")]))
    return out


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-eval")
    write_shards(_samples(0, 8), root / "train", samples_per_shard=4)
    write_shards(_samples(100, 7), root / "val", samples_per_shard=4)
    chat_tokenizer(root)
    return root


def _evaluate(root, *overrides, fit: bool = False):
    cfg = load_job_config(["--config", "examples/llava/tiny_cpu.yaml", f"data.path={root}", "data.format=chat",
                           f"model.seq_length={SEQ}", "model.num_layers=2", "vision.num_layers=1",
                           "train.global_batch_size=2", "train.micro_batch_size=2", "logging.level=WARNING",
                           *overrides])
    family = get_family("llava")
    family.validate(cfg, world_size=1)
    with one_process(seed=cfg.train.seed):
        torch.manual_seed(0)
        task = family.build_task(cfg, init_platform("cpu"), ParallelDims.from_config(cfg.parallel, 1))
        try:
            chunks = task.build_model()
            n = cfg.train.eval_samples or len(task.data.val_reader)
            if fit:
                _fit(task.data, chunks[0], n)
            result = task.evaluate(chunks, step=0)
            by_hand = {"real": _by_hand(task.data, chunks[0], n)}
            if cfg.train.eval_shuffled_images:
                donors = task.evaluator._val()[2]
                by_hand["donors"] = donors
                by_hand["shuffled"] = _by_hand(task.data, chunks[0], n, donors)
        finally:
            task.close()
    return task, result, by_hand


def _rows(data, n: int, donors=None) -> list[dict]:
    """Val samples ``0..n-1`` as micro-batches of one row each (with the images of ``donors[i]``)."""
    batcher = LlavaBatcher(data.val_reader, data.encoder, SEQ, data.tokenizer.pad_id, 32,
                           pad_to_multiple_of=data.multiple)
    lengths = data.scanner.scan(data.val_reader).lengths
    ids = list(range(len(data.val_reader)))
    return [batcher.microbatch([Pack((rid,), (0,), (int(lengths[rid]),))], ids, donors) for rid in range(n)]


def _logits(model, mb: dict) -> torch.Tensor:
    tokens, pos, _, packed = thd_inputs(mb)
    images = mb["images"] if mb["images"].shape[0] else None
    return model(tokens, pos, packed, images=images, labels=None).float()[0]  # [t, vocab]


def _fit(data, model, n: int, steps: int = 4) -> None:
    """A few Adam steps on the evaluated samples, so the argmax hits some
    answer tokens (a random model scores none: accuracy 0 would prove nothing)."""
    rows = _rows(data, n)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        for mb in rows:
            mask = mb["loss_mask"].reshape(-1).bool()
            loss = F.cross_entropy(_logits(model, mb)[mask], mb["labels"].reshape(-1)[mask])
            opt.zero_grad()
            loss.backward()
            opt.step()


def _by_hand(data, model, n: int, donors=None) -> dict[str, float]:
    """Loss and argmax accuracy over the loss-masked tokens of val samples
    ``0..n-1``, each forwarded alone (a row of its own), with the images of
    ``donors[i]`` if given."""
    loss_sum, hits, scored = 0.0, 0, 0
    model.eval()
    with torch.no_grad():
        for mb in _rows(data, n, donors):
            logits = _logits(model, mb)
            labels, mask = mb["labels"].reshape(-1), mb["loss_mask"].reshape(-1).bool()
            loss_sum += F.cross_entropy(logits[mask], labels[mask], reduction="sum").item()
            hits += int((logits[mask].argmax(-1) == labels[mask]).sum())
            scored += int(mask.sum())
    model.train()
    return {"loss": loss_sum / scored, "accuracy": hits / scored, "scored": scored}


def test_chat_evaluator_matches_a_hand_computation_on_the_capped_samples(chat_data):
    task, result, hand = _evaluate(chat_data, "train.eval_samples=4", "train.eval_shuffled_images=false",
                                      fit=True)
    by_hand = hand["real"]
    assert type(task.evaluator) is ChatEvaluator
    assert not ShapesEvaluator.applies(task.data.cfg, task.data)  # a BPE vocabulary: no shapes words
    assert sorted(result) == ["real/answer_token_accuracy", "real/loss", "real/scored_tokens"]
    assert result["real/scored_tokens"] == by_hand["scored"] > 0
    assert result["real/loss"] == pytest.approx(by_hand["loss"], rel=LOSS_RTOL)
    assert result["real/answer_token_accuracy"] == by_hand["accuracy"]
    assert 0 < by_hand["accuracy"] < 1, by_hand


def test_whole_split_and_the_shuffled_image_control(chat_data):
    _, capped, _ = _evaluate(chat_data, "train.eval_samples=4", "train.eval_shuffled_images=false")
    _, result, hand = _evaluate(chat_data, "train.eval_samples=0")
    # 0 = the whole split (7 samples): more tokens than the first 4.
    assert result["real/scored_tokens"] == hand["real"]["scored"] > capped["real/scored_tokens"]
    # The control gives each image sample (val 1, 2, 4, 5) another's images, same count.
    assert sorted(hand["donors"]) == [1, 2, 4, 5]
    assert all(d != s and d % 3 == s % 3 for s, d in hand["donors"].items())
    for name in ("real", "shuffled"):
        assert result[f"{name}/scored_tokens"] == hand[name]["scored"]
        assert result[f"{name}/loss"] == pytest.approx(hand[name]["loss"], rel=LOSS_RTOL)
        assert result[f"{name}/answer_token_accuracy"] == hand[name]["accuracy"]
