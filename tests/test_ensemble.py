"""Ensembles: several checkpoints decoded as one (``captioner.load([a, b])``, ``captioner evaluate A B``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import captioner
from captioner.cli import main
from captioner.errors import CheckpointError, ConfigError
from captioner.models.base import State


@pytest.fixture(scope="module")
def members(tmp_path_factory, untrained_checkpoint) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("members")
    paths = {name: untrained_checkpoint(root, name) for name in ("sat_soft_tiny", "transformer_tiny")}
    paths["narrow"] = untrained_checkpoint(tmp_path_factory.mktemp("narrow"), "transformer_tiny",
                                           **{"model.encoder.width": 8})
    paths["coarse"] = untrained_checkpoint(tmp_path_factory.mktemp("coarse"), "transformer_tiny",
                                           **{"model.encoder.grid": 2})
    paths["concepts"] = untrained_checkpoint(root, "sat_soft_tiny", concepts=("circle", "square"))
    return paths


def _steps(model: captioner.Captioner, images: torch.Tensor, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(log_probs (B,V), attention (B,N)) of each step, feeding ``tokens`` after <bos>."""
    out = []
    with torch.no_grad():
        features, _ = model.model.encode(images)
        state = model.model.decoder.init_state(features)
        prev = torch.full((images.size(0),), model.vocab.bos_id)
        for token in tokens:
            log_probs, state, attention = model.model.decoder.step(prev, state)
            out.append((log_probs, attention))
            prev = torch.full_like(prev, token)
    return out


@pytest.mark.parametrize("second", ["transformer_tiny", "narrow"])
def test_a_step_is_the_log_of_the_members_mean_probability(members, second):
    names = [members["sat_soft_tiny"], members[second]]
    ensemble = captioner.load(names, device="cpu")
    alone = [captioner.load(n, device="cpu") for n in names]
    # the same frozen tiny encoder is run once; a different one (narrower) gets its own pass and slice
    encoders = ensemble.model.encoder.encoders
    assert len(encoders) == (1 if second == "transformer_tiny" else 2)
    assert ensemble.model.encoder.out_dim == sum(e.out_dim for e in encoders)
    torch.manual_seed(3)
    images = torch.rand(2, 3, 64, 64)
    tokens = [ensemble.vocab.stoi[w] for w in ("a", "red", "circle")]
    together = _steps(ensemble, images, tokens)
    each = [_steps(model, images, tokens) for model in alone]
    for t, (log_probs, attention) in enumerate(together):
        probs = torch.stack([steps[t][0].exp() for steps in each]).mean(0)  # (B, V)
        torch.testing.assert_close(log_probs, probs.log(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(2))
        torch.testing.assert_close(attention, torch.stack([steps[t][1] for steps in each]).mean(0))
        torch.testing.assert_close(attention.sum(-1), torch.ones(2))


def test_an_ensemble_of_one_model_twice_captions_as_the_model(members, tmp_path):
    path = members["transformer_tiny"]
    one, twice = captioner.load(path, device="cpu"), captioner.load([path, path], device="cpu")
    image = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(5))
    a, b = one.caption(image, beam=3, max_len=6, attention=True)[0], twice.caption(image, beam=3, max_len=6,
                                                                                  attention=True)[0]
    assert a.tokens == b.tokens and len(a.tokens) == 6
    assert math.isclose(a.score, b.score, rel_tol=1e-5)
    torch.testing.assert_close(a.attention, b.attention)
    assert captioner.load([path], device="cpu").model.decoder.__class__ is one.model.decoder.__class__
    assert repr(twice).startswith("Captioner(ensemble='transformer + transformer', encoder='tiny'")


def test_the_teacher_forced_pass_averages_probabilities_too(members):
    names = [members["sat_soft_tiny"], members["transformer_tiny"]]
    ensemble = captioner.load(names, device="cpu")
    alone = [captioner.load(n, device="cpu") for n in names]
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(7))
    tokens = torch.tensor([[ensemble.vocab.bos_id] + [ensemble.vocab.stoi["a"]] * 3] * 2)
    with torch.no_grad():
        out = ensemble.model(images, tokens)
        probs = torch.stack([m.model(images, tokens).logits.softmax(-1) for m in alone]).mean(0)
    torch.testing.assert_close(out.logits, probs.log(), atol=1e-5, rtol=1e-5)
    assert out.attention.shape == (2, 4, 16)


def test_the_photo_tags_come_from_the_member_with_concepts(members):
    ensemble = captioner.load([members["transformer_tiny"], members["concepts"]], device="cpu")
    caption = ensemble.caption(torch.rand(3, 64, 64), max_len=4)[0]
    assert [w for w, _ in caption.concepts] == ["circle", "square"]
    assert caption.concept_maps.shape == (2, 4, 4)
    assert captioner.load([members["transformer_tiny"]] * 2, device="cpu").caption(torch.rand(3, 64, 64),
                                                                                  max_len=4)[0].concepts is None


def test_members_that_do_not_fit_together_are_named(members, tmp_path):
    from captioner.checkpoint.store import save_checkpoint
    from captioner.text import Vocabulary

    other = tmp_path / "other_vocab.safetensors"
    loaded = captioner.load(members["transformer_tiny"], device="cpu")
    words = list(loaded.vocab.itos[4:])
    words[-1] = "hexagon"
    save_checkpoint(other, loaded.model, Vocabulary(words))
    with pytest.raises(ConfigError, match=r"other_vocab\.safetensors: its vocabulary .* one vocabulary"):
        captioner.load([members["transformer_tiny"], other], device="cpu")
    swapped = tmp_path / "swapped_vocab.safetensors"  # the same words, two of them in another order
    words = list(loaded.vocab.itos[4:])
    words[0], words[1] = words[1], words[0]
    save_checkpoint(swapped, loaded.model, Vocabulary(words))
    first, second = loaded.vocab.itos[4], loaded.vocab.itos[5]
    with pytest.raises(ConfigError, match=rf"swapped_vocab\.safetensors: its vocabulary \({len(loaded.vocab)} words\) "
                                          rf".*: word 4 is '{second}' here and '{first}' there;"):
        captioner.load([members["transformer_tiny"], swapped], device="cpu")
    with pytest.raises(ConfigError, match=r"coarse.*encoder\.grid is 2 but .* has 4"):
        captioner.load([members["transformer_tiny"], members["coarse"]], device="cpu")
    with pytest.raises(CheckpointError, match="at least one checkpoint"):
        captioner.load([], device="cpu")
    with pytest.raises(ConfigError, match="#sha256="):
        captioner.load([members["transformer_tiny"]] * 2, device="cpu", sha256="0" * 64)
    with pytest.raises(CheckpointError, match="a path or a list of paths"):
        captioner.load(3, device="cpu")


def test_the_evaluate_command_scores_an_ensemble_in_its_own_folder(members, tiny_shapes, tmp_path, capsys):
    from captioner.evaluation.evaluate import evaluate_checkpoint

    names = [str(members["sat_soft_tiny"]), str(members["transformer_tiny"])]
    with pytest.raises(ConfigError, match=r"ensemble of 2 checkpoints .* \(--out\)"):
        evaluate_checkpoint(names, tiny_shapes, split="val", progress=False, meteor=False, coco_caption=False)
    out = tmp_path / "ensemble"
    code = main(["evaluate", *names, "--data", str(tiny_shapes), "--split", "val", "--max-images", "4",
                 "--max-len", "5", "--out", str(out), "--no-progress", "--no-meteor", "--no-coco-caption"])
    assert code == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"ensemble of {names[0]} + {names[1]} on ")
    report = json.loads((out / "metrics_val.json").read_text())
    assert report["checkpoint"] == names and report["num_images"] == 4
    results = json.loads((out / "captions_val_results.json").read_text())
    assert len(results) == 4 and all(len(r["caption"].split()) == 5 for r in results)
    assert not (members["sat_soft_tiny"].parent / "metrics_val.json").exists()  # no member's scores overwritten


def test_a_state_moves_rows_of_every_member(members):
    ensemble = captioner.load([members["sat_soft_tiny"], members["transformer_tiny"]], device="cpu")
    features, _ = ensemble.model.encode(torch.rand(3, 3, 64, 64))
    state = ensemble.model.decoder.init_state(features)
    _, state, _ = ensemble.model.decoder.step(torch.full((3,), ensemble.vocab.bos_id), state)
    moved = state.select(torch.tensor([2, 0]))
    assert isinstance(moved, State)
    for before, after in zip(state.dynamic["members"], moved.dynamic["members"]):
        for key, value in before.items():
            if isinstance(value, torch.Tensor) and value.dim():
                torch.testing.assert_close(after[key], value[[2, 0]])


def test_caption_and_attend_take_the_checkpoint_option_again_for_an_ensemble(members, tmp_path, capsys):
    import numpy as np
    from PIL import Image

    photo = tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(2).integers(0, 255, (40, 60, 3), dtype=np.uint8)).save(photo)
    pair = ["-c", str(members["sat_soft_tiny"]), "-c", str(members["transformer_tiny"])]
    assert main(["caption", str(photo), *pair, "--json", "--max-len", "4"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = captioner.load([members["sat_soft_tiny"], members["transformer_tiny"]], device="cpu").caption(
        photo, max_len=4)[0]
    assert record["caption"] == expected.text
    assert main(["attend", str(photo), *pair, "--out", str(tmp_path / "att"), "--max-len", "4"]) == 0
    assert (tmp_path / "att" / "attention.json").exists()
    assert main(["attend", str(photo), *pair, "--out", str(tmp_path / "att2"), "--layer", "1"]) == 1
    assert "--layer/--head need per-layer attention" in capsys.readouterr().err
