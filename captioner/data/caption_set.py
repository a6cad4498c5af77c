"""The in-memory caption set every layout loads into, its records, and the image-file checks.

``build_caption_set`` is the one place where empty captions and uncaptioned images are dropped.
:func:`pick_image_dir` picks the first of a layout's folders holding one of the first images the
annotations name; :func:`check_images` reports missing files before anything trains.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from captioner.data.images import DEFAULT_MAX_PIXELS, probe_image
from captioner.errors import DataError, ImageLoadError
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
    """The image folder of a COCO captions dict: the first of ``candidates`` holding one of its first files.

    Else the first existing one, else the first (``check_images`` then reports the missing files).
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
        """``(width, height)``: the annotation's, else from the file's header; ``ImageLoadError`` naming it."""
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
    """``{image_id: [ObjectBox, ...]}`` plus all the file's ``categories`` and the scenes' ``unseen_pairs``."""

    def __init__(self, boxes: Any = (), categories: Sequence[str] = (),
                 unseen_pairs: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(boxes)
        self.categories = list(categories)
        self.unseen_pairs = [tuple(p) for p in unseen_pairs]


@dataclass
class CaptionSet:
    """Images of one split (``len(cs)``) and their reference captions (raw text, whitespace-normalised)."""

    name: str
    split: str
    images: list[ImageRecord]
    captions: dict[int, list[str]]
    root: Path
    images_dir: Path | None = None  # where image files were looked for (for messages)
    source: Path | None = None  # the caption file the set was read from (for messages)

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


def build_caption_set(source: Path, name: str, split: str, entries: list[tuple[ImageRecord, list[str]]],
                      images_dir: Path) -> CaptionSet:
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
                      images_dir=images_dir, source=source)


OUTSIDE_OPTION = "data.files_outside=true"  # the setting that lets a caption file name images outside its folder


def confine(cs: CaptionSet) -> CaptionSet:
    """``cs`` when every image path stays inside its image folder, else one ``DataError`` line naming the
    caption file and the first entry that leaves it (``../../etc/passwd``, an absolute path).

    Checked on the names as written (no file is opened): a downloaded dataset cannot make training or
    evaluation read any other image file of the user's. A folder reached through a symbolic link the user
    made inside the dataset stays allowed.
    """
    if cs.images_dir is None:
        return cs
    base = os.path.normpath(os.path.abspath(cs.images_dir))
    inside = base.rstrip(os.sep) + os.sep
    for record in cs.images:
        path = os.path.normpath(os.path.abspath(record.path))
        if not path.startswith(inside):
            how = "an absolute path" if os.path.isabs(record.file_name) else "it leaves the folder"
            raise DataError(f"{cs.source or cs.root}: image {record.image_id}'s file {_short(record.file_name, 80)} is "
                            f"outside the dataset's image folder {cs.images_dir} ({how}); it is not read unless "
                            f"allowed ({OUTSIDE_OPTION}; evaluate: --files-outside)")
    return cs


log = logging.getLogger(__name__)

__all__ = ["check_images"]


def check_images(cs: CaptionSet, skip_missing: bool = False, check_headers: bool = True,
                 max_pixels: int | None = None, workers: int = 8) -> CaptionSet:
    """Find missing and unreadable image files before training.

    With ``check_headers`` each header must parse as an image of at most ``max_pixels`` (threaded, no
    decoding), so empty, mislabelled and bomb files are found here. ``skip_missing``: return a copy
    without them (logged). Returns ``cs`` when all are fine. Raises ``DataError`` when some are bad and
    ``skip_missing`` is off, or all are.
    """
    missing = [i for i, r in enumerate(cs.images) if not r.path.is_file()]
    where = cs.images_dir if cs.images_dir is not None else (cs.images[0].path.parent if cs.images else cs.root)
    total = len(cs.images)
    if missing:
        examples = ", ".join(cs.images[i].file_name for i in missing[:3])
        if len(missing) == total:
            raise DataError(all_missing_message(total, examples, where))
        if not skip_missing:
            raise DataError(f"{len(missing)} of {total} image files are missing (e.g. {examples}) under {where}; "
                            "pass --skip-missing to skip them")
        log.warning("skipping %d of %d images whose files are missing (e.g. %s) under %s",
                    len(missing), total, examples, where)
    gone = set(missing)
    bad: list[tuple[int, str]] = []
    if check_headers:
        bad = _unreadable([i for i in range(total) if i not in gone], cs, max_pixels, workers)
    if bad:
        examples = "; ".join(f"{cs.images[i].file_name}: {reason}" for i, reason in bad[:3])
        if len(bad) + len(gone) == total:
            raise DataError(f"none of the {total} image files can be read (e.g. {examples}) under {where}")
        if not skip_missing:
            raise DataError(f"{len(bad)} of {total} image files cannot be read (e.g. {examples}) under {where}; "
                            "pass --skip-missing to skip them")
        log.warning("skipping %d of %d images whose files cannot be read (e.g. %s) under %s",
                    len(bad), total, examples, where)
        gone |= {i for i, _ in bad}
    if not gone:
        return cs
    return cs.subset([i for i in range(total) if i not in gone])


def _unreadable(indices: list[int], cs: CaptionSet, max_pixels: int | None, workers: int) -> list[tuple[int, str]]:
    """``(index, reason)`` of the images whose header does not parse (reason without the path)."""
    from concurrent.futures import ThreadPoolExecutor


    limit = DEFAULT_MAX_PIXELS if max_pixels is None else max_pixels

    def probe(i: int) -> str | None:
        path = cs.images[i].path
        try:
            probe_image(path, max_pixels=limit)
        except ImageLoadError as exc:
            text = str(exc)
            prefix = f"{path}: "
            return text[len(prefix):] if text.startswith(prefix) else text
        return None

    if len(indices) < 64 or workers <= 1:
        reasons = [probe(i) for i in indices]
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            reasons = list(pool.map(probe, indices, chunksize=64))
    return [(i, r) for i, r in zip(indices, reasons) if r is not None]
