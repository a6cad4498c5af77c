"""The attention terms of cross-entropy training: a word's attention onto the box of its object.

``AttentionSupervision`` (``train.attention_supervision``: a word's attention onto the box of the
object it names, Liu et al. 2017) is a ``LossTerm`` of ``CrossEntropy`` built for a run by
:func:`build_attention_supervision` (None when the run does not ask for it); :func:`grounding_loss` is
shared with the concept guide (``captioner.training.concepts``); :func:`attention_kl` holds a decoder's
attention to another's (the label stage's ``train.labels.attend_kd``). docs/grounding.md explains the terms.

Shape legend: B batch, T caption steps, N regions.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from captioner.data.coco import load_instances
from captioner.data.images import crop_box
from captioner.errors import ConfigError
from captioner.evaluation.attention_metrics import (WordTable, bind_mentions, box_coverage, detect_vocabulary,
                                                    find_mentions, word_table)
from captioner.models.base import DecoderOutput
from captioner.text import Vocabulary

log = logging.getLogger(__name__)


FORMS = ("mass", "cross_entropy")
_EPS = 1e-6  # floor of the in-box mass (a box outside the grid's view has coverage 0 and is not supervised)


@dataclass
class GroundingTerm:
    """What :func:`grounding_loss` returns."""

    loss: torch.Tensor  # the unweighted term, mean over supervised words (0 when none; keeps the graph)
    words: torch.Tensor  # supervised words in the batch (0-d tensor)
    in_box: torch.Tensor  # mean attention mass inside the box over the supervised words (detached)


def grounding_loss(attention: torch.Tensor, coverage: torch.Tensor, form: str = "cross_entropy") -> GroundingTerm:
    """The supervision term for (B, T, N) attention maps and box ``coverage``; all-zero rows unsupervised.

    ``form``: ``"mass"`` or ``"cross_entropy"`` (docs/grounding.md). Returns a ``GroundingTerm`` (no host sync).
    """
    if form not in FORMS:
        raise ConfigError(f"attention supervision form {form!r}: use one of {', '.join(FORMS)}")
    if attention.shape != coverage.shape:
        raise ValueError(f"attention {tuple(attention.shape)} and box coverage {tuple(coverage.shape)} differ")
    attention = attention.float()
    coverage = coverage.to(attention.dtype)
    area = coverage.sum(dim=-1)  # (B, T)
    supervised = (area > 0).to(attention.dtype)  # (B, T)
    words = supervised.sum()
    mass = (attention * coverage).sum(dim=-1)  # (B, T) attention inside the box
    if form == "mass":
        per_word = -mass.clamp(min=_EPS).log()  # (B, T)
    else:
        target = coverage / area.clamp(min=_EPS).unsqueeze(-1)  # (B, T, N), rows sum to 1 where supervised
        log_ratio = target.clamp(min=_EPS).log() - attention.clamp(min=_EPS).log()  # (B, T, N)
        per_word = (target * log_ratio).sum(dim=-1)  # (B, T) KL(p || alpha) = cross-entropy - H(p)
    loss = (per_word * supervised).sum() / words.clamp(min=1.0)
    in_box = (mass.detach() * supervised).sum() / words.clamp(min=1.0)
    return GroundingTerm(loss, words.detach(), in_box)


def attention_kl(target: torch.Tensor, attention: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Attention maps (B, T, N), the target's and the one trained, and which steps are words (B, T) -> the
    mean over the words of KL(target || attention), in nats; 0 when they agree."""
    kl = (target * (target.clamp_min(1e-8).log() - attention.clamp_min(1e-8).log())).sum(-1)  # (B, T)
    words = words.to(kl.dtype)
    return (kl * words).sum() / words.sum().clamp_min(1.0)


class GroundingTargets:
    """Box coverages for the target words of training batches.

    ``instances``: ``{image_id: [ObjectBox]}`` (images without boxes unsupervised); ``view``:
    ``(width, height) -> crop box``; ``vocabulary``: as :func:`find_mentions` (None: detected).
    """

    def __init__(self, images: Sequence[Any], instances: dict[int, list[Any]], vocab: Vocabulary, view: Any,
                 grid: int, vocabulary: str | WordTable | None = None) -> None:
        self.images = list(images)
        self.instances = instances
        self.vocab = vocab
        self.view = view
        self.grid = grid
        self.table = word_table(vocabulary if vocabulary is not None else detect_vocabulary(instances))
        self._bindings: dict[tuple[int, tuple[int, ...]], list[tuple[int, int]]] = {}  # caption -> (t, bank row)
        self._rows: dict[tuple[int, tuple[int, ...]], int] = {}  # (image, box indices) -> bank row
        self._bank: list[np.ndarray] = []  # (N,) coverages

    @classmethod
    def for_encoder(cls, images: Sequence[Any], instances: dict[int, list[Any]], vocab: Vocabulary,
                    encoder: Any) -> "GroundingTargets":
        """Targets on the grid of ``encoder`` (an ``EncoderConfig``: its ``grid``, and the crop it sees)."""
        return cls(images, instances, vocab, lambda w, h: crop_box(w, h, encoder), encoder.grid)

    def _row(self, image: int, boxes: tuple[int, ...]) -> int:
        key = (image, boxes)
        if key not in self._rows:
            record = self.images[image]
            objects = self.instances.get(record.image_id, [])
            width, height = record.size()
            self._bank.append(box_coverage([objects[i].bbox for i in boxes], self.view(width, height), self.grid))
            self._rows[key] = len(self._bank) - 1
        return self._rows[key]

    def binding(self, image: int, ids: Sequence[int]) -> list[tuple[int, int]]:
        """``(target step, bank row)`` for one caption: target ids (``tokens[1:]``) of training image ``image``."""
        key = (image, tuple(ids))
        found = self._bindings.get(key)
        if found is None:
            objects = self.instances.get(self.images[image].image_id) or []
            found = []
            if objects:
                words = self.vocab.decode_tokens(ids)
                found = [(t, self._row(image, boxes))
                         for t, boxes in bind_mentions(find_mentions(words, self.table), objects)]
            self._bindings[key] = found
        return found

    def bound_words(self, image: int, ids: Sequence[int]) -> list[tuple[int, np.ndarray]]:
        """``(word id, coverage (N,))`` for each word of one caption (target ids) that names a box."""
        return [(int(ids[t]), self._bank[row]) for t, row in self.binding(image, ids)]

    def coverage(self, targets: torch.Tensor, image_index: torch.Tensor) -> torch.Tensor:
        """targets (B, T) word ids, image_index (B,) -> box coverage (B, T, N) float32 on the CPU."""
        rows = targets.tolist()
        images = image_index.tolist()
        out = np.zeros((len(rows), targets.shape[1], self.grid * self.grid), dtype=np.float32)  # (B, T, N)
        for b, (ids, image) in enumerate(zip(rows, images)):
            for t, row in self.binding(int(image), ids):
                out[b, t] = self._bank[row]
        return torch.from_numpy(out)


class AttentionSupervision:
    """The box-supervision ``LossTerm`` of ``CrossEntropy``, logged as ``grounding`` with its ``stats``."""

    name = "grounding"

    def __init__(self, targets: GroundingTargets, weight: float, form: str = "cross_entropy", pad_id: int = 0) -> None:
        self.targets = targets
        self.weight = weight
        self.form = form
        self.pad_id = pad_id
        self.stats: dict[str, torch.Tensor] = {}

    def __call__(self, output: DecoderOutput, batch: Any) -> torch.Tensor:
        """The unweighted term: ``output.attention`` (B, T-1, N) against the boxes of ``batch.tokens[:, 1:]``."""
        targets = batch.tokens[:, 1:]  # (B, T-1)
        coverage = self.targets.coverage(targets.cpu(), batch.image_index.cpu()).to(output.attention.device,
                                                                                     non_blocking=True)
        term = grounding_loss(output.attention, coverage, self.form)
        words = (targets != self.pad_id).sum().clamp(min=1).to(term.words.dtype)
        self.stats = {"grounded_words": term.words / words, "grounding_in_box": term.in_box}
        return term.loss


def cross_entropy_only(key: str, objective: str) -> bool:
    """Whether a term of cross-entropy training applies under ``train.objective``; warns when it does not."""
    if objective != "xe":
        log.warning("%s applies to cross-entropy training only; train.objective=%s trains without it", key, objective)
        return False
    return True


def build_attention_supervision(cfg: Any, train_set: Any, vocab: Vocabulary) -> AttentionSupervision | None:
    """The term for a run, or None when ``train.attention_supervision`` is 0 or nothing can be supervised."""
    t = cfg.train
    if not t.attention_supervision:
        return None
    if not cross_entropy_only("train.attention_supervision", t.objective):
        return None
    split = cfg.data.train_split
    instances = load_instances(cfg.data.root, split, cfg.data.images)
    if instances is None:
        log.warning("train.attention_supervision=%g: %s has no instances_%s.json with object boxes; training "
                    "without it", t.attention_supervision, cfg.data.root, split)
        return None
    with_boxes = sum(bool(instances.get(r.image_id)) for r in train_set.images)
    if not with_boxes:
        log.warning("train.attention_supervision=%g: none of the %d training images has a box in %s's "
                    "instances_%s.json; training without it", t.attention_supervision, len(train_set.images),
                    cfg.data.root, split)
        return None
    targets = GroundingTargets.for_encoder(train_set.images, instances, vocab, cfg.model.encoder)
    log.info("attention supervision (weight %g, form %s): %d of %d training images have boxes; words matched "
             "as %s", t.attention_supervision, t.attention_supervision_form, with_boxes, len(train_set.images),
             targets.table.name)
    return AttentionSupervision(targets, t.attention_supervision, t.attention_supervision_form, vocab.pad_id)
