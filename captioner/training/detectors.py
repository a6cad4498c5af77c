"""Learning concept detectors from captions over cached region features, and using them in training.

Shape legend: C images, N regions, D feature width, K concepts, B batch, T caption steps.

:func:`train_concepts` fits a :class:`captioner.models.concepts.ConceptHead` by multiple-instance
learning (Fang et al. 2015): an image's concept score pools its regions' scores, and binary
cross-entropy against "how many of the image's captions use the word" (0, 0.2, ..., 1: five
annotators are five noisy votes) trains it. It reads the frozen encoder's feature cache, so it
trains in minutes on a CPU and never touches pixels. :func:`average_precision` scores it on
held-out images; :func:`concept_pointing` asks whether a concept's map peaks inside the box of
the object it names (COCO boxes: the concept word must be a category word).

A run reads a concepts file (``train.concepts``): :func:`with_concept_input` sizes its decoder to
read the concepts and :func:`install_concepts` copies the head in; the guide term is
``captioner.training.objective.ConceptGuide``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from captioner.data.checks import check_images
from captioner.data.coco import load_caption_set, load_instances
from captioner.data.transforms import ImageTransform, crop_box
from captioner.errors import ConfigError, DataError
from captioner.evaluation.attention_metrics import attention_correctness, coco_word_table, summarize
from captioner.features.cache import get_feature_cache
from captioner.models.concepts import ConceptHead, choose_concepts, read_concepts, save_concepts
from captioner.models.encoder import build_encoder
from captioner.text import Vocabulary, tokenize

log = logging.getLogger(__name__)

ENCODE_BATCH = 32  # images per encoder batch when a feature cache has to be built


def concept_targets(caption_set: Any, words: Sequence[str]) -> torch.Tensor:
    """(C, K) float: the share of image c's captions that use concept word k."""
    index = {w: k for k, w in enumerate(words)}
    targets = torch.zeros(len(caption_set.images), len(words))
    for c, record in enumerate(caption_set.images):
        captions = caption_set.captions[record.image_id]
        for caption in captions:
            for k in {index[w] for w in tokenize(caption) if w in index}:
                targets[c, k] += 1.0 / max(len(captions), 1)
    return targets


def average_precision(scores: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """Per-column average precision: scores (C, K), positives (C, K) bool -> (K,) (NaN where no positive)."""
    order = scores.argsort(dim=0, descending=True)  # (C, K)
    hits = positives.gather(0, order).float()  # (C, K) in rank order
    precision = hits.cumsum(0) / torch.arange(1, len(hits) + 1, dtype=torch.float32).unsqueeze(1)
    count = hits.sum(0)
    return torch.where(count > 0, (precision * hits).sum(0) / count.clamp(min=1), torch.full_like(count, math.nan))


@dataclass
class ConceptReport:
    """What :func:`train_concepts` measured.

    Attributes:
        epochs: passes over the training images.
        seconds: wall time of the training loop.
        first_loss, last_loss: mean training loss of the first and the last epoch.
        dev_map: mean average precision on the held-out images, over concepts with a positive there
            (a concept counts as present when at least one of the image's captions uses it).
        dev_map_by_epoch: the same after each epoch.
        per_word_ap: the final average precision of each concept word (NaN: no positive).
    """

    epochs: int
    seconds: float
    first_loss: float
    last_loss: float
    dev_map: float
    dev_map_by_epoch: list[float] = field(default_factory=list)
    per_word_ap: list[float] = field(default_factory=list)


def _rows(features: Any, index: Sequence[int]) -> torch.Tensor:
    """Rows of a (C,N,D) tensor, array or :class:`_Rows` as a float32 tensor (B,N,D), in ascending order."""
    rows = features[sorted(int(i) for i in index)]
    return rows.float() if torch.is_tensor(rows) else torch.from_numpy(np.asarray(rows, dtype=np.float32))


@torch.no_grad()
def image_scores(head: ConceptHead, features: Any, batch_size: int = 256) -> torch.Tensor:
    """P(concept in image) for every row of ``features`` (C,N,D): (C, K)."""
    head.eval()
    out = [head.probs(_rows(features, range(i, min(i + batch_size, len(features)))))
           for i in range(0, len(features), batch_size)]
    return torch.cat(out) if out else torch.zeros(0, head.size)


def mil_loss(head: ConceptHead, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """BCE of the pooled image logits (B,K) against soft targets (B,K)."""
    return F.binary_cross_entropy_with_logits(head.pool(head(features)), targets)


def train_concepts(head: ConceptHead, train_features: Any, train_targets: torch.Tensor, dev_features: Any,
                   dev_targets: torch.Tensor, epochs: int = 8, batch_size: int = 64, lr: float = 1e-3,
                   weight_decay: float = 1e-4, seed: int = 0, progress: bool = True) -> ConceptReport:
    """Fit ``head`` in place by multiple-instance learning; the best dev epoch's weights are kept.

    Args:
        head: the head to train (its ``words`` define the targets' columns).
        train_features, dev_features: (C,N,D) region features (a feature cache's memory map or an array).
        train_targets, dev_targets: (C,K) soft targets (:func:`concept_targets`).
        epochs: passes over the training images (cosine learning-rate decay over them).
        batch_size, lr, weight_decay: AdamW's.
        seed: shuffling and initialisation are reproducible from it.
        progress: a progress bar per epoch.
    """
    if len(train_features) != len(train_targets) or len(dev_features) != len(dev_targets):
        raise DataError(f"features for {len(train_features)}/{len(dev_features)} images but targets for "
                        f"{len(train_targets)}/{len(dev_targets)}")
    if len(train_features) == 0:
        raise DataError("no training images for the concept detectors")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    steps = epochs * math.ceil(len(train_features) / batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0))))
    dev_positive = dev_targets > 0
    best, best_state, history, losses = -1.0, None, [], []
    start = time.perf_counter()
    for epoch in range(epochs):
        head.train()
        order = torch.randperm(len(train_features), generator=gen)
        total, count = 0.0, 0
        batches = range(0, len(order), batch_size)
        for i in tqdm(batches, desc=f"concepts epoch {epoch + 1}/{epochs}", disable=not progress, leave=False):
            index = order[i:i + batch_size].sort().values
            loss = mil_loss(head, _rows(train_features, index.tolist()), train_targets[index])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total, count = total + float(loss.detach()), count + 1
        losses.append(total / max(count, 1))
        ap = average_precision(image_scores(head, dev_features), dev_positive)
        score = float(ap.nanmean()) if len(dev_targets) else float("nan")
        history.append(score)
        log.info("concepts epoch %d/%d: loss %.4f, dev mAP %.3f", epoch + 1, epochs, losses[-1], score)
        if not score <= best:  # NaN (no dev images) keeps the last epoch
            best, best_state = score, {k: v.detach().clone() for k, v in head.state_dict().items()}
            best_ap = ap
    if best_state is not None:
        head.load_state_dict(best_state)
    head.eval()
    return ConceptReport(epochs, time.perf_counter() - start, losses[0], losses[-1], best, history,
                         [float(a) for a in best_ap])


# ----------------------------------------------------------------------------- the whole job


def _cache(cfg: Any, encoder: Any, caption_set: Any, progress: bool) -> Any:
    """The feature cache of ``caption_set`` (shared with training: same folder, same key)."""
    cache_dir = Path(cfg.data.feature_cache_dir or os.environ.get("CAPTIONER_FEATURE_CACHE") or "runs/features")
    return get_feature_cache(cfg.model, encoder, caption_set, ImageTransform(cfg.model.encoder), cache_dir,
                             batch_size=ENCODE_BATCH, progress=progress, skip_bad=cfg.data.skip_missing,
                             num_workers=cfg.data.num_workers)


class _Rows:
    """A cache's valid rows as a (C,N,D) sequence of float tensors (``len``, ``[index list]``)."""

    def __init__(self, cache: Any, valid: Sequence[int]) -> None:
        self.load, self.valid = cache.loader(), list(valid)

    def __len__(self) -> int:
        return len(self.valid)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.load.stack([self.valid[int(i)] for i in index]).float()


def concept_pointing(head: ConceptHead, features: Any, caption_set: Any, instances: dict[int, list[Any]],
                     encoder_cfg: Any) -> dict[str, Any]:
    """Do concept maps peak inside the boxes of the objects their words name?

    For every image and every COCO category in it whose name (or synonym, one word) is a concept,
    the concept's map is scored as attention correctness scores a word's attention: the mass inside
    the category's boxes against a uniform map's (``ratio``), and whether its peak lies in a box
    (``pointing_accuracy``).
    """
    table = {phrase[0]: category for phrase, category in coco_word_table().items() if len(phrase) == 1}
    wanted = [(k, w, table[w]) for k, w in enumerate(head.words) if w in table]
    scores = []
    with torch.no_grad():
        for c, record in enumerate(caption_set.images):
            objs = instances.get(record.image_id, [])
            present = {obj.category for obj in objs}
            hits = [(k, w) for k, w, category in wanted if category in present]
            if not hits:
                continue
            maps = head.maps(features[[c]])[0]  # (K, N)
            width, height = record.size()
            view = crop_box(width, height, encoder_cfg)
            for k, word in hits:
                scores.append(attention_correctness([word], maps[k:k + 1], objs, (width, height), view, "coco"))
    return summarize(scores)


def learn_concepts(cfg: Any, out: str | os.PathLike, k: int = 1000, epochs: int = 8, hidden: int = 512,
                   pooling: str = "lse", boxes: str | None = None, boxes_split: str = "train2017",
                   progress: bool = True) -> str:
    """Train concept detectors on ``cfg.data``'s training split over its feature cache, choose the
    epoch on its validation split, write the concepts file ``out``; returns a report (lines).

    Args:
        cfg: a run's ``Config`` (encoder, data root and splits, feature cache folder).
        out: the concepts file to write.
        k, epochs, hidden, pooling: the concepts and the head (``ConceptHead``).
        boxes, boxes_split: a COCO folder with object boxes: also report :func:`concept_pointing` there.
        progress: progress bars.
    """
    if cfg.model.encoder.fine_tune:
        raise ConfigError("concept detectors read a frozen encoder's features: set encoder.fine_tune=false")
    d = cfg.data
    train_set = check_images(load_caption_set(d.root, d.train_split, d.images), skip_missing=d.skip_missing)
    dev_set = check_images(load_caption_set(d.root, d.val_split, d.images), skip_missing=d.skip_missing)
    out = Path(out)
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: folder {out.parent} does not exist")
    encoder = build_encoder(cfg.model.encoder).eval()
    started = time.perf_counter()
    train_cache, dev_cache = (_cache(cfg, encoder, cs, progress) for cs in (train_set, dev_set))
    cache_seconds = time.perf_counter() - started
    train_valid, dev_valid = train_cache.valid_indices(), dev_cache.valid_indices()
    words = choose_concepts(([w for c in train_set.captions[r.image_id] for w in tokenize(c)]
                             for r in train_set.images), k)
    head = ConceptHead(train_cache.dim, words, hidden, pooling=pooling)
    train_targets = concept_targets(train_set.subset(train_valid), words)
    dev_targets = concept_targets(dev_set.subset(dev_valid), words)
    log.info("concept detectors: %d words (%s ...) over %d training and %d dev images", len(words),
             ", ".join(words[:8]), len(train_valid), len(dev_valid))
    report = train_concepts(head, _Rows(train_cache, train_valid), train_targets, _Rows(dev_cache, dev_valid),
                            dev_targets, epochs=epochs, seed=cfg.train.seed, progress=progress)
    lines = [f"{len(words)} concepts, {pooling} pooling: dev mAP {report.dev_map:.3f} "
             f"(by epoch: {', '.join(f'{m:.3f}' for m in report.dev_map_by_epoch)}); "
             f"training {report.seconds:.0f} s, feature caches {cache_seconds:.0f} s"]
    ranked = sorted((ap, w) for ap, w in zip(report.per_word_ap, words) if ap == ap)
    lines.append("best: " + ", ".join(f"{w} {ap:.2f}" for ap, w in ranked[::-1][:10]))
    extra: dict[str, Any] = {"dev_map": report.dev_map, "epochs": epochs, "data": str(d.root),
                             "encoder": cfg.model.encoder.name, "grid": cfg.model.encoder.grid,
                             "image_size": cfg.model.encoder.image_size}
    if boxes:
        box_set = check_images(load_caption_set(boxes, boxes_split, None), skip_missing=True)
        instances = load_instances(boxes, boxes_split)
        if instances is None:
            raise DataError(f"--boxes {boxes}: no instances_{boxes_split}.json with object boxes")
        box_cache = _cache(cfg, encoder, box_set, progress)
        valid = box_cache.valid_indices()
        pointing = concept_pointing(head, _Rows(box_cache, valid), box_set.subset(valid), instances,
                                    cfg.model.encoder)
        extra["boxes"] = {key: pointing[key] for key in ("ratio", "pointing_accuracy", "words_scored")}
        if pointing["ratio"] is not None:
            lines.append(f"COCO boxes ({boxes}): maps {pointing['ratio']:.2f}x uniform inside the named object's "
                         f"box, peak inside it {100 * pointing['pointing_accuracy']:.0f}% "
                         f"({pointing['words_scored']} words)")
        else:
            lines.append(f"COCO boxes ({boxes}): no concept word names a COCO category there")
    save_concepts(head, out, extra)
    lines.append(f"wrote {out}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- concepts in a training run


def read_run_concepts(cfg: Any, vocab: Vocabulary) -> ConceptHead | None:
    """``train.concepts``' head restricted to ``vocab``, or None when the run has no concepts file."""
    return read_concepts(cfg.train.concepts, cfg.model.encoder, vocab) if cfg.train.concepts else None


def with_concept_input(cfg: Any, head: ConceptHead | None) -> Any:
    """``cfg`` with the decoder sized to read ``head`` (``train.concept_input``), else ``cfg`` unchanged."""
    if head is None or not cfg.train.concept_input:
        return cfg
    if cfg.model.decoder.name != "sat":
        raise ConfigError(f"train.concept_input: the {cfg.model.decoder.name} decoder does not read concepts; "
                          "set train.concept_input=false (train.concept_guide still applies)")
    return cfg.override(**{"model.decoder.concepts": head.size, "model.decoder.concept_hidden": head.hidden_dim,
                           "model.decoder.concept_pooling": head.pooling, "model.decoder.concept_sharpness": head.sharpness})


def install_concepts(decoder: Any, head: ConceptHead | None, vocab: Vocabulary) -> None:
    """Copy ``head``'s weights and its words' vocabulary ids into a decoder built to read concepts."""
    if head is None or not getattr(decoder, "concepts", 0):
        return
    if decoder.concepts != head.size:
        raise ConfigError(f"the decoder reads {decoder.concepts} concepts, the concepts file has {head.size} "
                          "in this vocabulary")
    decoder.concept_head.load_state_dict(head.state_dict())
    decoder.concept_ids.copy_(torch.tensor([vocab.stoi[w] for w in head.words], dtype=torch.long))
