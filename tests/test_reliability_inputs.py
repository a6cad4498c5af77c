"""Bad inputs: hostile or odd image files and broken annotation files.

* Every odd image (empty, truncated JPEG, PNG with a bad CRC, text named ``.jpg``, 1x1, a real
  20000x20000 decompression bomb, CMYK, 16-bit, animated GIF, RGBA, EXIF-rotated, unreadable)
  gets a caption or a one-line error naming the file, from ``load_image`` and from
  ``captioner caption``; the bomb is refused without decoding (memory measured in a subprocess).
* Training over a dataset holding such files stops with a clear error before training, or, with
  ``data.skip_missing``, reports the files and trains without them through a complete epoch.
* Broken annotation files (invalid JSON, unknown image ids, empty captions, missing keys) stop
  ``captioner train`` with one error line before any checkpoint is written.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.cli import main
from captioner.data.images import load_image
from captioner.errors import CaptionerError, DataError, ImageLoadError
from untrained import never_eos_first

REPO = Path(__file__).resolve().parents[1]
WORDS = "a red blue green circle square triangle star small large".split()


# ----------------------------------------------------------------------------- odd image files


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def write_bomb(path: Path, side: int) -> Path:
    """A valid 1-bit greyscale PNG of ``side`` x ``side`` white pixels, compressed to a few KB.

    The rows are streamed through zlib, so the test never holds the decoded image in memory.
    """
    row = b"\x00" + b"\xff" * ((side + 7) // 8)  # filter byte + packed bits
    packer = zlib.compressobj(9)
    chunks = [packer.compress(row * 500) for _ in range(side // 500)]
    chunks += [packer.compress(row * (side % 500)), packer.flush()]
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", b"".join(chunks))
                     + _png_chunk(b"IEND", b""))
    return path


def _noise(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8))


def _jpeg_bytes(image: Image.Image, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=90, **kwargs)
    return buf.getvalue()


def _png_with_bad_crc() -> bytes:
    buf = io.BytesIO()
    _noise(32, 32, seed=1).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    idat = data.index(b"IDAT")
    data[idat + 4 + 20] ^= 0xFF  # a byte of compressed pixel data; the chunk's CRC no longer matches
    return bytes(data)


# name -> (how to write it, None when it must be captioned / a substring of its one-line error)
def make_odd_images(folder: Path) -> dict[str, str | None]:
    folder.mkdir(parents=True, exist_ok=True)
    expect: dict[str, str | None] = {}

    (folder / "empty.jpg").write_bytes(b"")
    expect["empty.jpg"] = "file is empty"
    (folder / "truncated.jpg").write_bytes(_jpeg_bytes(_noise(64, 64))[:1500])
    expect["truncated.jpg"] = "truncated or corrupt image"
    (folder / "bad_crc.png").write_bytes(_png_with_bad_crc())
    expect["bad_crc.png"] = "truncated or corrupt image"
    (folder / "text.jpg").write_text("these are my holiday notes, not a photo\n")
    expect["text.jpg"] = "not an image file"
    write_bomb(folder / "bomb.png", 20000)
    expect["bomb.png"] = "image too large"
    write_bomb(folder / "big.png", 9000)  # under PIL's own limit, over captioner's 64 megapixels
    expect["big.png"] = "image too large (9000x9000 pixels, limit 64 megapixels)"
    expect["missing.jpg"] = "file not found"

    Image.new("RGB", (1, 1), (255, 0, 0)).save(folder / "one_pixel.png")
    Image.new("CMYK", (40, 30), (0, 255, 255, 0)).save(folder / "cmyk.jpg", quality=95)
    Image.fromarray(np.full((20, 30), 40000, dtype=np.uint16)).save(folder / "deep16.png")
    frames = [Image.new("RGB", (24, 24), c) for c in ((255, 0, 0), (0, 0, 255), (0, 255, 0))]
    frames[0].save(folder / "animated.gif", save_all=True, append_images=frames[1:], duration=40, loop=0)
    rgba = Image.new("RGBA", (30, 20), (0, 0, 255, 0))
    rgba.paste((255, 0, 0, 255), (0, 0, 15, 20))
    rgba.save(folder / "rgba.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed rotated 90 degrees clockwise
    _noise(60, 30, seed=2).save(folder / "rotated.jpg", exif=exif, quality=90)
    for name in ("one_pixel.png", "cmyk.jpg", "deep16.png", "animated.gif", "rgba.png", "rotated.jpg"):
        expect[name] = None
    return expect


@pytest.fixture(scope="module")
def odd_images(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str | None]]:
    folder = tmp_path_factory.mktemp("odd")
    return folder, make_odd_images(folder)


def test_load_image_gives_rgb_or_one_line_error_naming_the_file(odd_images) -> None:
    folder, expect = odd_images
    for name, error in expect.items():
        path = folder / name
        if error is None:
            image = load_image(path)
            assert image.mode == "RGB" and min(image.size) >= 1, name
            continue
        with pytest.raises(ImageLoadError) as info:
            load_image(path)
        message = str(info.value)
        assert message.startswith(f"{path}: ") and error in message and "\n" not in message, message


def test_odd_modes_are_converted_correctly(odd_images) -> None:
    folder, _ = odd_images
    assert load_image(folder / "rotated.jpg").size == (30, 60)  # EXIF orientation applied
    assert load_image(folder / "cmyk.jpg").getpixel((20, 15))[0] > 200  # CMYK red stays red
    assert load_image(folder / "rgba.png").getpixel((25, 10)) == (255, 255, 255)  # transparent -> white
    assert load_image(folder / "deep16.png").getpixel((0, 0)) == (156,) * 3  # 40000 / 257, not clipped
    assert load_image(folder / "animated.gif").getpixel((5, 5)) == (255, 0, 0)  # first frame


@pytest.mark.slow  # a fresh process measures its memory: about 3 s
@pytest.mark.timeout(60)
def test_decompression_bomb_is_refused_without_decoding(odd_images) -> None:
    """In a fresh process, so that the peak memory belongs to this one call."""
    folder, _ = odd_images
    code = ("import resource, sys\n"
            "from captioner.data.images import load_image\n"
            "from captioner.errors import ImageLoadError\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "for name in sys.argv[1:]:\n"
            "    try:\n"
            "        load_image(name)\n"
            "        print('LOADED', name)\n"
            "    except ImageLoadError as exc:\n"
            "        print(exc)\n"
            "print('GROWTH_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n")
    paths = [str(folder / "bomb.png"), str(folder / "big.png")]
    proc = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=50,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{paths[0]}: image too large") and "LOADED" not in proc.stdout
    assert lines[1] == f"{paths[1]}: image too large (9000x9000 pixels, limit 64 megapixels)"
    growth_mb = int(lines[2].split()[1]) / 1024
    assert growth_mb < 50, f"refusing the bombs cost {growth_mb:.0f} MB (decoding would cost hundreds)"


# ----------------------------------------------------------------------------- unreadable files


def test_unreadable_file_real_permissions(tmp_path: Path) -> None:
    path = tmp_path / "secret.png"
    Image.new("RGB", (4, 4)).save(path)
    path.chmod(0)
    try:
        if os.access(path, os.R_OK):
            pytest.skip("running as root (or with CAP_DAC_OVERRIDE): chmod 000 does not stop reading; "
                        "see test_unreadable_file_simulated")
        with pytest.raises(ImageLoadError, match=rf"^{path}: permission denied$"):
            load_image(path)
    finally:
        path.chmod(0o644)


def test_unreadable_file_simulated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture, tiny_checkpoint: Path) -> None:
    """Whatever user runs the suite: reading the file raises PermissionError, as for chmod 000."""
    good, secret = tmp_path / "good.png", tmp_path / "secret.png"
    for path in (good, secret):
        Image.new("RGB", (8, 8), (0, 200, 0)).save(path)
    real_open = os.open

    def deny(file: os.PathLike, flags: int, *args: object, **kwargs: object) -> int:
        if Path(file).name == "secret.png":
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", deny)
    code = main(["caption", str(secret), str(good), "--checkpoint", str(tiny_checkpoint), "--beam", "1"])
    out, err = capsys.readouterr()
    assert code == 1
    assert err.splitlines() == [f"captioner caption: error: {secret}: permission denied"]
    assert [line.split("\t")[0] for line in out.splitlines()] == [str(good)]


@pytest.mark.parametrize("reader", ["load_image", "probe_image"])
def test_running_out_of_memory_while_opening_is_one_line_naming_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: str) -> None:
    """A MemoryError from PIL, while reading the header or decoding, is the same one-line error."""
    from captioner.data import images

    path = tmp_path / "huge.png"
    Image.new("RGB", (8, 8)).save(path)

    def exhausted(*args: object, **kwargs: object) -> None:
        raise MemoryError()

    monkeypatch.setattr(images.Image, "open", exhausted)
    with pytest.raises(ImageLoadError, match=rf"^{path}: not enough memory to decode the image$"):
        getattr(images, reader)(path)


# ----------------------------------------------------------------------------- captioner caption


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from captioner.checkpoint.store import save_checkpoint
    from captioner.config import get_preset
    from captioner.models.model import build_model
    from captioner.text import Vocabulary

    torch.manual_seed(0)
    vocab = Vocabulary(WORDS)
    model = build_model(get_preset("sat_soft_tiny").model, len(vocab), load_pretrained=False).eval()
    never_eos_first(model, vocab)  # an empty caption is an error, not what this file tests
    path = tmp_path_factory.mktemp("ckpt") / "tiny.safetensors"
    # The first header bytes of a safetensors file are its header length; b"\x80" / b"PK" there trip a
    # format-sniffing bug pinned in test_reliability_checkpoints.py, which is not what this file tests.
    for pad in range(64):
        save_checkpoint(path, model, vocab, metadata={"pad": "x" * pad})
        head = path.read_bytes()[:2]
        if head[:1] != b"\x80" and head != b"PK":
            break
    return path


@pytest.mark.timeout(120)
def test_caption_command_captions_good_files_and_reports_each_bad_one(
        odd_images, tiny_checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    folder, expect = odd_images
    names = sorted(expect)
    code = main(["caption", *(str(folder / n) for n in names), "--checkpoint", str(tiny_checkpoint),
                 "--beam", "2", "--max-len", "5", "--batch-size", "4"])
    out, err = capsys.readouterr()
    assert code == 1  # some inputs failed

    captioned = [line.split("\t", 1)[0] for line in out.splitlines()]
    assert captioned == [str(folder / n) for n in names if expect[n] is None]  # input order, one line each
    assert all("\t" in line for line in out.splitlines())

    errors = err.splitlines()
    assert "Traceback" not in err
    bad = [n for n in names if expect[n] is not None]
    assert len(errors) == len(bad), err
    for name, line in zip(bad, errors):
        assert line.startswith(f"captioner caption: error: {folder / name}: ") and expect[name] in line, line


def test_caption_command_on_only_bad_files_exits_1(odd_images, tiny_checkpoint: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    folder, _ = odd_images
    code = main(["caption", str(folder / "text.jpg"), str(folder / "empty.jpg"), "--checkpoint",
                 str(tiny_checkpoint), "--json"])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.splitlines() == [f"captioner caption: error: {folder / 'text.jpg'}: not an image file",
                                f"captioner caption: error: {folder / 'empty.jpg'}: file is empty"]


# ----------------------------------------------------------------------------- training over bad images


def tiny_overrides(root: Path, **extra) -> dict:
    """1 epoch of sat_soft_tiny at batch 48: 5 steps over the 48 training images' 240 captions."""
    return {"data.root": str(root), "train.epochs": 1, "train.batch_size": 48, "train.val_max_images": 2,
            "train.log_every": 1, **extra}


@pytest.fixture
def spoiled_shapes(tiny_shapes: Path, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A copy of tiny_shapes in which five training images are broken in five ways."""
    root = tmp_path / "shapes"
    shutil.copytree(tiny_shapes, root)
    train = json.loads((root / "captions_train.json").read_text())
    names = [img["file_name"] for img in train["images"][3:8]]
    images = root / "images"
    (images / names[0]).write_bytes(b"")
    (images / names[1]).write_text("not an image")
    write_bomb(images / names[2], 9000)
    (images / names[3]).write_bytes(_jpeg_bytes(_noise(64, 64))[:1500])  # truncated pixel data
    (images / names[4]).write_bytes(_png_with_bad_crc())
    kinds = dict(zip(names, ["empty", "text", "bomb", "truncated", "bad_crc"]))
    return root, kinds


@pytest.mark.timeout(120)
def test_training_stops_before_training_when_images_are_bad(spoiled_shapes, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    root, kinds = spoiled_shapes
    out = tmp_path / "run"
    code = main(["train", "--preset", "sat_soft_tiny", "--data", str(root), "--out", str(out), "--epochs", "1",
                 "--batch-size", "48", "--set", "train.val_max_images=2", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    [line] = [l for l in err.splitlines() if l.startswith("captioner train: error:")]
    assert any(name in line for name in kinds), line  # names (one of) the bad files
    assert "--skip-missing" in line  # and says how to go on
    assert not (out / "latest.safetensors").exists() and not (out / "train_state.pt").exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("feature_cache", [True, False], ids=["feature_cache", "pixels"])
def test_training_with_skip_missing_reports_bad_images_and_finishes_the_epoch(
        spoiled_shapes, tmp_path: Path, caplog: pytest.LogCaptureFixture, feature_cache: bool) -> None:
    """``data.skip_missing`` (``--skip-missing``): every bad file is named in a warning, the epoch
    completes without them. With ``data.feature_cache=false`` (also what a fine-tuned encoder
    uses) the images are decoded inside the training loop, so the truncated and bad-CRC files are
    only found mid-epoch."""
    from captioner.config import get_preset
    from captioner.training.loop import train

    root, kinds = spoiled_shapes
    cfg = get_preset("sat_soft_tiny", **tiny_overrides(root, **{"data.skip_missing": True,
                                                                 "data.feature_cache": feature_cache}))
    with caplog.at_level(logging.WARNING):
        result = train(cfg, tmp_path / "run", progress=False)
    [row] = result.history
    assert row["epoch"] == 1 and row["partial"] == 0  # the epoch ran to its end
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    for name, kind in kinds.items():
        assert name in warnings, f"the {kind} image {name} was not reported"
    weights = torch.load(tmp_path / "run" / "train_state.pt", weights_only=True)["model"]
    assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())


# ----------------------------------------------------------------------------- broken annotation files


def _dataset_with(tmp_path: Path, tiny_shapes: Path, train_doc: dict | str) -> Path:
    """tiny_shapes' val split and images, with ``train_doc`` as captions_train.json."""
    root = tmp_path / "data"
    root.mkdir()
    (root / "images").symlink_to(tiny_shapes / "images", target_is_directory=True)
    shutil.copy(tiny_shapes / "captions_val.json", root / "captions_val.json")
    text = train_doc if isinstance(train_doc, str) else json.dumps(train_doc)
    (root / "captions_train.json").write_text(text)
    return root


def _spoil(doc: dict, how: str) -> dict | str:
    if how == "invalid_json":
        return json.dumps(doc)[:500]
    if how == "unknown_image_id":
        doc["annotations"][7]["image_id"] = 99999
    elif how == "all_captions_empty":
        for ann in doc["annotations"]:
            ann["caption"] = " .. "
    elif how == "caption_missing":
        del doc["annotations"][4]["caption"]
    elif how == "file_name_missing":
        del doc["images"][2]["file_name"]
    elif how == "caption_not_text":
        doc["annotations"][0]["caption"] = ["a", "list"]
    elif how == "no_annotations":
        del doc["annotations"]
    return doc


BROKEN = {
    "invalid_json": r"captions_train\.json: invalid JSON at line 1, column \d+ \(.+\)$",
    "unknown_image_id": r"captions_train\.json: annotation 7 refers to unknown image id 99999$",
    "all_captions_empty": r"captions_train\.json: split 'train' has no captioned images$",
    "caption_missing": r"captions_train\.json: annotation 4 has no 'caption'$",
    "file_name_missing": r"captions_train\.json: image 2 has no 'file_name'$",
    "caption_not_text": r"captions_train\.json: annotation 0 has a caption that is not a string$",
    "no_annotations": r"captions_train\.json: no 'annotations' list$",
}


@pytest.mark.parametrize("how", sorted(BROKEN))
def test_broken_annotations_stop_train_before_anything_is_written(
        how: str, tiny_shapes: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import re

    doc = json.loads((tiny_shapes / "captions_train.json").read_text())
    root = _dataset_with(tmp_path, tiny_shapes, _spoil(doc, how))
    out = tmp_path / "run"
    code = main(["train", "--preset", "sat_soft_tiny", "--data", str(root), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    [line] = [l for l in err.splitlines() if l.startswith("captioner train: error:")]
    assert re.search(re.escape(f"captioner train: error: {root}/") + BROKEN[how], line), line
    assert not out.exists() or not any(out.iterdir())  # no run folder content, no checkpoint


def test_broken_val_split_is_found_before_training(tiny_shapes: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    root = _dataset_with(tmp_path, tiny_shapes, json.loads((tiny_shapes / "captions_train.json").read_text()))
    (root / "captions_val.json").write_text('{"images": [], "annotations": [}')
    out = tmp_path / "run"
    code = main(["train", "--preset", "sat_soft_tiny", "--data", str(root), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1
    assert f"captioner train: error: {root / 'captions_val.json'}: invalid JSON at line 1, column 32" in err
    assert not out.exists() or not any(out.iterdir())


def test_some_empty_captions_are_dropped_with_one_warning(tiny_shapes: Path, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    from captioner.data.caption_set import check_images
    from captioner.data.coco import load_caption_set

    doc = json.loads((tiny_shapes / "captions_train.json").read_text())
    first = doc["images"][0]["id"]
    for ann in doc["annotations"]:
        if ann["image_id"] == first:
            ann["caption"] = "   "  # this image loses every caption
    doc["annotations"][-1]["caption"] = "?!"
    root = _dataset_with(tmp_path, tiny_shapes, doc)
    with caplog.at_level(logging.WARNING):
        cs = load_caption_set(root, "train")
    assert first not in {r.image_id for r in cs.images} and len(cs) == len(doc["images"]) - 1
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert messages == [f"{root / 'captions_train.json'}: dropped 6 empty caption(s)",
                        f"{root / 'captions_train.json'}: skipped 1 image(s) without captions in split 'train'"]


def test_check_images_names_unreadable_files_before_training(spoiled_shapes) -> None:
    from captioner.data.caption_set import check_images
    from captioner.data.coco import load_caption_set

    root, kinds = spoiled_shapes
    cs = load_caption_set(root, "train")
    with pytest.raises(DataError) as info:
        check_images(cs)
    message = str(info.value)
    assert message.startswith(f"3 of {len(cs)} image files cannot be read (e.g. ") and "\n" not in message
    by_kind = {kind: name for name, kind in kinds.items()}
    assert f"{by_kind['empty']}: file is empty" in message and f"{by_kind['text']}: not an image file" in message
    assert f"{by_kind['bomb']}: image too large (9000x9000 pixels" in message
    kept = check_images(cs, skip_missing=True)
    assert len(kept) == len(cs) - 3  # header checks cannot see truncated pixel data: decoding does
    assert {by_kind["truncated"], by_kind["bad_crc"]} <= {r.file_name for r in kept.images}
    assert isinstance(info.value, CaptionerError)


def test_image_loader_skip_bad_drops_unreadable_items_from_batches(spoiled_shapes,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The data-layer half of skipping mid-epoch: ``skip_bad`` gives None, collate drops it."""
    from captioner.config import get_preset
    from captioner.data.coco import load_caption_set
    from captioner.data.dataset import (CaptionEvalDataset, CaptionTrainDataset, collate_captions, collate_images,
                                        image_loader)
    from captioner.data.images import ImageTransform
    from captioner.models.registry import resolve_encoder
    from captioner.text import Vocabulary

    root, kinds = spoiled_shapes
    cs = load_caption_set(root, "train")
    transform = ImageTransform(resolve_encoder(get_preset("sat_soft_tiny").model.encoder))
    bad = [i for i, r in enumerate(cs.images) if r.file_name in kinds]
    assert len(bad) == 5
    with pytest.raises(ImageLoadError):
        image_loader(cs, transform)(bad[0])  # the default still raises

    load = image_loader(cs, transform, skip_bad=True)
    with caplog.at_level(logging.WARNING):
        assert all(load(i) is None for i in bad) and all(load(i) is None for i in bad)  # twice, warned once
    warned = [r.getMessage() for r in caplog.records if "skipping unreadable image" in r.getMessage()]
    assert len(warned) == 5 and all(any(name in w for w in warned) for name in kinds)

    items = CaptionTrainDataset(cs, Vocabulary.build(cs.all_captions()), load, max_len=10)
    batch = [items[k] for k in range(len(items)) if items.image_index[k] in (bad[0], bad[1], 0)]
    x, tokens, index = collate_captions(batch)
    assert index.tolist() == [0] * 5 and x.shape[0] == tokens.shape[0] == 5  # bad images' captions dropped
    assert collate_captions([items[k] for k in range(len(items)) if items.image_index[k] == bad[2]]) is None
    evals = CaptionEvalDataset(cs, load)
    x, index = collate_images([evals[i] for i in (0, bad[3], 1, bad[4])])
    assert index.tolist() == [0, 1] and x.shape[0] == 2
    assert collate_images([evals[bad[0]]]) is None
