"""Attention correctness: does a word that names an object look at that object?

For every generated word that names an object (a shape noun of the synthetic scenes, a COCO
category name, plural or synonym, or, on any other COCO-format dataset, one of its instances
file's own category names or their plurals; colour/size words directly before a shape noun count
for the same object) the word's g x g attention map is placed on the ORIGINAL image geometry: each region's
weight is spread over the part of the image that region covers inside the encoder's view
(``crop_box``; "stretch" = the whole image, "center_crop" = the central square), the map is
renormalised to sum 1 and the mass inside the object's ground-truth box is summed (Liu et al. 2017,
"Attention Correctness in Neural Image Captioning"). When several boxes share the category, the
union of those boxes is the target. Next to it:

* the uniform baseline: what a uniform attention map scores through the same mapping (the box's
  share of the visible image area: exactly its share of the image for "stretch");
* pointing accuracy: the centre of the argmax region, in original pixels, falls inside the box;
* invented objects: object words whose category is absent from the image (reported, not scored).

Scores are averaged over all scored words of all images (every word counts once).

Shape legend: L generated words, g grid size.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from captioner.data.transforms import crop_box
from captioner.errors import DataError
from captioner.evaluation.object_words import VOCABULARIES, WordTable, choose_vocabulary, find_mentions, word_table
from captioner.grids import as_array, cell_centre, cell_weights

__all__ = ["WordScore", "WordScores", "VOCABULARIES", "attention_correctness", "attention_mass", "summarize",
           "caption_object_accuracy", "attention_entropy_summary", "attention_correctness_for_results",
           "detect_vocabulary"]

logger = logging.getLogger(__name__)

Box = tuple[float, float, float, float]  # (left, top, right, bottom) in original pixels
MAX_CANVAS_SIDE = 256  # the image is rasterised at most this large (scale-invariant shares)


@dataclass
class WordScore:
    """One scored word.

    Attributes:
        index: position of the word in the caption.
        word: the word.
        category: the object category it names (or describes).
        mass: share of the word's attention inside the object's box(es), 0..1.
        uniform: what uniform attention would score for the same box(es).
        hit: the argmax region's centre falls inside the box(es).
    """

    index: int
    word: str
    category: str
    mass: float
    uniform: float
    hit: bool


@dataclass
class WordScores:
    """Attention-correctness scores of one caption.

    Attributes:
        scored: one entry per word naming (or describing) an object present in the image.
        invented: ``(index, word, category)`` of object words whose category is absent.
        mentions: object mentions found in the caption (present or invented).
    """

    scored: list[WordScore] = field(default_factory=list)
    invented: list[tuple[int, str, str]] = field(default_factory=list)
    mentions: int = 0

# ----------------------------------------------------------------------------- geometry


def _box_coverage(n_out: int, lo: float, hi: float, scale: float) -> np.ndarray:
    """(n_out,) fraction of each canvas pixel covered by the interval [lo, hi) (original px)."""
    edges = np.arange(n_out + 1) / scale
    return np.clip(np.minimum(edges[1:], hi) - np.maximum(edges[:-1], lo), 0, None) * scale


@dataclass
class _Canvas:
    """Pixel grid of the original image (downscaled to at most ``MAX_CANVAS_SIDE``)."""

    rows: np.ndarray  # (H', g) canvas row -> grid row
    cols: np.ndarray  # (W', g)
    scale: float
    view: Box

    @classmethod
    def make(cls, image_size: tuple[int, int], view: Box, g: int) -> "_Canvas":
        w, h = image_size
        if w <= 0 or h <= 0:
            raise DataError(f"image size must be positive, got {w}x{h}")
        scale = min(1.0, MAX_CANVAS_SIDE / max(w, h))
        cw, ch = max(1, round(w * scale)), max(1, round(h * scale))
        left, top, right, bottom = view
        return cls(cell_weights(ch, top, bottom, g, scale), cell_weights(cw, left, right, g, scale), scale, view)

    def place(self, attention: np.ndarray) -> np.ndarray:
        """(g, g) attention -> (H', W') map on the image, each region's weight spread over its cells."""
        counts = self.rows.sum(0)[:, None] * self.cols.sum(0)[None, :]  # pixels per cell
        per_pixel = np.divide(attention, counts, out=np.zeros_like(attention, dtype=float), where=counts > 0)
        canvas = self.rows @ per_pixel @ self.cols.T
        total = canvas.sum()
        return canvas / total if total > 0 else canvas

    def mask(self, boxes: Iterable[Sequence[float]]) -> np.ndarray:
        """(H', W') coverage of the union of ``(x, y, w, h)`` boxes, 0..1 per pixel."""
        out = np.zeros((self.rows.shape[0], self.cols.shape[0]))
        for x, y, bw, bh in boxes:
            cov = np.outer(_box_coverage(out.shape[0], y, y + bh, self.scale),
                           _box_coverage(out.shape[1], x, x + bw, self.scale))
            np.maximum(out, cov, out=out)
        return out


def _inside(point: tuple[float, float], boxes: Iterable[Sequence[float]]) -> bool:
    px, py = point
    return any(x <= px < x + w and y <= py < y + h for x, y, w, h in boxes)


def attention_mass(attention: Any, boxes: Sequence[Sequence[float]], image_size: tuple[int, int], box: Box) -> float:
    """Share of one (g, g) attention map's mass inside the union of ``(x, y, w, h)`` boxes."""
    att = _as_maps(attention)[0]
    canvas = _Canvas.make(image_size, box, att.shape[-1])
    return float((canvas.place(att) * canvas.mask(boxes)).sum())


def _as_maps(attention: Any) -> np.ndarray:
    """Tensor/array (L, g, g), (g, g) or (L, N) -> float64 array (L, g, g)."""
    att = as_array(attention, np.float64)
    if att.ndim == 2 and att.shape[0] == att.shape[1] and att.shape[0] > 1:
        att = att[None]
    if att.ndim == 2:  # (L, N)
        g = math.isqrt(att.shape[1])
        if g * g != att.shape[1]:
            raise DataError(f"attention has {att.shape[1]} regions, not a square grid")
        att = att.reshape(att.shape[0], g, g)
    if att.ndim != 3 or att.shape[1] != att.shape[2]:
        raise DataError(f"attention must be (L, g, g), got shape {tuple(att.shape)}")
    return att


# ----------------------------------------------------------------------------- scoring


def attention_correctness(
    words: Sequence[str],
    attention: Any,
    boxes: Sequence[Any],
    image_size: tuple[int, int],
    box: Box | None = None,
    vocabulary: str | WordTable = "shapes",
) -> WordScores:
    """Score one caption's object words against the ground-truth boxes.

    Args:
        words: the generated words (L).
        attention: (L, g, g) attention per word (tensor or array); extra trailing steps (e.g.
            ``<eos>``) are ignored.
        boxes: ``ObjectBox`` items of the image (``category``, ``bbox`` = (x, y, w, h) pixels).
        image_size: original ``(width, height)``.
        box: ``crop_box(width, height, encoder_cfg)``, the part of the image the encoder saw;
            None means the whole image.
        vocabulary: ``"shapes"``, ``"coco"`` or a ``WordTable`` (e.g. ``category_table(names)``).

    Returns:
        ``WordScores`` with one ``WordScore`` per scored word and the invented mentions.
    """
    att = _as_maps(attention) if len(words) else np.zeros((0, 1, 1))
    if att.shape[0] < len(words):
        raise DataError(f"attention has {att.shape[0]} steps for {len(words)} words")
    w, h = image_size
    view = box if box is not None else (0.0, 0.0, float(w), float(h))
    by_category: dict[str, list[Sequence[float]]] = {}
    for obj in boxes:
        by_category.setdefault(obj.category, []).append(tuple(float(v) for v in obj.bbox))
    result = WordScores()
    mentions = find_mentions(words, vocabulary)
    result.mentions = len(mentions)
    if not mentions:
        return result
    g = att.shape[-1]
    canvas = _Canvas.make(image_size, view, g)
    uniform_map = canvas.place(np.full((g, g), 1.0 / (g * g)))
    for m in mentions:
        targets = by_category.get(m.category)
        if not targets:
            result.invented.append((m.noun_start, words[m.noun_start], m.category))
            continue
        mask = canvas.mask(targets)
        uniform = float((uniform_map * mask).sum())
        for i in range(m.start, m.end):
            placed = canvas.place(att[i])
            hit = _inside(cell_centre(int(att[i].argmax()), g, canvas.view), targets)
            result.scored.append(WordScore(i, words[i], m.category, float((placed * mask).sum()), uniform, hit))
    return result


def summarize(scores: Iterable[WordScores]) -> dict[str, float | int | None]:
    """Average per-word scores over all words of all images.

    Returns:
        ``attention_correctness`` (mean mass in box), ``uniform_baseline``, ``ratio`` (their
        quotient), ``pointing_accuracy``, ``words_scored``, ``images_scored``,
        ``objects_invented`` and ``invented_rate`` (invented / all object mentions); the means
        are None when no word was scored.
    """
    masses, uniforms, hits, images, invented, named = [], [], [], 0, 0, 0
    for s in scores:
        masses += [w.mass for w in s.scored]
        uniforms += [w.uniform for w in s.scored]
        hits += [w.hit for w in s.scored]
        images += bool(s.scored)
        invented += len(s.invented)
        named += s.mentions
    ac = float(np.mean(masses)) if masses else None
    base = float(np.mean(uniforms)) if uniforms else None
    return {
        "attention_correctness": ac,
        "uniform_baseline": base,
        "ratio": ac / base if ac is not None and base else None,
        "pointing_accuracy": float(np.mean(hits)) if hits else None,
        "words_scored": len(masses),
        "images_scored": images,
        "objects_invented": invented,
        "invented_rate": invented / named if named else None,
    }


# ----------------------------------------------------------------------------- synthetic captions


def caption_object_accuracy(words: Sequence[str], boxes: Sequence[Any]) -> bool:
    """True when a synthetic-scene caption names every object with the right colour and shape.

    Every object must be named by its shape noun with its colour word directly before it (size
    words are not checked), and no shape absent from the image may be named.
    """
    truth = {obj.category: str(obj.attributes.get("color", "")).lower() for obj in boxes}
    named: dict[str, set[str]] = {}
    for m in find_mentions(words, "shapes"):
        if m.category not in truth:
            return False
        named.setdefault(m.category, set()).add(m.attributes.get("color", ""))
    return set(named) == set(truth) and all(named[c] == {truth[c]} for c in truth)


def attention_entropy_summary(results: Sequence[Any]) -> dict[str, float | None]:
    """Mean attention entropy (nats) over all generated words, and the uniform entropy log N."""
    entropies, n_regions = [], None
    for r in results:
        att = _as_maps(r.attention)[: len(r.words)] if len(r.words) else None
        if att is None or not len(att):
            continue
        flat = att.reshape(att.shape[0], -1)
        n_regions = flat.shape[1]
        entropies += list(-(flat * np.log(flat + 1e-12)).sum(1))
    return {
        "attention_entropy": float(np.mean(entropies)) if entropies else None,
        "uniform_entropy": math.log(n_regions) if n_regions else None,
    }


def detect_vocabulary(instances: dict[int, list[Any]]) -> str | WordTable:
    """The word table for a dataset's boxes (``object_words.choose_vocabulary``).

    The names come from the instances file's ``categories`` list when ``instances`` carries it
    (``load_instances`` output), else from the boxes. ``"shapes"`` when every name is a synthetic
    shape, ``"coco"`` when every name is a COCO category, else the dataset's own names.
    """
    names = getattr(instances, "categories", None) or [obj.category for objs in instances.values() for obj in objs]
    return choose_vocabulary(names)


def attention_correctness_for_results(
    results: Sequence[Any],
    caption_set: Any,
    instances: dict[int, list[Any]],
    encoder_cfg: Any,
    vocabulary: str | WordTable | None = None,
) -> dict[str, float | int | str | None]:
    """Attention correctness of a decoded split (called by ``evaluate.py``).

    Args:
        results: ``captioner.inference.Caption`` per image (``words``, ``attention`` (L, g, g)), aligned with
            ``caption_set.images``.
        caption_set: the ``CaptionSet`` the results were decoded from (image sizes come from its
            records, or from the image file when a record has none).
        instances: ``load_instances(...)`` output, image id -> ``ObjectBox`` list.
        encoder_cfg: the checkpoint's ``EncoderConfig`` (for ``crop_box``).
        vocabulary: ``"shapes"``, ``"coco"`` or a ``WordTable``; None detects it from the
            categories (``detect_vocabulary``).

    Returns:
        ``summarize`` keys, ``vocabulary`` (``"shapes"``, ``"coco"`` or ``"categories"``: the
        dataset's own category names), plus ``objects_correct`` (share of captions naming every
        object with the right colour and shape, inventing none) for the synthetic scenes.
    """
    if len(results) != len(caption_set.images):
        raise DataError(f"{len(results)} results for {len(caption_set.images)} images")
    table = word_table(vocabulary if vocabulary is not None else detect_vocabulary(instances))
    scores, correct = [], []
    for result, record in zip(results, caption_set.images):
        objs = instances.get(record.image_id, [])
        width, height = record.size()
        view = crop_box(width, height, encoder_cfg)
        scores.append(attention_correctness(result.words, result.attention, objs, (width, height), view, table))
        if table.name == "shapes":
            correct.append(caption_object_accuracy(result.words, objs))
    out: dict[str, float | int | str | None] = dict(summarize(scores))
    out["vocabulary"] = table.name
    out["objects_correct"] = float(np.mean(correct)) if correct else None
    logger.debug("attention correctness over %d images: %s", len(results), out)
    return out
