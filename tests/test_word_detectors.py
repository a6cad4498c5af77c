"""Encoder pretraining as multiple-instance word detectors (``captioner.training.word_detectors``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from captioner.config import get_preset
from captioner.data.coco import load_caption_set
from captioner.errors import ConfigError
from captioner.models.encoder import build_encoder
from captioner.text import Vocabulary, tokenize
from captioner.training.word_detectors import image_word_scores, pretrain_word_detectors, word_targets


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
