"""CHAIR: how often captions name objects that are not in the photo (Rohrbach et al. 2018).

* **CHAIR-s**: the share of captions that name at least one absent object;
* **CHAIR-i**: the share of object mentions that name an absent object;
* **object coverage**: the share of the objects the references name that the caption names too.

Objects are named through :data:`CHAIR_SYNONYMS` (the 80 COCO categories, plurals, two-word names
and synonyms, longest phrase first, so "hot dog" is never a dog) minus :data:`NOT_OBJECTS`
("toilet paper", "train tracks"). The objects present are the photo's box categories (when there
are boxes) joined with those its references name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from captioner.evaluation.attention_metrics import WordTable, _plural_phrase, find_mentions
from captioner.text import tokenize

__all__ = ["CHAIR_SYNONYMS", "NOT_OBJECTS", "ChairScores", "chair_scores", "chair_table", "named_objects"]

# COCO category -> the phrases that name it (singular; regular plurals are added, irregular ones are
# listed). Written for captions: what people call each object in COCO's and Flickr's sentences.
CHAIR_SYNONYMS: dict[str, tuple[str, ...]] = {
    "person": ("person", "persons", "people", "man", "men", "woman", "women", "boy", "girl", "child", "children",
               "kid", "guy", "lady", "ladies", "gentleman", "gentlemen", "baby", "babies", "toddler", "teenager",
               "teen", "adult", "player", "skier", "surfer", "skateboarder", "snowboarder", "batter", "catcher",
               "umpire", "rider", "biker", "cyclist", "bicyclist", "motorcyclist", "chef", "groom", "bride",
               "diver", "officer", "policeman", "policemen", "soldier", "worker", "tourist", "pedestrian",
               "spectator", "crowd", "family", "friend", "student", "doctor", "mother", "father",
               "daughter", "son", "brother", "sister", "husband", "wife", "someone", "somebody", "individual",
               "passenger", "driver", "cowboy", "athlete", "tennis player", "baseball player"),
    "bicycle": ("bicycle", "bike", "cycle", "tandem bicycle", "mountain bike"),
    "car": ("car", "automobile", "sedan", "suv", "taxi", "cab", "taxicab", "jeep", "convertible", "limousine",
            "limo", "minivan", "van", "coupe", "hatchback", "police car"),
    "motorcycle": ("motorcycle", "motorbike", "motor bike", "motor cycle", "scooter", "moped", "dirt bike"),
    "airplane": ("airplane", "aeroplane", "plane", "jet", "jetliner", "airliner", "aircraft", "warplane",
                 "fighter jet", "passenger jet", "biplane"),
    "bus": ("bus", "busses", "trolleybus", "minibus", "school bus", "double decker", "double decker bus"),
    "train": ("train", "locomotive", "tram", "trolley", "streetcar", "subway", "railcar", "passenger train",
              "freight train", "steam engine", "caboose"),
    "truck": ("truck", "lorry", "pickup", "pickup truck", "fire truck", "firetruck", "fire engine", "dump truck",
              "semi", "semi truck", "tow truck", "garbage truck", "tractor trailer"),
    "boat": ("boat", "ship", "sailboat", "canoe", "kayak", "yacht", "ferry", "motorboat", "speedboat", "rowboat",
             "dinghy", "tugboat", "barge", "catamaran", "gondola", "raft", "vessel", "liner", "schooner", "lifeboat"),
    "traffic light": ("traffic light", "traffic signal", "stop light", "stoplight", "street light"),
    "fire hydrant": ("fire hydrant", "hydrant"),
    "stop sign": ("stop sign",),
    "parking meter": ("parking meter", "meter"),
    "bench": ("bench", "park bench"),
    "bird": ("bird", "seagull", "gull", "pigeon", "dove", "duck", "duckling", "goose", "geese", "swan", "parrot",
             "owl", "eagle", "hawk", "sparrow", "crow", "robin", "pelican", "penguin", "flamingo", "heron",
             "chicken", "hen", "rooster", "turkey", "ostrich", "peacock", "finch", "hummingbird", "vulture"),
    "cat": ("cat", "kitten", "kitty", "kitties", "tabby"),
    "dog": ("dog", "puppy", "puppies", "pup", "doggy", "doggie", "hound", "terrier", "poodle", "labrador",
            "retriever", "sheepdog", "collie", "dalmatian", "beagle", "chihuahua", "pug", "bulldog"),
    "horse": ("horse", "pony", "ponies", "foal", "colt", "stallion", "mare"),
    "sheep": ("sheep", "lamb", "ram", "ewe"),
    "cow": ("cow", "cattle", "bull", "calf", "calves", "ox", "oxen", "heifer", "steer"),
    "elephant": ("elephant",),
    "bear": ("bear", "grizzly", "polar bear", "black bear", "brown bear", "grizzly bear"),
    "zebra": ("zebra",),
    "giraffe": ("giraffe",),
    "backpack": ("backpack", "back pack", "rucksack", "knapsack"),
    "umbrella": ("umbrella", "parasol"),
    "handbag": ("handbag", "purse", "hand bag", "pocketbook"),
    "tie": ("tie", "necktie", "bow tie", "bowtie"),
    "suitcase": ("suitcase", "suit case", "luggage", "luggages", "baggage"),
    "frisbee": ("frisbee", "flying disc"),
    "skis": ("skis", "ski"),
    "snowboard": ("snowboard", "snow board"),
    "sports ball": ("ball", "soccer ball", "tennis ball", "football", "volleyball", "basketball", "softball",
                    "beach ball", "golf ball"),
    "kite": ("kite",),
    "baseball bat": ("baseball bat", "bat"),
    "baseball glove": ("baseball glove", "baseball mitt", "glove", "mitt", "catchers mitt"),
    "skateboard": ("skateboard", "skate board"),
    "surfboard": ("surfboard", "surf board", "boogie board", "paddle board", "paddleboard"),
    "tennis racket": ("tennis racket", "tennis racquet", "racket", "racquet"),
    "bottle": ("bottle",),
    "wine glass": ("wine glass", "wineglass", "glass", "goblet", "glass of wine"),
    "cup": ("cup", "mug", "coffee cup", "teacup", "tea cup"),
    "fork": ("fork",),
    "knife": ("knife", "knives"),
    "spoon": ("spoon",),
    "bowl": ("bowl",),
    "banana": ("banana",),
    "apple": ("apple",),
    "sandwich": ("sandwich", "burger", "hamburger", "cheeseburger", "sub", "panini"),
    "orange": ("orange",),
    "broccoli": ("broccoli", "brocolli"),
    "carrot": ("carrot",),
    "hot dog": ("hot dog", "hotdog", "chili dog", "corn dog"),
    "pizza": ("pizza",),
    "donut": ("donut", "doughnut"),
    "cake": ("cake", "cupcake", "cheesecake"),
    "chair": ("chair", "stool", "armchair"),
    "couch": ("couch", "sofa", "loveseat", "love seat", "futon"),
    "potted plant": ("potted plant", "houseplant", "house plant", "flowerpot", "flower pot", "plant"),
    "bed": ("bed",),
    "dining table": ("dining table", "table", "kitchen table", "picnic table", "coffee table", "desk"),
    "toilet": ("toilet", "urinal", "toilet seat"),
    "tv": ("tv", "tvs", "television", "television set", "flat screen", "monitor",
           "computer monitor"),
    "laptop": ("laptop", "laptop computer", "notebook computer", "computer", "netbook"),
    "mouse": ("mouse", "mice", "computer mouse"),
    "remote": ("remote", "remote control", "controller", "game controller", "wii remote", "wii controller"),
    "keyboard": ("keyboard", "computer keyboard"),
    "cell phone": ("cell phone", "cellphone", "phone", "smartphone", "smart phone", "mobile phone", "iphone",
                   "telephone"),
    "microwave": ("microwave", "microwave oven"),
    "oven": ("oven", "stove", "stovetop", "stove top"),
    "toaster": ("toaster",),
    "sink": ("sink", "washbasin"),
    "refrigerator": ("refrigerator", "fridge", "freezer"),
    "book": ("book", "novel"),
    "clock": ("clock", "clocktower", "clock tower"),
    "vase": ("vase",),
    "scissors": ("scissors", "scissor", "shears"),
    "teddy bear": ("teddy bear", "teddy", "teddybear", "stuffed bear"),
    "hair drier": ("hair drier", "hair dryer", "hairdryer", "blow dryer", "blow drier"),
    "toothbrush": ("toothbrush", "tooth brush"),
}

# Phrases that hold an object word but do not name the object: matched first (longest phrase wins),
# they name nothing.
NOT_OBJECTS: tuple[str, ...] = (
    "toilet paper", "toilet tissue", "pool table", "table cloth", "tablecloth", "table top", "train tracks",
    "train track", "train station", "train platform", "railroad tracks", "bus stop", "bus station", "bus lane",
    "bike lane", "bike path", "bike rack", "orange juice", "glass door", "glass window", "glass doors",
    "glass windows", "glass wall", "glass walls", "glass building", "stained glass", "sun glasses", "eye glasses",
    "glasses", "ski slope", "ski lift", "ski lodge", "ski resort", "ski poles", "ski pole",
    "ski suit", "ski jacket", "ski gear", "ski boots", "ski trail", "ski run", "tennis court", "tennis match",
    "baseball field", "baseball game", "baseball diamond", "baseball cap", "baseball uniform", "baseball",
    "football field", "football game", "dog food", "cat food", "bird cage", "birdcage", "bird feeder",
    "horse drawn", "cow bell", "apple logo", "cake pan", "book shelf", "bookshelf", "phone booth", "cell tower",
    "clock face", "plant life", "power plant", "bear statue", "stuffed animal", "hot tub", "kite surfing",
    "kitesurfing", "kite boarding", "kiteboarding", "kite surfer", "kite boarder", "sandwich board", "tie dye",
    "meter maid", "toy car", "remote area",
)
_NO_PLURAL = frozenset({"glass", "persons", "people", "men", "women", "children", "ladies", "gentlemen", "babies",
                        "mice", "knives", "calves", "oxen", "geese", "puppies", "ponies", "kitties", "cattle",
                        "sheep", "skis", "scissors", "broccoli", "brocolli", "luggage", "baggage", "luggages",
                        "busses", "tvs", "shears"})
_TABLE: dict[tuple[str, ...], str] = {}
NOTHING = ""  # the category of a phrase in NOT_OBJECTS


def chair_table() -> WordTable:
    """Phrase (tuple of tokens) -> COCO category ("" for :data:`NOT_OBJECTS`), plurals included."""
    if not _TABLE:
        for category, phrases in CHAIR_SYNONYMS.items():
            for phrase in phrases:
                words = tuple(phrase.split())
                _TABLE.setdefault(words, category)
                if phrase not in _NO_PLURAL:
                    _TABLE.setdefault(_plural_phrase(words), category)
        for phrase in NOT_OBJECTS:
            words = tuple(phrase.split())
            _TABLE[words] = NOTHING
            _TABLE.setdefault(_plural_phrase(words), NOTHING)
    return WordTable("chair", _TABLE)


def named_objects(caption: str | Sequence[str]) -> list[str]:
    """The COCO categories a caption (text or tokens) names, one per mention, in order: "a man ... dog" -> person, dog."""
    words = tokenize(caption) if isinstance(caption, str) else list(caption)
    return [m.category for m in find_mentions(words, chair_table()) if m.category != NOTHING]


@dataclass(frozen=True)
class ChairScores:
    """CHAIR over a set of captions (shares in 0-1; None where nothing was counted), with ``per_image`` details."""

    chair_s: float | None
    chair_i: float | None
    coverage: float | None
    captions: int
    mentions: int
    hallucinated: int
    objects_source: str
    per_image: list[dict[str, list[str]]]

    def as_dict(self, with_images: bool = False) -> dict[str, object]:
        """The metrics JSON's ``"chair"`` entry (per-image lists only when asked)."""
        out: dict[str, object] = {"CHAIR-s": self.chair_s, "CHAIR-i": self.chair_i, "coverage": self.coverage,
                                  "captions": self.captions, "mentions": self.mentions,
                                  "hallucinated": self.hallucinated, "objects": self.objects_source}
        if with_images:
            out["per_image"] = self.per_image
        return out


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def chair_scores(captions: Sequence[str], references: Sequence[Sequence[str]],
                 boxes: Sequence[Iterable[str]] | None = None,
                 categories: Mapping[str, str] | None = None) -> ChairScores:
    """CHAIR-s, CHAIR-i and object coverage of one caption per image.

    ``boxes``: per image its boxes' category names, or None; ``categories``: a map from the instances
    file's names to COCO's.
    """
    if len(references) != len(captions) or (boxes is not None and len(boxes) != len(captions)):
        raise ValueError(f"chair_scores: {len(captions)} captions, {len(references)} reference lists"
                         + (f", {len(boxes)} box lists" if boxes is not None else ""))
    categories = categories or {}
    bad_captions = mentions = hallucinated = covered = referenced = 0
    per_image = []
    for i, caption in enumerate(captions):
        in_references = {c for text in references[i] for c in named_objects(text)}
        present = set(in_references)
        if boxes is not None:
            present |= {categories.get(name, name) for name in boxes[i]}
        named = named_objects(caption)
        absent = [c for c in named if c not in present]
        mentions += len(named)
        hallucinated += len(absent)
        bad_captions += bool(absent)
        covered += len(in_references & set(named))
        referenced += len(in_references)
        per_image.append({"named": named, "present": sorted(present), "absent": sorted(set(absent))})
    return ChairScores(_share(bad_captions, len(captions)), _share(hallucinated, mentions),
                       _share(covered, referenced), len(captions), mentions, hallucinated,
                       "references" if boxes is None else "boxes and references", per_image)
