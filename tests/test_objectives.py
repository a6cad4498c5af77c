"""Training objectives as objects: one ``loss(model, batch)``, chosen once by ``train.objective``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from captioner.config import get_preset
from captioner.config.schema import OBJECTIVES
from captioner.data.coco import load_caption_set
from captioner.models.base import DecoderOutput
from captioner.models.model import build_model
from captioner.text import Vocabulary
from captioner.training.loop import BUILDERS, build_objective
from captioner.training.objective import Batch, CaptionLoss, CrossEntropy, TrainModel
from captioner.training.scst import SelfCritical

PACKAGE = Path(__file__).resolve().parents[1] / "captioner"


def _batch(vocab: Vocabulary, rows: int = 3) -> Batch:
    tokens = torch.tensor([vocab.encode("a red circle", 8) + [vocab.pad_id] * 2,
                           vocab.encode("a blue square left", 8) + [vocab.pad_id],
                           vocab.encode("green triangle left a", 8) + [vocab.pad_id]][:rows])  # (B, T)
    return Batch(torch.randn(rows, 16, 32), tokens, torch.arange(rows))


def _model(preset: str, vocab: Vocabulary):
    torch.manual_seed(0)
    model = build_model(get_preset(preset).model, len(vocab), load_pretrained=False)
    return model, TrainModel(model.decoder, model.decoder, None)


VOCAB = Vocabulary.build(["a red circle", "a blue square left", "green triangle left"], min_freq=1)


def test_every_objective_name_has_a_builder_and_the_step_never_names_one() -> None:
    assert set(BUILDERS) == set(OBJECTIVES)
    for path in PACKAGE.rglob("*.py"):
        assert "objective == " not in path.read_text(encoding="utf-8"), path


def test_build_objective_picks_the_class_by_name(tiny_shapes: Path) -> None:
    train_set = load_caption_set(tiny_shapes, "train")
    cfg = get_preset("sat_hard_tiny", **{"data.root": str(tiny_shapes), "train.alpha_c": 0.5})
    xe = build_objective(cfg, train_set, VOCAB, torch.device("cpu"))
    assert type(xe) is CrossEntropy and (xe.alpha_c, xe.entropy_weight) == (0.5, cfg.train.entropy_weight)
    scst = build_objective(cfg.override(**{"train.objective": "scst", "train.scst.samples": 3}), train_set, VOCAB,
                           torch.device("cpu"))
    assert type(scst) is SelfCritical and scst.samples == 3 and scst.baseline_kind == cfg.train.scst.baseline


@pytest.mark.parametrize("preset", ["sat_hard_tiny", "transformer_tiny"])
def test_cross_entropy_is_caption_loss_of_the_teacher_forced_output(preset: str) -> None:
    model, train_model = _model(preset, VOCAB)
    batch = _batch(VOCAB)
    cfg = get_preset(preset)
    objective = CrossEntropy.from_config(cfg.train, cfg.model.decoder, VOCAB.pad_id)
    criterion = CaptionLoss.from_config(cfg.train, cfg.model.decoder, VOCAB.pad_id)
    assert objective.state_dict().keys() == criterion.state_dict().keys()  # train_state.pt's "criterion" entry
    torch.manual_seed(1)
    result = objective.loss(train_model, batch)
    torch.manual_seed(1)
    expected = criterion(model.decoder(batch.x, batch.tokens[:, :-1]), batch.tokens[:, 1:])
    assert result.captions == 3 and result.terms.keys() == expected.terms.keys()
    assert torch.equal(result.total, expected.total) and torch.equal(result.objective, expected.objective)
    for key, value in expected.terms.items():
        assert torch.equal(result.terms[key], value), key


class _Length:
    """An extra term: the mean logit (any differentiable scalar of the output)."""

    name, weight = "mean_logit", 0.5

    def __call__(self, output: DecoderOutput, batch: Batch) -> torch.Tensor:
        return output.logits.float().mean()


def test_cross_entropy_takes_extra_terms_and_logs_them() -> None:
    model, train_model = _model("sat_soft_tiny", VOCAB)
    cfg = get_preset("sat_soft_tiny")
    plain = CrossEntropy.from_config(cfg.train, cfg.model.decoder, VOCAB.pad_id)
    extended = CrossEntropy.from_config(cfg.train, cfg.model.decoder, VOCAB.pad_id, extra_terms=[_Length()])
    batch = _batch(VOCAB)
    a, b = plain.loss(train_model, batch), extended.loss(train_model, batch)
    with torch.no_grad():
        term = model.decoder(batch.x, batch.tokens[:, :-1]).logits.float().mean()
    assert float((b.total - a.total).detach()) == pytest.approx(0.5 * float(term), rel=1e-5, abs=1e-7)
    assert float(b.objective - a.objective) == pytest.approx(0.5 * float(term), rel=1e-5, abs=1e-7)
    assert float(b.terms["mean_logit"]) == pytest.approx(float(term), rel=1e-6)
    assert float(b.terms["weighted_mean_logit"]) == pytest.approx(0.5 * float(term), rel=1e-6)
    assert "mean_logit" not in a.terms and b.captions == a.captions == 3
