"""Synthetic shapes: captions follow the geometry, files are COCO-valid and byte-reproducible."""

from __future__ import annotations

import argparse
import hashlib
import io
import re
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from captioner.commands import make_shapes as command
from captioner.data.coco import load_caption_set, load_instances
from captioner.data.shapes import COLORS, SHAPES, SIZES, SceneObject, make_shapes, scene_captions
from captioner.errors import ConfigError
from captioner.text import tokenize

TEMPLATE_WORDS = {"a", "there", "is", "picture", "of", "one", "shape", "single", "to", "the", "left", "right",
                  "above", "below", "and", "two", "shapes", "from", "three"}


def obj(shape: str, color: str, size: str, cx: float, cy: float) -> SceneObject:
    return SceneObject(shape, color, size, cx, cy, 20.0)


def test_constants() -> None:
    assert len(SHAPES) >= 5 and len(set(SHAPES)) == len(SHAPES)
    assert len(COLORS) >= 6 and len(set(COLORS.values())) == len(COLORS)
    rgb = np.array(list(COLORS.values()), dtype=float)
    gaps = [np.abs(a - b).max() for i, a in enumerate(rgb) for b in rgb[i + 1:]]
    assert min(gaps) >= 100  # every pair of colours differs by >= 100 in some channel
    assert set(SIZES) == {"small", "large"} and SIZES["large"] >= 1.5 * SIZES["small"]


def test_scene_captions_known_answers() -> None:
    one = [obj("star", "red", "small", 30, 40)]
    assert scene_captions(one) == ["A small red star.", "There is a small red star.", "A picture of a small red star.",
                                   "One shape: a small red star.", "A single small red star."]
    horizontal = [obj("square", "blue", "large", 90, 50), obj("circle", "red", "small", 20, 60)]
    assert scene_captions(horizontal)[:2] == ["A small red circle to the left of a large blue square.",
                                              "A large blue square to the right of a small red circle."]
    vertical = [obj("square", "blue", "large", 50, 100), obj("circle", "red", "small", 40, 20)]
    assert scene_captions(vertical) == [
        "A small red circle above a large blue square.", "A large blue square below a small red circle.",
        "There is a small red circle above a large blue square.", "A small red circle and a large blue square.",
        "Two shapes: a small red circle and a large blue square."]
    three = [obj("cross", "green", "small", 100, 20), obj("circle", "red", "small", 10, 100),
             obj("star", "cyan", "large", 50, 20)]
    assert scene_captions(three) == [
        "A small red circle, a large cyan star and a small green cross.",
        "There is a small red circle, a large cyan star and a small green cross.",
        "From left to right: a small red circle, a large cyan star and a small green cross.",
        "A small red circle below a large cyan star and a small green cross.",
        "Three shapes: a small red circle, a large cyan star and a small green cross."]


def _expected_first_caption(boxes) -> str:
    """Re-derive the first template from the written boxes, independently of shapes.py."""
    items = [(b.bbox[0] + b.bbox[2] / 2, b.bbox[1] + b.bbox[3] / 2,
              f"{b.attributes['size']} {b.attributes['color']} {b.category}") for b in boxes]
    if len(items) == 1:
        return f"A {items[0][2]}."
    if len(items) == 2:
        (x0, y0, _), (x1, y1, _) = items
        horizontal = abs(x0 - x1) >= abs(y0 - y1)
        a, b = sorted(items, key=lambda t: t[0] if horizontal else t[1])
        return f"A {a[2]} {'to the left of' if horizontal else 'above'} a {b[2]}."
    a, b, c = sorted(items, key=lambda t: t[0])
    return f"A {a[2]}, a {b[2]} and a {c[2]}."


def test_dataset_is_consistent(tiny_shapes: Path) -> None:
    seen_counts, centres_x = set(), []
    for split, expected_images in (("train", 48), ("val", 6), ("test", 6)):
        cs = load_caption_set(tiny_shapes, split)
        boxes = load_instances(tiny_shapes, split)
        assert len(cs) == expected_images and cs.num_captions == 5 * expected_images
        for record in cs.images:
            refs, objs = cs.references(record.image_id), boxes[record.image_id]
            assert len(set(refs)) == 5 and all(len(tokenize(r)) <= 17 for r in refs)
            assert len({o.category for o in objs}) == len(objs)  # distinct shapes
            assert refs[0] == _expected_first_caption(objs)
            image = np.asarray(Image.open(record.path))
            assert image.shape == (64, 64, 3)
            for o in objs:  # the object's colour is painted at its centre
                x, y, w, h = o.bbox
                assert tuple(image[int(y + h / 2), int(x + w / 2)]) == COLORS[o.attributes["color"]]
                centres_x.append((x + w / 2) / 64)
            for i, a in enumerate(objs):  # boxes never overlap
                for b in objs[i + 1:]:
                    assert (a.bbox[0] + a.bbox[2] <= b.bbox[0] or b.bbox[0] + b.bbox[2] <= a.bbox[0]
                            or a.bbox[1] + a.bbox[3] <= b.bbox[1] or b.bbox[1] + b.bbox[3] <= a.bbox[1])
            seen_counts.add(len(objs))
    assert seen_counts == {1, 2, 3}
    assert min(centres_x) < 0.3 and max(centres_x) > 0.7  # positions vary across the image


def test_sizes_are_clearly_different(tiny_shapes: Path) -> None:
    extents = {"small": [], "large": []}
    for boxes in load_instances(tiny_shapes, "train").values():
        for b in boxes:
            extents[b.attributes["size"]].append(max(b.bbox[2], b.bbox[3]))
    assert min(extents["large"]) > 1.4 * max(extents["small"])


def test_small_vocabulary(tiny_shapes: Path) -> None:
    words = {w for c in load_caption_set(tiny_shapes, "train").all_captions() for w in tokenize(c)}
    assert words <= TEMPLATE_WORDS | set(COLORS) | set(SHAPES) | set(SIZES)


@pytest.mark.filterwarnings("ignore::DeprecationWarning:pycocotools")
def test_json_loads_with_pycocotools(tiny_shapes: Path) -> None:
    from pycocotools.coco import COCO

    with redirect_stdout(io.StringIO()):
        caps = COCO(str(tiny_shapes / "captions_val.json"))
        inst = COCO(str(tiny_shapes / "instances_val.json"))
    assert len(caps.getImgIds()) == 6 and len(caps.getAnnIds()) == 30
    assert [c["name"] for c in inst.loadCats(inst.getCatIds())] == list(SHAPES)
    ann = inst.loadAnns(inst.getAnnIds())[0]
    assert {"bbox", "area", "iscrowd", "category_id", "color", "size"} <= set(ann)
    mask = inst.annToMask(ann)  # the segmentation polygon matches the box
    ys, xs = np.nonzero(mask)
    x, y, w, h = ann["bbox"]
    assert abs(xs.min() - x) <= 1.5 and abs(xs.max() + 1 - (x + w)) <= 1.5 and abs(ys.min() - y) <= 1.5


def _digest(folder: Path) -> dict[str, str]:
    """The dataset's files (not the folder's manifest of what captioner wrote: it records their times)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".captioner-files.json"}


def test_same_seed_gives_identical_files(tmp_path: Path) -> None:
    first = make_shapes(tmp_path / "a", images=9, seed=3, image_size=32)
    make_shapes(tmp_path / "b", images=9, seed=3, image_size=32)
    make_shapes(tmp_path / "c", images=9, seed=4, image_size=32)
    a, b, c = _digest(tmp_path / "a"), _digest(tmp_path / "b"), _digest(tmp_path / "c")
    assert len(a) == 9 + 6 and a == b
    assert a["captions_train.json"] != c["captions_train.json"] and a["images/00001.png"] != c["images/00001.png"]
    assert first["images"] == 9 and first["captions"] == 45 and sum(first["splits"].values()) == 9


@pytest.mark.parametrize("kwargs, message", [
    ({"images": 2}, "images must be >= 3 (one per split), got 2"),
    ({"image_size": 16}, "image_size must be >= 32, got 16"),
    ({"split_fractions": (0.5, 0.5, 0.0)}, "split_fractions must be 3 positive numbers summing to 1"),
])
def test_bad_arguments(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_shapes(tmp_path, **kwargs)


def test_make_shapes_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path / "s"), "--images", "5", "--seed", "2", "--image-size", "32"])
    assert command.run(args) == 0
    out = capsys.readouterr().out.strip()
    assert re.fullmatch(rf"wrote 5 images \(3 train, 1 val, 1 test\), 25 captions and \d+ object boxes "
                        rf"to {re.escape(str(tmp_path / 's'))} in [\d.]+s", out)
    assert len(list((tmp_path / "s" / "images").glob("*.png"))) == 5
    assert parser.parse_args([]).out == "data/shapes" and parser.parse_args([]).images == 3000
    with pytest.raises(SystemExit):
        parser.parse_args(["--images", "0"])
    assert command.NAME == "make-shapes" and "make-shapes" in command.EXAMPLES


def test_make_shapes_never_rewrites_a_dataset_without_force(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from captioner.cli import main
    from captioner.data import shapes

    out = tmp_path / "s"
    assert main(["make-shapes", "--out", str(out), "--images", "12", "--image-size", "32"]) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["make-shapes", "--out", str(out), "--images", "5", "--image-size", "32"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{out / 'captions_test.json'}: already exists, written by an earlier run (and " \
        in err and "pass --force" in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # untouched
    (out / "notes.txt").write_text("mine")
    assert main(["make-shapes", "--out", str(out), "--images", "5", "--image-size", "32", "--force"]) == 0
    assert len(list((out / "images").glob("*.png"))) == 5  # the old 12 do not linger as orphans
    assert (out / "notes.txt").read_text() == "mine"
    assert (command.MAX_IMAGES, command.MAX_IMAGE_SIZE, command.MAX_UNSEEN_PAIRS) == (
        shapes.MAX_IMAGES, shapes.MAX_IMAGE_SIZE, shapes.MAX_UNSEEN_PAIRS)


@pytest.mark.parametrize("option, value, message", [
    ("--images", "2", "argument --images: must be between 3 and 10000000, got 2"),
    ("--image-size", "1e3", "argument --image-size: expected a whole number, got '1e3'"),
    ("--seed", "-1", "argument --seed: must be between 0 and"),
    ("--unseen-pairs", "19", "argument --unseen-pairs: must be between 0 and 18, got 19"),
])
def test_make_shapes_numbers_are_checked_while_parsing(tmp_path: Path, capsys: pytest.CaptureFixture, option: str,
                                                      value: str, message: str) -> None:
    from captioner.cli import main

    assert main(["make-shapes", "--out", str(tmp_path / "s"), option, value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and not (tmp_path / "s").exists()
