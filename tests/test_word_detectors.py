"""Encoder pretraining as multiple-instance word detectors (``captioner.training.detectors``)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from captioner.config import get_preset
from captioner.data.coco import load_caption_set, load_instances
from captioner.data.images import crop_box
from captioner.errors import ConfigError
from captioner.models.encoder import build_encoder
from captioner.text import Vocabulary, tokenize
from captioner.training.attention_terms import GroundingTargets
from captioner.training.detectors import (PERMUTATIONS, RegionTargets, colour_words, image_word_scores,
                                          pretrain_word_detectors, recolour_batch, region_loss, word_targets)


def test_word_targets_mark_every_word_of_any_caption_of_the_image(tiny_shapes: Path) -> None:
    cs = load_caption_set(tiny_shapes, "train")
    vocab = Vocabulary.build(cs.all_captions())
    targets = word_targets(cs, vocab)
    assert targets.shape == (len(cs.images), len(vocab))
    assert not targets[:, : vocab.unk_id + 1].any()  # specials and <unk> are never targets
    record = cs.images[0]
    words = {w for c in cs.captions[record.image_id] for w in tokenize(c)}
    on = {vocab.itos[i] for i in torch.nonzero(targets[0]).flatten().tolist()}
    assert on == words


def test_image_score_is_a_soft_maximum_over_regions() -> None:
    scores = torch.tensor([[[0.0, 3.0, -1.0, 2.9]]])  # (B=1, V=1, N=4)
    soft = image_word_scores(scores, sharpness=4.0)
    assert scores.max() <= soft.item() <= scores.max() + math.log(4) / 4
    assert image_word_scores(scores, sharpness=50.0).item() == pytest.approx(3.0, abs=0.05)


def test_pretraining_lowers_the_loss_and_writes_weights_the_encoder_loads(tiny_shapes: Path, tmp_path: Path) -> None:
    cfg = get_preset("sat_soft_tiny", **{"data.root": str(tiny_shapes)})
    out = tmp_path / "encoder.safetensors"
    result = pretrain_word_detectors(cfg, out, max_steps=60, batch_size=16, progress=False)
    assert result.steps == 60 and out.is_file() and not list(tmp_path.glob("*.tmp"))
    assert result.last_loss < 0.8 * result.first_loss  # the detectors learn the captions' words
    enc_cfg = cfg.model.encoder
    enc_cfg.pretrained, enc_cfg.weights = True, str(out)
    trained = build_encoder(enc_cfg)  # strict load: the file holds exactly the trunk
    enc_cfg.pretrained, enc_cfg.weights = False, None
    torch.manual_seed(cfg.train.seed)
    fresh = build_encoder(enc_cfg)
    x = torch.randn(2, 3, enc_cfg.image_size, enc_cfg.image_size)
    with torch.no_grad():
        a, grid = trained.eval()(x)
        b, _ = fresh.eval()(x)
    assert grid == (enc_cfg.grid, enc_cfg.grid) and not torch.allclose(a, b)


def test_pretraining_needs_a_stopping_rule(tiny_shapes: Path, tmp_path: Path) -> None:
    cfg = get_preset("sat_soft_tiny", **{"data.root": str(tiny_shapes)})
    with pytest.raises(ConfigError, match="seconds or max_steps"):
        pretrain_word_detectors(cfg, tmp_path / "w.safetensors")
    with pytest.raises(ConfigError, match="batch_size"):
        pretrain_word_detectors(cfg, tmp_path / "w.safetensors", max_steps=1, batch_size=0)


def _region_targets(root: Path, grid: int = 4) -> tuple:
    cfg = get_preset("sat_soft_tiny", **{"data.root": str(root), "model.encoder.grid": grid})
    cs = load_caption_set(root, "train")
    vocab = Vocabulary.build(cs.all_captions())
    instances = load_instances(root, "train")
    view = lambda w, h: crop_box(w, h, cfg.model.encoder)  # noqa: E731
    return cs, vocab, instances, view, RegionTargets.build(cs, vocab, GroundingTargets(cs.images, instances, vocab,
                                                                                      view, grid))


def test_region_targets_put_each_colour_word_on_its_own_object(tiny_shapes: Path) -> None:
    cs, vocab, instances, view, regions = _region_targets(tiny_shapes)
    assert regions.grounded_images == len(cs.images)  # every scene has boxes and names its objects
    checked = 0
    for c, record in enumerate(cs.images):
        objects = instances[record.image_id]
        words = {w for caption in cs.captions[record.image_id] for w in tokenize(caption)}
        assert {vocab.itos[w] for w in regions.per_image[c]} <= words  # only words the captions say
        colours = [o.attributes.get("color") for o in objects]
        for obj in objects:  # a colour no other object has: its word lies on this object only
            colour = obj.attributes.get("color")
            if colours.count(colour) != 1 or vocab.stoi.get(colour) not in regions.per_image[c]:
                continue
            coverage = regions.per_image[c][vocab.stoi[colour]].reshape(4, 4)
            left, top, right, bottom = view(*record.size())
            x, y, w, h = obj.bbox
            cols = [int((v - left) / (right - left) * 4) for v in (x, x + w / 2, min(x + w, right - 1e-6))]
            rows = [int((v - top) / (bottom - top) * 4) for v in (y, y + h / 2, min(y + h, bottom - 1e-6))]
            assert coverage[rows[1], cols[1]] > 0  # the region of the object's centre
            outside = np.ones((4, 4), dtype=bool)
            outside[rows[0]: rows[2] + 1, cols[0]: cols[2] + 1] = False
            assert coverage[outside].sum() == 0  # and nothing off the object's box
            checked += 1
    assert checked >= 20


def test_region_targets_batch_and_loss() -> None:
    per_image = [{5: np.array([1.0, 0.0, 0.0, 0.5], dtype=np.float32)}, {}]
    regions = RegionTargets(per_image, vocab_size=8, regions=4)
    target, mask = regions.batch(torch.tensor([1, 0, 0]))
    assert target.shape == (3, 8, 4) and mask.tolist() == [[False] * 8, [i == 5 for i in range(8)],
                                                           [i == 5 for i in range(8)]]
    assert target[1, 5].tolist() == [1.0, 0.0, 0.0, 0.5] and target[0].sum() == 0
    right = torch.full((3, 8, 4), -6.0)
    right[:, 5, 0] = 6.0
    wrong = -right
    assert region_loss(right, target, mask) < region_loss(wrong, target, mask)
    assert region_loss(wrong, target, torch.zeros_like(mask)).item() == 0.0  # nothing supervised: no term
    scores = torch.zeros(3, 8, 4, requires_grad=True)
    region_loss(scores, target, mask).backward()
    assert scores.grad[0].abs().sum() == 0 and scores.grad[1, 5].abs().sum() > 0  # only supervised pairs


def test_pretraining_with_boxes_trains_words_region_by_region(tiny_shapes: Path, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    cfg = get_preset("sat_soft_tiny", **{"data.root": str(tiny_shapes)})
    result = pretrain_word_detectors(cfg, tmp_path / "boxes.safetensors", max_steps=3, batch_size=8, progress=False,
                                     boxes=True)
    assert result.grounded_images == len(load_caption_set(tiny_shapes, "train").images)
    plain = pretrain_word_detectors(cfg, tmp_path / "plain.safetensors", max_steps=3, batch_size=8, progress=False)
    assert plain.grounded_images == 0 and result.first_loss > plain.first_loss  # the region term is added


def test_pretraining_with_boxes_but_none_warns_and_uses_mil(tiny_shapes: Path, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "no_boxes"
    root.mkdir()
    for f in tiny_shapes.iterdir():
        if not f.name.startswith("instances_"):
            (root / f.name).symlink_to(f)
    cfg = get_preset("sat_soft_tiny", **{"data.root": str(root)})
    with caplog.at_level("WARNING"):
        result = pretrain_word_detectors(cfg, tmp_path / "w.safetensors", max_steps=2, batch_size=8, progress=False,
                                         boxes=True)
    assert result.grounded_images == 0 and "no object boxes" in caplog.text


def test_recolour_permutes_the_colour_channels_of_about_that_share() -> None:
    pixels = torch.rand(400, 3, 4, 4)
    original = pixels.clone()
    flipped = recolour_batch(pixels, 0.5, torch.Generator().manual_seed(0))
    assert 0.4 < flipped.float().mean() < 0.6
    assert torch.equal(pixels[~flipped], original[~flipped])
    for b in flipped.nonzero().flatten().tolist():  # some non-identity permutation of that image's channels
        assert any(torch.equal(pixels[b], original[b, list(p)]) for p in PERMUTATIONS[1:])
        assert not torch.equal(pixels[b], original[b])
    none = torch.rand(8, 3, 2, 2)
    assert not recolour_batch(none.clone(), 0.0, torch.Generator()).any()


def test_colour_words_are_the_hues_of_the_vocabulary() -> None:
    vocab = Vocabulary.build(["a red circle", "a white dog on green grass", "a cyan star"])
    marked = {vocab.itos[i] for i in torch.nonzero(colour_words(vocab)).flatten().tolist()}
    assert marked == {"red", "green", "cyan"}  # white keeps its truth under a channel permutation


def test_pretraining_with_recolouring(tiny_shapes: Path, tmp_path: Path) -> None:
    cfg = get_preset("sat_soft_tiny", **{"data.root": str(tiny_shapes)})
    plain = pretrain_word_detectors(cfg, tmp_path / "plain.safetensors", max_steps=3, batch_size=8, progress=False,
                                    boxes=True)
    mixed = pretrain_word_detectors(cfg, tmp_path / "mixed.safetensors", max_steps=3, batch_size=8, progress=False,
                                    boxes=True, recolour=0.5)
    assert mixed.first_loss != plain.first_loss  # other pixels, fewer targets
    with pytest.raises(ConfigError, match="recolour"):
        pretrain_word_detectors(cfg, tmp_path / "w.safetensors", max_steps=1, recolour=1.5)
