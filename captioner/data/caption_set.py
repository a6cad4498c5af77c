"""The in-memory caption set every layout loads into (``coco.load_caption_set``), and its records.

``CaptionSet`` holds one split's images and their reference captions; ``build_caption_set`` is
the one place where empty captions and uncaptioned images are dropped, whatever the layout.

Where a caption dataset's image files are, and what to say when they are nowhere.

Each layout of ``captioner.data.coco`` has a few folders its images may be in. The folder chosen
is the first one holding one of the first image files the annotations name, so a dataset whose
``images/`` folder exists but whose pictures sit in ``train/`` and ``val/`` still loads. When no
candidate holds any of them, the first existing folder is chosen and ``check_images`` reports the
missing files with :data:`LAYOUTS_HINT`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from captioner.data.images import probe_image
from captioner.errors import DataError
from captioner.text import tokenize

log = logging.getLogger(__name__)


SAMPLE = 8  # image files probed per candidate folder

LAYOUTS_HINT = (
    "the layouts that load keep images in images/, <split>/ or the dataset folder beside captions_<split>.json; "
    "in <split>/ or images/<split>/ beside annotations/; in images/ beside captions_coco_format.json; at "
    "<filepath>/<filename> beside a Karpathy dataset_*.json; in Flicker8k_Dataset/ beside Flickr8k_text/; "
    "otherwise point at the image folder: --set data.images=DIR (train), --images DIR (evaluate)"
)


def _first_names(data: Any) -> list[str]:
    """Up to ``SAMPLE`` image file names of a COCO dict (not validated yet: odd entries are ignored)."""
    images = data.get("images") if isinstance(data, dict) else None
    if not isinstance(images, list):
        return []
    return [img["file_name"] for img in images[:SAMPLE]
            if isinstance(img, dict) and isinstance(img.get("file_name"), str) and img["file_name"]]


def pick_image_dir(data: Any, *candidates: Path) -> Path:
    """The image folder of a COCO captions dict, among ``candidates`` (in order of preference).

    Args:
        data: the parsed captions file; its first image file names are looked for.
        *candidates: folders where the layout allows the images to be.

    Returns:
        The first candidate holding one of those files; else the first existing folder; else the
        first candidate (the missing files are reported by ``check_images``).
    """
    names = _first_names(data)
    for folder in candidates:
        if any((folder / name).is_file() for name in names):
            return folder
    return next((c for c in candidates if c.is_dir()), candidates[0])


def all_missing_message(total: int, examples: str, where: Path) -> str:
    """One line for a caption set none of whose image files exist."""
    return f"all {total} image files are missing (e.g. {examples}) under {where}; {LAYOUTS_HINT}"


@dataclass(frozen=True)
class ImageRecord:
    """One image of a caption set: its dataset id, file name and resolved path."""

    image_id: int
    file_name: str
    path: Path
    width: int | None = None
    height: int | None = None

    def size(self) -> tuple[int, int]:
        """``(width, height)``: the annotation's, else read from the file's header (no pixel decoding).

        Raises:
            ImageLoadError: the file is missing, unreadable or not an image (one line naming it).
        """
        if self.width and self.height:
            return int(self.width), int(self.height)
        return probe_image(self.path)


@dataclass(frozen=True)
class ObjectBox:
    """One annotated object: category name, ``(x, y, w, h)`` box in original pixels, extra keys."""

    category: str
    bbox: tuple[float, float, float, float]
    attributes: dict[str, Any] = field(default_factory=dict)


class InstanceBoxes(dict):
    """``{image_id: [ObjectBox, ...]}`` plus ``categories``: every name in the file's ``categories``
    list, in file order (also those no box of the split uses), so words can be matched to them; and
    ``unseen_pairs``: the (colour, shape) pairs a compositional split of the scenes kept out of
    training (``info.unseen_pairs``; empty otherwise)."""

    def __init__(self, boxes: Any = (), categories: Sequence[str] = (),
                 unseen_pairs: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(boxes)
        self.categories = list(categories)
        self.unseen_pairs = [tuple(p) for p in unseen_pairs]


@dataclass
class CaptionSet:
    """Images of one split and their reference captions (raw text, whitespace-normalised).

    ``len(cs)`` is the number of images; dataset items refer to images by their index in
    ``cs.images``.
    """

    name: str
    split: str
    images: list[ImageRecord]
    captions: dict[int, list[str]]
    root: Path
    images_dir: Path | None = None  # where image files were looked for (for messages)

    def __len__(self) -> int:
        return len(self.images)

    @property
    def num_captions(self) -> int:
        return sum(len(self.captions[r.image_id]) for r in self.images)

    def all_captions(self) -> list[str]:
        """Every caption of every image, in image order (e.g. to build a vocabulary)."""
        return [c for r in self.images for c in self.captions[r.image_id]]

    def references(self, image_id: int) -> list[str]:
        """All reference captions of one image."""
        return list(self.captions[image_id])

    def subset(self, indices: Sequence[int]) -> "CaptionSet":
        """A copy holding only ``cs.images[i]`` for ``i`` in ``indices`` (in that order)."""
        images = [self.images[i] for i in indices]
        captions = {r.image_id: list(self.captions[r.image_id]) for r in images}
        return dataclasses.replace(self, images=images, captions=captions)

    def __repr__(self) -> str:
        return (f"CaptionSet(name={self.name!r}, split={self.split!r}, images={len(self)}, "
                f"captions={self.num_captions})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any, limit: int = 40) -> str:
    """``repr`` cut to ``limit`` characters (messages stay one short line whatever the file holds)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def build_caption_set(
    source: Path, name: str, split: str, entries: list[tuple[ImageRecord, list[str]]], images_dir: Path
) -> CaptionSet:
    """Drop empty captions and uncaptioned images (with a warning); DataError when nothing is left."""
    images: list[ImageRecord] = []
    captions: dict[int, list[str]] = {}
    empty = uncaptioned = 0
    for record, raw in entries:
        texts = [" ".join(c.split()) for c in raw]
        kept = [t for t in texts if tokenize(t)]
        empty += len(texts) - len(kept)
        if not kept:
            uncaptioned += 1
            continue
        images.append(record)
        captions[record.image_id] = kept
    if empty:
        log.warning("%s: dropped %d empty caption(s)", source, empty)
    if uncaptioned:
        log.warning("%s: skipped %d image(s) without captions in split %r", source, uncaptioned, split)
    if not images:
        raise DataError(f"{source}: split {split!r} has no captioned images")
    return CaptionSet(name=name, split=split, images=images, captions=captions, root=source.parent,
                      images_dir=images_dir)
