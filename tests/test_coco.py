"""load_caption_set over every layout, annotation validation, check_images and load_instances."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from PIL import Image

from captioner.data.caption_set import check_images
from captioner.data.coco import CaptionSet, load_caption_set, load_instances
from captioner.errors import DataError

CAPTIONS = {
    1: ["A red circle.", "A circle that is red."],
    2: ["Two blue squares.", "Blue squares, two of them."],
    3: ["A green star!", "One green star."],
}


def coco_dict(captions: dict[int, list[str]] = CAPTIONS) -> dict:
    images = [{"id": i, "file_name": f"img{i}.png", "width": 8, "height": 6} for i in captions]
    anns, k = [], 0
    for image_id, texts in captions.items():
        for text in texts:
            k += 1
            anns.append({"id": k, "image_id": image_id, "caption": text})
    return {"info": {}, "images": images, "annotations": anns}


def write_json(path: Path, data: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path


def write_images(folder: Path, names: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        Image.new("RGB", (8, 6), (1, 2, 3)).save(folder / name)


def test_flat_layout(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "myshapes"
    write_json(root / "captions_train.json", coco_dict())
    write_images(root / "images", ["img1.png", "img2.png", "img3.png"])
    cs = load_caption_set(root, "train")
    assert capsys.readouterr().out == ""  # pycocotools' progress prints are swallowed
    assert (cs.name, cs.split, cs.root, cs.images_dir) == ("myshapes", "train", root, root / "images")
    assert len(cs) == 3 and cs.num_captions == 6
    assert [r.image_id for r in cs.images] == [1, 2, 3]
    assert cs.images[1].path == root / "images" / "img2.png" and (cs.images[1].width, cs.images[1].height) == (8, 6)
    assert cs.references(2) == ["Two blue squares.", "Blue squares, two of them."]
    assert cs.all_captions() == [c for texts in CAPTIONS.values() for c in texts]
    assert check_images(cs) is cs


@pytest.mark.parametrize("split", ["train2017", "val2014"])
def test_official_coco_layout(tmp_path: Path, split: str) -> None:
    write_json(tmp_path / "annotations" / f"captions_{split}.json", coco_dict())
    write_images(tmp_path / split, ["img1.png", "img2.png", "img3.png"])
    cs = check_images(load_caption_set(tmp_path, split))
    assert cs.images_dir == tmp_path / split and cs.images[0].path == tmp_path / split / "img1.png"
    assert cs.split == split and len(cs) == 3


def test_official_layout_with_images_subfolder_and_override(tmp_path: Path) -> None:
    write_json(tmp_path / "annotations" / "captions_val2017.json", coco_dict())
    write_images(tmp_path / "images" / "val2017", ["img1.png"])
    assert load_caption_set(tmp_path, "val2017").images_dir == tmp_path / "images" / "val2017"
    other = tmp_path / "elsewhere"
    assert load_caption_set(tmp_path, "val2017", images_dir=other).images[2].path == other / "img3.png"


def test_flat_layout_with_split_folders(tmp_path: Path) -> None:
    """captions_<split>.json and instances_<split>.json at the root, the images in train/ and val/
    (an unrelated images/ folder does not hide them)."""
    root = tmp_path / "ds"
    write_json(root / "captions_train.json", coco_dict())
    write_json(root / "captions_val.json", coco_dict({7: ["A val picture."]}) | {
        "images": [{"id": 7, "file_name": "img7.png"}]})
    write_json(root / "instances_train.json", _instances(True))
    write_images(root / "train", ["img1.png", "img2.png", "img3.png"])
    write_images(root / "val", ["img7.png"])
    write_images(root / "images", ["unrelated.png"])
    train = check_images(load_caption_set(root, "train"))
    assert train.images_dir == root / "train" and train.images[2].path == root / "train" / "img3.png"
    assert len(train) == 3 and train.references(1) == CAPTIONS[1]
    val = check_images(load_caption_set(root, "val"))
    assert val.images_dir == root / "val" and val.images[0].path == root / "val" / "img7.png"
    assert load_instances(root, "train")[1][0].category == "square"
    assert load_caption_set(root / "captions_val.json", "val").images_dir == root / "val"  # the file itself


def test_flat_layout_prefers_the_folder_holding_the_images(tmp_path: Path) -> None:
    write_json(tmp_path / "captions_train.json", coco_dict())
    write_images(tmp_path / "train", ["img1.png"])
    write_images(tmp_path / "images", ["img1.png", "img2.png", "img3.png"])
    assert load_caption_set(tmp_path, "train").images_dir == tmp_path / "images"  # shapes layout unchanged
    write_images(tmp_path, ["img1.png"])
    (tmp_path / "images" / "img1.png").unlink()
    (tmp_path / "train" / "img1.png").unlink()
    assert load_caption_set(tmp_path, "train").images_dir == tmp_path / "images"  # img2 is found there
    for name in ("img2.png", "img3.png"):
        (tmp_path / "images" / name).unlink()
    assert load_caption_set(tmp_path, "train").images_dir == tmp_path  # beside captions_train.json


def _flickr(root: Path) -> Path:
    write_json(root / "captions_coco_format.json", coco_dict())
    (root / "splits.tsv").write_text("image\tsplit\nimg1.png\ttrain\nimg2.png\tdev\nimg3.png\ttrain\n")
    write_images(root / "images", ["img1.png", "img2.png", "img3.png"])
    return root


def test_flickr_subset_layout(tmp_path: Path) -> None:
    root = _flickr(tmp_path / "flickr")
    train = load_caption_set(root, "train")
    assert [r.image_id for r in train.images] == [1, 3] and train.images_dir == root / "images"
    assert [r.image_id for r in load_caption_set(root, "dev").images] == [2]
    assert len(load_caption_set(root, "all")) == 3
    assert len(load_caption_set(root / "captions_coco_format.json", "dev")) == 1  # the file itself works too
    with pytest.raises(DataError, match=f"^{root}: unknown split 'val'; available: train, dev, all$"):
        load_caption_set(root, "val")


def test_flickr_bad_split_line(tmp_path: Path) -> None:
    root = _flickr(tmp_path)
    (root / "splits.tsv").write_text("image\tsplit\nimg1.png train\n")
    with pytest.raises(DataError, match=r"splits.tsv: line 2: expected 'image<TAB>split', got 'img1.png train'$"):
        load_caption_set(root, "train")


def karpathy_dict() -> dict:
    def entry(cocoid: int, folder: str, split: str, sentences: list[dict]) -> dict:
        return {"filepath": folder, "filename": f"COCO_{cocoid}.jpg", "split": split, "cocoid": cocoid,
                "imgid": cocoid + 1000, "sentences": sentences}

    return {"dataset": "coco", "images": [
        entry(1, "train2014", "train", [{"raw": "A dog runs.", "tokens": ["a", "dog", "runs"]}]),
        entry(2, "val2014", "restval", [{"tokens": ["a", "cat", "sleeps"]}, {"raw": "A cat."}]),
        entry(3, "val2014", "val", [{"raw": "A bird."}]),
        entry(4, "val2014", "test", [{"raw": "A fish."}, {"raw": "  "}]),
    ]}


def test_karpathy_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_json(tmp_path / "dataset_coco.json", karpathy_dict())
    train = load_caption_set(path, "train")
    assert [r.image_id for r in train.images] == [1, 2]  # restval included by default, cocoid used
    assert train.images[1].path == tmp_path / "val2014" / "COCO_2.jpg"
    assert train.references(2) == ["a cat sleeps", "A cat."]  # tokens joined when there is no raw text
    assert train.name == "dataset_coco" and train.images[0].width is None
    assert [r.image_id for r in load_caption_set(path, "train", include_restval=False).images] == [1]
    with caplog.at_level(logging.WARNING):
        test = load_caption_set(path, "test")
    assert test.references(4) == ["A fish."] and "dropped 1 empty caption(s)" in caplog.text
    override = load_caption_set(path, "val", images_dir=tmp_path / "coco")
    assert override.images[0].path == tmp_path / "coco" / "val2014" / "COCO_3.jpg"
    assert len(load_caption_set(tmp_path, "val")) == 1  # the only dataset_*.json of a folder is found
    dev = load_caption_set(path, "dev")  # the Flickr8k name of val, so one command serves both layouts
    assert [r.image_id for r in dev.images] == [3] and dev.split == "val"
    with pytest.raises(DataError, match=f"^{path}: unknown split 'devel'; available: train, restval, val, test, all$"):
        load_caption_set(path, "devel")


def test_karpathy_flickr_style_uses_imgid(tmp_path: Path) -> None:
    data = {"images": [{"filename": "a.jpg", "split": "train", "imgid": 7, "sentences": [{"raw": "x y"}]}]}
    path = write_json(tmp_path / "dataset_flickr8k.json", data)
    cs = load_caption_set(path, "train", images_dir=tmp_path / "Flicker8k_Dataset")
    assert cs.images[0].image_id == 7 and cs.images[0].path == tmp_path / "Flicker8k_Dataset" / "a.jpg"
    del data["images"][0]["filename"]
    write_json(path, data)
    with pytest.raises(DataError, match=rf"^{path}: images\[0\] has no 'filename'$"):
        load_caption_set(path, "train")


def test_direct_coco_json(tmp_path: Path) -> None:
    path = write_json(tmp_path / "ann" / "captions_mine.json", coco_dict())
    write_images(tmp_path / "pics", ["img1.png", "img2.png", "img3.png"])
    cs = check_images(load_caption_set(path, "mine", images_dir=tmp_path / "pics"))
    assert len(cs) == 3 and cs.root == path
    assert len(load_caption_set(path, "all", images_dir=tmp_path / "pics")) == 3
    message = f"^{path}: unknown split 'train'; this file holds one split, available: mine, all$"
    with pytest.raises(DataError, match=message):
        load_caption_set(path, "train")


def test_layout_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match=f"^{missing}: dataset path does not exist$"):
        load_caption_set(missing, "train")
    with pytest.raises(DataError, match=rf"^{tmp_path}: no caption data found; the layouts that load: "
                                        r"flat COCO folder \(captions_train.json\), official COCO "
                                        r"\(annotations/captions_train.json\), Flickr8k in COCO format "
                                        r"\(captions_coco_format.json \+ splits.tsv\), Karpathy split file "
                                        r"\(dataset_\*.json\), Flickr8k official \(Flickr8k_text/Flickr8k.token.txt "
                                        r"\+ Flickr_8k.<split>Images.txt\)$"):
        load_caption_set(tmp_path, "train")
    write_json(tmp_path / "captions_train.json", coco_dict())
    write_json(tmp_path / "annotations" / "captions_val2017.json", coco_dict())
    with pytest.raises(DataError, match=f"^{tmp_path}: unknown split 'test'; available: train, val2017$"):
        load_caption_set(tmp_path, "test")
    other = write_json(tmp_path / "other.json", {"hello": 1})
    with pytest.raises(DataError, match=f"^{other}: not a COCO captions file"):
        load_caption_set(other, "train")


def test_invalid_json_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "captions_train.json"
    path.write_text('{\n  "images": [],\n  "annotations": [,]\n}')
    with pytest.raises(DataError, match=f"^{path}: invalid JSON at line 3, column 19 \\(Expecting value\\)$"):
        load_caption_set(tmp_path, "train")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["annotations"][4].pop("caption"), "annotation 4 has no 'caption'"),
    (lambda d: d["annotations"][1].pop("image_id"), "annotation 1 has no 'image_id'"),
    (lambda d: d["annotations"][2].update(image_id=99), "annotation 2 refers to unknown image id 99"),
    (lambda d: d["annotations"][0].update(caption=None), "annotation 0 has a caption that is not a string"),
    (lambda d: d["images"][1].pop("file_name"), "image 1 has no 'file_name'"),
    (lambda d: d["images"][1].update(id="abc"), "image 1 has a non-integer id 'abc'"),
    (lambda d: d["images"][2].update(id=1), "image 2 repeats image id 1"),
    (lambda d: d.pop("annotations"), "no 'annotations' list"),
])
def test_annotation_validation(tmp_path: Path, edit, message: str) -> None:
    data = coco_dict()
    edit(data)
    path = write_json(tmp_path / "captions_train.json", data)
    with pytest.raises(DataError, match=f"^{path}: {message}$"):
        load_caption_set(tmp_path, "train")


def test_empty_captions_and_uncaptioned_images(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = coco_dict({1: ["A cat.", "  ", "..."], 2: ["", "!"], 3: ["A dog."]})
    write_json(tmp_path / "captions_train.json", data)
    with caplog.at_level(logging.WARNING):
        cs = load_caption_set(tmp_path, "train")
    assert [r.image_id for r in cs.images] == [1, 3] and cs.references(1) == ["A cat."]
    assert "dropped 4 empty caption(s)" in caplog.text and "skipped 1 image(s) without captions" in caplog.text
    path = write_json(tmp_path / "captions_val.json", coco_dict({1: [" "], 2: []}))
    with pytest.raises(DataError, match=f"^{path}: split 'val' has no captioned images$"):
        load_caption_set(tmp_path, "val")


def test_caption_whitespace_is_normalised(tmp_path: Path) -> None:
    write_json(tmp_path / "captions_train.json", coco_dict({1: ["  A  red\ncircle. "]}))
    assert load_caption_set(tmp_path, "train").references(1) == ["A red circle."]


def _set_with_files(tmp_path: Path, present: list[int]) -> CaptionSet:
    captions = {i: [f"caption {i}"] for i in range(1, 6)}
    write_json(tmp_path / "captions_train.json", coco_dict(captions))
    write_images(tmp_path / "images", [f"img{i}.png" for i in present])
    return load_caption_set(tmp_path, "train")


def test_check_images_reports_missing(tmp_path: Path) -> None:
    cs = _set_with_files(tmp_path, [2, 4])
    expected = (f"3 of 5 image files are missing (e.g. img1.png, img3.png, img5.png) under {tmp_path / 'images'}; "
                "pass --skip-missing to skip them")
    with pytest.raises(DataError) as info:
        check_images(cs)
    assert str(info.value) == expected


def test_check_images_skip_missing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cs = _set_with_files(tmp_path, [2, 4])
    with caplog.at_level(logging.WARNING):
        kept = check_images(cs, skip_missing=True)
    assert [r.image_id for r in kept.images] == [2, 4] and set(kept.captions) == {2, 4}
    assert len(cs) == 5  # the original is untouched
    assert "skipping 3 of 5 images" in caplog.text


def test_check_images_all_missing(tmp_path: Path) -> None:
    cs = _set_with_files(tmp_path, [])
    with pytest.raises(DataError, match=r"^all 5 image files are missing \(e.g. img1.png, img2.png, img3.png\)"):
        check_images(cs, skip_missing=True)


def test_all_missing_names_the_layouts_and_data_images(tmp_path: Path) -> None:
    """Images in a folder no layout looks in: one line saying where they may be and how to point at them."""
    write_json(tmp_path / "captions_train.json", coco_dict())
    write_images(tmp_path / "pictures" / "train", ["img1.png", "img2.png", "img3.png"])
    with pytest.raises(DataError) as info:
        check_images(load_caption_set(tmp_path, "train"))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"all 3 image files are missing (e.g. img1.png, img2.png, img3.png) under {tmp_path}; "
                              "the layouts that load keep images in images/, <split>/ or the dataset folder beside "
                              "captions_<split>.json; in <split>/ or images/<split>/ beside annotations/; ")
    assert message.endswith("otherwise point at the image folder: --set data.images=DIR (train), --images DIR "
                            "(evaluate)")
    assert "captions_coco_format.json" in message and "dataset_*.json" in message
    # following the advice loads it
    assert len(check_images(load_caption_set(tmp_path, "train", images_dir=tmp_path / "pictures" / "train"))) == 3


def _instances(with_attributes: bool) -> dict:
    data = coco_dict()
    data["categories"] = [{"id": 1, "name": "circle"}, {"id": 2, "name": "square"}]
    box = {"id": 1, "image_id": 1, "category_id": 2, "bbox": [1, 2, 3, 4], "area": 12, "iscrowd": 0}
    if with_attributes:
        box.update(color="red", size="small")
    data["annotations"] = [box]
    return data


def test_load_instances_flat_and_official(tmp_path: Path) -> None:
    write_json(tmp_path / "flat" / "instances_train.json", _instances(True))
    boxes = load_instances(tmp_path / "flat", "train")
    assert boxes[1][0].category == "square" and boxes[1][0].bbox == (1.0, 2.0, 3.0, 4.0)
    assert boxes[1][0].attributes == {"color": "red", "size": "small"}
    assert boxes[2] == [] and boxes[3] == []
    write_json(tmp_path / "coco" / "annotations" / "instances_val2017.json", _instances(False))
    assert load_instances(tmp_path / "coco", "val2017")[1][0].attributes == {}
    assert load_instances(tmp_path / "coco", "train2017") is None


def test_load_instances_bad_category(tmp_path: Path) -> None:
    data = _instances(True)
    data["annotations"][0]["category_id"] = 9
    path = write_json(tmp_path / "instances_train.json", data)
    with pytest.raises(DataError, match=f"^{path}: annotation 0 has unknown category_id 9$"):
        load_instances(tmp_path, "train")


def test_train_cli_says_where_images_may_be_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from captioner.cli import main

    root = tmp_path / "ds"
    for split in ("train", "val"):
        write_json(root / f"captions_{split}.json", coco_dict())
    write_images(root / "photos", ["img1.png", "img2.png", "img3.png"])
    assert main(["train", "--preset", "sat_soft_tiny", "--data", str(root), "--out", str(tmp_path / "run"),
                 "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"captioner train: error: all 3 image files are missing (e.g. img1.png, img2.png, "
                          f"img3.png) under {root}; the layouts that load ")
    assert "--set data.images=DIR (train)" in err and err.count("\n") == 1


def test_every_name_captioner_data_exports_resolves_and_check_images_works(tmp_path: Path) -> None:
    import captioner.data

    for name in captioner.data.__all__:
        assert getattr(captioner.data, name).__name__ == name  # each lazy export lands in its defining module
    write_json(tmp_path / "captions_train.json", coco_dict())
    write_images(tmp_path / "images", ["img1.png", "img2.png", "img3.png"])
    cs = captioner.data.load_caption_set(tmp_path, "train")
    assert captioner.data.check_images(cs) is cs


def test_the_validation_split_is_found_by_any_of_its_names(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from captioner.data.coco import load_validation_set

    data = {"images": [{"id": 1, "file_name": "a.jpg"}], "annotations": [{"id": 1, "image_id": 1, "caption": "a"}]}
    (tmp_path / "captions_train.json").write_text(json.dumps(data))
    (tmp_path / "captions_validation.json").write_text(json.dumps(data))
    with caplog.at_level(logging.INFO, logger="captioner"):
        assert load_validation_set(tmp_path, "val").split == "validation"
    assert any("has no 'val' split: validating on its 'validation' split" in r.getMessage() for r in caplog.records)
    with pytest.raises(DataError, match=r"unknown split 'holdout'; available: train, validation; name the validation "
                                        r"split with --set data.val_split=NAME$"):
        load_validation_set(tmp_path, "holdout")  # a name of the user's own: not replaced by a guess
