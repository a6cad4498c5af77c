"""The official Flickr8k layout (``captioner.data.coco.load_flickr8k``) on a small fixture built here, dirt included."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from PIL import Image

from captioner.data.caption_set import check_images
from captioner.data.coco import load_caption_set
from captioner.errors import DataError

SPLITS = {"train": ["1000_a.jpg", "1001_b.jpg", "1002_c.jpg", "1003_f.jpg"], "dev": ["2000_d.jpg"],
          "test": ["3000_e.jpg"]}
# 1003_f.jpg is listed for train but has no caption line; 2258277193_586949ec62.jpg.1 is in no list.
TOKEN_LINES = [
    "1000_a.jpg#0\tA dog runs on the grass .",
    "1000_a.jpg#1\tA brown dog running .",
    "1000_a.jpg#1\tA brown dog running .",  # exact duplicate line
    "1000_a.jpg#2\tThe dog is outside .",
    "",
    "1000_a.jpg#3 A dog with no tab .",  # malformed: no tab
    "1000_a.jpg#3\tA dog in a field .",
    "1000_a.jpg#4\tA dog .",
    "1000_a.jpg#5\tA sixth caption for the dog .",  # more than five captions
    "1001_b.jpg\tNo suffix here .",  # malformed: no #n
    "1001_b.jpg#0\tTwo children play .",
    "1001_b.jpg#1\t   ",  # malformed: empty caption
    "1001_b.jpg#1\tKids playing in a park .",  # fewer than five captions
    "2258277193_586949ec62.jpg.1#0\tA caption of an image nobody lists .",
    "1002_c.jpg#0\tA man rides a bike .",
    "2000_d.jpg#0\tA girl in a pink dress .",
    "2000_d.jpg#1\tA little girl .",
    "3000_e.jpg#0\tA cat sleeps .",
    "   ",
]


def _jpg(path: Path, colour: tuple[int, int, int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 6), colour).save(path, "JPEG")


def make_flickr8k(root: Path, line_end: str = "\n", text: str = "Flickr8k_text",
                  images: str = "Flicker8k_Dataset") -> Path:
    """The official layout (or a variant: ``text``/``images`` may be ``"."``) with the dirt above."""
    text_dir = root / text if text != "." else root
    image_dir = root / images if images != "." else root
    text_dir.mkdir(parents=True, exist_ok=True)
    (text_dir / "Flickr8k.token.txt").write_bytes(line_end.join(TOKEN_LINES).encode())
    for split, names in SPLITS.items():
        (text_dir / f"Flickr_8k.{split}Images.txt").write_bytes((line_end.join(names) + line_end * 2).encode())
    for i, name in enumerate(n for names in SPLITS.values() for n in names if n != "1003_f.jpg"):
        _jpg(image_dir / name, (40 * i, 100, 200))
    return root


@pytest.fixture()
def flickr(tmp_path: Path) -> Path:
    return make_flickr8k(tmp_path / "Flickr8k")


def test_splits_count_images_and_captions(flickr: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        train = load_caption_set(flickr, "train")
    assert train.name == "flickr8k" and train.split == "train" and train.root == flickr
    assert [r.file_name for r in train.images] == ["1000_a.jpg", "1001_b.jpg", "1002_c.jpg"]
    assert [len(train.references(r.image_id)) for r in train.images] == [6, 2, 1]
    assert train.references(train.images[0].image_id)[:2] == ["A dog runs on the grass .", "A brown dog running ."]
    assert train.images_dir == flickr / "Flicker8k_Dataset"
    assert train.images[0].path == flickr / "Flicker8k_Dataset" / "1000_a.jpg"
    assert "skipped 1 image(s) without captions in split 'train'" in caplog.text  # 1003_f.jpg
    dev, test = load_caption_set(flickr, "dev"), load_caption_set(flickr, "test")
    assert (len(dev), dev.num_captions, len(test), test.num_captions) == (1, 2, 1, 1)
    assert len(check_images(train)) == 3  # the files are where the layout says
    both = load_caption_set(flickr, "all")
    assert len(both) == 5 and both.num_captions == 12  # the .jpg.1 name is in no list: ignored


def test_ids_are_stable_across_splits_and_val_is_dev(flickr: Path) -> None:
    ids = {r.file_name: r.image_id for r in load_caption_set(flickr, "all").images}
    # the 1-based order of first appearance in the token file (the .jpg.1 entry takes number 3)
    assert ids == {"1000_a.jpg": 1, "1001_b.jpg": 2, "1002_c.jpg": 4, "2000_d.jpg": 5, "3000_e.jpg": 6}
    for split in ("train", "dev", "test"):
        assert all(ids[r.file_name] == r.image_id for r in load_caption_set(flickr, split).images)
    val = load_caption_set(flickr, "val")
    assert val.split == "dev" and [r.image_id for r in val.images] == [5]


def test_dirt_is_skipped_with_one_warning(flickr: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="captioner.data.flickr8k"):
        load_caption_set(flickr, "dev")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].endswith("Flickr8k.token.txt: skipped 3 malformed line(s) (no tab, no #n suffix or empty "
                                "caption); first: line 6: '1000_a.jpg#3 A dog with no tab .'")
    assert "dropped 1 duplicate caption line(s)" in caplog.text


def test_crlf_files_load_the_same(tmp_path: Path) -> None:
    unix = make_flickr8k(tmp_path / "lf")
    dos = make_flickr8k(tmp_path / "crlf", line_end="\r\n")
    assert b"\r\n" in (dos / "Flickr8k_text" / "Flickr8k.token.txt").read_bytes()
    for split in ("train", "dev", "test"):
        a, b = load_caption_set(unix, split), load_caption_set(dos, split)
        assert [(r.image_id, r.file_name) for r in a.images] == [(r.image_id, r.file_name) for r in b.images]
        assert a.captions == b.captions
    assert all("\r" not in c for c in load_caption_set(dos, "all").all_captions())


def test_missing_files_are_one_line_errors(flickr: Path) -> None:
    text = flickr / "Flickr8k_text"
    (text / "Flickr_8k.testImages.txt").unlink()
    assert len(load_caption_set(flickr, "train")) == 3  # only the asked split's list is needed
    assert len(load_caption_set(flickr, "all")) == 4  # the lists that exist
    with pytest.raises(DataError, match=rf"^{text}/Flickr_8k.testImages.txt: file not found "
                                        r"\(the Flickr8k 'test' split list\)$"):
        load_caption_set(flickr, "test")
    (text / "Flickr8k.token.txt").unlink()
    with pytest.raises(DataError, match=rf"^{text}/Flickr8k.token.txt: file not found \(the Flickr8k caption file\)$"):
        load_caption_set(flickr, "train")
    with pytest.raises(DataError, match=rf"^{flickr}: unknown split 'testing'; available: train, dev, test, all "
                                        r"\(val = dev\)$"):
        load_caption_set(flickr, "testing")


def test_only_the_image_folder_names_the_missing_text_files(tmp_path: Path) -> None:
    _jpg(tmp_path / "Flicker8k_Dataset" / "1000_a.jpg", (1, 2, 3))
    with pytest.raises(DataError, match=rf"^{tmp_path}/Flickr8k_text/Flickr_8k.trainImages.txt: file not found"):
        load_caption_set(tmp_path, "train")


def test_other_ways_of_unzipping(tmp_path: Path) -> None:
    flat = make_flickr8k(tmp_path / "flat", text=".", images=".")  # everything in one folder
    cs = load_caption_set(flat, "train")
    assert cs.images_dir == flat and len(check_images(cs)) == 3
    nested = make_flickr8k(tmp_path / "nested", text="Flickr8k_text/Flickr8k_text",
                           images="Flickr8k_Dataset/Flicker8k_Dataset")  # unzipped into folders named as the zips
    cs = load_caption_set(nested, "dev")
    assert cs.images_dir == nested / "Flickr8k_Dataset" / "Flicker8k_Dataset" and len(check_images(cs)) == 1
    spelled = make_flickr8k(tmp_path / "spelled", images="Flickr8k_Dataset")  # the misspelling corrected
    assert load_caption_set(spelled, "test").images_dir == spelled / "Flickr8k_Dataset"
    # both the folder and the top level hold text files: Flickr8k_text/ wins, whatever else is there
    (spelled / "Flickr8k.token.txt").write_text("1000_a.jpg#0\tsomething else\n")
    assert load_caption_set(spelled, "dev").num_captions == 2
    override = load_caption_set(spelled, "dev", images_dir=tmp_path / "pics")
    assert override.images[0].path == tmp_path / "pics" / "2000_d.jpg"


def test_feature_cache_file_name_reads_well(flickr: Path) -> None:
    from captioner.features.cache import cache_path

    assert cache_path("cache", load_caption_set(flickr, "dev"), "ab" * 32).name == "flickr8k_dev_abababababababab.feats"


def test_karpathy_flickr8k_file_with_dev_alias(flickr: Path) -> None:
    images = [{"filename": name, "imgid": i, "split": "val" if split == "dev" else split,
               "sentences": [{"raw": f"caption {i} .", "tokens": ["caption", str(i)]}]}
              for i, (split, name) in enumerate((s, n) for s, names in SPLITS.items() for n in names)]
    path = flickr / "dataset_flickr8k.json"
    path.write_text(json.dumps({"dataset": "flickr8k", "images": images}))
    for split, count in (("train", 4), ("val", 1), ("dev", 1), ("test", 1)):
        assert len(load_caption_set(path, split)) == count
    dev = load_caption_set(path, "dev")
    assert dev.split == "val" and dev.images[0].path == flickr / "Flicker8k_Dataset" / "2000_d.jpg"
    # a folder holding both: the Karpathy file is read (it was the layout found before this one existed)
    assert load_caption_set(flickr, "dev").name == "dataset_flickr8k"
    path.unlink()
    shutil.rmtree(flickr / "Flickr8k_text")
    with pytest.raises(DataError, match="Flickr_8k.devImages.txt: file not found"):
        load_caption_set(flickr, "dev")
