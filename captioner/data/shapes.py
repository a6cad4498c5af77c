"""Synthetic scenes: coloured shapes on textured backgrounds, captioned from their geometry.

``make_shapes(out)`` writes a small COCO-format dataset a model learns in minutes, with known boxes:
``images/NNNNN.png`` (1-3 objects of distinct :data:`SHAPES`, :data:`COLORS` and :data:`SIZES`),
``captions_{train,val,test}.json`` (5 per image) and ``instances_{train,val,test}.json`` (boxes
with ``color`` and ``size``). ``unseen_pairs=K`` keeps K colour-shape pairs out of train and val.
Captions are deterministic (all 5 templates of the object count; objects left to right); scenes
whose order or relation would be ambiguous are never drawn. Same seed, byte-identical files.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from captioner.errors import ConfigError, DataError
from captioner.files import Outputs, atomic_write, writable_folder

log = logging.getLogger(__name__)

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (225, 35, 35),
    "yellow": (240, 220, 30),
    "green": (35, 175, 55),
    "cyan": (40, 205, 215),
    "blue": (35, 70, 225),
    "purple": (155, 50, 205),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond", "star", "cross")
SIZES: dict[str, float] = {"small": 0.19, "large": 0.34}  # nominal extent as a fraction of the image side
SPLITS: tuple[str, ...] = ("train", "val", "test")
CAPTIONS_PER_IMAGE = 5
MAX_IMAGES = 10_000_000  # make_shapes refuses more (and larger images): a request that could never finish
MAX_IMAGE_SIZE = 4096
MAX_UNSEEN_PAIRS = 18  # held-out colour-shape pairs of the compositional split (half of the 36)

_SIZE_JITTER = 0.06  # extents vary +-6% around the nominal size
_GAP = 0.04  # minimum empty space between two objects' boxes (fraction of the side)
_MIN_DX = 0.12  # three objects: left-to-right neighbours are at least this far apart in x
_DOMINANCE = 1.4  # a relation's axis offset is at least this many times the other axis offset
_MAX_TRIES = 4096  # candidate layouts per scene, drawn in batches of _BATCH
_BATCH = 64
_SUPERSAMPLE = 2  # shapes are drawn at 2x and box-filtered down (antialiased edges)


@dataclass(frozen=True)
class SceneObject:
    """One object of a scene; ``cx, cy, extent`` in pixels of the final image."""

    shape: str
    color: str
    size: str
    cx: float
    cy: float
    extent: float

    @property
    def phrase(self) -> str:
        return f"{self.size} {self.color} {self.shape}"


# ----------------------------------------------------------------------------- captions
def _relation(a: SceneObject, b: SceneObject) -> str:
    """Where ``a`` is relative to ``b``, from the dominant axis of the centre offset."""
    dx, dy = a.cx - b.cx, a.cy - b.cy
    if abs(dx) >= abs(dy):
        return "to the left of" if dx < 0 else "to the right of"
    return "above" if dy < 0 else "below"


def caption_order(objects: list[SceneObject]) -> list[SceneObject]:
    """Objects in caption order: left to right; a vertical pair of two goes top to bottom."""
    if len(objects) == 2:
        a, b = objects
        if abs(a.cx - b.cx) < abs(a.cy - b.cy):
            return sorted(objects, key=lambda o: o.cy)
    return sorted(objects, key=lambda o: o.cx)


def scene_captions(objects: list[SceneObject]) -> list[str]:
    """The 5 captions of a scene, one per template of the family for its object count."""
    objs = caption_order(objects)
    p = [o.phrase for o in objs]
    if len(objs) == 1:
        return [f"A {p[0]}.", f"There is a {p[0]}.", f"A picture of a {p[0]}.",
                f"One shape: a {p[0]}.", f"A single {p[0]}."]
    if len(objs) == 2:
        rel, inv = _relation(objs[0], objs[1]), _relation(objs[1], objs[0])
        return [f"A {p[0]} {rel} a {p[1]}.", f"A {p[1]} {inv} a {p[0]}.", f"There is a {p[0]} {rel} a {p[1]}.",
                f"A {p[0]} and a {p[1]}.", f"Two shapes: a {p[0]} and a {p[1]}."]
    if len(objs) == 3:
        rel = _relation(objs[0], objs[1])
        listing = f"a {p[0]}, a {p[1]} and a {p[2]}"
        return [f"A {p[0]}, a {p[1]} and a {p[2]}.", f"There is {listing}.", f"From left to right: {listing}.",
                f"A {p[0]} {rel} a {p[1]} and a {p[2]}.", f"Three shapes: {listing}."]
    raise ValueError(f"scenes hold 1 to 3 objects, got {len(objs)}")


def _clear_axis(a: SceneObject, b: SceneObject) -> bool:
    """One axis clearly dominates the centre offset, so the relation word is not a coin toss."""
    dx, dy = abs(a.cx - b.cx), abs(a.cy - b.cy)
    return max(dx, dy) >= _DOMINANCE * min(dx, dy)


def _valid(objects: list[SceneObject], size: int) -> bool:
    """Boxes apart by the gap; caption order and the first relation are never close calls."""
    for i in range(len(objects)):
        for j in range(i + 1, len(objects)):
            a, b = objects[i], objects[j]
            reach = (a.extent + b.extent) / 2 + _GAP * size
            if abs(a.cx - b.cx) < reach and abs(a.cy - b.cy) < reach:
                return False  # overlapping (or touching) boxes
    order = caption_order(objects)
    if len(order) >= 2 and not _clear_axis(order[0], order[1]):
        return False
    if len(order) == 3 and min(order[1].cx - order[0].cx, order[2].cx - order[1].cx) < _MIN_DX * size:
        return False
    return True


# ----------------------------------------------------------------------------- rendering
def sample_scene(rng: np.random.Generator, size: int, forbidden: frozenset[tuple[str, str]] = frozenset(),
                 require: Sequence[tuple[str, str]] = ()) -> list[SceneObject]:
    """Draw 1-3 objects: distinct shapes, colours and sizes, valid positions; no ``forbidden`` pair, first one ``require``d."""
    count = int(rng.integers(1, 4))
    shapes = [SHAPES[i] for i in rng.choice(len(SHAPES), size=count, replace=False)]
    colors = [list(COLORS)[i] for i in rng.integers(0, len(COLORS), size=count)]
    if require:
        color, shape = require[int(rng.integers(0, len(require)))]
        if shape in shapes[1:]:  # keep the shapes distinct: the other object takes the replaced shape
            shapes[shapes.index(shape, 1)] = shapes[0]
        shapes[0], colors[0] = shape, color
    for k, (color, shape) in enumerate(zip(colors, shapes)):
        if (color, shape) in forbidden:
            allowed = [c for c in COLORS if (c, shape) not in forbidden]
            colors[k] = allowed[int(rng.integers(0, len(allowed)))]
    sizes = [list(SIZES)[i] for i in rng.integers(0, len(SIZES), size=count)]
    extents = [SIZES[s] * size * (1 + rng.uniform(-_SIZE_JITTER, _SIZE_JITTER)) for s in sizes]
    lo = np.array(extents) / 2 + 0.02 * size  # (n,) centre bounds keep objects inside the image
    for _ in range(_MAX_TRIES // _BATCH):
        cx = rng.uniform(lo, size - lo, size=(_BATCH, count))  # (K, n) candidate layouts
        cy = rng.uniform(lo, size - lo, size=(_BATCH, count))  # (K, n)
        for k in np.flatnonzero(_plausible(cx, cy, np.array(extents), size)):
            objects = [SceneObject(s, c, z, round(float(x), 2), round(float(y), 2), round(e, 2))
                       for s, c, z, x, y, e in zip(shapes, colors, sizes, cx[k], cy[k], extents)]
            if _valid(objects, size):  # the exact rule, on the rounded values that get written
                return objects
    raise RuntimeError(f"could not place {count} objects in a {size}px image")  # not reached in practice


def _plausible(cx: np.ndarray, cy: np.ndarray, extents: np.ndarray, size: int) -> np.ndarray:
    """Vectorised :func:`_valid` over K candidate layouts: (K, n) centres -> (K,) bool."""
    n = cx.shape[1]
    ok = np.ones(cx.shape[0], dtype=bool)  # (K,)
    for i in range(n):
        for j in range(i + 1, n):
            reach = (extents[i] + extents[j]) / 2 + _GAP * size
            ok &= (np.abs(cx[:, i] - cx[:, j]) >= reach) | (np.abs(cy[:, i] - cy[:, j]) >= reach)
    if n >= 2:
        order = np.argsort(cx, axis=1)  # (K, n) left to right
        sx = np.take_along_axis(cx, order, axis=1)  # (K, n)
        sy = np.take_along_axis(cy, order, axis=1)  # (K, n)
        dx, dy = sx[:, 1] - sx[:, 0], np.abs(sy[:, 1] - sy[:, 0])  # (K,)
        ok &= np.maximum(dx, dy) >= _DOMINANCE * np.minimum(dx, dy)
        if n == 3:
            ok &= np.minimum(sx[:, 1] - sx[:, 0], sx[:, 2] - sx[:, 1]) >= _MIN_DX * size
    return ok


def shape_polygon(obj: SceneObject, scale: float = 1.0) -> list[tuple[float, float]]:
    """The outline of an object as polygon points (circles as 32-gons), in pixels times ``scale``."""
    cx, cy, r = obj.cx * scale, obj.cy * scale, obj.extent * scale / 2
    if obj.shape == "circle":
        pts = [(math.cos(2 * math.pi * k / 32), math.sin(2 * math.pi * k / 32)) for k in range(32)]
    elif obj.shape == "square":
        pts = [(-0.9, -0.9), (0.9, -0.9), (0.9, 0.9), (-0.9, 0.9)]
    elif obj.shape == "triangle":
        pts = [(0.0, -1.0), (1.0, 0.85), (-1.0, 0.85)]
    elif obj.shape == "diamond":
        pts = [(0.0, -1.0), (1.0, 0.0), (0.0, 1.0), (-1.0, 0.0)]
    elif obj.shape == "star":
        pts = [((1.0 if k % 2 == 0 else 0.45) * math.sin(math.pi * k / 5),
                -(1.0 if k % 2 == 0 else 0.45) * math.cos(math.pi * k / 5) + 0.1) for k in range(10)]
    elif obj.shape == "cross":
        w = 0.33
        pts = [(-w, -1), (w, -1), (w, -w), (1, -w), (1, w), (w, w), (w, 1), (-w, 1), (-w, w), (-1, w),
               (-1, -w), (-w, -w)]
    else:
        raise ValueError(f"unknown shape {obj.shape!r}")
    return [(cx + r * x, cy + r * y) for x, y in pts]


@functools.lru_cache(maxsize=4)
def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size  # (S, S) each, in [0, 1)
    return yy, xx


def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    """(size, size, 3) uint8 low-contrast texture (blotches, a gradient or stripes) plus grain."""
    base = (rng.uniform(80, 165) + rng.uniform(-12, 12, size=3)).astype(np.float32)  # (3,) tinted grey
    kind = int(rng.integers(0, 3))
    yy, xx = _grid(size)
    if kind == 0:  # smooth blotches: 5x5 random values, bicubic-upsampled
        coarse = rng.standard_normal((5, 5)).astype(np.float32) * rng.uniform(6, 10)  # (5, 5)
        texture = np.asarray(Image.fromarray(coarse).resize((size, size), Image.Resampling.BICUBIC))  # (S, S)
    elif kind == 1:  # linear gradient in a random direction
        angle = rng.uniform(0, 2 * math.pi)
        texture = rng.uniform(15, 30) * ((math.cos(angle) * xx + math.sin(angle) * yy) - 0.5)  # (S, S)
    else:  # sinusoidal stripes
        angle, period = rng.uniform(0, math.pi), rng.uniform(0.08, 0.25)
        phase = (math.cos(angle) * xx + math.sin(angle) * yy) / period  # (S, S)
        texture = rng.uniform(6, 12) * np.sin(2 * math.pi * phase)  # (S, S)
    grain = rng.standard_normal((size, size), dtype=np.float32) * rng.uniform(2, 4)  # (S, S) luminance grain
    pixels = base[None, None, :] + (texture + grain)[:, :, None]  # (S, S, 3)
    return np.clip(pixels, 0, 255, out=pixels).astype(np.uint8)


def render_scene(rng: np.random.Generator, objects: list[SceneObject], size: int) -> Image.Image:
    """Draw the objects over a random background (antialiased by 2x supersampling)."""
    background = Image.fromarray(_background(rng, size))
    big = background.resize((size * _SUPERSAMPLE, size * _SUPERSAMPLE), Image.Resampling.NEAREST)
    draw = ImageDraw.Draw(big)
    for obj in objects:
        draw.polygon(shape_polygon(obj, _SUPERSAMPLE), fill=COLORS[obj.color])
    return big.reduce(_SUPERSAMPLE)


# ----------------------------------------------------------------------------- dataset writer
def held_out_pairs(seed: int, count: int) -> list[tuple[str, str]]:
    """``count`` (colour, shape) pairs for the compositional split, fixed by ``seed``, each partner kept in training."""
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_UNSEEN_PAIRS:
        raise ConfigError(f"unseen_pairs must be an integer from 0 to {MAX_UNSEEN_PAIRS}, got {count!r}")
    rng = np.random.default_rng([seed, 24])
    colors = [list(COLORS)[i] for i in rng.permutation(len(COLORS))]
    shapes = [SHAPES[i] for i in rng.permutation(len(SHAPES))]
    return [(colors[j % len(colors)], shapes[(j + j // len(colors)) % len(shapes)]) for j in range(count)]


def _split_sizes(n: int, fractions: tuple[float, float, float]) -> list[int]:
    val = max(1, round(fractions[1] * n))
    test = max(1, round(fractions[2] * n))
    return [n - val - test, val, test]


def _write_json(path: Path, data: dict, written: list[Path]) -> None:
    text = json.dumps(data, separators=(",", ":")) + "\n"
    atomic_write(path, lambda f: f.write(text.encode("utf-8")), error=DataError, after=written.append)


def make_shapes(out: str | os.PathLike, images: int = 3000, seed: int = 0, image_size: int = 128,
                split_fractions: tuple[float, float, float] = (0.8, 0.1, 0.1), unseen_pairs: int = 0,
                overwrite: bool = False) -> dict:
    """Write the synthetic shapes dataset into ``out`` (created); return its statistics.

    ``images`` over all splits (>= 3) of side ``image_size`` (>= 32), split by ``split_fractions``;
    ``unseen_pairs``: K pairs kept out of train and val; ``overwrite``: replace a dataset already
    there. Bad arguments (``ConfigError``) and a dataset in the way (``DataError``) are refused before
    any file is written.
    """
    if images < 3:
        raise ConfigError(f"images must be >= 3 (one per split), got {images}")
    if images > MAX_IMAGES:
        raise ConfigError(f"images must be at most {MAX_IMAGES}, got {images}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0, got {seed!r}")
    if image_size < 32:
        raise ConfigError(f"image_size must be >= 32, got {image_size}")
    if image_size > MAX_IMAGE_SIZE:
        raise ConfigError(f"image_size must be at most {MAX_IMAGE_SIZE}, got {image_size}")
    if len(split_fractions) != 3 or min(split_fractions) <= 0 or abs(sum(split_fractions) - 1) > 1e-6:
        raise ConfigError(f"split_fractions must be 3 positive numbers summing to 1, got {split_fractions}")
    held = held_out_pairs(seed, unseen_pairs)
    start = time.perf_counter()
    out = Path(out)
    image_dir = out / "images"
    owned = dataset_files(out)
    width = max(5, len(str(images)))
    planned = [out / f"{kind}_{split}.json" for kind in ("captions", "instances") for split in SPLITS] + \
        [image_dir / f"{i + 1:0{width}d}.png" for i in range(images)]
    outputs = Outputs(out, force=overwrite, option="--out", replace_own=False, error=DataError)
    outputs.check(sorted(set(planned) | set(owned)))  # an earlier dataset, a larger one too, or a user's file
    writable_folder(out, DataError)
    for path in owned:  # --force: the old dataset goes first, so none of its images is left orphaned
        path.unlink()
    try:
        image_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"{image_dir}: cannot create output folder ({exc.strerror or exc})") from None

    order = np.random.default_rng([seed, images, 7]).permutation(images)
    bounds = np.cumsum([0] + _split_sizes(images, split_fractions))
    test_rank = {int(k): r for r, k in enumerate(sorted(order[bounds[2]:]))}  # test scenes, in image order
    written: list[Path] = []  # recorded in the manifest however the run ends: an interrupted one is rerun with --force
    try:
        records, counts = _write_images(image_dir, images, seed, image_size, held, test_rank, width, written)
        _write_splits(out, records, order, bounds, _dataset_info(seed, image_size, images, held), written)
    finally:
        outputs.record(written)
    sizes = {name: int(hi - lo) for name, lo, hi in zip(SPLITS, bounds[:-1], bounds[1:])}
    stats = {"out": str(out), "images": images, "captions": images * CAPTIONS_PER_IMAGE,
             "objects": sum(len(r[2]) for r in records), "splits": sizes, "objects_per_image": counts,
             "seconds": round(time.perf_counter() - start, 2), "unseen_pairs": [list(p) for p in held]}
    log.info("shapes: wrote %d images (%s) to %s in %.1fs", images, sizes, out, stats["seconds"])
    return stats


def _dataset_info(seed: int, image_size: int, images: int, held: list[tuple[str, str]]) -> dict:
    """The ``info`` entry of the dataset's JSON files."""
    about = {"description": "captioner synthetic shapes", "version": "1", "seed": seed,
             "image_size": image_size, "images": images}
    if held:
        about["unseen_pairs"] = [list(pair) for pair in held]
    return about


def _write_images(image_dir: Path, images: int, seed: int, image_size: int, held: list[tuple[str, str]],
                  test_rank: dict[int, int], width: int, written: list[Path]) -> tuple[list, dict[int, int]]:
    """Render and write every scene (each PNG atomically, added to ``written``); the records and object counts."""
    records, counts = [], {1: 0, 2: 0, 3: 0}
    for i in range(images):
        rng = np.random.default_rng([seed, i])
        if held and i not in test_rank:
            objects = sample_scene(rng, image_size, forbidden=frozenset(held))
        elif held and test_rank[i] % 2 == 0:
            objects = sample_scene(rng, image_size, require=held)
        else:
            objects = sample_scene(rng, image_size)
        file_name = f"{i + 1:0{width}d}.png"
        scene = render_scene(rng, objects, image_size)
        atomic_write(image_dir / file_name, lambda f: scene.save(f, format="PNG", compress_level=1), DataError,
                     after=written.append, sync=False)
        records.append((i + 1, file_name, objects))
        counts[len(objects)] += 1
    return records, counts


def _write_splits(out: Path, records: list, order: np.ndarray, bounds: np.ndarray, info: dict,
                  written: list[Path]) -> None:
    """Write each split's caption and instance files (added to ``written``)."""
    image_size = info["image_size"]
    categories = [{"id": k + 1, "name": s, "supercategory": "shape"} for k, s in enumerate(SHAPES)]
    caption_id = object_id = 0
    for name, lo, hi in zip(SPLITS, bounds[:-1], bounds[1:]):
        chosen = sorted(int(k) for k in order[lo:hi])
        imgs, caps, boxes = [], [], []
        for k in chosen:
            image_id, file_name, objects = records[k]
            imgs.append({"id": image_id, "file_name": file_name, "width": image_size, "height": image_size})
            for text in scene_captions(objects):
                caption_id += 1
                caps.append({"id": caption_id, "image_id": image_id, "caption": text})
            for obj in caption_order(objects):
                object_id += 1
                boxes.append(_instance(object_id, image_id, obj))
        _write_json(out / f"captions_{name}.json", {"info": info, "licenses": [], "images": imgs, "annotations": caps},
                    written)
        _write_json(out / f"instances_{name}.json", {"info": info, "licenses": [], "images": imgs,
                                                    "annotations": boxes, "categories": categories}, written)


def dataset_files(out: Path) -> list[Path]:
    """The files of a shapes dataset already in ``out``: its JSON files and the PNGs in ``images/``."""
    out = Path(out)
    if not out.is_dir():
        return []
    found = [out / f"{kind}_{split}.json" for kind in ("captions", "instances") for split in SPLITS]
    found = [p for p in found if p.is_file()]
    if (out / "images").is_dir():
        found += sorted(p for p in (out / "images").glob("*.png") if p.stem.isdigit())
    return found


def _instance(object_id: int, image_id: int, obj: SceneObject) -> dict:
    poly = shape_polygon(obj)
    xs, ys = [p[0] for p in poly], [p[1] for p in poly]
    x0, y0, x1, y1 = min(xs), min(ys), max(xs), max(ys)
    area = 0.5 * abs(sum(xs[k] * ys[k - 1] - xs[k - 1] * ys[k] for k in range(len(poly))))  # shoelace
    return {"id": object_id, "image_id": image_id, "category_id": SHAPES.index(obj.shape) + 1,
            "bbox": [round(x0, 2), round(y0, 2), round(x1 - x0, 2), round(y1 - y0, 2)],
            "area": round(area, 2), "iscrowd": 0,
            "segmentation": [[round(v, 2) for p in poly for v in p]],
            "color": obj.color, "size": obj.size}
