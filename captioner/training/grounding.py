"""``train.attention_supervision``: the training step's hook for attention supervised by object boxes.

Shape legend: B batch, T caption steps, N regions.

:class:`GroundingTargets` turns a training batch's target words and image indices into box
coverages (B, T, N): the words are matched to objects as attention correctness matches them
(``captioner.evaluation.object_words.find_mentions``: the scenes' shapes with their colour and size
words, COCO categories with synonyms and plurals, or the dataset's own category names), bound to
boxes by ``captioner.data.grounding.bind_mentions``, and each box is laid on the region grid by
``box_coverage``. Images without boxes (no entry in ``instances_<split>.json``) give all-zero rows:
their captions train without the term. A caption's binding is computed once and remembered.

:class:`AttentionSupervision` is the term ``grounding_loss(...)`` (``captioner.grounding_loss``) as
one of the cross-entropy objective's extra terms (``captioner.training.objective.LossTerm``): the
objective adds ``weight *`` it to the loss and logs ``grounding`` (unweighted, per supervised word)
and ``weighted_grounding`` (so ``share_grounding`` and the regulariser warning see it), and the
term's ``stats``: ``grounded_words`` (share of target words supervised) and ``grounding_in_box``
(their attention mass inside the box). :func:`build_attention_supervision` makes it for a run
(``captioner.training.objectives.build_cross_entropy`` asks), or returns None.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from captioner.data.coco import load_instances
from captioner.data.grounding import bind_mentions, box_coverage
from captioner.data.transforms import crop_box
from captioner.evaluation.attention_metrics import detect_vocabulary
from captioner.evaluation.object_words import WordTable, find_mentions, word_table
from captioner.grounding_loss import grounding_loss
from captioner.models.base import DecoderOutput
from captioner.text import Vocabulary

log = logging.getLogger(__name__)


class GroundingTargets:
    """Box coverages for the target words of training batches.

    Args:
        images: the training ``ImageRecord`` list (batch image indices index it).
        instances: ``{image_id: [ObjectBox]}`` (``load_instances``); images absent or with no boxes
            are not supervised.
        vocab: the training vocabulary (target ids -> words).
        view: ``(width, height) -> (left, top, right, bottom)``, the part of the image the grid covers.
        grid: g, regions per side.
        vocabulary: ``"shapes"``, ``"coco"`` or a ``WordTable`` (None: from the instances' categories).
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
    """The box-supervision term of :class:`captioner.training.objective.CrossEntropy` (a ``LossTerm``).

    ``CrossEntropy`` adds ``weight * term(output, batch)`` to the loss and logs it as ``grounding``
    and ``weighted_grounding``; ``stats`` (the last batch's ``grounded_words`` and
    ``grounding_in_box``) is logged beside them.

    Args:
        targets: the batch targets' box coverages.
        weight: lambda, the term's weight (``train.attention_supervision``).
        form: ``"cross_entropy"`` or ``"mass"`` (``train.attention_supervision_form``).
        pad_id: id of padding in the targets.
    """

    name = "grounding"

    def __init__(self, targets: GroundingTargets, weight: float, form: str = "cross_entropy", pad_id: int = 0) -> None:
        self.targets = targets
        self.weight = weight
        self.form = form
        self.pad_id = pad_id
        self.stats: dict[str, torch.Tensor] = {}

    def __call__(self, output: DecoderOutput, batch: Any) -> torch.Tensor:
        """The unweighted term for a teacher-forced ``output`` of ``batch`` (``tokens``, ``image_index``).

        ``output.attention`` (B, T-1, N) is supervised for the targets ``batch.tokens[:, 1:]``.
        """
        targets = batch.tokens[:, 1:]  # (B, T-1)
        coverage = self.targets.coverage(targets.cpu(), batch.image_index.cpu()).to(output.attention.device,
                                                                                     non_blocking=True)
        term = grounding_loss(output.attention, coverage, self.form)
        words = (targets != self.pad_id).sum().clamp(min=1).to(term.words.dtype)
        self.stats = {"grounded_words": term.words / words, "grounding_in_box": term.in_box}
        return term.loss


def build_attention_supervision(cfg: Any, train_set: Any, vocab: Vocabulary) -> AttentionSupervision | None:
    """The hook for a run, or None when ``train.attention_supervision`` is 0 or nothing can be supervised.

    Args:
        cfg: the run's ``Config`` (``train.attention_supervision``, ``train.attention_supervision_form``,
            ``train.objective``, ``data``, ``model.encoder`` for the grid and the crop).
        train_set: the training ``CaptionSet`` (batch image indices index its images).
        vocab: the training vocabulary.
    """
    t = cfg.train
    if not t.attention_supervision:
        return None
    if t.objective != "xe":
        log.warning("train.attention_supervision applies to cross-entropy training only; train.objective=%s "
                    "trains without it", t.objective)
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
