"""Karpathy split files (``dataset_coco.json``, ``dataset_flickr8k.json``, ``dataset_flickr30k.json``).

Format: ``{"images": [{"filepath"?, "filename", "split", "cocoid" | "imgid",
"sentences": [{"raw", "tokens"}, ...]}, ...]}``. Splits are ``train``, ``val``, ``test`` and (COCO)
``restval``; by default ``train`` includes ``restval``, the usual 113k-image training set.
Images are found at ``images_dir/filepath/filename`` (``filepath`` is optional). ``images_dir``
defaults to the first of the JSON file's folder and its ``Flicker8k_Dataset/``, ``Flickr8k_Dataset/``,
``images/`` and ``Images/`` subfolders that holds the first images (the JSON's folder when none does),
so ``dataset_flickr8k.json`` placed beside the official Flickr8k folders finds its images.
``dev`` is an alias of ``val`` (the Flickr8k distribution calls it dev), so the same commands work
on both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from captioner.data.caption_set import CaptionSet, ImageRecord, _is_int, _short, build_caption_set
from captioner.data.caption_set import SAMPLE, pick_image_dir
from captioner.errors import DataError

RESTVAL = "restval"
ALIASES = {"dev": "val"}
IMAGE_SUBDIRS = ("Flicker8k_Dataset", "Flickr8k_Dataset", "images", "Images")


def is_karpathy(data: Any) -> bool:
    """True for a parsed Karpathy split file (``images`` entries carry ``sentences``, no ``annotations``)."""
    if not isinstance(data, dict) or "annotations" in data or not isinstance(data.get("images"), list):
        return False
    first = data["images"][0] if data["images"] else None
    return isinstance(first, dict) and "sentences" in first


def karpathy_splits(data: dict) -> list[str]:
    """Split names present in a Karpathy file, in first-seen order."""
    return list(dict.fromkeys(str(img.get("split")) for img in data["images"] if isinstance(img, dict)))


def caption_set_from_karpathy(
    path: Path, data: dict, split: str, images_dir: Path | None = None, include_restval: bool = True
) -> CaptionSet:
    """Validate a parsed Karpathy file and build the caption set of one split.

    Args:
        path: the JSON file (for messages and the default image folder).
        data: its parsed content.
        split: ``train``, ``val`` (or ``dev``), ``test``, ``restval`` or ``all``.
        images_dir: image folder; ``filepath`` entries are joined below it (default: see the module).
        include_restval: ``train`` also takes the ``restval`` images.
    """
    available = karpathy_splits(data)
    if split in ALIASES and split not in available and ALIASES[split] in available:
        split = ALIASES[split]
    if split not in available + ["all"]:
        raise DataError(f"{path}: unknown split {split!r}; available: {', '.join(available + ['all'])}")
    wanted = {split}
    if split == "train" and include_restval:
        wanted.add(RESTVAL)
    if images_dir is None:
        images_dir = _image_dir(path, data)

    entries: list[tuple[ImageRecord, list[str]]] = []
    seen: set[int] = set()
    for i, img in enumerate(data["images"]):
        record, captions = _parse_image(path, i, img, images_dir)
        if record.image_id in seen:
            raise DataError(f"{path}: images[{i}] repeats image id {record.image_id}")
        seen.add(record.image_id)
        if split == "all" or img["split"] in wanted:
            entries.append((record, captions))
    return build_caption_set(path, path.stem, split, entries, images_dir)


def _image_dir(path: Path, data: dict) -> Path:
    """The folder of the first images among the JSON's folder and :data:`IMAGE_SUBDIRS` below it."""
    first = [img for img in data["images"][:SAMPLE] if isinstance(img, dict) and isinstance(img.get("filename"), str)]
    probe = {"images": [{"file_name": str(Path(img.get("filepath") or "") / img["filename"])} for img in first
                        if isinstance(img.get("filepath") or "", str)]}
    return pick_image_dir(probe, path.parent, *(path.parent / d for d in IMAGE_SUBDIRS))


def _parse_image(path: Path, i: int, img: Any, images_dir: Path) -> tuple[ImageRecord, list[str]]:
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
