"""Encoder transforms (geometry, normalisation) and the caption datasets / collate functions."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from captioner.config import EncoderConfig
from captioner.data.coco import load_caption_set
from captioner.data.dataset import (CaptionEvalDataset, CaptionTrainDataset, collate_captions, collate_images,
                                    image_loader)
from captioner.data.images import ImageTransform, crop_box, denormalize
from captioner.errors import ImageLoadError
from captioner.models.registry import resolve_encoder
from captioner.text import Vocabulary

RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def to_pil(x: torch.Tensor, cfg: EncoderConfig) -> Image.Image:
    """A normalised (3, S, S) tensor back to a PIL RGB image (for display and debugging)."""
    pixels = denormalize(x.detach().float().cpu(), cfg).mul(255.0).round().byte()  # (3, S, S)
    return Image.fromarray(pixels.permute(1, 2, 0).numpy())


def enc(**kw) -> EncoderConfig:
    """A tiny encoder's config at 16 px, its preprocessing filled in as when the model is built."""
    return resolve_encoder(EncoderConfig(name="tiny", pretrained=False, image_size=kw.pop("image_size", 16), **kw))


def stripes(width: int, height: int, colors: list[tuple[int, int, int]], vertical: bool = True) -> Image.Image:
    """Equal bands of colour, left to right (vertical) or top to bottom."""
    image = Image.new("RGB", (width, height))
    n = len(colors)
    for k, c in enumerate(colors):
        box = (k * width // n, 0, (k + 1) * width // n, height) if vertical else \
              (0, k * height // n, width, (k + 1) * height // n)
        image.paste(c, box)
    return image


# ----------------------------------------------------------------------------- transforms


def test_crop_box_geometry() -> None:
    stretch, crop = enc(resize="stretch"), enc(resize="center_crop")
    assert crop_box(640, 480, stretch) == (0, 0, 640, 480)
    assert crop_box(60, 20, crop) == (20, 0, 40, 20)
    assert crop_box(20, 61, crop) == (0, 20, 20, 40)
    assert crop_box(33, 33, crop) == (0, 0, 33, 33)


def test_normalisation_uses_config_mean_std() -> None:
    cfg = enc(mean=(0.5, 0.25, 0.0), std=(0.5, 0.25, 2.0))
    x = ImageTransform(cfg)(Image.new("RGB", (10, 7), (255, 51, 102)))
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32
    expected = torch.tensor([(1.0 - 0.5) / 0.5, (0.2 - 0.25) / 0.25, 0.4 / 2.0])
    assert torch.allclose(x.mean(dim=(1, 2)), expected, atol=1e-6)
    assert torch.allclose(x.std(dim=(1, 2)), torch.zeros(3), atol=1e-6)


def test_stretch_keeps_whole_image_and_center_crop_cuts_sides() -> None:
    image = stripes(60, 20, [RED, GREEN, BLUE])
    stretched = to_pil(ImageTransform(enc(resize="stretch"))(image), enc())
    assert stretched.getpixel((1, 8)) == RED and stretched.getpixel((8, 8)) == GREEN
    assert stretched.getpixel((14, 8)) == BLUE
    cropped = to_pil(ImageTransform(enc(resize="center_crop"))(image), enc())
    assert {cropped.getpixel((x, y)) for x in range(16) for y in range(16)} == {GREEN}


def test_center_crop_portrait() -> None:
    image = stripes(20, 60, [RED, GREEN, BLUE], vertical=False)
    cropped = to_pil(ImageTransform(enc(resize="center_crop"))(image), enc())
    assert {cropped.getpixel((x, y)) for x in range(16) for y in range(16)} == {GREEN}


def test_interpolation_is_read_from_config() -> None:
    image = Image.effect_noise((50, 50), 80).convert("RGB")
    bilinear = ImageTransform(enc(interpolation="bilinear"))(image)
    bicubic = ImageTransform(enc(interpolation="bicubic"))(image)
    expected = torch.from_numpy(__import__("numpy").asarray(
        image.resize((16, 16), Image.Resampling.BICUBIC), dtype="float32")).permute(2, 0, 1) / 255
    cfg = enc()
    assert torch.allclose(denormalize(bicubic, cfg), expected, atol=1e-5)
    assert not torch.allclose(bilinear, bicubic)


def test_denormalize_batch_and_non_rgb_input() -> None:
    cfg = enc()
    x = ImageTransform(cfg)(Image.new("L", (9, 9), 128))
    batch = torch.stack([x, x])  # (2, 3, S, S)
    out = denormalize(batch, cfg)
    assert out.shape == (2, 3, 16, 16) and torch.allclose(out, torch.full_like(out, 128 / 255), atol=1e-6)


# ----------------------------------------------------------------------------- datasets


@pytest.fixture()
def tiny_set(tmp_path: Path):
    colors = {1: RED, 2: GREEN, 3: BLUE}
    captions = {1: ["a red image", "red all over the place here"], 2: ["a green image"], 3: ["blue", "a blue one"]}
    (tmp_path / "images").mkdir()
    images, anns = [], []
    for image_id, color in colors.items():
        Image.new("RGB", (12, 10), color).save(tmp_path / "images" / f"{image_id}.png")
        images.append({"id": image_id, "file_name": f"{image_id}.png"})
        anns += [{"id": len(anns) + k + 1, "image_id": image_id, "caption": c}
                 for k, c in enumerate(captions[image_id])]
    (tmp_path / "captions_train.json").write_text(json.dumps({"images": images, "annotations": anns}))
    cs = load_caption_set(tmp_path, "train")
    return cs, Vocabulary.build(cs.all_captions())


def test_image_loader(tiny_set) -> None:
    cs, _ = tiny_set
    cfg = enc(image_size=16)
    load = image_loader(cs, ImageTransform(resolve_encoder(cfg)))
    x = load(1)
    assert x.shape == (3, 16, 16)
    assert to_pil(x, cfg).getpixel((8, 8)) == GREEN
    clone = pickle.loads(pickle.dumps(load))  # DataLoader workers may need to pickle it
    assert torch.equal(clone(2), load(2))
    cs.images[0].path.unlink()
    with pytest.raises(ImageLoadError, match="1.png: file not found$"):
        load(0)


def test_train_dataset_items(tiny_set) -> None:
    cs, vocab = tiny_set
    ds = CaptionTrainDataset(cs, vocab, load=lambda i: torch.full((4, 2), float(i)), max_len=3)
    assert len(ds) == cs.num_captions == 5
    texts = [(r.image_id, c) for r in cs.images for c in cs.captions[r.image_id]]
    for item, (image_id, caption) in enumerate(texts):
        x, tokens, index = ds[item]
        assert cs.images[index].image_id == image_id
        assert torch.equal(x, torch.full((4, 2), float(index)))  # x is whatever load returns
        assert tokens.dtype == torch.long and tokens.tolist() == vocab.encode(caption, 3)
    assert ds[1][1].tolist()[1:-1] == [vocab.stoi[w] for w in ("red", "all", "over")]  # cut to 3 words
    assert ds.lengths.tolist() == [5, 5, 5, 3, 5]


def test_eval_dataset_items(tiny_set) -> None:
    cs, _ = tiny_set
    ds = CaptionEvalDataset(cs, load=lambda i: torch.tensor([i]))
    assert len(ds) == 3 and [ds[i][1] for i in range(3)] == [0, 1, 2] and ds[2][0].item() == 2


def test_collate_captions_pads_with_zero() -> None:
    batch = [(torch.ones(3, 4, 4), torch.tensor([1, 7, 2]), 5),
             (torch.zeros(3, 4, 4), torch.tensor([1, 8, 9, 10, 2]), 0)]
    x, tokens, index = collate_captions(batch)
    assert x.shape == (2, 3, 4, 4) and x[0].sum() == 48
    assert tokens.tolist() == [[1, 7, 2, 0, 0], [1, 8, 9, 10, 2]] and tokens.dtype == torch.long
    assert index.tolist() == [5, 0] and index.dtype == torch.long


def test_collate_images() -> None:
    x, index = collate_images([(torch.zeros(16, 8), 3), (torch.ones(16, 8), 1)])
    assert x.shape == (2, 16, 8) and index.tolist() == [3, 1]


def test_dataloader_end_to_end(tiny_set) -> None:
    cs, vocab = tiny_set
    cfg = enc(image_size=16)
    ds = CaptionTrainDataset(cs, vocab, image_loader(cs, ImageTransform(resolve_encoder(cfg))), max_len=10)
    batches = list(DataLoader(ds, batch_size=2, collate_fn=collate_captions))
    assert [b[0].shape[0] for b in batches] == [2, 2, 1]
    x, tokens, index = batches[0]
    assert x.shape == (2, 3, 16, 16) and tokens.shape == (2, 8)  # "red all over the place here" + bos/eos
    assert (tokens[0, 5:] == 0).all() and index.tolist() == [0, 0]


def test_length_buckets_visit_every_caption_once_in_batches_of_similar_length() -> None:
    from torch.utils.data import DistributedSampler

    from captioner.training.data import LengthBuckets, SkipSampler

    gen = np.random.default_rng(0)
    lengths = gen.integers(3, 30, size=1000)  # token counts of 1,000 captions
    base = DistributedSampler(range(1000), num_replicas=1, rank=0, shuffle=True, seed=0)
    base.set_epoch(3)
    order = list(LengthBuckets(base, lengths, batch_size=32, pool_batches=10, seed=3))
    assert sorted(order) == list(range(1000))  # a permutation: every caption once
    batches = [order[i:i + 32] for i in range(0, 1000, 32)]
    padded = sum(max(lengths[b]) * len(b) for b in batches)
    random = sum(max(lengths[b]) * len(b) for b in (list(base)[i:i + 32] for i in range(0, 1000, 32)))
    assert padded < 0.75 * random  # far less padding than random batches
    assert order == list(LengthBuckets(base, lengths, 32, 10, seed=3))  # same seed, same order (resume)
    assert order != list(LengthBuckets(base, lengths, 32, 10, seed=4))  # the batch order is shuffled
    pool = set(list(base)[:320])  # a pool's batches come from the base order's first 320 captions
    assert set(order[:320]) == pool
    skipped = list(SkipSampler(LengthBuckets(base, lengths, 32, 10, seed=3), 64))
    assert skipped == order[64:]  # mid-epoch resume skips whole batches of the same order


def test_prefetched_batches_equal_the_serial_loader():
    """The threaded reader gives the DataLoader's batches, in order, errors included."""
    from torch.utils.data import DataLoader

    from captioner.data.dataset import SafeImages, collate_safe, prefetched_batches

    def load(i: int) -> torch.Tensor:
        if i == 3:
            raise ImageLoadError("img3.jpg: truncated or corrupt image")
        return torch.full((2, 2), float(i))

    data = SafeImages(load, 7)
    ours = list(prefetched_batches(data, 3))
    theirs = list(DataLoader(data, batch_size=3, collate_fn=collate_safe))
    assert len(ours) == len(theirs) == 3
    for (xa, ia, ea), (xb, ib, eb) in zip(ours, theirs):
        assert ia == ib and ea == eb and torch.equal(xa, xb)
    assert ours[1][1] == [3, 4, 5] and ours[1][2][0] == "img3.jpg: truncated or corrupt image"
    assert ours[1][0].shape == (2, 2, 2)  # the two readable images of that batch
    assert list(prefetched_batches(SafeImages(load, 0), 3)) == []
