"""The real photos in ../shared/data load through the same API as everything else (skips when absent)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from captioner.config import EncoderConfig
from captioner.data.caption_set import check_images
from captioner.data.coco import load_caption_set, load_instances
from captioner.data.images import ImageTransform, crop_box, load_image
from captioner.errors import DataError
from captioner.models.registry import resolve_encoder
from captioner.text import Vocabulary


def test_coco2017_mini(shared_data: Path) -> None:
    root = shared_data / "coco2017-mini"
    cs = check_images(load_caption_set(root, "train2017"))
    assert (len(cs), cs.num_captions) == (80, 400)
    assert all(len(cs.references(r.image_id)) == 5 for r in cs.images)
    assert all(r.path.parent == root / "train2017" and r.width and r.height for r in cs.images)
    boxes = load_instances(root, "train2017")  # the official instances file of the same 80 photos
    assert boxes is not None and len(boxes) == 80
    assert sum(len(b) for b in boxes.values()) == 739  # every box, crowd boxes included (README of the data)
    with pytest.raises(DataError, match=r"unknown split 'train'; available: train2017, val2017_text_only$"):
        load_caption_set(root, "train")


def test_coco_val_text_only_captions(shared_data: Path) -> None:
    cs = load_caption_set(shared_data / "coco2017-mini", "val2017_text_only")
    assert len(cs) == 4841 and cs.num_captions == 24219
    vocab = Vocabulary.build(cs.all_captions(), min_freq=5)
    assert 2000 < len(vocab) < 4000 and "man" in vocab and "<unk>" in vocab


@pytest.mark.parametrize("split, images", [("train", 753), ("dev", 113), ("none", 9)])
def test_flickr8k_subset(shared_data: Path, split: str, images: int) -> None:
    cs = check_images(load_caption_set(shared_data / "flickr8k-subset", split))
    assert len(cs) == images and cs.num_captions == 5 * images


def test_real_images_through_transform(shared_data: Path) -> None:
    coco = load_caption_set(shared_data / "coco2017-mini", "train2017")
    flickr = load_caption_set(shared_data / "flickr8k-subset", "dev")
    cfg = EncoderConfig(name="tiny", pretrained=False, image_size=64, resize="center_crop")
    transform = ImageTransform(resolve_encoder(cfg))
    for record in coco.images[:4] + flickr.images[:4]:
        image = load_image(record.path)
        assert image.mode == "RGB"
        if record.width and record.height:
            assert image.size == (record.width, record.height)
        left, top, right, bottom = crop_box(*image.size, cfg)
        assert right - left == bottom - top == min(image.size)
        x = transform(image)
        assert x.shape == (3, 64, 64) and torch.isfinite(x).all() and x.std() > 0.05
