"""Caption datasets: one loader for every layout the package accepts.

``load_caption_set(root, split)`` detects the layout of ``root`` (a flat COCO-format folder, the
official COCO layout, Flickr8k's, a Karpathy split file, a COCO captions JSON file; the entries of
:data:`LAYOUTS`, tried in order) and returns a ``CaptionSet``; ``load_instances`` reads the object
boxes. docs/data.md lists the layouts and the files each looks for.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from captioner.data.caption_set import (SAMPLE, CaptionSet, ImageRecord, InstanceBoxes, ObjectBox, _is_int, _short,
                                        build_caption_set, confine, pick_image_dir)
from captioner.errors import DataError
from captioner.files import MiB, check_regular, read_bytes, read_json, read_text

__all__ = ["ALL_SPLIT", "FLICKR_JSON", "FLICKR_SPLITS", "LAYOUTS", "CaptionSet", "ImageRecord", "InstanceBoxes",
           "Layout", "ObjectBox", "TokenFile", "UnknownSplitError", "VALIDATION_SPLITS", "available_splits",
           "caption_set_from_coco", "caption_set_from_karpathy", "coco_index", "is_flickr8k", "is_karpathy",
           "karpathy_splits", "load_caption_set", "load_flickr8k", "load_instances", "load_validation_set",
           "parse_token_lines", "read_annotations", "read_split_list", "read_token_file", "validate_coco"]

log = logging.getLogger(__name__)

# the largest annotation file read (COCO's instances_train2014.json is 0.45 GB; Karpathy's dataset_coco.json 0.15 GB)
MAX_ANNOTATION_BYTES = 1024 * MiB
ALL_SPLIT = "all"  # the whole file, for layouts whose one file holds several splits
VALIDATION_SPLITS = ("dev", "val", "validation")  # what datasets call their validation split, in this order
FLICKR_JSON, FLICKR_SPLITS = "captions_coco_format.json", "splits.tsv"
_BOX_KEYS = {"id", "image_id", "category_id", "bbox", "area", "iscrowd", "segmentation"}


# ----------------------------------------------------------------------------- loading
def load_caption_set(root: str | Path, split: str, images_dir: str | Path | None = None, *,
                     include_restval: bool = True, files_outside: bool = False) -> CaptionSet:
    """Load one split of a caption dataset, whatever its layout (:data:`LAYOUTS`); image paths are not checked.

    ``root``: a dataset folder, a COCO captions JSON or a Karpathy split JSON; ``split``: e.g. ``"train"``,
    ``"dev"``, ``"all"``; ``include_restval``: Karpathy ``"train"`` also takes ``restval``;
    ``files_outside``: accept image names that leave the image folder (``..``, absolute paths;
    :func:`~captioner.data.caption_set.confine`). Raises ``DataError`` when no layout matches, for an
    unknown split (listing them), an invalid file or an image outside its folder.
    """
    root = Path(root)
    images = Path(images_dir) if images_dir is not None else None
    if not root.exists():
        raise DataError(f"{root}: dataset path does not exist")
    cs = _load(root, str(split), images, include_restval)
    cs.root = root
    return cs if files_outside else confine(cs)


class UnknownSplitError(DataError):
    """A split the dataset does not have (the message lists those it has)."""


def load_validation_set(root: str | Path, split: str, images_dir: str | Path | None = None,
                        files_outside: bool = False) -> CaptionSet:
    """:func:`load_caption_set` of a validation split, by whichever of :data:`VALIDATION_SPLITS` the data has.

    ``split`` comes first; when it is one of those names and the data lacks it, the first of the others
    the data has is used and a log line says so (Flickr8k calls it ``dev``, COCO folders ``val``).

    Raises:
        DataError: as :func:`load_caption_set`; for a split the data lacks, the message names the
            splits it has and ``--set data.val_split=NAME``.
    """
    try:
        return load_caption_set(root, split, images_dir, files_outside=files_outside)
    except UnknownSplitError as exc:
        missing = exc
    if split in VALIDATION_SPLITS:
        for other in (name for name in VALIDATION_SPLITS if name != split):
            try:
                cs = load_caption_set(root, other, images_dir, files_outside=files_outside)
            except UnknownSplitError:
                continue
            log.info("%s has no %r split: validating on its %r split (--set data.val_split=NAME picks another)",
                     root, split, other)
            return cs
    raise DataError(f"{missing}; name the validation split with --set data.val_split=NAME") from None


@dataclass(frozen=True)
class Layout:
    """One folder layout ``load_caption_set`` reads; ``load(root, split, images_dir, include_restval)``."""

    name: str  # what it is called in messages
    looks_for: Callable[[str], str]  # ``looks_for(split)``, the files it needs, for the "no caption data" error
    detect: Callable[[Path, str], bool]  # ``detect(root, split)``, true when ``root`` is this layout
    load: Callable[[Path, str, Path | None, bool], CaptionSet]


def _load_flat(root: Path, split: str, images: Path | None, _: bool) -> CaptionSet:
    path = root / f"captions_{split}.json"
    data = read_annotations(path)
    image_dir = images or pick_image_dir(data, root / "images", root / split, root)
    return caption_set_from_coco(path, data, split, image_dir, root.name)


def _load_official(root: Path, split: str, images: Path | None, _: bool) -> CaptionSet:
    path = root / "annotations" / f"captions_{split}.json"
    data = read_annotations(path)
    image_dir = images or pick_image_dir(data, root / split, root / "images" / split)
    return caption_set_from_coco(path, data, split, image_dir, root.name)


def _load_karpathy_folder(root: Path, split: str, images: Path | None, include_restval: bool) -> CaptionSet:
    files = sorted(root.glob("dataset_*.json"))
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise DataError(f"{root}: several Karpathy split files ({names}); pass the one to use as the path")
    return _load_file(files[0], split, images, include_restval)


# In order of precedence: a folder that several layouts match loads as the first.
LAYOUTS = (
    Layout("flat COCO folder", lambda s: f"captions_{s}.json",
           lambda root, s: (root / f"captions_{s}.json").is_file(), _load_flat),
    Layout("official COCO", lambda s: f"annotations/captions_{s}.json",
           lambda root, s: (root / "annotations" / f"captions_{s}.json").is_file(), _load_official),
    Layout("Flickr8k in COCO format", lambda s: f"{FLICKR_JSON} + {FLICKR_SPLITS}",
           lambda root, s: (root / FLICKR_JSON).is_file() and (root / FLICKR_SPLITS).is_file(),
           lambda root, s, images, _: _load_flickr(root / FLICKR_JSON, read_annotations(root / FLICKR_JSON), s, images,
                                                   root.name)),
    Layout("Karpathy split file", lambda s: "dataset_*.json",
           lambda root, s: any(root.glob("dataset_*.json")), _load_karpathy_folder),
    Layout("Flickr8k official", lambda s: f"Flickr8k_text/{FLICKR8K_TOKEN_FILE} + Flickr_8k.<split>Images.txt",
           lambda root, s: is_flickr8k(root), lambda root, s, images, _: load_flickr8k(root, s, images)),
)


def _load(root: Path, split: str, images: Path | None, include_restval: bool) -> CaptionSet:
    if not root.is_dir():  # an annotation file (a pipe or a device is refused here by name)
        check_regular(root, MAX_ANNOTATION_BYTES, DataError, "annotation file")
        return _load_file(root, split, images, include_restval)
    for layout in LAYOUTS:
        if layout.detect(root, split):
            return layout.load(root, split, images, include_restval)
    available = available_splits(root)
    if available:
        raise UnknownSplitError(f"{root}: unknown split {split!r}; available: {', '.join(available)}")
    looked = ", ".join(f"{layout.name} ({layout.looks_for(split)})" for layout in LAYOUTS)
    raise DataError(f"{root}: no caption data found; the layouts that load: {looked}")


def available_splits(root: str | Path) -> list[str]:
    """Split names offered by a dataset folder's ``captions_<split>.json`` files."""
    root = Path(root)
    names = {p.stem[len("captions_"):] for d in (root, root / "annotations") for p in d.glob("captions_*.json")}
    names.discard(Path(FLICKR_JSON).stem[len("captions_"):])
    return sorted(names)


def _load_file(path: Path, split: str, images_dir: Path | None, include_restval: bool) -> CaptionSet:
    data = read_annotations(path)
    if is_karpathy(data):
        return caption_set_from_karpathy(path, data, split, images_dir, include_restval)
    if not (isinstance(data, dict) and "images" in data and "annotations" in data):
        raise DataError(f"{path}: not a COCO captions file (no 'images' and 'annotations') "
                        "nor a Karpathy split file (no 'images' with 'sentences')")
    if (path.parent / FLICKR_SPLITS).is_file():
        return _load_flickr(path, data, split, images_dir, path.parent.name)
    own = path.stem[len("captions_"):] if path.stem.startswith("captions_") else path.stem
    if split not in (own, ALL_SPLIT):
        raise UnknownSplitError(f"{path}: unknown split {split!r}; this file holds one split, available: {own}, "
                                f"{ALL_SPLIT}")
    image_dir = images_dir or pick_image_dir(data, path.parent.parent / own, path.parent / own,
                                             path.parent / "images", path.parent)
    return caption_set_from_coco(path, data, split, image_dir, path.stem)


def _load_flickr(json_path: Path, data: Any, split: str, images_dir: Path | None, name: str) -> CaptionSet:
    tsv = json_path.parent / FLICKR_SPLITS
    splits = _read_splits_tsv(tsv)
    available = list(dict.fromkeys(splits.values())) + [ALL_SPLIT]
    if split not in available:
        raise UnknownSplitError(f"{json_path.parent}: unknown split {split!r}; available: {', '.join(available)}")
    image_dir = images_dir or pick_image_dir(data, json_path.parent / "images", json_path.parent)
    keep = None if split == ALL_SPLIT else (lambda img: splits.get(img["file_name"]) == split)
    return caption_set_from_coco(json_path, data, split, image_dir, name, keep=keep)


def _read_splits_tsv(path: Path) -> dict[str, str]:
    """``image<TAB>split`` lines (an ``image<TAB>split`` header is optional) -> {file_name: split}."""
    lines = read_text(path, MAX_ANNOTATION_BYTES, DataError, "split file").splitlines()
    splits: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip() or (number == 1 and line.strip().lower() == "image\tsplit"):
            continue
        parts = line.rstrip("\r\n").split("\t")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise DataError(f"{path}: line {number}: expected 'image<TAB>split', got {line[:60]!r}")
        splits[parts[0]] = parts[1]
    if not splits:
        raise DataError(f"{path}: split file lists no images")
    return splits


def read_annotations(path: Path) -> Any:
    """A JSON annotation file (:func:`captioner.files.read_json`, at most :data:`MAX_ANNOTATION_BYTES`)."""
    return read_json(path, MAX_ANNOTATION_BYTES, DataError, "annotation file")


# ----------------------------------------------------------------------------- Karpathy split files

RESTVAL = "restval"
KARPATHY_ALIASES = {"dev": "val"}
KARPATHY_IMAGE_DIRS = ("Flicker8k_Dataset", "Flickr8k_Dataset", "images", "Images")


def is_karpathy(data: Any) -> bool:
    """True for a parsed Karpathy split file (``images`` entries carry ``sentences``, no ``annotations``)."""
    if not isinstance(data, dict) or "annotations" in data or not isinstance(data.get("images"), list):
        return False
    first = data["images"][0] if data["images"] else None
    return isinstance(first, dict) and "sentences" in first


def karpathy_splits(data: dict) -> list[str]:
    """Split names present in a Karpathy file, in first-seen order."""
    return list(dict.fromkeys(str(img.get("split")) for img in data["images"] if isinstance(img, dict)))


def caption_set_from_karpathy(path: Path, data: dict, split: str, images_dir: Path | None = None,
                              include_restval: bool = True) -> CaptionSet:
    """Validate a parsed Karpathy file and build the caption set of one split (``val`` or ``dev``, ``all``...)."""
    available = karpathy_splits(data)
    if split in KARPATHY_ALIASES and split not in available and KARPATHY_ALIASES[split] in available:
        split = KARPATHY_ALIASES[split]
    if split not in available + ["all"]:
        raise UnknownSplitError(f"{path}: unknown split {split!r}; available: {', '.join(available + ['all'])}")
    wanted = {split}
    if split == "train" and include_restval:
        wanted.add(RESTVAL)
    if images_dir is None:
        images_dir = _karpathy_image_dir(path, data)

    entries: list[tuple[ImageRecord, list[str]]] = []
    seen: set[int] = set()
    for i, img in enumerate(data["images"]):
        record, captions = _parse_karpathy_image(path, i, img, images_dir)
        if record.image_id in seen:
            raise DataError(f"{path}: images[{i}] repeats image id {record.image_id}")
        seen.add(record.image_id)
        if split == "all" or img["split"] in wanted:
            entries.append((record, captions))
    return build_caption_set(path, path.stem, split, entries, images_dir)


def _karpathy_image_dir(path: Path, data: dict) -> Path:
    """The folder of the first images among the JSON's folder and :data:`KARPATHY_IMAGE_DIRS` below it."""
    first = [img for img in data["images"][:SAMPLE] if isinstance(img, dict) and isinstance(img.get("filename"), str)]
    probe = {"images": [{"file_name": str(Path(img.get("filepath") or "") / img["filename"])} for img in first
                        if isinstance(img.get("filepath") or "", str)]}
    return pick_image_dir(probe, path.parent, *(path.parent / d for d in KARPATHY_IMAGE_DIRS))


def _parse_karpathy_image(path: Path, i: int, img: Any, images_dir: Path) -> tuple[ImageRecord, list[str]]:
    if not isinstance(img, dict):
        raise DataError(f"{path}: images[{i}] is not an object")
    for key in ("filename", "split", "sentences"):
        if key not in img:
            raise DataError(f"{path}: images[{i}] has no '{key}'")
    image_id = img.get("cocoid", img.get("imgid"))
    if image_id is None:
        raise DataError(f"{path}: images[{i}] has no 'cocoid' or 'imgid'")
    if not _is_int(image_id):
        raise DataError(f"{path}: images[{i}] has a non-integer id {_short(image_id)}")
    if not isinstance(img["filename"], str) or not img["filename"]:
        raise DataError(f"{path}: images[{i}] has an invalid filename {_short(img['filename'])}")
    if not isinstance(img["split"], str):
        raise DataError(f"{path}: images[{i}] has a split that is not a string: {_short(img['split'])}")
    filepath = img.get("filepath")
    if filepath is not None and not isinstance(filepath, str):
        raise DataError(f"{path}: images[{i}] has a filepath that is not a string: {_short(filepath)}")
    if not isinstance(img["sentences"], list):
        raise DataError(f"{path}: images[{i}] has 'sentences' that is not a list")
    captions = []
    for j, sentence in enumerate(img["sentences"]):
        raw = sentence.get("raw") if isinstance(sentence, dict) else None
        tokens = sentence.get("tokens") if isinstance(sentence, dict) else None
        if isinstance(raw, str):
            captions.append(raw)
        elif isinstance(tokens, list) and all(isinstance(t, str) for t in tokens):
            captions.append(" ".join(tokens))
        else:
            raise DataError(f"{path}: images[{i}] sentence {j} has no 'raw' text or 'tokens' list")
    folder = images_dir / filepath if filepath else images_dir
    record = ImageRecord(image_id=image_id, file_name=img["filename"], path=folder / img["filename"])
    return record, captions


# ----------------------------------------------------------------------------- the official Flickr8k distribution

_flickr8k_log = logging.getLogger("captioner.data.flickr8k")  # Flickr8k's notes, apart for log filters

FLICKR8K_NAME = "flickr8k"
FLICKR8K_TOKEN_FILE = "Flickr8k.token.txt"
FLICKR8K_SPLIT_FILES = {"train": "Flickr_8k.trainImages.txt", "dev": "Flickr_8k.devImages.txt",
               "test": "Flickr_8k.testImages.txt"}
FLICKR8K_ALIASES = {"val": "dev"}
FLICKR8K_TEXT_DIRS = ("Flickr8k_text", "Flickr8k_text/Flickr8k_text", ".")
FLICKR8K_IMAGE_DIRS = ("Flicker8k_Dataset", "Flickr8k_Dataset", "Flickr8k_Dataset/Flicker8k_Dataset",
              "Flicker8k_Dataset/Flicker8k_Dataset", "Images", "images", ".")
_FLICKR8K_KEY = re.compile(r"^(?P<name>.+)#(?P<n>\d+)$")


@dataclass
class TokenFile:
    """The parsed caption file: ``captions[image name]``, names in first-seen order."""

    captions: dict[str, list[str]] = field(default_factory=dict)
    malformed: int = 0  # lines skipped as malformed.  first_malformed: ``(line number, text)`` of the first
    first_malformed: tuple[int, str] | None = None
    duplicates: int = 0  # captions dropped because the same image already had that exact caption


def _text_lines(path: Path, what: str) -> list[str]:
    """The lines of a text file (any line ends, BOM dropped); a missing file is a one-line DataError."""
    if not path.is_symlink() and not path.exists():
        raise DataError(f"{path}: file not found ({what})")
    data = read_bytes(path, MAX_ANNOTATION_BYTES, DataError, what)  # regular files only, bounded
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    return text.replace("\r\n", "\n").replace("\r", "\n").split("\n")


def parse_token_lines(lines: list[str]) -> TokenFile:
    """Parse ``NAME#n<TAB>caption`` lines (see the module docstring for what is skipped)."""
    out = TokenFile()
    seen: dict[str, set[str]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        key, tab, caption = line.partition("\t")
        match = _FLICKR8K_KEY.match(key.strip())
        caption = " ".join(caption.split())
        if not tab or match is None or not caption:
            out.malformed += 1
            if out.first_malformed is None:
                out.first_malformed = (number, line)
            continue
        name = match["name"].strip()
        if caption in seen.setdefault(name, set()):
            out.duplicates += 1
            continue
        seen[name].add(caption)
        out.captions.setdefault(name, []).append(caption)
    return out


def read_token_file(path: Path) -> TokenFile:
    """Parse ``Flickr8k.token.txt``, warning once about malformed lines."""
    parsed = parse_token_lines(_text_lines(path, "the Flickr8k caption file"))
    if parsed.first_malformed is not None:
        number, text = parsed.first_malformed
        shown = text if len(text) <= 80 else text[:77] + "..."
        _flickr8k_log.warning("%s: skipped %d malformed line(s) (no tab, no #n suffix or empty caption); "
                              "first: line %d: %r", path, parsed.malformed, number, shown)
    if parsed.duplicates:
        _flickr8k_log.info("%s: dropped %d duplicate caption line(s)", path, parsed.duplicates)
    if not parsed.captions:
        raise DataError(f"{path}: no 'NAME.jpg#n<TAB>caption' line")
    return parsed


def read_split_list(path: Path, split: str) -> list[str]:
    """Image names of one split list (blank lines and repeats dropped, order kept)."""
    names = [line.strip() for line in _text_lines(path, f"the Flickr8k {split!r} split list")]
    return list(dict.fromkeys(n for n in names if n))


def flickr8k_text_dir(root: Path) -> Path | None:
    """The first of :data:`FLICKR8K_TEXT_DIRS` under ``root`` holding the token file or a split list."""
    for rel in FLICKR8K_TEXT_DIRS:
        folder = root / rel if rel != "." else root
        if (folder / FLICKR8K_TOKEN_FILE).is_file() \
                or any((folder / f).is_file() for f in FLICKR8K_SPLIT_FILES.values()):
            return folder
    return None


def is_flickr8k(root: Path) -> bool:
    """True when ``root`` is a folder with the official Flickr8k text files or image folder."""
    if not root.is_dir():
        return False
    return flickr8k_text_dir(root) is not None or any((root / d).is_dir() for d in FLICKR8K_IMAGE_DIRS[:2])


def load_flickr8k(root: Path, split: str, images_dir: Path | None = None) -> CaptionSet:
    """One split (``train``, ``dev``/``val``, ``test``, ``all``) of the official Flickr8k layout, named ``flickr8k``."""
    split = FLICKR8K_ALIASES.get(split, split)
    if split not in (*FLICKR8K_SPLIT_FILES, ALL_SPLIT):
        raise UnknownSplitError(f"{root}: unknown split {split!r}; available: "
                                f"{', '.join([*FLICKR8K_SPLIT_FILES, ALL_SPLIT])} (val = dev)")
    folder = flickr8k_text_dir(root) or root / FLICKR8K_TEXT_DIRS[0]
    if split == ALL_SPLIT:
        present = [s for s in FLICKR8K_SPLIT_FILES if (folder / FLICKR8K_SPLIT_FILES[s]).is_file()] or ["train"]
        names = list(dict.fromkeys(n for s in present for n in read_split_list(folder / FLICKR8K_SPLIT_FILES[s], s)))
    else:
        names = read_split_list(folder / FLICKR8K_SPLIT_FILES[split], split)
    if not names:
        raise DataError(f"{folder / FLICKR8K_SPLIT_FILES.get(split, FLICKR8K_SPLIT_FILES['train'])}: lists no image")
    token_path = folder / FLICKR8K_TOKEN_FILE
    parsed = read_token_file(token_path)
    ids = {name: i for i, name in enumerate(parsed.captions, start=1)}
    for name in names:  # listed but never captioned: build_caption_set skips them with a warning
        ids.setdefault(name, len(ids) + 1)
    if images_dir is None:
        probe = {"images": [{"file_name": n} for n in names[:8]]}
        images_dir = pick_image_dir(probe, *[root / d if d != "." else root for d in FLICKR8K_IMAGE_DIRS])
    entries = [(ImageRecord(image_id=ids[name], file_name=name, path=images_dir / name),
                parsed.captions.get(name, [])) for name in names]
    return build_caption_set(token_path, FLICKR8K_NAME, split, entries, images_dir)


# ----------------------------------------------------------------------------- COCO format
def coco_index(data: dict, with_categories: bool = False) -> Any:
    """A quiet ``pycocotools.coco.COCO`` index over a validated dict (only ``images``, ``annotations``, ``categories``)."""
    from pycocotools.coco import COCO

    keys = ("images", "annotations", "categories") if with_categories else ("images", "annotations")
    with contextlib.redirect_stdout(io.StringIO()):  # COCO prints progress lines
        coco = COCO()
        coco.dataset = {k: data[k] for k in keys if k in data}
        coco.createIndex()
    return coco


def validate_coco(path: Path, data: Any, ann_keys: Sequence[str] = ("id", "image_id", "caption")) -> None:
    """Check the structure of a COCO-format annotation dict; DataError names the first bad entry."""
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object with 'images' and 'annotations'")
    for key in ("images", "annotations"):
        if not isinstance(data.get(key), list):
            raise DataError(f"{path}: no '{key}' list")
    ids: set[int] = set()
    for i, img in enumerate(data["images"]):
        if not isinstance(img, dict):
            raise DataError(f"{path}: image {i} is not an object")
        for key in ("id", "file_name"):
            if key not in img:
                raise DataError(f"{path}: image {i} has no '{key}'")
        if not _is_int(img["id"]):
            raise DataError(f"{path}: image {i} has a non-integer id {_short(img['id'])}")
        if not isinstance(img["file_name"], str) or not img["file_name"]:
            raise DataError(f"{path}: image {i} has an invalid file_name {_short(img['file_name'])}")
        if img["id"] in ids:
            raise DataError(f"{path}: image {i} repeats image id {img['id']}")
        ids.add(img["id"])
    for j, ann in enumerate(data["annotations"]):
        if not isinstance(ann, dict):
            raise DataError(f"{path}: annotation {j} is not an object")
        for key in ann_keys:
            if key not in ann:
                raise DataError(f"{path}: annotation {j} has no '{key}'")
        if not (_is_int(ann["id"]) or isinstance(ann["id"], str)):
            raise DataError(f"{path}: annotation {j} has an id that is not an integer: {_short(ann['id'])}")
        if "caption" in ann_keys and not isinstance(ann["caption"], str):
            raise DataError(f"{path}: annotation {j} has a caption that is not a string")
        if not _is_int(ann["image_id"]) or ann["image_id"] not in ids:
            raise DataError(f"{path}: annotation {j} refers to unknown image id {_short(ann['image_id'])}")


def caption_set_from_coco(path: Path, data: Any, split: str, images_dir: Path, name: str,
                          keep: Callable[[dict], bool] | None = None) -> CaptionSet:
    """Validate a COCO captions dict and build the caption set of the images ``keep`` accepts."""
    validate_coco(path, data)
    coco = coco_index(data)
    entries = []
    for img in coco.dataset["images"]:
        if keep is not None and not keep(img):
            continue
        record = ImageRecord(
            image_id=img["id"], file_name=img["file_name"], path=images_dir / img["file_name"],
            width=img.get("width") if _is_int(img.get("width")) else None,
            height=img.get("height") if _is_int(img.get("height")) else None,
        )
        entries.append((record, [ann["caption"] for ann in coco.imgToAnns.get(img["id"], [])]))
    return build_caption_set(path, name, split, entries, images_dir)


# ----------------------------------------------------------------------------- boxes
def load_instances(root: str | Path, split: str, images_dir: str | Path | None = None) -> InstanceBoxes | None:
    """Object boxes from ``instances_<split>.json`` (in ``root``, ``root/annotations`` or beside a captions file).

    Returns ``{image_id: [ObjectBox, ...]}`` with ``.categories``, or ``None`` without an instances file.
    ``images_dir`` is accepted for symmetry with :func:`load_caption_set`.
    """
    del images_dir
    root = Path(root)
    if root.is_file():
        stem = root.stem.replace("captions_", "instances_", 1)
        candidates = [root.parent / f"instances_{split}.json", root.parent / f"{stem}.json"]
    else:
        candidates = [root / f"instances_{split}.json", root / "annotations" / f"instances_{split}.json"]
    path = next((c for c in candidates if c.is_file()), None)
    if path is None:
        return None
    data = read_annotations(path)
    validate_coco(path, data, ann_keys=("id", "image_id", "category_id", "bbox"))
    categories = data.get("categories")
    if not isinstance(categories, list) or not all(isinstance(c, dict) and _is_int(c.get("id")) and "name" in c
                                                   for c in categories):
        raise DataError(f"{path}: no valid 'categories' list (each needs an integer 'id' and a 'name')")
    names = {c["id"]: str(c["name"]) for c in categories}
    for j, ann in enumerate(data["annotations"]):
        if not _is_int(ann["category_id"]) or ann["category_id"] not in names:
            raise DataError(f"{path}: annotation {j} has unknown category_id {_short(ann['category_id'])}")
        box = ann["bbox"]
        if not (isinstance(box, list) and len(box) == 4
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box)):
            raise DataError(f"{path}: annotation {j} has an invalid bbox {_short(box)} (need [x, y, w, h])")
    coco = coco_index(data, with_categories=True)
    boxes = InstanceBoxes(categories=list(dict.fromkeys(names.values())), unseen_pairs=_unseen_pairs(path, data))
    for image_id in coco.imgs:
        boxes[image_id] = [
            ObjectBox(names[ann["category_id"]], tuple(float(v) for v in ann["bbox"]),
                      {k: v for k, v in ann.items() if k not in _BOX_KEYS})
            for ann in coco.imgToAnns.get(image_id, [])
        ]
    return boxes


def _unseen_pairs(path: Path, data: dict) -> list[tuple[str, str]]:
    """``info.unseen_pairs`` of a compositional scenes split: ``[[colour, shape], ...]`` (else empty)."""
    info = data.get("info")
    pairs = info.get("unseen_pairs", []) if isinstance(info, dict) else []
    if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(v, str) for v in p)
                                              for p in pairs):
        raise DataError(f"{path}: info.unseen_pairs must be a list of [colour, shape] pairs, got {_short(pairs)}")
    return [(c, s) for c, s in pairs]
