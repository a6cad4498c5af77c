"""Attention supervised by object boxes (issue 24): targets on the grid, phrase binding, the loss, the hook."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from captioner.config import Config, EncoderConfig, get_preset
from captioner.data.coco import ObjectBox, load_caption_set, load_instances
from captioner.data.images import crop_box
from captioner.errors import ConfigError
from captioner.evaluation.attention_metrics import attention_mass, bind_mentions, box_coverage, find_mentions
from captioner.text import Vocabulary, tokenize
from captioner.training.attention_terms import GroundingTargets, grounding_loss



# ----------------------------------------------------------------------------- targets on the grid


def test_box_coverage_of_a_known_box_on_a_known_grid() -> None:
    # 64 x 64 image, 4 x 4 grid: cells of 16 px. The box x 8..40, y 16..32 covers row 1 only:
    # column 0 half (8..16), column 1 whole, column 2 half (32..40).
    cov = box_coverage([(8, 16, 32, 16)], (0, 0, 64, 64), 4).reshape(4, 4)
    expected = np.zeros((4, 4))
    expected[1] = [0.5, 1.0, 0.5, 0.0]
    np.testing.assert_allclose(cov, expected, atol=1e-6)
    # two boxes: their union, cell by cell
    two = box_coverage([(8, 16, 32, 16), (0, 48, 16, 16)], (0, 0, 64, 64), 4).reshape(4, 4)
    expected[3, 0] = 1.0
    np.testing.assert_allclose(two, expected, atol=1e-6)
    assert not box_coverage([], (0, 0, 64, 64), 4).any()


def test_box_coverage_follows_the_centre_crop() -> None:
    # 128 x 64 image, centre crop = x 32..96: a box at x 32..48 is the whole first column of a 4 x 4 grid
    view = crop_box(128, 64, EncoderConfig(resize="center_crop"))
    assert view == (32, 0, 96, 64)
    cov = box_coverage([(32, 0, 16, 64)], view, 4).reshape(4, 4)
    np.testing.assert_allclose(cov[:, 0], 1.0)
    assert cov[:, 1:].sum() == 0
    assert not box_coverage([(0, 0, 30, 64)], view, 4).any()  # outside the view: nothing to attend to


def test_coverage_weighted_attention_is_the_metrics_mass_in_box() -> None:
    rng = np.random.default_rng(0)
    att = rng.random((7, 7))
    att /= att.sum()
    boxes = [(13.0, 22.0, 61.0, 40.0)]
    view = (0, 0, 112, 112)
    cov = box_coverage(boxes, view, 7)
    assert float((att.reshape(-1) * cov).sum()) == pytest.approx(attention_mass(att, boxes, (112, 112), view),
                                                                 abs=2e-3)


# ----------------------------------------------------------------------------- phrase binding


def shape(category: str, color: str, size: str = "small", x: float = 0.0) -> ObjectBox:
    return ObjectBox(category, (x, 0.0, 10.0, 10.0), {"color": color, "size": size})


def test_phrase_words_point_at_their_own_box() -> None:
    words = tokenize("A small purple star to the left of a large green triangle.")
    objects = [shape("triangle", "green", "large"), shape("star", "purple")]
    bound = bind_mentions(find_mentions(words, "shapes"), objects)
    assert [(words[t], boxes) for t, boxes in bound] == [
        ("small", (1,)), ("purple", (1,)), ("star", (1,)),  # colour and size words bind to the star's box
        ("large", (0,)), ("green", (0,)), ("triangle", (0,))]


def test_a_word_with_no_box_binds_nothing() -> None:
    words = tokenize("A red circle and a blue square.")
    bound = bind_mentions(find_mentions(words, "shapes"), [shape("square", "blue")])
    assert [words[t] for t, _ in bound] == ["blue", "square"]  # the circle is not in the image
    assert bind_mentions(find_mentions(words, "shapes"), []) == []


def test_attributes_pick_one_box_among_boxes_of_the_same_category() -> None:
    words = tokenize("a green triangle above a red circle")
    objects = [shape("triangle", "red", x=0), shape("triangle", "green", x=20), shape("circle", "red")]
    bound = dict(bind_mentions(find_mentions(words, "shapes"), objects))
    assert bound[1] == bound[2] == (1,)  # "green triangle": the green one
    assert bound[6] == (2,)


def test_an_ambiguous_word_points_at_the_union_of_its_boxes() -> None:
    words = tokenize("a man riding a horse next to a woman")
    objects = [ObjectBox("person", (0, 0, 10, 10)), ObjectBox("horse", (20, 0, 10, 10)),
               ObjectBox("person", (40, 0, 10, 10))]
    bound = dict(bind_mentions(find_mentions(words, "coco"), objects))
    assert bound == {1: (0, 2), 4: (1,), 8: (0, 2)}


# ----------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("form", ["mass", "cross_entropy"])
def test_a_word_with_no_box_contributes_nothing(form: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 3, 4, requires_grad=True)
    coverage = torch.zeros(1, 3, 4)
    coverage[0, 1, 2] = 1.0  # only step 1 names an object (region 2)
    term = grounding_loss(logits.softmax(-1), coverage, form)
    term.loss.backward()
    assert term.words.item() == 1
    assert logits.grad[0, [0, 2]].abs().sum() == 0  # steps 0 and 2: no gradient at all
    assert logits.grad[0, 1].abs().sum() > 0
    only = grounding_loss(logits[:, 1:2].softmax(-1), coverage[:, 1:2], form).loss
    assert term.loss.item() == pytest.approx(only.item())  # the mean is over supervised words only
    empty = grounding_loss(logits.softmax(-1), torch.zeros(1, 3, 4), form)
    assert empty.loss.item() == 0.0 and empty.words.item() == 0 and empty.loss.requires_grad


def test_the_two_forms_on_a_known_map() -> None:
    att = torch.tensor([[[0.1, 0.2, 0.3, 0.4]]])
    cov = torch.tensor([[[0.0, 1.0, 0.5, 0.0]]])
    term = grounding_loss(att, cov, "mass")
    assert term.loss.item() == pytest.approx(-np.log(0.2 + 0.15))
    assert term.in_box.item() == pytest.approx(0.35)
    ce = grounding_loss(att, cov, "cross_entropy")  # target (0, 2/3, 1/3, 0): cross-entropy minus its entropy
    cross_entropy = -(2 / 3 * np.log(0.2) + 1 / 3 * np.log(0.3))
    assert ce.loss.item() == pytest.approx(cross_entropy + (2 / 3 * np.log(2 / 3) + 1 / 3 * np.log(1 / 3)))
    assert grounding_loss(torch.tensor([[[0.0, 2 / 3, 1 / 3, 0.0]]]), cov).loss.item() == pytest.approx(0.0, abs=1e-5)
    with pytest.raises(ConfigError, match="use one of mass, cross_entropy"):
        grounding_loss(att, cov, "l2")


def _in_box(decoder: torch.nn.Module, features: torch.Tensor, tokens: torch.Tensor, cov: torch.Tensor) -> float:
    decoder.eval()  # hard attention: alpha, not a sample; no dropout
    with torch.no_grad():
        return float((decoder(features, tokens).attention[0, 2] * cov).sum())


@pytest.mark.parametrize("form", ["cross_entropy", "mass"])
@pytest.mark.parametrize("preset", ["sat_soft_tiny", "sat_hard_tiny", "transformer_tiny"])
def test_the_gradient_raises_the_in_box_attention_of_one_step(preset: str, form: str) -> None:
    from captioner.models.model import build_model

    torch.manual_seed(0)
    cfg = get_preset(preset)
    model = build_model(cfg.model, 12, load_pretrained=False)
    decoder = model.decoder
    g = cfg.model.encoder.grid
    features = torch.randn(1, g * g, model.encoder.out_dim)
    tokens = torch.tensor([[1, 5, 6, 7, 8]])
    coverage = torch.zeros(1, 5, g * g)
    coverage[0, 2] = torch.from_numpy(box_coverage([(0, 0, 16, 16)], (0, 0, 32, 32), g))  # top-left quarter
    before = _in_box(decoder, features, tokens, coverage[0, 2])
    optimizer = torch.optim.SGD(decoder.parameters(), lr=0.5)
    decoder.train()
    out = decoder(features, tokens)
    grounding_loss(out.attention, coverage, form).loss.backward()
    optimizer.step()
    after = _in_box(decoder, features, tokens, coverage[0, 2])
    assert after > before + 0.01, (before, after)


# ----------------------------------------------------------------------------- batches and training


def test_batch_targets_from_the_scenes_boxes(tiny_shapes: Path) -> None:
    cs = load_caption_set(tiny_shapes, "train")
    instances = load_instances(tiny_shapes, "train")
    vocab = Vocabulary.build(cs.all_captions())
    index = next(i for i, r in enumerate(cs.images) if len(instances[r.image_id]) == 2)
    record = cs.images[index]
    caption = cs.references(record.image_id)[0]
    words = tokenize(caption)
    targets = GroundingTargets(cs.images, instances, vocab, lambda w, h: (0, 0, w, h), 8)
    tokens = torch.tensor([vocab.encode(caption)[1:], vocab.encode(caption)[1:]])
    cov = targets.coverage(tokens, torch.tensor([index, index]))
    assert cov.shape == (2, len(words) + 1, 64) and torch.equal(cov[0], cov[1])
    objects = {o.category: o for o in instances[record.image_id]}
    for t, word in enumerate(words):
        mention = next((m for m in find_mentions(words, "shapes") if m.start <= t < m.end), None)
        if mention is None:
            assert cov[0, t].sum() == 0, word
        else:
            expected = box_coverage([objects[mention.category].bbox], (0, 0, 64, 64), 8)
            np.testing.assert_allclose(cov[0, t].numpy(), expected)
    assert cov[0, len(words)].sum() == 0  # <eos>
    missing = GroundingTargets(cs.images, {}, vocab, lambda w, h: (0, 0, w, h), 8)
    assert missing.coverage(tokens, torch.tensor([index, index])).sum() == 0  # no instances entry: unsupervised


def test_configs_without_the_key_load_unchanged() -> None:
    for name in ("sat_soft_tiny", "transformer_tiny"):
        old = json.loads(json.dumps(get_preset(name).to_dict()))
        del old["train"]["attention_supervision"], old["train"]["attention_supervision_form"]
        cfg = Config.from_dict(old)
        assert cfg.train.attention_supervision == 0.0 and cfg.train.attention_supervision_form == "cross_entropy"
    with pytest.raises(ConfigError, match="train.attention_supervision must be a number >= 0"):
        get_preset("sat_soft_tiny", **{"train.attention_supervision": -1.0})
    with pytest.raises(ConfigError, match="attention_supervision_form='box'"):
        get_preset("sat_soft_tiny", **{"train.attention_supervision_form": "box"})


@pytest.mark.parametrize("preset", [pytest.param("sat_hard_tiny", marks=pytest.mark.slow), "transformer_tiny"])
def test_training_logs_the_supervised_share_and_the_terms_share(preset: str, tiny_shapes: Path,
                                                               tmp_path: Path) -> None:
    from captioner.training.loop import train

    cfg = get_preset(preset, **{"data.root": str(tiny_shapes), "train.batch_size": 16, "train.val_max_images": 2,
                                "train.log_every": 5, "train.epochs": 1, "train.attention_supervision": 1.0})
    train(cfg, tmp_path, progress=False)
    rows = [r for r in csv.DictReader(open(tmp_path / "metrics.csv", newline="")) if r["kind"] == "step"]
    assert rows
    for r in rows:
        assert 0.3 < float(r["grounded_words"]) < 0.8  # shape, colour and size words of every caption
        assert float(r["grounding"]) > 0 and 0 < float(r["share_grounding"]) < 1
        assert 0 < float(r["grounding_in_box"]) < 1


def test_a_dataset_without_boxes_trains_without_the_term(tiny_shapes: Path, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    from captioner.training.attention_terms import build_attention_supervision

    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val"):
        (data / f"captions_{split}.json").write_text((tiny_shapes / f"captions_{split}.json").read_text())
    cfg = get_preset("sat_soft_tiny", **{"data.root": str(data), "train.attention_supervision": 1.0})
    cs = SimpleNamespace(images=[], split="train")
    assert build_attention_supervision(cfg, cs, Vocabulary(["a"])) is None
    assert "no instances_train.json" in caplog.text
    off = get_preset("sat_soft_tiny", **{"data.root": str(tiny_shapes)})
    assert build_attention_supervision(off, cs, Vocabulary(["a"])) is None
