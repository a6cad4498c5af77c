"""Outcome test: a SAT soft model trained for a minute on CPU looks at the objects it names.

A loss that falls proves nothing about attention (issue 12): this trains the demo's recipe on a
small scenes set (the CNN pretrained as word detectors, then frozen, then SAT soft on its cached
features, 60 s of training in all) and scores attention correctness on the test split: the share
of each object word's attention inside that object's box must be at least twice what uniform
attention gets.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from captioner.config import get_preset
from captioner.data.shapes import make_shapes
from captioner.evaluation.evaluate import evaluate_checkpoint
from captioner.training.loop import train
from captioner.training.detectors import pretrain_word_detectors

ENCODER_SECONDS, DECODER_SECONDS = 20.0, 40.0


@pytest.mark.slow
def test_sat_soft_attention_lands_on_the_named_objects_within_a_minute(tmp_path: Path) -> None:
    torch.set_num_threads(2)
    try:
        root = tmp_path / "scenes"
        make_shapes(root, images=800, seed=3, image_size=64)
        cfg = get_preset("sat_soft_demo", **{"data.root": str(root), "train.seed": 3})
        weights = pretrain_word_detectors(cfg, tmp_path / "encoder.safetensors", seconds=ENCODER_SECONDS,
                                          progress=False).weights
        torch.set_num_threads(1)
        cfg = get_preset("sat_soft_demo", **{
            "data.root": str(root), "train.seed": 3, "train.time_budget": DECODER_SECONDS,
            "model.encoder.pretrained": True, "model.encoder.weights": str(weights),
            "model.encoder.fine_tune": False, "data.feature_cache_dir": str(tmp_path / "features")})
        result = train(cfg, tmp_path / "run", progress=False)
        metrics = evaluate_checkpoint(result.best_checkpoint, root, "test", beam_size=1, progress=False,
                                      meteor=False)
    finally:
        torch.set_num_threads(1)
    att = metrics["attention_correctness"]
    assert att["words_scored"] > 50
    assert att["ratio"] >= 2.0, f"attention correctness only {att['ratio']:.2f}x uniform ({att})"
    assert metrics["attention"]["attention_entropy"] < 0.9 * metrics["attention"]["uniform_entropy"]
