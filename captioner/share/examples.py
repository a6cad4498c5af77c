"""The example pictures offered on the ``captioner serve`` page, chosen by what the models were trained on.

Photos: the package's example photos (:data:`captioner.pretrained.PHOTOS`), or ``--examples DIR``
(image files in DIR, each checked like an upload). Synthetic scenes drawn by
:mod:`captioner.data.shapes` from fixed seeds (made on start-up, so no image file with someone
else's licence ships in the package) are offered only to a model trained on such scenes: one whose
vocabulary is the scenes' own words (:func:`reads_scenes`). A photo is served as its file's own
bytes, so the page captions exactly what ``captioner caption FILE`` does.
"""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from captioner.data.images import load_image
from captioner.data.shapes import COLORS, SHAPES, SIZES, render_scene, sample_scene, scene_captions
from captioner.errors import DataError, ImageLoadError
from captioner.files import MiB, read_bytes
from captioner.text import tokenize

__all__ = ["Example", "default_examples", "example_scenes", "folder_examples", "reads_scenes"]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
MAX_EXAMPLES = 12
MAX_EXAMPLE_BYTES = 16 * MiB  # a larger example file is re-encoded (a JPEG of at most 2048 px)
SCENE_SHARE = 0.9  # a vocabulary this much made of the scenes' words is a scenes model's
MEDIA_TYPES = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp", "BMP": "image/bmp"}


@dataclass(frozen=True)
class Example:
    """One example picture: its name on the page, its file name, and its bytes with their media type."""

    name: str
    data: bytes
    media_type: str
    filename: str = ""

    def info(self) -> dict:
        """What the page is told: the name shown and the file name an upload of it carries."""
        ext = {"image/png": ".png", "image/webp": ".webp", "image/bmp": ".bmp"}.get(self.media_type, ".jpg")
        return {"name": self.name, "file": self.filename or self.name.replace(" ", "_") + ext}


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
        out.append(Example(f"scene {i + 1}", _png(image), "image/png", f"scene_{i + 1}.png"))
    return out


@functools.lru_cache(maxsize=1)
def scene_words() -> frozenset[str]:
    """Every word the synthetic scenes' captions use (their colours, shapes, sizes and templates)."""
    rng = np.random.default_rng(0)
    words = set(COLORS) | set(SHAPES) | set(SIZES)
    for _ in range(60):
        for caption in scene_captions(sample_scene(rng, 128)):
            words.update(tokenize(caption))
    return frozenset(words)


def reads_scenes(words: Iterable[str]) -> bool:
    """Whether a model with vocabulary ``words`` (special tokens left out) was trained on synthetic scenes:
    at least :data:`SCENE_SHARE` of its words are the scenes' words."""
    words = [w for w in words if not (w.startswith("<") and w.endswith(">"))]
    return bool(words) and sum(w in scene_words() for w in words) >= SCENE_SHARE * len(words)


def _example_file(path: Path) -> Example:
    """``path`` as an example: its own bytes when small enough, else a JPEG of it at most 2048 px."""
    image = load_image(path)  # ImageLoadError names the file
    if path.stat().st_size <= MAX_EXAMPLE_BYTES:
        data = read_bytes(path, MAX_EXAMPLE_BYTES, ImageLoadError)
        with Image.open(io.BytesIO(data)) as opened:
            kind = MEDIA_TYPES.get(opened.format or "")
        if kind is not None:
            return Example(path.stem, data, kind, path.name)
    image.thumbnail((2048, 2048))
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=92)
    return Example(path.stem, buf.getvalue(), "image/jpeg", path.stem + ".jpg")


def folder_examples(folder: str | os.PathLike) -> list[Example]:
    """The image files of ``folder`` (sorted, at most :data:`MAX_EXAMPLES`), as they are on disk.

    Raises:
        DataError: not a folder, no readable image in it, or a file that is not a readable image.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: --examples must be a folder of images")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)[:MAX_EXAMPLES]
    out = [_example_file(path) for path in files]
    if not out:
        raise ImageLoadError(f"{folder}: no images ({', '.join(IMAGE_SUFFIXES)}) in the --examples folder")
    return out


def default_examples(vocabularies: Iterable[Iterable[str]], photos: str | os.PathLike) -> list[Example]:
    """The examples for models with these vocabularies: the photos in ``photos`` when any model reads
    photos, the synthetic scenes when any was trained on them (both, for a mix)."""
    scenes = [reads_scenes(words) for words in vocabularies]
    out = folder_examples(photos) if not all(scenes) else []
    return out + (example_scenes() if any(scenes) else [])
