"""Attention correctness: does a word that names an object look at that object (Liu et al. 2017)?

Sums each object word's attention mass inside the object's box on the original image, beside the
uniform baseline, pointing accuracy and bootstrap intervals; docs/evaluation.md explains the measure.

Shape legend: L generated words, g grid size.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from captioner.data.images import (Box, as_array, attention_entropy, cell_centre, cell_weights, crop_box,
                                   interval_overlap)
from captioner.data.shapes import COLORS, SHAPES, SIZES
from captioner.errors import DataError
from captioner.text import tokenize

logger = logging.getLogger(__name__)


VOCABULARIES = ("shapes", "coco")


@dataclass(frozen=True)
class ObjectMention:
    """Caption words ``[start, end)`` naming one ``category`` (name from ``noun_start``, ``attributes`` before it)."""

    start: int
    noun_start: int
    end: int
    category: str
    attributes: dict[str, str]


def _plural(word: str) -> str:
    if word.endswith(("s", "sh", "ch", "x", "z")):
        return word + "es"
    if word.endswith("y") and len(word) > 1 and word[-2] not in "aeiou":
        return word[:-1] + "ies"
    return word + "s"


# COCO category: extra names (singular; plurals are added automatically unless listed in
# _IRREGULAR). Multi-word names are matched as phrases, longest first ("hot dog" before "dog").
_COCO_SYNONYMS: dict[str, str] = {
    "person": "people persons man men woman women boy boys girl girls child children kid kids guy "
              "lady ladies gentleman baby babies adult player skier surfer skateboarder snowboarder "
              "batter catcher pitcher rider biker cyclist teenager toddler",
    "bicycle": "bike bicycle", "car": "car taxi sedan suv", "motorcycle": "motorcycle motorbike scooter",
    "airplane": "airplane aeroplane plane jet airliner aircraft", "bus": "bus", "train": "train locomotive",
    "truck": "truck lorry", "boat": "boat ship sailboat canoe kayak", "traffic light": "traffic light stoplight",
    "fire hydrant": "fire hydrant hydrant", "stop sign": "stop sign", "parking meter": "parking meter",
    "bench": "bench", "bird": "bird seagull gull pigeon duck parrot", "cat": "cat kitten kitty",
    "dog": "dog puppy", "horse": "horse pony", "sheep": "sheep lamb", "cow": "cow cattle bull calf",
    "elephant": "elephant", "bear": "bear", "zebra": "zebra", "giraffe": "giraffe", "backpack": "backpack",
    "umbrella": "umbrella parasol", "handbag": "handbag purse", "tie": "tie necktie",
    "suitcase": "suitcase luggage", "frisbee": "frisbee", "skis": "skis", "snowboard": "snowboard",
    "sports ball": "ball soccer ball tennis ball football", "kite": "kite", "baseball bat": "baseball bat bat",
    "baseball glove": "baseball glove glove mitt", "skateboard": "skateboard skate board",
    "surfboard": "surfboard surf board", "tennis racket": "tennis racket racket racquet",
    "bottle": "bottle", "wine glass": "wine glass glass", "cup": "cup mug", "fork": "fork",
    "knife": "knife", "spoon": "spoon", "bowl": "bowl", "banana": "banana", "apple": "apple",
    "sandwich": "sandwich", "orange": "orange", "broccoli": "broccoli", "carrot": "carrot",
    "hot dog": "hot dog hotdog", "pizza": "pizza", "donut": "donut doughnut", "cake": "cake cupcake",
    "chair": "chair", "couch": "couch sofa", "potted plant": "potted plant houseplant plant",
    "bed": "bed", "dining table": "dining table table", "toilet": "toilet", "tv": "tv television monitor",
    "laptop": "laptop", "mouse": "mouse", "remote": "remote remote control controller",
    "keyboard": "keyboard", "cell phone": "cell phone cellphone phone smartphone",
    "microwave": "microwave", "oven": "oven stove", "toaster": "toaster", "sink": "sink",
    "refrigerator": "refrigerator fridge", "book": "book", "clock": "clock", "vase": "vase",
    "scissors": "scissors", "teddy bear": "teddy bear teddy", "hair drier": "hair drier hair dryer blow dryer",
    "toothbrush": "toothbrush tooth brush",
}
# multi-word synonyms inside the strings above (so "remote control" is one name, not two)
_COCO_PHRASES = ("traffic light", "fire hydrant", "stop sign", "parking meter", "soccer ball", "tennis ball",
                 "baseball bat", "baseball glove", "skate board", "surf board", "tennis racket", "wine glass",
                 "hot dog", "potted plant", "dining table", "remote control", "cell phone", "teddy bear",
                 "hair drier", "hair dryer", "blow dryer", "tooth brush")
_IRREGULAR = {"man": "men", "woman": "women", "child": "children", "person": "people", "sheep": "sheep",
              "knife": "knives", "mouse": "mice", "skis": "skis", "scissors": "scissors", "cattle": "cattle",
              "broccoli": "broccoli", "people": "people", "children": "children", "calf": "calves",
              "luggage": "luggage", "persons": "persons"}
_NO_PLURAL = frozenset({"glass"})  # "glasses" alone are usually spectacles, not wine glasses
_COCO_TABLE: dict[tuple[str, ...], str] = {}


def coco_word_table() -> dict[tuple[str, ...], str]:
    """Phrase (tuple of tokens) -> COCO category, for the 80 categories, plurals and synonyms."""
    if not _COCO_TABLE:
        for category, text in _COCO_SYNONYMS.items():
            for phrase in _PHRASE_RE.findall(text):
                words = phrase.split()
                _COCO_TABLE[tuple(words)] = category
                if phrase not in _NO_PLURAL:
                    _COCO_TABLE[tuple(words[:-1] + [_IRREGULAR.get(words[-1]) or _plural(words[-1])])] = category
    return _COCO_TABLE


_PHRASE_RE = re.compile("|".join(sorted(_COCO_PHRASES, key=len, reverse=True)) + r"|\S+")
COCO_CATEGORIES = frozenset(_COCO_SYNONYMS)


@dataclass(frozen=True)
class WordTable:
    """The phrases (lowercase token tuples -> category) and attribute words that name objects."""

    name: str
    phrases: Mapping[tuple[str, ...], str]
    attributes: Mapping[str, str] = field(default_factory=dict)


def _plural_phrase(words: tuple[str, ...]) -> tuple[str, ...]:
    last = words[-1]
    return words[:-1] + (_IRREGULAR.get(last) or _plural(last),)


def category_table(names: Iterable[str]) -> WordTable:
    """A word table for a dataset's own category names, singular or plural, with COCO synonyms where they match."""
    phrases: dict[tuple[str, ...], str] = {}
    for name in names:
        words = tuple(tokenize(str(name)))
        if words:
            phrases.setdefault(words, name)
    for words, name in list(phrases.items()):
        phrases.setdefault(_plural_phrase(words), name)
    by_coco_name = {" ".join(words): name for words, name in phrases.items() if " ".join(words) in COCO_CATEGORIES}
    for words, coco_category in coco_word_table().items():
        if coco_category in by_coco_name:
            phrases.setdefault(words, by_coco_name[coco_category])
    return WordTable("categories", phrases)


def choose_vocabulary(names: Iterable[str]) -> str | WordTable:
    """``"shapes"`` or ``"coco"`` when every name is one of those, else ``category_table(names)``."""
    names = list(dict.fromkeys(str(n) for n in names))
    if names and set(names) <= set(SHAPES):
        return "shapes"
    if set(names) <= COCO_CATEGORIES:
        return "coco"
    return category_table(names)


def _shape_table() -> WordTable:
    """Shape nouns (and plurals) and the colour/size words of the synthetic scenes."""
    phrases: dict[tuple[str, ...], str] = {}
    for shape in SHAPES:
        words = tuple(shape.split())
        phrases[words] = shape
        phrases[words[:-1] + (_plural(words[-1]),)] = shape
    attributes = {str(c).lower(): "color" for c in COLORS}
    attributes.update({str(s).lower(): "size" for s in SIZES})
    return WordTable("shapes", phrases, attributes)


def word_table(vocabulary: str | WordTable) -> WordTable:
    """``"shapes"``, ``"coco"`` or a ``WordTable`` (returned as is) -> ``WordTable``."""
    if isinstance(vocabulary, WordTable):
        return vocabulary
    if vocabulary == "shapes":
        return _shape_table()
    if vocabulary == "coco":
        return WordTable("coco", coco_word_table())
    raise DataError(f"vocabulary={vocabulary!r}: use one of {', '.join(VOCABULARIES)} or a category_table(...)")


def find_mentions(words: Sequence[str], vocabulary: str | WordTable = "shapes") -> list[ObjectMention]:
    """Find the object names in a caption (tokens), longest phrase first, in caption order.

    ``vocabulary``: ``"shapes"`` (colour/size words before a shape noun attributed to it), ``"coco"``
    (80 categories, plurals, synonyms) or a ``WordTable``.
    """
    table = word_table(vocabulary)
    phrases, attribute_words = table.phrases, table.attributes
    longest = max((len(p) for p in phrases), default=1)
    words = [w.lower() for w in words]
    mentions: list[ObjectMention] = []
    i = 0
    while i < len(words):
        match = None
        for n in range(min(longest, len(words) - i), 0, -1):
            category = phrases.get(tuple(words[i:i + n]))
            if category is not None and not _adjectival(words, i, n):
                match = (n, category)
                break
        if match is None:
            i += 1
            continue
        n, category = match
        start, attributes = i, {}
        while start > 0 and words[start - 1] in attribute_words:
            kind = attribute_words[words[start - 1]]
            if kind in attributes:
                break
            attributes[kind] = words[start - 1]
            start -= 1
        if mentions and start < mentions[-1].end:  # never steal words of the previous mention
            start = mentions[-1].end
        mentions.append(ObjectMention(start, i, i + n, category, attributes))
        i += n
    return mentions


_FUNCTION_WORDS = frozenset("a an the and on in with of is are at to by near next sitting".split())


def _adjectival(words: Sequence[str], i: int, n: int) -> bool:
    """The object "orange" is a colour unless it ends the phrase ("an orange on a plate")."""
    if n != 1 or words[i] != "orange":
        return False
    return i + 1 < len(words) and words[i + 1] not in _FUNCTION_WORDS


MAX_CANVAS_SIDE = 256  # the image is rasterised at most this large (scale-invariant shares)


@dataclass
class WordScore:
    """One scored word: attention ``mass`` inside its object's box(es), the ``uniform`` baseline, ``hit`` (argmax inside)."""

    index: int
    word: str
    category: str
    mass: float
    uniform: float
    hit: bool


@dataclass
class WordScores:
    """One caption's ``scored`` words, its ``invented`` object words (category absent) and all ``mentions``."""

    scored: list[WordScore] = field(default_factory=list)
    invented: list[tuple[int, str, str]] = field(default_factory=list)
    mentions: int = 0

# ----------------------------------------------------------------------------- geometry
def _box_coverage(n_out: int, lo: float, hi: float, scale: float) -> np.ndarray:
    """(n_out,) fraction of each canvas pixel covered by the interval [lo, hi) (original px)."""
    edges = np.arange(n_out + 1) / scale
    return interval_overlap(edges[:-1], edges[1:], lo, hi) * scale


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
        for box in map(Box.from_xywh, boxes):
            cov = np.outer(_box_coverage(out.shape[0], box.top, box.bottom, self.scale),
                           _box_coverage(out.shape[1], box.left, box.right, self.scale))
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
def attention_correctness(words: Sequence[str], attention: Any, boxes: Sequence[Any], image_size: tuple[int, int],
                          box: Box | None = None, vocabulary: str | WordTable = "shapes") -> WordScores:
    """Score one caption's object words (L) against the ground-truth boxes.

    ``attention``: (L, g, g) (extra trailing steps ignored); ``boxes``: ``ObjectBox`` items with
    ``bbox`` (x, y, w, h) pixels; ``box``: the part of the image the encoder saw (None: all of it).
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


BOOTSTRAP_DRAWS = 2000  # resamples of the images for the 95% intervals (seeded: the same scores, the same interval)


def summarize(scores: Iterable[WordScores]) -> dict[str, Any]:
    """Average per-word scores over all words of all images.

    Returns ``attention_correctness``, ``uniform_baseline``, ``ratio``, ``pointing_accuracy``,
    ``words_scored``, ``images_scored``, ``objects_invented``, ``invented_rate`` (None means where no
    word was scored) and 95% bootstrap ``ratio_interval``/``pointing_interval`` over images.
    """
    per_image, invented, named = [], 0, 0  # per_image: (mass, uniform, hits, words) summed over its scored words
    for s in scores:
        invented += len(s.invented)
        named += s.mentions
        if s.scored:
            per_image.append((sum(w.mass for w in s.scored), sum(w.uniform for w in s.scored),
                              sum(w.hit for w in s.scored), len(s.scored)))
    mass, uniform, hits, words = (float(v) for v in np.asarray(per_image, dtype=np.float64).reshape(-1, 4).sum(0))
    ac = mass / words if words else None
    base = uniform / words if words else None
    ratio_interval, pointing_interval = bootstrap_intervals(per_image)
    return {
        "attention_correctness": ac,
        "uniform_baseline": base,
        "ratio": ac / base if ac is not None and base else None,
        "ratio_interval": ratio_interval,
        "pointing_accuracy": hits / words if words else None,
        "pointing_interval": pointing_interval,
        "words_scored": int(words),
        "images_scored": len(per_image),
        "objects_invented": invented,
        "invented_rate": invented / named if named else None,
    }


def bootstrap_intervals(per_image: Sequence[tuple[float, float, float, int]], draws: int = BOOTSTRAP_DRAWS,
                        seed: int = 0) -> tuple[list[float] | None, list[float] | None]:
    """95% intervals ``([low, high] of the ratio, [low, high] of pointing)``, resampling whole images.

    ``per_image``: sums of mass, baseline and hits and the word count per image. None with fewer than two
    images (or for the ratio where a resample's baseline is zero).
    """
    if len(per_image) < 2:
        return None, None
    table = np.asarray(per_image, dtype=np.float64)  # (I, 4)
    picks = np.random.default_rng(seed).integers(0, len(table), size=(draws, len(table)))
    sums = table[picks].sum(axis=1)  # (draws, 4)
    ratio = _middle_95(sums[:, 0] / sums[:, 1]) if bool((sums[:, 1] > 0).all()) else None
    return ratio, _middle_95(sums[:, 2] / sums[:, 3])


def _middle_95(values: np.ndarray) -> list[float]:
    """``[2.5th, 97.5th]`` percentiles of ``values``."""
    return [float(v) for v in np.percentile(values, [2.5, 97.5])]


# ----------------------------------------------------------------------------- synthetic captions
def caption_object_accuracy(words: Sequence[str], boxes: Sequence[Any]) -> bool:
    """True when a scene caption names every object by colour and shape and names no absent shape."""
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
        entropies += list(attention_entropy(flat))
    return {
        "attention_entropy": float(np.mean(entropies)) if entropies else None,
        "uniform_entropy": math.log(n_regions) if n_regions else None,
    }


def detect_vocabulary(instances: dict[int, list[Any]]) -> str | WordTable:
    """The word table for a dataset's boxes, from its ``categories`` list when it has one."""
    names = getattr(instances, "categories", None) or [obj.category for objs in instances.values() for obj in objs]
    return choose_vocabulary(names)


def attention_correctness_for_results(results: Sequence[Any], caption_set: Any, instances: dict[int, list[Any]],
                                      encoder_cfg: Any,
                                      vocabulary: str | WordTable | None = None) -> dict[str, float | int | str | None]:
    """Attention correctness of a decoded split (one ``Caption`` per image of ``caption_set``).

    ``vocabulary``: None detects it from the categories. Returns the :func:`summarize` keys,
    ``vocabulary`` and, for the synthetic scenes, ``objects_correct``.
    """
    if len(results) != len(caption_set.images):
        raise DataError(f"{len(results)} results for {len(caption_set.images)} images")
    table = word_table(vocabulary if vocabulary is not None else detect_vocabulary(instances))
    scores, correct = [], []
    for result, record in zip(results, caption_set.images):
        objs = instances.get(record.image_id, [])
        scores.append(_image_scores(record, [result], objs, encoder_cfg, table))
        if table.name == "shapes":
            correct.append(caption_object_accuracy(result.words, objs))
    out: dict[str, float | int | str | None] = dict(summarize(scores))
    out["vocabulary"] = table.name
    out["objects_correct"] = float(np.mean(correct)) if correct else None
    logger.debug("attention correctness over %d images: %s", len(results), out)
    return out


def reference_correctness(captions: Sequence[Sequence[Any]], caption_set: Any, instances: dict[int, list[Any]],
                          encoder_cfg: Any,
                          vocabulary: str | WordTable | None = None) -> dict[str, float | int | str | None]:
    """Attention correctness of the model on the **reference** captions, teacher-forced.

    Every model is judged on the same words, about five times as many, so narrower intervals; an
    image's words from all its captions form one bootstrap unit. Returns the :func:`summarize` keys,
    ``vocabulary`` and ``captions_scored``.
    """
    if len(captions) != len(caption_set.images):
        raise DataError(f"reference captions of {len(captions)} images for {len(caption_set.images)} images")
    table = word_table(vocabulary if vocabulary is not None else detect_vocabulary(instances))
    scores = [_image_scores(record, refs, instances.get(record.image_id, []), encoder_cfg, table)
              for refs, record in zip(captions, caption_set.images)]
    out: dict[str, float | int | str | None] = dict(summarize(scores))
    out["vocabulary"] = table.name
    out["captions_scored"] = sum(len(refs) for refs in captions)
    return out


def _image_scores(record: Any, captions: Sequence[Any], objs: Sequence[Any], encoder_cfg: Any,
                  table: WordTable) -> WordScores:
    """The scores of one image's captions (each with ``words`` and ``attention``), as one unit."""
    width, height = record.size()
    view = crop_box(width, height, encoder_cfg)
    merged = WordScores()
    for caption in captions:
        one = attention_correctness(caption.words, caption.attention, objs, (width, height), view, table)
        merged.scored += one.scored
        merged.invented += one.invented
        merged.mentions += one.mentions
    return merged


def _pair(obj: Any) -> tuple[str, str]:
    return str(obj.attributes.get("color", "")).lower(), obj.category


def pair_named(words: Sequence[str], obj: Any) -> bool:
    """The caption names ``obj``'s shape with ``obj``'s colour word directly before it."""
    color, shape = _pair(obj)
    return any(m.category == shape and m.attributes.get("color") == color for m in find_mentions(words, "shapes"))


def _share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def compositional_scores(results: Sequence[Any], caption_set: Any, instances: Any) -> dict[str, Any] | None:
    """Scores of decoded test captions on seen and held-out (unseen) pairs, or None without unseen pairs."""
    unseen = {(c.lower(), s) for c, s in getattr(instances, "unseen_pairs", ())}
    if not unseen:
        return None
    correct: dict[bool, list[bool]] = {False: [], True: []}
    named: dict[bool, list[bool]] = {False: [], True: []}
    for result, record in zip(results, caption_set.images):
        objects = instances.get(record.image_id, [])
        has_unseen = any(_pair(o) in unseen for o in objects)
        correct[has_unseen].append(caption_object_accuracy(result.words, objects))
        for obj in objects:
            named[_pair(obj) in unseen].append(pair_named(result.words, obj))
    return {"unseen_pairs": sorted(" ".join(p) for p in unseen),
            "objects_correct_seen": _share(correct[False]), "objects_correct_unseen": _share(correct[True]),
            "seen_pairs_named": _share(named[False]), "unseen_pairs_named": _share(named[True]),
            "scenes_seen": len(correct[False]), "scenes_unseen": len(correct[True]),
            "objects_unseen": len(named[True])}


BINDING_ATTRIBUTES = ("color", "size")  # attribute kinds that pick one box among boxes of the same category


def _overlap(lo: np.ndarray, hi: np.ndarray, box_lo: float, box_hi: float) -> np.ndarray:
    """Share of each interval ``[lo, hi)`` inside ``[box_lo, box_hi)``: (g,) -> (g,)."""
    return interval_overlap(lo, hi, box_lo, box_hi) / np.maximum(hi - lo, 1e-9)


def box_coverage(boxes: Sequence[Sequence[float]], view: Sequence[float], grid: int) -> np.ndarray:
    """(N,) each region's area share in [0, 1] inside the union of ``(x, y, w, h)`` boxes, seen through ``view``."""
    if grid < 1:
        raise DataError(f"grid must be >= 1, got {grid}")
    left, top, right, bottom = (float(v) for v in view)
    if not (right > left and bottom > top):
        raise DataError(f"view {tuple(view)} is empty")
    edges_x = left + (right - left) * np.arange(grid + 1) / grid  # (g+1,)
    edges_y = top + (bottom - top) * np.arange(grid + 1) / grid
    out = np.zeros((grid, grid), dtype=np.float64)
    for box in boxes:
        x, y, w, h = (float(v) for v in box)
        if not (w > 0 and h > 0):
            continue
        cols = _overlap(edges_x[:-1], edges_x[1:], x, x + w)  # (g,)
        rows = _overlap(edges_y[:-1], edges_y[1:], y, y + h)  # (g,)
        np.maximum(out, np.outer(rows, cols), out=out)
    return out.reshape(-1).astype(np.float32)  # (N,)


def _agrees(obj: Any, attributes: dict[str, str]) -> bool:
    """The box's own attributes do not contradict the mention's colour/size words."""
    own = getattr(obj, "attributes", None) or {}
    return all(str(own[k]).lower() == v for k, v in attributes.items() if k in BINDING_ATTRIBUTES and k in own)


def bind_mentions(mentions: Sequence[Any], objects: Sequence[Any]) -> list[tuple[int, tuple[int, ...]]]:
    """``(word index, box indices)`` for every word of every mention whose category is in the image."""
    bound: list[tuple[int, tuple[int, ...]]] = []
    for m in mentions:
        same = [i for i, obj in enumerate(objects) if obj.category == m.category]
        if len(same) > 1:
            agreeing = [i for i in same if _agrees(objects[i], dict(m.attributes))]
            same = agreeing or same  # nothing agrees: the words still name the category
        if not same:
            continue
        bound += [(word, tuple(same)) for word in range(m.start, m.end)]
    return bound
