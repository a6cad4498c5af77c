"""Concept detectors learnt and joined to a training run: the ``captioner concepts`` job, the decoder's
reading set up for a run, and the concept terms of its loss (docs/concepts.md, docs/grounding.md).

:func:`learn_concepts` fits a ``ConceptHead`` over cached features by multiple-instance learning from
the captions alone (Fang et al. 2015); :func:`run_concepts` is the one hook of a training run.

Shape legend: B images, T caption steps, N regions, D feature width, K concepts.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from captioner.models.concepts import (READERS, ConceptHead, OutOfFoldConcepts, choose_concepts, feature_fold,
                                      read_concepts, read_concepts_with_folds, save_concepts)
from captioner.checkpoint.remote import cache_root
from captioner.data.caption_set import check_images
from captioner.data.coco import load_caption_set, load_instances, load_validation_set
from captioner.data.images import ImageTransform, crop_box
from captioner.device import resolve_device
from captioner.errors import ConfigError, DataError
from captioner.evaluation.attention_metrics import attention_correctness, coco_word_table, summarize
from captioner.features.cache import get_feature_cache
from captioner.files import Outputs, writable_folder
from captioner.models.base import DecoderOutput
from captioner.models.encoder import build_encoder
from captioner.models.registry import resolve_encoder
from captioner.text import Vocabulary, tokenize
from captioner.training.attention_terms import cross_entropy_only, grounding_loss
from captioner.training.data import Remap, feature_cache_dir

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


def top_k_precision(scores: torch.Tensor, positives: torch.Tensor, k: int = 10) -> float:
    """The share of each image's ``k`` most probable concepts that its captions use, over the images: unlike
    mean average precision it does not depend on how many images are ranked, so sets of different sizes compare."""
    if not len(scores):
        return math.nan
    k = min(k, scores.shape[1])
    return float(positives.gather(1, scores.topk(k, dim=1).indices).float().mean())


@dataclass
class ConceptReport:
    """What :func:`train_concepts` measured: ``dev_map`` over the concepts with a positive on the held-out
    images (present: one of the image's captions uses it) and ``per_word_ap`` (NaN: no positive)."""

    epochs: int  # passes over the training images
    seconds: float  # wall time of the training loop
    first_loss: float
    last_loss: float
    dev_map: float
    dev_map_by_epoch: list[float] = field(default_factory=list)  # the same after each epoch
    per_word_ap: list[float] = field(default_factory=list)


def _rows(features: Any, index: Sequence[int]) -> torch.Tensor:
    """Rows of a (C,N,D) tensor, array or row loader (``stack``: a cache's :class:`Remap`) as a float32
    tensor (B,N,D), in ascending order."""
    index = sorted(int(i) for i in index)
    rows = features.stack(index) if callable(getattr(features, "stack", None)) else features[index]
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

    Features are (C,N,D) (a feature cache's memory map or an array), targets (C,K) soft targets
    (:func:`concept_targets`); the learning rate decays by a cosine over the ``epochs``.
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
        for i in tqdm(batches, desc=f"concepts epoch {epoch + 1}/{epochs}", disable=not progress or None, leave=False):
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
    cache_dir = feature_cache_dir(cfg, cache_root() / "features")  # never beside the working directory
    return get_feature_cache(cfg.model, encoder, caption_set, ImageTransform(resolve_encoder(cfg.model.encoder)),
                             cache_dir,
                             batch_size=ENCODE_BATCH, progress=progress, skip_bad=cfg.data.skip_missing,
                             num_workers=cfg.data.num_workers,
                             device=resolve_device(cfg.train.device, option="train.device"))  # a GPU encodes


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
            maps = head.maps(_rows(features, [c]))[0]  # (K, N)
            width, height = record.size()
            view = crop_box(width, height, encoder_cfg)
            for k, word in hits:
                scores.append(attention_correctness([word], maps[k:k + 1], objs, (width, height), view, "coco"))
    return summarize(scores)


def check_fold_count(folds: int) -> None:
    """Cross-fitting needs at least 2 folds (``--folds 0``, the default, is none: not checked here)."""
    if folds < 2:
        raise ConfigError(f"--folds must be 0 (no cross-fitting) or at least 2, got {folds}")


@torch.no_grad()
def feature_folds(features: Any, folds: int, batch_size: int = 256) -> torch.Tensor:
    """:func:`feature_fold` of every row of ``features`` (C,N,D): (C,) long."""
    return torch.cat([feature_fold(_rows(features, range(i, min(i + batch_size, len(features)))), folds)
                      for i in range(0, len(features), batch_size)]) if len(features) else torch.zeros(0, dtype=torch.long)


def train_fold_heads(make_head: Callable[[], ConceptHead], train_features: Any, train_targets: torch.Tensor,
                     dev_features: Any, dev_targets: torch.Tensor, folds: int, epochs: int, seed: int = 0,
                     progress: bool = True) -> tuple[list[ConceptHead], dict[str, Any]]:
    """Cross-fitting: fold head f trained (as :func:`train_concepts`) without the training photos of fold f.
    Returns the F heads, each one's dev mAP, the photos per fold, and the out-of-fold mean average
    precision on the training photos (each photo scored by the head that never saw it).
    """
    check_fold_count(folds)
    fold = feature_folds(train_features, folds)
    sizes = torch.bincount(fold, minlength=folds)
    if int(sizes.min()) == 0:
        raise DataError(f"cross-fitting over {folds} folds left fold {int(sizes.argmin())} without a training photo "
                        f"({len(fold)} photos); use fewer folds")
    heads, dev_maps = [], []
    scores = torch.zeros(len(train_targets), train_targets.shape[1])
    for f in range(folds):
        keep = (fold != f).nonzero().squeeze(1).tolist()
        held = (fold == f).nonzero().squeeze(1).tolist()
        head = make_head()
        log.info("concepts fold %d/%d: trained on %d photos, scores the other %d", f + 1, folds, len(keep), len(held))
        report = train_concepts(head, _Subset(train_features, keep), train_targets[keep], dev_features, dev_targets,
                                epochs=epochs, seed=seed + 1 + f, progress=progress)
        heads.append(head)
        dev_maps.append(report.dev_map)
        scores[held] = image_scores(head, _Subset(train_features, held))
    out_of_fold = float(average_precision(scores, train_targets > 0).nanmean())
    return heads, {"folds": folds, "fold_sizes": sizes.tolist(), "fold_dev_map": dev_maps,
                   "out_of_fold_train_map": out_of_fold,
                   "out_of_fold_train_top10": top_k_precision(scores, train_targets > 0)}


class _Subset:
    """Rows ``index`` of a (C,N,D) row source, as :func:`_rows` reads them (``stack`` when it has one)."""

    def __init__(self, features: Any, index: Sequence[int]) -> None:
        self.features, self.index = features, list(index)

    def __len__(self) -> int:
        return len(self.index)

    def stack(self, items: Sequence[int]) -> torch.Tensor:
        return _rows(self.features, [self.index[i] for i in items])


MAX_CONCEPT_WORDS = 100_000
MAX_CONCEPT_EPOCHS = 10_000
MAX_HEAD_WIDTH = 65_536


def check_concept_options(k: int, epochs: int, hidden: int) -> None:
    """The numbers of :func:`learn_concepts`, each in its range (one line naming it otherwise)."""
    for name, value, low, high in (("concepts", k, 1, MAX_CONCEPT_WORDS), ("epochs", epochs, 1, MAX_CONCEPT_EPOCHS),
                                   ("hidden", hidden, 0, MAX_HEAD_WIDTH)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(f"--{name} must be a whole number from {low} to {high}, got {value!r}")


def check_output_file(out: str | os.PathLike, overwrite: bool, option: str, example: str = "concepts.safetensors") -> Path:
    """``out`` as a file that may be written: not a folder, not an existing file unless ``overwrite``
    (:class:`captioner.files.Outputs`, its folder's manifest records it once written), in a folder that
    exists and can be written (checked with a temporary file)."""
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"{option} {out}: is a folder; give the file to write (e.g. {out / example})")
    concepts_output(out, overwrite, option).check([out])
    if not out.parent.is_dir():
        raise ConfigError(f"{option} {out}: folder {out.parent} does not exist")
    writable_folder(out.parent, ConfigError)
    return out


def concepts_output(out: Path, overwrite: bool, option: str) -> Outputs:
    """The writer rule for a concept file: an existing file is replaced only with ``--force`` (even one
    captioner wrote: a trained head is work to keep)."""
    return Outputs(out.parent, force=overwrite, option=option, replace_own=False)


def _cross_fit(make_head: Any, train_rows: Any, train_targets: torch.Tensor, dev_rows: Any, dev_targets: torch.Tensor,
               folds: int, epochs: int, seed: int, progress: bool, extra: dict[str, Any]
               ) -> tuple[list[ConceptHead], str]:
    """``learn_concepts``' fold heads (:func:`train_fold_heads`), their figures added to ``extra``, and a report line."""
    started = time.perf_counter()
    fold_heads, measured = train_fold_heads(make_head, train_rows, train_targets, dev_rows, dev_targets, folds, epochs,
                                            seed=seed, progress=progress)
    extra.update(measured)
    return fold_heads, (
        f"{folds} fold heads for cross-fitting ({', '.join(map(str, measured['fold_sizes']))} photos left "
        f"out): dev mAP {', '.join(f'{m:.3f}' for m in measured['fold_dev_map'])}; each training photo "
        f"by the head that never saw it: 10 most probable concepts "
        f"{100 * measured['out_of_fold_train_top10']:.1f}% in its captions, mAP "
        f"{measured['out_of_fold_train_map']:.3f} (the full head: {extra['train_map']:.3f}); "
        f"{time.perf_counter() - started:.0f} s")


def _box_report(cfg: Any, encoder: Any, head: ConceptHead, boxes: str, boxes_split: str, progress: bool,
                extra: dict[str, Any]) -> str:
    """How well the concepts' maps find the objects of a COCO folder with boxes (added to ``extra``): a report line."""
    box_set = check_images(load_caption_set(boxes, boxes_split, None), skip_missing=True)
    instances = load_instances(boxes, boxes_split)
    if instances is None:
        raise DataError(f"--boxes {boxes}: no instances_{boxes_split}.json with object boxes")
    box_cache = _cache(cfg, encoder, box_set, progress)
    valid = box_cache.valid_indices()
    pointing = concept_pointing(head, Remap(box_cache.loader(), valid), box_set.subset(valid), instances,
                                cfg.model.encoder)
    extra["boxes"] = {key: pointing[key] for key in ("ratio", "pointing_accuracy", "words_scored")}
    if pointing["ratio"] is None:
        return f"COCO boxes ({boxes}): no concept word names a COCO category there"
    return (f"COCO boxes ({boxes}): maps {pointing['ratio']:.2f}x uniform inside the named object's "
            f"box, peak inside it {100 * pointing['pointing_accuracy']:.0f}% ({pointing['words_scored']} words)")


def learn_concepts(cfg: Any, out: str | os.PathLike, k: int = 1000, epochs: int = 8, hidden: int = 512,
                   pooling: str = "lse", boxes: str | None = None, boxes_split: str = "train2017",
                   progress: bool = True, folds: int = 0, overwrite: bool = False) -> str:
    """Train concept detectors on ``cfg.data``'s training split over its feature cache, choose the
    epoch on its validation split, write the concepts file ``out``; returns a report (lines).

    ``boxes``: a COCO folder with object boxes, where :func:`concept_pointing` is also reported; ``folds``:
    0, or F >= 2 fold heads for cross-fitting, stored beside the head. Every argument, ``out`` and
    ``boxes`` are checked before the encoder is built or any training starts.
    """
    check_concept_options(k, epochs, hidden)
    if folds:
        check_fold_count(folds)  # before minutes of training the full head
    if cfg.model.encoder.fine_tune:
        raise ConfigError("concept detectors read a frozen encoder's features: set encoder.fine_tune=false")
    out = check_output_file(out, overwrite, "--out")
    d = cfg.data
    if boxes:
        box_set = check_images(load_caption_set(boxes, boxes_split, None), skip_missing=True)
        instances = load_instances(boxes, boxes_split)
        if instances is None:
            raise DataError(f"--boxes {boxes}: no instances_{boxes_split}.json with object boxes")
    train_set = check_images(load_caption_set(d.root, d.train_split, d.images), skip_missing=d.skip_missing)
    dev_set = check_images(load_validation_set(d.root, d.val_split, d.images), skip_missing=d.skip_missing)
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
    report = train_concepts(head, Remap(train_cache.loader(), train_valid), train_targets, Remap(dev_cache.loader(), dev_valid),
                            dev_targets, epochs=epochs, seed=cfg.train.seed, progress=progress)
    lines = [f"{len(words)} concepts, {pooling} pooling: dev mAP {report.dev_map:.3f} "
             f"(by epoch: {', '.join(f'{m:.3f}' for m in report.dev_map_by_epoch)}); "
             f"training {report.seconds:.0f} s, feature caches {cache_seconds:.0f} s"]
    ranked = sorted((ap, w) for ap, w in zip(report.per_word_ap, words) if ap == ap)
    lines.append("best: " + ", ".join(f"{w} {ap:.2f}" for ap, w in ranked[::-1][:10]))
    extra: dict[str, Any] = {"dev_map": report.dev_map, "epochs": epochs, "data": str(d.root),
                             "encoder": cfg.model.encoder.name, "grid": cfg.model.encoder.grid,
                             "image_size": cfg.model.encoder.image_size}
    train_rows = Remap(train_cache.loader(), train_valid)
    in_sample = image_scores(head, train_rows)
    extra["train_map"] = float(average_precision(in_sample, train_targets > 0).nanmean())
    extra["train_top10"] = top_k_precision(in_sample, train_targets > 0)
    extra["dev_top10"] = top_k_precision(image_scores(head, Remap(dev_cache.loader(), dev_valid)), dev_targets > 0)
    lines.append(f"a photo's 10 most probable concepts in its captions: {100 * extra['dev_top10']:.1f}% on dev, "
                 f"{100 * extra['train_top10']:.1f}% on the training photos the head trained on")
    fold_heads: list[ConceptHead] = []
    if folds:
        fold_heads, line = _cross_fit(lambda: ConceptHead(train_cache.dim, words, hidden, pooling=pooling), train_rows,
                                      train_targets, Remap(dev_cache.loader(), dev_valid), dev_targets, folds, epochs,
                                      cfg.train.seed, progress, extra)
        lines.append(line)
    else:
        lines.append("(captioner concepts --folds F gives each training photo concepts from a head that never saw it)")
    if boxes:
        lines.append(_box_report(cfg, encoder, head, boxes, boxes_split, progress, extra))
    save_concepts(head, out, extra, folds=fold_heads)
    concepts_output(out, overwrite, "--out").record([out])
    lines.append(f"wrote {out}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- concepts in a training run


@dataclass
class RunConcepts:
    """What ``train.concepts`` brings to a training run: ``head``, the concepts file's head restricted to
    the run's vocabulary, or None."""

    cfg: Any  # the run's config, its ``model.concepts`` sized to read ``head`` (``train.concept_input``)
    head: ConceptHead | None
    vocab: Vocabulary  # that vocabulary

    def install(self, decoder: Any, device: Any = "cpu") -> None:
        """Fill a freshly built decoder's extension with the head's weights and its words' vocabulary ids, and
        (``train.concept_cross_fit``) let it read each training photo's concepts from the fold head that
        never saw it."""
        extension = getattr(decoder, "extension", None)
        count = getattr(extension, "concepts", 0)
        if self.head is None or not count:
            return
        if count != self.head.size:
            raise ConfigError(f"the decoder reads {count} concepts, the concepts file has {self.head.size} "
                              "in this vocabulary")
        extension.concept_head.load_state_dict(self.head.state_dict())
        extension.concept_ids.copy_(torch.tensor([self.vocab.stoi[w] for w in self.head.words], dtype=torch.long))
        self._install_folds(extension, device)

    def _install_folds(self, extension: Any, device: Any) -> None:
        t = self.cfg.train
        if not (t.concepts and t.concept_cross_fit):
            return
        _, folds = read_concepts_with_folds(t.concepts, self.cfg.model.encoder, self.vocab)
        if not folds:
            return
        if getattr(t, "cuda_graph", False):
            raise ConfigError(f"train.cuda_graph cannot capture cross-fitted concepts (each photo picks its fold "
                              f"head); set train.concept_cross_fit=false or train.cuda_graph=false ({t.concepts} "
                              "has fold heads)")
        if folds[0].size != extension.concepts:
            raise ConfigError(f"the decoder reads {extension.concepts} concepts, the fold heads of {t.concepts} have "
                              f"{folds[0].size} in this vocabulary")
        extension.use_concept_folds(OutOfFoldConcepts(folds).to(device))
        log.info("concepts: each training photo's from the fold head that never saw it (%d folds)", len(folds))


def run_concepts(cfg: Any, vocab: Vocabulary) -> RunConcepts:
    """The one hook of a training run: ``train.concepts``' head restricted to ``vocab`` (checked before the
    run's first write) and ``cfg`` with ``model.concepts`` sized to read it (``train.concept_input``)."""
    head = read_concepts(cfg.train.concepts, cfg.model.encoder, vocab) if cfg.train.concepts else None
    if cfg.model.concepts.prior and (head is None or not cfg.train.concept_input):
        raise ConfigError("concepts.prior reshapes attention by the concepts' maps: it needs "
                          "train.concepts=FILE and train.concept_input=true")
    if head is not None and cfg.train.concept_input:
        if not isinstance(cfg.model.decoder, READERS):  # a registered family the extension does not join
            raise ConfigError(f"train.concept_input: the {cfg.model.decoder.name} decoder does not read concepts; "
                              "set train.concept_input=false (train.concept_guide still applies)")
        cfg = cfg.override(**{"model.concepts.count": head.size, "model.concepts.hidden": head.hidden_dim,
                              "model.concepts.pooling": head.pooling, "model.concepts.sharpness": head.sharpness})
    return RunConcepts(cfg, head, vocab)


def concept_table(words: Sequence[str], vocab: Vocabulary) -> torch.Tensor:
    """vocabulary id -> index of its concept in ``words``, -1 for a word that is no concept: (V,) long."""
    table = torch.full((len(vocab),), -1, dtype=torch.long)
    for k, word in enumerate(words):
        if word in vocab.stoi:
            table[vocab.stoi[word]] = k
    return table


class ConceptGuide:
    """The concept-guide term of cross-entropy training (a ``LossTerm``, ``train.concept_guide``).

    For every target word that is a concept, the decoder's attention at the step that predicts it
    is pulled towards that concept's map in the image (KL divergence to the map, as box
    supervision's ``cross_entropy`` form; logged as ``concept_guide`` and ``concept_guided_words``).
    A step is guided only where the head finds the concept with P >= ``min_prob``; the target is the map
    raised to ``sharpness``, renormalised (1: the map itself).
    """

    name = "concept_guide"

    def __init__(self, head: ConceptHead, vocab: Vocabulary, weight: float, min_prob: float = 0.1,
                 sharpness: float = 1.0) -> None:
        self.head = head.eval().requires_grad_(False)
        self.weight = weight
        self.min_prob = min_prob
        self.sharpness = sharpness
        self.pad_id = vocab.pad_id
        self.table = concept_table(head.words, vocab)
        self.stats: dict[str, torch.Tensor] = {}

    def targets(self, features: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """features (B,N,D), target words (B,T) -> soft targets (B,T,N); all-zero rows are not guided."""
        with torch.no_grad():
            self.head.to(features.device)
            probs, maps = self.head.read(features)  # (B, K), (B, K, N)
            present = probs >= self.min_prob  # (B, K)
            k = self.table.to(words.device)[words]  # (B, T)
            guided = k >= 0
            kk = k.clamp(min=0)
            target = maps.gather(1, kk.unsqueeze(-1).expand(-1, -1, maps.shape[-1]))  # (B, T, N)
            if self.sharpness != 1.0:  # in log space: a sharp power of small values underflows
                target = torch.softmax(self.sharpness * target.clamp(min=1e-30).log(), dim=-1)
            keep = guided & present.gather(1, kk)  # (B, T)
            return target * keep.unsqueeze(-1).to(target.dtype)

    def __call__(self, output: DecoderOutput, batch: Any) -> torch.Tensor:
        if batch.x.dim() != 3:
            raise DataError("train.concept_guide needs cached region features (a frozen encoder and "
                            "data.feature_cache=true)")
        words = batch.tokens[:, 1:]  # (B, T-1)
        target = self.targets(batch.x, words)
        term = grounding_loss(output.attention, target, "cross_entropy")
        real = (words != self.pad_id).sum().clamp(min=1).to(term.words.dtype)
        self.stats = {"concept_guided_words": term.words / real}
        return term.loss


class ConceptPointer:
    """The concept prior's pointer term of cross-entropy training (a ``LossTerm``, ``train.concept_pointer``).

    A SAT decoder with ``concepts.prior`` reads, at every step, a pointer q over the photo's K
    concepts and "none" (``aux["concept_pointer"]``, log q (B,T,K+1)); its attention is multiplied by
    the maps of the concepts q points at (:class:`captioner.models.concepts.SATConcepts`). This term teaches q to name the
    concept of the word the step predicts: the cross-entropy of q against that concept where the word is
    one and the head finds it in the photo (P >= ``min_prob``, as the guide), against "none" elsewhere.
    Logged as ``concept_pointer`` and ``concept_pointer_words`` (the share of words pointed at a concept).
    ``words``: the decoder's K concept words, in its order.
    """

    name = "concept_pointer"

    def __init__(self, words: Sequence[str], vocab: Vocabulary, weight: float, min_prob: float = 0.1) -> None:
        self.table = concept_table(words, vocab)
        self.weight = weight
        self.min_prob = min_prob
        self.pad_id = vocab.pad_id
        self.stats: dict[str, torch.Tensor] = {}

    def targets(self, words: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Target words (B,T), P(concept in image) (B,K) -> the pointer's targets (B,T): a concept index, K ("none")."""
        none = probs.shape[1]
        k = self.table.to(words.device)[words]  # (B, T), -1: no concept
        kk = k.clamp(min=0)
        found = (k >= 0) & (probs.gather(1, kk) >= self.min_prob)
        return torch.where(found, kk, torch.full_like(kk, none))

    def __call__(self, output: DecoderOutput, batch: Any) -> torch.Tensor:
        log_q = output.aux.get("concept_pointer")
        if log_q is None:
            raise ConfigError("train.concept_pointer trains the pointer of concepts.prior; this decoder has none")
        words = batch.tokens[:, 1:]  # (B, T-1)
        target = self.targets(words, output.aux["concept_probs"])
        real = words != self.pad_id
        nll = -log_q.float().gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (B, T-1)
        count = real.sum().clamp(min=1)
        self.stats = {"concept_pointer_words": ((target < log_q.shape[-1] - 1) & real).sum() / count}
        return (nll * real).sum() / count


def build_concept_pointer(cfg: Any, vocab: Vocabulary) -> ConceptPointer | None:
    """The ``train.concept_pointer`` term, for a decoder with ``concepts.prior`` trained by cross-entropy."""
    t = cfg.train
    if not cfg.model.concepts.prior or not t.concept_pointer:
        return None
    if not cross_entropy_only("train.concept_pointer", t.objective):
        return None
    head = read_concepts(t.concepts, cfg.model.encoder, vocab)
    log.info("concept prior: pointer over %d concepts (weight %g)", head.size, t.concept_pointer)
    return ConceptPointer(head.words, vocab, t.concept_pointer, t.concept_guide_min_prob)


def build_concept_guide(cfg: Any, vocab: Vocabulary) -> ConceptGuide | None:
    """The ``train.concept_guide`` term of cross-entropy training, or None when it is off."""
    t = cfg.train
    if not t.concept_guide:
        return None
    if not cross_entropy_only("train.concept_guide", t.objective):
        return None
    head = read_concepts(t.concepts, cfg.model.encoder, vocab)
    log.info("concept guide (weight %g, sharpness %g): %d concepts of %s", t.concept_guide,
             t.concept_guide_sharpness, head.size, t.concepts)
    return ConceptGuide(head, vocab, t.concept_guide, t.concept_guide_min_prob, t.concept_guide_sharpness)


def concept_terms(cfg: Any, vocab: Vocabulary) -> list[Any]:
    """The concept terms of a run's cross-entropy loss (``LossTerm``s of ``CrossEntropy``): the guide, then the
    pointer, each when the run asks for it."""
    return [term for term in (build_concept_guide(cfg, vocab), build_concept_pointer(cfg, vocab)) if term is not None]
