"""Detector learners: words found in image regions, learnt from captions alone (Fang et al. 2015).

Word detectors pretrain the demo's from-scratch CNN encoder (``pretrain_word_detectors``); concept
detectors fit a ``ConceptHead`` over a frozen encoder's cached features (``learn_concepts``,
``train_concepts``, ``captioner concepts``) and join a training run (``with_concept_input``,
``install_concepts``). docs/concepts.md explains both.

Shape legend: B images, D feature width, g grid side, N = g*g regions, V vocabulary.
"""

from __future__ import annotations

import itertools
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
from torch import nn
from safetensors.torch import save
from tqdm import tqdm

from captioner.checkpoint.remote import cache_root
from captioner.config import Config
from captioner.config.decoders import ConceptReaderConfig
from captioner.device import resolve_device
from captioner.data.checks import check_images
from captioner.data.coco import load_caption_set, load_instances
from captioner.data.dataset import image_loader
from captioner.data.transforms import ImageTransform, crop_box
from captioner.errors import ConfigError, DataError
from captioner.evaluation.attention_metrics import attention_correctness, coco_word_table, summarize
from captioner.features.cache import get_feature_cache
from captioner.files import Outputs, atomic_write, writable_folder
from captioner.models.concepts import (ConceptHead, OutOfFoldConcepts, choose_concepts, feature_fold, read_concepts,
                                       read_concepts_with_folds, save_concepts)
from captioner.models.encoder import build_encoder
from captioner.text import Vocabulary, tokenize
from captioner.training.data import Remap, feature_cache_dir, pixels_in_memory
from captioner.training.attention_terms import GroundingTargets

log = logging.getLogger(__name__)

POSTFIX_EVERY = 25  # steps between updates of the progress bar's loss

PERMUTATIONS = tuple(itertools.permutations(range(3)))  # of the colour channels, the identity first
# Words a permutation of the colour channels changes the truth of (white, black and grey it keeps).
HUE_WORDS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "cyan", "magenta", "violet",
             "teal", "turquoise", "maroon", "tan", "gold", "golden", "beige", "lime", "navy", "olive", "blonde")
SHARPNESS = 4.0  # r of the soft maximum over regions (r -> infinity: the max; r -> 0: the mean)


@dataclass
class PretrainResult:
    """What ``pretrain_word_detectors`` returns.

    Attributes:
        weights: the trunk's weights file (for ``encoder.weights``).
        steps: optimizer steps taken.
        first_loss, last_loss: mean BCE of the first and the last 20 steps.
        seconds: wall time of the training loop.
        grounded_images: training images whose words were also trained region by region (``boxes``).
    """

    weights: Path
    steps: int
    first_loss: float
    last_loss: float
    seconds: float
    grounded_images: int = 0


def word_targets(caption_set, vocab) -> torch.Tensor:  # noqa: ANN001
    """(C, V) float: 1 where a word occurs in any caption of image c (special tokens and <unk> stay 0)."""
    targets = torch.zeros(len(caption_set.images), len(vocab))
    for i, record in enumerate(caption_set.images):
        for caption in caption_set.captions[record.image_id]:
            for word in tokenize(caption):
                targets[i, vocab.stoi.get(word, vocab.unk_id)] = 1.0
    targets[:, : vocab.unk_id + 1] = 0.0  # <pad> <bos> <eos> <unk>
    return targets


class RegionTargets:
    """The words of each training image that name a box, with their region coverage (``boxes=True``).

    Args:
        per_image: for training image c, ``{word id: coverage (N,)}`` (the union of the word's boxes
            over the image's captions).
        vocab_size: V.
        regions: N.
    """

    def __init__(self, per_image: list[dict[int, np.ndarray]], vocab_size: int, regions: int,
                 table: Any = None) -> None:
        self.per_image = per_image
        self.table = table
        self.vocab_size = vocab_size
        self.regions = regions

    @classmethod
    def build(cls, caption_set, vocab: Vocabulary, grounding: GroundingTargets) -> "RegionTargets":  # noqa: ANN001
        per_image: list[dict[int, np.ndarray]] = []
        for c, record in enumerate(caption_set.images):
            words: dict[int, np.ndarray] = {}
            for caption in caption_set.captions[record.image_id]:
                for word, coverage in grounding.bound_words(c, vocab.encode(caption)[1:]):
                    words[word] = np.maximum(words[word], coverage) if word in words else coverage
            per_image.append(words)
        return cls(per_image, len(vocab), grounding.grid * grounding.grid, grounding.table)

    @property
    def grounded_images(self) -> int:
        return sum(bool(words) for words in self.per_image)

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """index (B,) -> coverage targets (B, V, N) and which (image, word) pairs they hold (B, V) bool."""
        target = np.zeros((len(index), self.vocab_size, self.regions), dtype=np.float32)  # (B, V, N)
        mask = np.zeros((len(index), self.vocab_size), dtype=bool)  # (B, V)
        for b, c in enumerate(index.tolist()):
            for word, coverage in self.per_image[c].items():
                target[b, word] = coverage
                mask[b, word] = True
        return torch.from_numpy(target), torch.from_numpy(mask)


def region_loss(region_scores: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean BCE of the region scores (B, V, N) against box coverage (B, V, N) over the pairs in mask (B, V)."""
    if not mask.any():
        return region_scores.sum() * 0.0
    per_region = F.binary_cross_entropy_with_logits(region_scores, target, reduction="none")  # (B, V, N)
    return per_region.mean(2)[mask].mean()


def colour_words(vocab: Vocabulary, table: Any = None) -> torch.Tensor:
    """(V,) bool: the vocabulary's hue words (:data:`HUE_WORDS`, and a word table's colour attributes)."""
    words = set(HUE_WORDS) | {w for w, kind in (table.attributes.items() if table is not None else ()) if kind == "color"}
    mask = torch.zeros(len(vocab), dtype=torch.bool)
    for word in words & set(vocab.stoi):
        mask[vocab.stoi[word]] = True
    return mask


def recolour_batch(pixels: torch.Tensor, share: float, gen: torch.Generator) -> torch.Tensor:
    """Permute the colour channels of about ``share`` of the images (B, 3, H, W), in place, each by one of
    the five non-identity permutations; returns which images were recoloured (B,) bool."""
    flip = torch.rand(len(pixels), generator=gen) < share  # (B,)
    perm = torch.randint(1, len(PERMUTATIONS), (len(pixels),), generator=gen)  # (B,) never the identity
    for b in flip.nonzero().flatten().tolist():
        pixels[b] = pixels[b, list(PERMUTATIONS[int(perm[b])])]
    return flip


def image_word_scores(region_scores: torch.Tensor, sharpness: float = SHARPNESS) -> torch.Tensor:
    """Soft maximum over regions: (B, V, N) -> (B, V), ``(1/r) logsumexp(r s)``."""
    return torch.logsumexp(region_scores * sharpness, dim=2) / sharpness


def pretrain_word_detectors(cfg: Config, out: str | os.PathLike, seconds: float | None = None,
                            max_steps: int | None = None, batch_size: int = 64, lr: float = 3e-3,
                            progress: bool = True, boxes: bool = False, recolour: float = 0.0) -> PretrainResult:
    """Train ``cfg.model.encoder`` (from its initial weights) as word detectors on the training captions.

    Args:
        cfg: the config whose encoder, data (root, train split, min_freq) and seed are used.
        out: the weights file to write (safetensors, written atomically).
        seconds: stop after this many seconds of training (at least one of ``seconds``/``max_steps``).
        max_steps: stop after this many steps.
        batch_size: images per step.
        lr: Adam learning rate of the trunk and the detector head.
        progress: show a tqdm bar.
        boxes: also train the words that name a box region by region, where the training split has
            object boxes (``instances_<split>.json``); without any, a warning and MIL alone.
        recolour: share of each batch's images shown with their colour channels permuted, their hue
            words (:func:`colour_words`) left out of the loss, so the other words' detectors, shapes
            above all, learn not to lean on colour (see the module docstring).

    Raises:
        ConfigError: no stopping rule, or a bad batch size.
        DataError: the training split cannot be read or gives no words.
    """
    if seconds is None and max_steps is None:
        raise ConfigError("pretrain_word_detectors needs seconds or max_steps")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if not 0.0 <= recolour <= 1.0:
        raise ConfigError(f"recolour must be a share in [0, 1], got {recolour}")
    d = cfg.data
    cs = check_images(load_caption_set(d.root, d.train_split, d.images), skip_missing=d.skip_missing)
    vocab = Vocabulary.build(cs.all_captions(), min_freq=d.min_freq, max_len=d.max_caption_len)
    targets = word_targets(cs, vocab)  # (C, V)
    if not targets.any():
        raise DataError(f"{d.root}: the {d.train_split!r} captions give no words to detect")
    regions = _region_targets(cfg, cs, vocab) if boxes else None
    colour = colour_words(vocab, regions.table if regions is not None else None)  # (V,) bool
    if recolour > 0 and not colour.any():
        log.warning("word detectors: recolour=%g but the vocabulary has no colour words; nothing to recolour",
                    recolour)
    transform = ImageTransform(cfg.model.encoder)
    store = pixels_in_memory(cs, transform, d.in_memory_mb, "word-detector images", progress)
    if store is not None:
        gather = store.gather
    else:  # too large to hold (or an unreadable image, reported by the loader): decode per batch
        load = image_loader(cs, transform)

        def gather(index: torch.Tensor) -> torch.Tensor:
            return torch.stack([load(int(i)) for i in index])

    torch.manual_seed(cfg.train.seed)
    encoder = build_encoder(cfg.model.encoder)
    for p in encoder.parameters():
        p.requires_grad_(True)
    encoder.train()
    for module in encoder.modules():  # build_encoder may leave frozen stages in eval mode
        module.train()
    head = nn.Conv2d(encoder.out_dim, len(vocab), kernel_size=1)  # one detector per word and region
    optimizer = torch.optim.Adam([*encoder.parameters(), *head.parameters()], lr=lr)
    gen = torch.Generator().manual_seed(cfg.train.seed)
    losses: list[float] = []
    start = time.monotonic()
    bar = tqdm(desc="word detectors", unit="step", leave=False, disable=not progress or None,
               total=max_steps)
    step = 0
    while (max_steps is None or step < max_steps) and (seconds is None or time.monotonic() - start < seconds):
        index = torch.randint(0, len(cs.images), (min(batch_size, len(cs.images)),), generator=gen)  # (B,)
        pixels = gather(index)  # (B, 3, H, W)
        weight = torch.ones(len(index), len(vocab))  # (B, V)
        if recolour > 0 and colour.any():  # the hue words of a recoloured image are not its own: no target
            weight[recolour_batch(pixels, recolour, gen)[:, None] & colour[None, :]] = 0.0
        fmap = encoder.pool(encoder.feature_map(pixels))  # (B, D, g, g)
        region_scores = head(fmap).flatten(2)  # (B, V, N)
        loss = F.binary_cross_entropy_with_logits(image_word_scores(region_scores), targets.index_select(0, index),
                                                  weight=weight)
        if regions is not None:
            cover, pairs = regions.batch(index)
            loss = loss + region_loss(region_scores, cover, pairs & (weight > 0))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        losses.append(float(loss.detach()))
        bar.update(1)
        if step % POSTFIX_EVERY == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    bar.close()
    elapsed = time.monotonic() - start
    if not losses:
        raise ConfigError("pretrain_word_detectors: the time budget ended before the first step")
    if not all(torch.isfinite(p).all() for p in encoder.parameters()):
        raise DataError("word-detector pretraining produced non-finite weights; lower its learning rate")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous() for k, v in encoder.trunk.state_dict().items()}
    atomic_write(out, lambda f: f.write(save(weights)), error=DataError)
    first, last = sum(losses[:20]) / len(losses[:20]), sum(losses[-20:]) / len(losses[-20:])
    log.info("word-detector pretraining: %d steps in %.0f s, loss %.3f -> %.3f; encoder weights in %s",
             step, elapsed, first, last, out)
    return PretrainResult(out, step, first, last, elapsed, regions.grounded_images if regions is not None else 0)


def _region_targets(cfg: Config, caption_set, vocab: Vocabulary) -> RegionTargets | None:  # noqa: ANN001
    d = cfg.data
    instances = load_instances(d.root, d.train_split, d.images)
    if not instances:
        log.warning("word detectors: %s has no object boxes for %r (instances_%s.json); MIL from the captions "
                    "alone", d.root, d.train_split, d.train_split)
        return None
    grounding = GroundingTargets.for_encoder(caption_set.images, instances, vocab, cfg.model.encoder)
    regions = RegionTargets.build(caption_set, vocab, grounding)
    log.info("word detectors: %d of %d training images also train their object words region by region "
             "(words matched as %s)", regions.grounded_images, len(caption_set.images), grounding.table.name)
    return regions if regions.grounded_images else None


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
    return get_feature_cache(cfg.model, encoder, caption_set, ImageTransform(cfg.model.encoder), cache_dir,
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

    Returns:
        The F heads, and what was measured: each head's dev mAP, the photos per fold, and the **out-of-fold**
        mean average precision on the training photos (each photo scored by the head that never saw it).
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


def check_output_file(out: str | os.PathLike, overwrite: bool, option: str) -> Path:
    """``out`` as a file that may be written: not a folder, not an existing file unless ``overwrite``
    (:class:`captioner.files.Outputs`, its folder's manifest records it once written), in a folder that
    exists and can be written (checked with a temporary file)."""
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"{option} {out}: is a folder; give the file to write (e.g. {out / 'concepts.safetensors'})")
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

    Args:
        cfg: a run's ``Config`` (encoder, data root and splits, feature cache folder).
        out: the concepts file to write.
        k, epochs, hidden, pooling: the concepts and the head (``ConceptHead``).
        boxes, boxes_split: a COCO folder with object boxes: also report :func:`concept_pointing` there.
        progress: progress bars.
        folds: 0, or F >= 2 fold heads for cross-fitting (:func:`train_fold_heads`), stored beside the head.
        overwrite: replace an existing ``out``.

    Every argument, ``out`` and the ``boxes`` folder are checked before the encoder is built or any
    training starts.
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
    dev_set = check_images(load_caption_set(d.root, d.val_split, d.images), skip_missing=d.skip_missing)
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


def read_run_concepts(cfg: Any, vocab: Vocabulary) -> ConceptHead | None:
    """``train.concepts``' head restricted to ``vocab``, or None when the run has no concepts file."""
    return read_concepts(cfg.train.concepts, cfg.model.encoder, vocab) if cfg.train.concepts else None


def with_concept_input(cfg: Any, head: ConceptHead | None) -> Any:
    """``cfg`` with the decoder sized to read ``head`` (``train.concept_input``), else ``cfg`` unchanged."""
    if getattr(cfg.model.decoder, "concept_prior", False) and (head is None or not cfg.train.concept_input):
        raise ConfigError("decoder.concept_prior reshapes attention by the concepts' maps: it needs "
                          "train.concepts=FILE and train.concept_input=true")
    if head is None or not cfg.train.concept_input:
        return cfg
    if not isinstance(cfg.model.decoder, ConceptReaderConfig):  # a registered family without the concept fields
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


def install_concept_folds(decoder: Any, cfg: Any, vocab: Vocabulary, device: Any = "cpu") -> int:
    """Let a decoder that reads concepts take each training photo's concepts from the fold head that never
    saw it (``train.concept_cross_fit``, when ``train.concepts`` holds fold heads: ``captioner concepts
    --folds``); returns the number of folds (0: the full head throughout)."""
    t = cfg.train
    if not (t.concepts and t.concept_cross_fit and getattr(decoder, "concepts", 0)):
        return 0
    _, folds = read_concepts_with_folds(t.concepts, cfg.model.encoder, vocab)
    if not folds:
        return 0
    if getattr(t, "cuda_graph", False):
        raise ConfigError(f"train.cuda_graph cannot capture cross-fitted concepts (each photo picks its fold head); "
                          f"set train.concept_cross_fit=false or train.cuda_graph=false ({t.concepts} has fold heads)")
    if folds[0].size != decoder.concepts:
        raise ConfigError(f"the decoder reads {decoder.concepts} concepts, the fold heads of {t.concepts} have "
                          f"{folds[0].size} in this vocabulary")
    decoder.use_concept_folds(OutOfFoldConcepts(folds).to(device))
    log.info("concepts: each training photo's from the fold head that never saw it (%d folds)", len(folds))
    return len(folds)
