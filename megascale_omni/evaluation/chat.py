"""Held-out evaluation of a LLaVA model on any conversation dataset: val loss
and answer-token accuracy, on at most ``train.eval_samples`` samples, with the
shuffled-image control when ``train.eval_shuffled_images`` is set.

Answer-token accuracy is the fraction of scored tokens (``loss_mask``: every
assistant token the model is trained on) whose argmax prediction equals the
label. The control pass gives every sample another sample's images (same
tower inputs per image, so the encoded length is unchanged) and plays every
video's frames in a random order: the gap between the two passes is what the
model reads from the pixels, and for videos from the frame order.
With videos in the val split the scores split by modality:
``accuracy/image`` (samples without a video) and ``accuracy/video``, and each
``categories`` breakdown counts image samples only (``video_categories``:
video samples).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megascale_omni.data.health import check_bad_fraction
from megascale_omni.data.llava.batches import LlavaBatcher
from megascale_omni.data.packing import Pack, pack_samples
from megascale_omni.evaluation.base import Evaluator
from megascale_omni.models.loss import masked_token_loss
from megascale_omni.parallel import data_parallel_rank
from megascale_omni.parallel.schedules import LOSS_KEY, reduce_reports

logger = logging.getLogger(__name__)


class ChatEvaluator(Evaluator):
    """``train.evaluator: chat`` of the LLaVA family (every rank).

    Metrics (loss rank), per pass ``real`` and, with the control, ``shuffled``:
    ``<pass>/loss`` (mean token loss over ``loss_mask``), ``<pass>/<metric>``
    (argmax accuracy over the tokens of :attr:`mask_key`) and
    ``<pass>/scored_tokens``.
    """

    #: Name of the accuracy metric.
    metric = "answer_token_accuracy"
    #: Micro-batch entry marking the tokens the accuracy scores.
    mask_key = "loss_mask"

    def categories(self) -> dict[str, torch.Tensor]:
        """Label token ids per category for an accuracy breakdown of image samples (none here)."""
        return {}

    def video_categories(self) -> dict[str, torch.Tensor]:
        """Label token ids per category for an accuracy breakdown of video samples (none here)."""
        return {}

    def evaluate(self, chunks: Sequence[torch.nn.Module], step: int) -> Optional[dict[str, float]]:
        """Held-out loss and accuracy with real images and, if enabled, with
        images shuffled across samples; None without a ``val/`` split."""
        if self.data.val_reader is None:
            return None
        passes = (("real", False), ("shuffled", True)) if self.cfg.train.eval_shuffled_images else (("real", False),)
        result = {}
        for name, shuffled in passes:
            totals = self._pass(chunks, shuffled)
            if totals is None:
                continue
            loss_sum, count = totals[LOSS_KEY].tolist()
            correct, total = totals["accuracy"].tolist()
            result[f"{name}/loss"] = loss_sum / max(count, 1.0)
            result[f"{name}/{self.metric}"] = correct / max(total, 1.0)
            result[f"{name}/scored_tokens"] = total
            video = totals.get("accuracy/video")
            for key, value in totals.items():
                if key == "accuracy/image" and (video is None or video[1] == 0):
                    continue  # no video in the split: the image score is the headline's
                if key.startswith("accuracy/") and value[1] > 0:
                    result[f"{name}/{key}"] = (value[0] / value[1]).item()
        if result:
            logger.info("evaluation at step %d (held-out split, %d samples)\n%s", step, len(self._val()[0]),
                        format_eval_table(result, self.metric))
        return result or None

    def _val(self) -> tuple[np.ndarray, list[Pack], dict[int, int]]:
        """The evaluated val samples (ids, packed rows, shuffled-image donors):
        the first ``train.eval_samples`` usable ones (0: all), scanned once."""
        if not hasattr(self, "_val_split"):
            data = self.data
            scan = data.scanner.scan(data.val_reader)
            check_bad_fraction(scan.bad, len(data.val_reader), self.cfg.data.max_bad_sample_fraction,
                               f"scanning {data.val_reader.root}")
            cap = self.cfg.train.eval_samples or len(scan.ids)
            ids, lengths, views = scan.ids[:cap], scan.lengths[:cap], scan.views[:cap]
            self._val_split = (ids, pack_samples(lengths, data.seq_length), shuffled_image_sources(ids, views))
            self._batcher = LlavaBatcher(
                data.val_reader, data.encoder, data.seq_length, data.tokenizer.pad_id, self.cfg.vision.image_size,
                preprocess=data.preprocess, pad_to_multiple_of=data.multiple, video_frames=self.cfg.data.video_frames,
            )
        return self._val_split

    def _pass(self, chunks: Sequence[torch.nn.Module], shuffled: bool) -> Optional[dict]:
        """Summed reports of one pass over this DP rank's val rows (every rank; None off the loss rank)."""
        ids, packs, sources = self._val()
        mine = list(packs[data_parallel_rank() :: self.dims.dp])
        mbs = self.cfg.train.micro_batch_size
        # Pipeline p2p buffers are [seq, micro_batch_size, hidden]: every
        # micro-batch must be full, so pad the tail with empty rows. The
        # interleaved (VPP) schedule also runs micro-batches in groups of pp
        # and rejects a partial last group: pad to whole groups.
        rows = mbs * (self.dims.pp if self.dims.num_model_chunks > 1 else 1)
        mine += [Pack((), (), ())] * (-len(mine) % rows or (rows if not mine else 0))
        batches = self.data.broadcast(lambda: [
            self._batcher.microbatch(mine[i : i + mbs], ids, sources if shuffled else None, shuffle_frames=shuffled)
            for i in range(0, len(mine), mbs)
        ], self._batcher.counter)
        score = partial(score_logits, mask_key=self.mask_key, categories=self.categories(),
                        video_categories=self.video_categories())
        return reduce_reports(self.forward_only(chunks, partial(self.model.logits_step, score=score), batches))


def score_logits(logits: torch.Tensor, batch: dict, mask_key: str = "loss_mask",
                 categories: Optional[dict[str, torch.Tensor]] = None,
                 video_categories: Optional[dict[str, torch.Tensor]] = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Last stage, eval only: token loss over ``loss_mask`` and argmax accuracy
    over ``batch[mask_key]`` (``report["accuracy"] = [correct, scored]``, float64),
    per category of label ids too. With ``batch["video_mask"]`` also
    ``accuracy/image`` and ``accuracy/video`` (tokens of samples without and
    with a video); ``categories`` then score image samples and
    ``video_categories`` video samples (``accuracy/video <name>``).
    ``logits``: ``[1, t, vocab / tp]`` (THD: the ``[b, s]`` rows of ``batch`` flattened)."""
    full = gather_from_tensor_model_parallel_region(logits).float()  # [1, t, vocab]
    return score_tokens(full, batch, mask_key, categories, video_categories)


def score_tokens(full: torch.Tensor, batch: dict, mask_key: str = "loss_mask",
                 categories: Optional[dict[str, torch.Tensor]] = None,
                 video_categories: Optional[dict[str, torch.Tensor]] = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """:func:`score_logits` on the whole vocabulary's logits ``[1, t, vocab]`` (any rank, no collective)."""
    labels = batch["labels"].reshape(full.shape[:-1])
    token_loss = F.cross_entropy(full.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    loss_sum, num_tokens, report = masked_token_loss(token_loss, batch["loss_mask"])
    hit = (full.argmax(-1) == labels).float()
    m = batch[mask_key].reshape(labels.shape).float()
    report["accuracy"] = torch.stack([(hit * m).sum().double(), m.sum().double()])
    video = batch.get("video_mask")
    on_video = torch.zeros_like(m) if video is None else video.reshape(labels.shape).float()
    groups = [("", m * (1 - on_video), categories or {})]
    if video is not None:
        groups.append(("video ", m * on_video, video_categories or {}))
        report["accuracy/image"] = torch.stack([(hit * groups[0][1]).sum().double(), groups[0][1].sum().double()])
        report["accuracy/video"] = torch.stack([(hit * groups[1][1]).sum().double(), groups[1][1].sum().double()])
    for prefix, gm, cats in groups:
        for name, ids in cats.items():
            cm = gm * torch.isin(labels, ids.to(labels.device)).float()
            report[f"accuracy/{prefix}{name}"] = torch.stack([(hit * cm).sum().double(), cm.sum().double()])
    return loss_sum, num_tokens, report


def format_eval_table(result: dict[str, float], metric: str) -> str:
    """Real-vs-shuffled-images table for the log (loss rank)."""
    rows = [("images", "loss", metric.replace("_", " ").replace("image word", "image-word"), "scored tokens")]
    for name in ("real", "shuffled"):
        if f"{name}/loss" in result:
            rows.append((
                name if name == "real" else "shuffled (control)",
                f"{result[f'{name}/loss']:.4f}",
                f"{result[f'{name}/{metric}']:.3f}",
                f"{int(result[f'{name}/scored_tokens'])}",
            ))
    # Image samples' categories, then both modalities' totals, then the videos' categories.
    cats = sorted({k.split("/", 2)[2] for k in result if k.startswith("real/accuracy/")},
                  key=lambda c: (c.startswith("video "), c in ("image", "video"), c))
    for cat in cats:
        real = result.get(f"real/accuracy/{cat}")
        shuf = result.get(f"shuffled/accuracy/{cat}")
        rows.append((f"  {cat} words", "", f"{real:.3f} (control {shuf:.3f})" if shuf is not None else f"{real:.3f}", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def shuffled_image_sources(ids: np.ndarray, views: Sequence[tuple[int, ...]]) -> dict[int, int]:
    """Map each val sample to a donor sample with the same tower inputs per
    image (``views``; one each unless anyres), so its encoded length is
    unchanged: a rotation within each group, so text stays and images are wrong."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, v in zip(ids.tolist(), views):
        groups.setdefault(tuple(v), []).append(i)
    sources = {}
    for key, members in groups.items():
        n = len(key)
        if n == 0:
            continue
        rng = np.random.default_rng([7, n, *key] if any(v != 1 for v in key) else [7, n])
        order = rng.permutation(len(members))
        for k, idx in enumerate(order):
            sources[members[idx]] = members[order[(k + 1) % len(order)]]
    return sources
