"""Where a caption dataset's image files are, and what to say when they are nowhere.

Each layout of ``captioner.data.coco`` has a few folders its images may be in. The folder chosen
is the first one holding one of the first image files the annotations name, so a dataset whose
``images/`` folder exists but whose pictures sit in ``train/`` and ``val/`` still loads. When no
candidate holds any of them, the first existing folder is chosen and ``check_images`` reports the
missing files with :data:`LAYOUTS_HINT`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
