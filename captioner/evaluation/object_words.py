"""Which caption words name which objects: synthetic shapes, the 80 COCO categories, or any list.

``find_mentions(words, vocabulary)`` returns the spans of a caption that name an object
(``ObjectMention``), longest phrase first, so "hot dog" is one COCO object and not a dog:

* ``"shapes"``: the shape nouns of ``captioner.data.shapes.SHAPES`` and their plurals; colour and
  size words directly before a noun (``COLORS``, ``SIZES``) are attributed to the same object;
* ``"coco"``: each category's name, plural and common synonyms ("men" -> person, "bike" ->
  bicycle, "sofa" -> couch, "hotdog"/"hot dog" -> hot dog, "phone" -> cell phone). "orange" is
  the fruit only when it ends a noun phrase ("an orange on a plate", not "an orange cat");
* a ``WordTable`` from ``category_table(names)``: any dataset's own category names (an
  ``instances_*.json`` file's ``categories[].name``), tokenized like captions, with their plurals
  ("box"/"boxes", "traffic cone"/"traffic cones"); a name that is also a COCO category brings its
  COCO synonyms along.

``choose_vocabulary(names)`` picks the table for a dataset's category names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from captioner.data.shapes import COLORS, SHAPES, SIZES
from captioner.errors import DataError
from captioner.text import tokenize

VOCABULARIES = ("shapes", "coco")


@dataclass(frozen=True)
class ObjectMention:
    """A span of caption words that names one object category.

    Attributes:
        start: index of the first word (attribute words included).
        noun_start: index of the first word of the object name.
        end: one past the last word.
        category: the category named.
        attributes: attribute words before the name, e.g. ``{"color": "red", "size": "small"}``.
    """

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
    """The phrases that name objects, for :func:`find_mentions`.

    Attributes:
        name: ``"shapes"``, ``"coco"`` or ``"categories"`` (a dataset's own names).
        phrases: tuple of lowercase tokens -> category, spelt as the dataset spells it.
        attributes: word -> attribute kind (``"color"``, ``"size"``) for words directly before a name.
    """

    name: str
    phrases: Mapping[tuple[str, ...], str]
    attributes: Mapping[str, str] = field(default_factory=dict)


def _plural_phrase(words: tuple[str, ...]) -> tuple[str, ...]:
    last = words[-1]
    return words[:-1] + (_IRREGULAR.get(last) or _plural(last),)


def category_table(names: Iterable[str]) -> WordTable:
    """A word table for a dataset's own category names (e.g. an instances file's ``categories``).

    Each name is tokenized like a caption ("Traffic_Cone" -> "traffic cone") and matched as a
    phrase, singular or plural; when two names give the same phrase the first one keeps it. A name
    that equals a COCO category (case aside) also gets that category's COCO synonyms, unless a
    synonym is itself one of the dataset's names.
    """
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
    """The vocabulary for a dataset whose objects have these category names.

    Returns:
        ``"shapes"`` when every name is a synthetic shape, ``"coco"`` when every name is a COCO
        category (or there are none), else ``category_table(names)``.
    """
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
    """Find the object names in a caption, longest phrase first.

    Args:
        words: caption tokens (``captioner.text.tokenize`` output).
        vocabulary: ``"shapes"`` (synthetic scenes; colour/size words directly before a shape
            noun are attributed to it), ``"coco"`` (80 categories, plurals, synonyms) or a
            ``WordTable`` such as ``category_table(names)`` (a dataset's own category names).

    Returns:
        Mentions in caption order.
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
