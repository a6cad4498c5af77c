"""Word detectors: words found in image regions, learnt from captions alone (Fang et al. 2015).

They pretrain the demo's from-scratch CNN encoder (``pretrain_word_detectors``). The concept detectors
over a frozen encoder's features are ``captioner.training.concepts``. docs/concepts.md explains both.

Shape legend: B images, D feature width, g grid side, N = g*g regions, V vocabulary.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from safetensors.torch import save
from tqdm import tqdm

from captioner.config import Config
from captioner.data.caption_set import check_images
from captioner.data.coco import load_caption_set, load_instances
from captioner.data.dataset import image_loader
from captioner.data.images import ImageTransform
from captioner.errors import ConfigError, DataError
from captioner.files import atomic_write
from captioner.models.encoder import build_encoder
from captioner.models.registry import resolve_encoder
from captioner.text import Vocabulary, tokenize
from captioner.training.attention_terms import GroundingTargets
from captioner.training.data import pixels_in_memory

log = logging.getLogger(__name__)

POSTFIX_EVERY = 25  # steps between updates of the progress bar's loss

PERMUTATIONS = tuple(itertools.permutations(range(3)))  # of the colour channels, the identity first
# Words a permutation of the colour channels changes the truth of (white, black and grey it keeps).
HUE_WORDS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "cyan", "magenta", "violet",
             "teal", "turquoise", "maroon", "tan", "gold", "golden", "beige", "lime", "navy", "olive", "blonde")
SHARPNESS = 4.0  # r of the soft maximum over regions (r -> infinity: the max; r -> 0: the mean)


@dataclass
class PretrainResult:
    """What ``pretrain_word_detectors`` returns."""

    weights: Path  # the trunk's weights file (for ``encoder.weights``)
    steps: int  # optimizer steps taken
    first_loss: float
    last_loss: float
    seconds: float  # wall time of the training loop
    grounded_images: int = 0  # training images whose words were also trained region by region (``boxes``)


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
    """For each training image, ``{word id: coverage (N,)}`` of the words that name a box (``boxes=True``)."""

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
    """Train ``cfg.model.encoder`` as word detectors on the training captions; write its weights to ``out``.

    Stops after ``seconds`` or ``max_steps``. ``boxes``: also train box-naming words region by region;
    ``recolour``: share of images with permuted colour channels, their hue words left out, so the other
    detectors do not lean on colour. ``ConfigError``/``DataError`` for bad options or an unusable split.
    """
    if seconds is None and max_steps is None:
        raise ConfigError("pretrain_word_detectors needs seconds or max_steps")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if not 0.0 <= recolour <= 1.0:
        raise ConfigError(f"recolour must be a share in [0, 1], got {recolour}")
    d = cfg.data
    cs = check_images(load_caption_set(d.root, d.train_split, d.images, files_outside=d.files_outside),
                      skip_missing=d.skip_missing)
    vocab = Vocabulary.build(cs.all_captions(), min_freq=d.min_freq, max_len=d.max_caption_len)
    targets = word_targets(cs, vocab)  # (C, V)
    if not targets.any():
        raise DataError(f"{d.root}: the {d.train_split!r} captions give no words to detect")
    regions = _region_targets(cfg, cs, vocab) if boxes else None
    colour = colour_words(vocab, regions.table if regions is not None else None)  # (V,) bool
    if recolour > 0 and not colour.any():
        log.warning("word detectors: recolour=%g but the vocabulary has no colour words; nothing to recolour",
                    recolour)
    transform = ImageTransform(resolve_encoder(cfg.model.encoder))
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
