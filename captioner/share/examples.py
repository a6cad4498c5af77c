"""The example pictures offered on the ``captioner serve`` page.

Built in: a few synthetic scenes drawn by :mod:`captioner.data.shapes` from fixed seeds (made on
start-up, so no image file with someone else's licence ships in the package); ``--examples DIR``
adds the user's own photos (image files in DIR, each checked like an upload).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from captioner.data.images import load_image
from captioner.data.shapes import render_scene, sample_scene
from captioner.errors import DataError, ImageLoadError

__all__ = ["Example", "example_scenes", "folder_examples"]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
MAX_EXAMPLES = 12


@dataclass(frozen=True)
class Example:
    """One example picture: its name on the page and its PNG or JPEG bytes."""

    name: str
    data: bytes
    media_type: str


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def example_scenes(count: int = 3, size: int = 256, seed: int = 7) -> list[Example]:
    """``count`` synthetic scenes (1-3 coloured shapes), the same on every start."""
    out = []
    for i in range(count):
        rng = np.random.default_rng(seed + i)
        image = render_scene(rng, sample_scene(rng, size), size)
        out.append(Example(f"scene {i + 1}", _png(image), "image/png"))
    return out


def folder_examples(folder: str | os.PathLike) -> list[Example]:
    """The image files of ``folder`` (sorted, at most :data:`MAX_EXAMPLES`), re-encoded as JPEG.

    Raises:
        DataError: not a folder, no readable image in it, or a file that is not a readable image.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: --examples must be a folder of images")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)[:MAX_EXAMPLES]
    out = []
    for path in files:
        image = load_image(path)  # ImageLoadError names the file
        image.thumbnail((1024, 1024))
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=90)
        out.append(Example(path.stem, buf.getvalue(), "image/jpeg"))
    if not out:
        raise ImageLoadError(f"{folder}: no images ({', '.join(IMAGE_SUFFIXES)}) in the --examples folder")
    return out
