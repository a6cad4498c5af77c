"""The label stage (``captioner train --preset flickr8k_labels``, captioner.training.label_stage): the shipped
model's last stage made by the package: its pieces (person probe, attention term, text rows' labels,
vocabulary growth, the decoder over given labels) and a short run end to end on tiny data."""

from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path

import pytest
import torch

import captioner
from captioner.checkpoint.store import load_checkpoint, save_checkpoint
from captioner.cli import main
from captioner.models.labels import IMAGENET_CLASSES, fit_person_probe, read_lexicon
from captioner.config import EncoderConfig, LabelStageConfig, ModelConfig, SATConfig, TransformerConfig, get_preset
from captioner.data.shapes import make_shapes
from captioner.errors import ConfigError, DataError
from captioner.evaluation.chair import named_objects
from captioner.models.model import build_model
from captioner.text import Vocabulary
from captioner.training.attention_terms import attention_kl
from captioner.training.label_stage import (SATGivenLabels, grown_vocabulary, read_teacher, read_text_rows,
                                            text_labels, training_decoder, with_labels)

WORDS = "a red blue green circle square triangle on the left right of".split()
TEXT = ["a dog runs on the grass", "a man rides a bicycle", "a cat sits on a red table", "two people and a dog",
        "a woman holds an umbrella", "a pizza on a plate"] * 3


# ----------------------------------------------------------------------------- the attention term


def test_attention_kl_is_zero_when_the_maps_agree():
    maps = torch.softmax(torch.randn(2, 3, 49), dim=-1)
    assert attention_kl(maps, maps, torch.ones(2, 3, dtype=torch.bool)).item() == pytest.approx(0.0, abs=1e-6)


def test_attention_kl_known_value_counts_only_words():
    target = torch.tensor([[[0.5, 0.5], [1.0, 0.0]]])  # (1, 2, 2)
    trained = torch.tensor([[[0.25, 0.75], [0.5, 0.5]]])
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # the first step's KL
    words = torch.tensor([[True, False]])  # the second step is padding
    assert attention_kl(target, trained, words).item() == pytest.approx(expected, rel=1e-5)
    both = attention_kl(target, trained, torch.ones(1, 2, dtype=torch.bool)).item()
    assert both == pytest.approx((expected + math.log(2.0)) / 2, rel=1e-5)


def test_attention_kl_pulls_the_trained_map_towards_the_target():
    target = torch.softmax(torch.randn(1, 4, 9), dim=-1)
    logits = torch.zeros(1, 4, 9, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=5.0)
    first = None
    for _ in range(200):
        loss = attention_kl(target, torch.softmax(logits, -1), torch.ones(1, 4, dtype=torch.bool))
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.01 * first
    assert torch.allclose(torch.softmax(logits, -1), target, atol=0.02)


# ----------------------------------------------------------------------------- the person probe


def _photos(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Class probabilities of ``n`` photos; a person shows where class 7 is likely."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(n, IMAGENET_CLASSES, generator=gen)
    flags = torch.arange(n) % 2 == 0
    logits[flags, 7] += 6.0
    return torch.softmax(logits, -1), flags


def test_the_person_probe_separates_the_photos_and_is_deterministic():
    probs, flags = _photos()
    probe = fit_person_probe(probs, flags)
    assert ((probe.logit(probs) > 0) == flags).all()
    assert int(probe.w.argmax()) == 7  # the class that tells
    again = fit_person_probe(probs, flags)
    assert torch.equal(again.w, probe.w) and again.b == probe.b
    with pytest.raises(ConfigError, match=r"a person probe needs class probabilities \(B, C\) and B flags"):
        fit_person_probe(probs, flags[:3])


def test_the_reading_scores_the_person_with_the_probe_and_its_shift():
    probs, flags = _photos()
    probe = fit_person_probe(probs, flags)
    cfg = ModelConfig(encoder=EncoderConfig(name="efficientnet_lite0", grid=2, image_size=64, labels=True),
                      decoder=SATConfig(embed_dim=8, hidden_dim=8, attention_dim=8))
    reading = build_model(cfg, 8, load_pretrained=False).decoder.extension
    reading.use_person_probe(probe)
    person = reading.labels(probs)[:, -1]
    torch.testing.assert_close(person, torch.sigmoid(probe.logit(probs)))
    reading.use_person_probe(probe, shift=-2.0)  # a rarer prior where the model is used: every photo alike
    torch.testing.assert_close(reading.labels(probs)[:, -1], torch.sigmoid(probe.logit(probs) - 2.0))


# ----------------------------------------------------------------------------- the rows and their labels


def test_a_text_rows_labels_are_its_named_words_and_a_drawn_person_score():
    words = read_lexicon().words
    random.seed(0)
    pool = torch.tensor([1.5, -2.0])
    for _ in range(20):
        v = text_labels("two dogs chase a cat", words, pool)
        assert v.shape == (len(words) + 1,) and v[:-1].sum() <= 1.0 + 1e-6
        named = {words[k] for k in (v[:-1] > 0.1).nonzero().flatten().tolist()}
        assert named <= {"dog", "cat"}  # spurious words stay below 0.1
        assert min(abs(float(v[-1]) - float(torch.sigmoid(p))) for p in pool) < 1e-6
    kept = [float(text_labels("a dog", words, pool)[words.index("dog")]) for _ in range(400)]
    assert 0.65 < sum(k >= 0.15 for k in kept) / len(kept) < 0.85  # kept three times in four


def test_the_vocabulary_grows_by_the_frequent_new_words_keeping_old_ids():
    vocab = Vocabulary(["a", "dog", "runs"])
    grown, added = grown_vocabulary(vocab, ["a dog and a cat", "a cat", "a zebra"], min_count=2)
    assert added == ["cat"] and grown.itos[:len(vocab)] == vocab.itos and grown.stoi["cat"] == len(vocab)
    assert grown_vocabulary(vocab, ["a dog"], 1) == (vocab, [])


def test_text_rows_leave_out_the_excluded_photos_and_bad_files_are_one_line(tmp_path):
    text, exclude = tmp_path / "text.json", tmp_path / "dev.json"
    text.write_text(json.dumps({"annotations": [{"image_id": 1, "caption": "a dog"}, {"image_id": 2, "caption": "a cat"}]}))
    exclude.write_text(json.dumps({"images": [{"id": 2}], "annotations": []}))
    assert read_text_rows(text) == [(1, "a dog"), (2, "a cat")]
    assert read_text_rows(text, exclude) == [(1, "a dog")]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"annotations": [{"image_id": "x", "caption": "a dog"}]}))
    with pytest.raises(DataError, match=f"{bad}: entry 0 is not an object with an integer image_id"):
        read_text_rows(bad)
    with pytest.raises(DataError, match=f"{text}: not a COCO results file"):
        read_teacher(text, [1])
    results = tmp_path / "results.json"
    results.write_text(json.dumps([{"image_id": 1, "caption": "a dog"}]))
    assert read_teacher(results, [1]) == ["a dog"]
    with pytest.raises(DataError, match=f"{results}: no caption of 1 of the 2 training photos .* captioner evaluate"):
        read_teacher(results, [1, 5])


def test_the_training_decoder_reads_given_labels_as_the_model_reads_its_label_channels():
    vocab_size = 9
    cfg = ModelConfig(encoder=EncoderConfig(name="efficientnet_lite0", grid=2, image_size=64, labels=True),
                      decoder=SATConfig(embed_dim=8, hidden_dim=8, attention_dim=8, dropout=0.0))
    model = build_model(cfg, vocab_size).eval()
    decoder = training_decoder(cfg, 1280, vocab_size).eval()
    assert isinstance(decoder.extension, SATGivenLabels)
    assert decoder.state_dict().keys() == model.decoder.state_dict().keys()
    with torch.no_grad():
        model.decoder.extension.init_labels.weight.normal_()  # a reading that matters
        model.decoder.extension.gate.bias.fill_(0.0)
    decoder.load_state_dict(model.decoder.state_dict())
    features = torch.rand(2, 4, 1280 + 1280)
    ext = model.decoder.extension
    labels = ext.labels(ext.class_probs(features))
    tokens = torch.tensor([[1, 4, 5, 6], [1, 7, 8, 4]])
    with torch.no_grad():
        ours = decoder(with_labels(features[..., :1280], labels), tokens)
        theirs = model.decoder(features, tokens)
    torch.testing.assert_close(ours.logits, theirs.logits)
    torch.testing.assert_close(ours.attention, theirs.attention)


# ----------------------------------------------------------------------------- the preset


def test_the_preset_validates_and_bad_settings_are_one_line():
    cfg = get_preset("flickr8k_labels")
    assert cfg.train.stage == "labels" and cfg.model.encoder.labels and not cfg.model.encoder.fine_tune
    assert (cfg.train.labels.steps, cfg.train.labels.photos, cfg.train.lr, cfg.train.labels.extension_lr,
            cfg.train.labels.attend_kd, cfg.data.max_caption_len) == (2000, 48, 1e-4, 1e-3, 1.0, 19)
    assert get_preset("sat_soft_flickr8k").train.stage == "captions"
    with pytest.raises(ConfigError, match=r"train.stage='label': use captions or labels"):
        get_preset("flickr8k_labels", **{"train.stage": "label"})
    with pytest.raises(ConfigError, match="train.labels.photos must be an integer >= 1, got 0"):
        LabelStageConfig(photos=0)
    with pytest.raises(ConfigError, match="train.labels.attend_kd must be a number >= 0"):
        LabelStageConfig(attend_kd=-1.0)
    with pytest.raises(ConfigError, match="train.labels.text_exclude leaves photos out of train.labels.text"):
        LabelStageConfig(text_exclude="dev.json")


# ----------------------------------------------------------------------------- end to end


def _init(path: Path, labels: bool = False, decoder: str = "sat") -> Path:
    """An untrained Lite0 model at 64 px (2 x 2 regions) over the shapes' words."""
    torch.manual_seed(0)
    dec = SATConfig(embed_dim=16, hidden_dim=32, attention_dim=16, dropout=0.0)
    if decoder != "sat":
        dec = TransformerConfig(d_model=16, num_layers=1, num_heads=2, ff_dim=16, dropout=0.0)
    cfg = ModelConfig(encoder=EncoderConfig(name="efficientnet_lite0", grid=2, image_size=64, labels=labels),
                      decoder=dec)
    return save_checkpoint(path, build_model(cfg, len(Vocabulary(WORDS))), Vocabulary(WORDS))


@pytest.fixture(scope="module")
def stage_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The shapes (24 training photos), an --init model, caption-only rows and teacher captions."""
    root = tmp_path_factory.mktemp("label_stage")
    make_shapes(root / "shapes", images=30, seed=0, image_size=64)
    text = root / "text.json"
    text.write_text(json.dumps({"images": [{"id": i} for i in range(len(TEXT))],
                                "annotations": [{"image_id": i // 2, "id": i, "caption": c} for i, c in enumerate(TEXT)]}))
    exclude = root / "exclude.json"
    exclude.write_text(json.dumps({"images": [{"id": 0}], "annotations": []}))
    train = json.loads((root / "shapes" / "captions_train.json").read_text())
    first = {}
    for a in train["annotations"]:
        first.setdefault(a["image_id"], a["caption"])
    teacher = root / "teacher.json"
    teacher.write_text(json.dumps([{"image_id": i, "caption": c} for i, c in first.items()]))
    return {"root": root, "shapes": root / "shapes", "init": _init(root / "init.safetensors"), "text": text,
            "exclude": exclude, "teacher": teacher}


def _stage_args(files: dict[str, Path], out: Path, *more: str) -> list[str]:
    return ["train", "--preset", "flickr8k_labels", "--init", str(files["init"]), "--data", str(files["shapes"]),
            "--out", str(out), "--device", "cpu", "--no-progress",
            "--set", "train.labels.steps=3", "--set", "train.labels.photos=4", "--set", "train.val_max_images=3",
            "--set", "train.log_every=1", "--set", "data.val_split=val", "--set", "data.shared_feature_cache=false",
            "--set", f"train.labels.teacher={files['teacher']}", "--set", f"train.labels.text={files['text']}",
            "--set", f"train.labels.text_exclude={files['exclude']}", "--set", "train.labels.text_min_count=2", *more]


def test_the_stage_trains_a_model_that_loads_and_reads_labels(stage_files, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_stage_args(stage_files, out)) == 0
    assert "best val BLEU-4" in capsys.readouterr().out
    model = captioner.load(str(out / "best.safetensors"))
    assert model.model.config.encoder.labels
    vocab = model.vocab
    assert vocab.itos[:len(WORDS) + 4] == Vocabulary(WORDS).itos  # the --init words keep their ids
    assert {"dog", "cat", "man", "table"} <= set(vocab.stoi)  # grown by the caption-only rows (>= 2 uses)
    assert "umbrella" not in vocab.stoi or TEXT.count("a woman holds an umbrella") >= 2
    reading = model.model.decoder.extension
    lexicon = read_lexicon()
    assert int(reading.copy_ids[lexicon.words.index("dog")]) == vocab.stoi["dog"]  # the copy writes the new words
    assert float(reading.person_sd.min()) > 1e-4 and reading.person_mu.abs().sum() > 0  # the probe's statistics
    image = next((stage_files["shapes"] / "images").iterdir())
    [seen] = model.caption([str(image)], labels=3)
    assert len(seen.labels) == 3 and seen.text
    [vetoed] = model.caption([str(image)], veto=10.0)  # a decoding rule only a label-reading model takes
    assert vetoed.text
    # the structure of a model built from the config, the release file the same tensors in float16
    config = load_checkpoint(out / "best.safetensors").model
    built = build_model(config.config, len(vocab), load_pretrained=False).state_dict()
    trained = config.state_dict()
    assert {k: v.shape for k, v in built.items()} == {k: v.shape for k, v in trained.items()}
    release = load_checkpoint(out / "release.safetensors").model.state_dict()
    assert release.keys() == trained.keys()
    torch.testing.assert_close(release["decoder.embedding.weight"], trained["decoder.embedding.weight"].half().float())
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [r for r in rows if r["kind"] == "step"]
    assert [int(r["step"]) for r in steps] == [1, 2, 3] and all(float(r["attention_kl"]) >= 0 for r in steps)
    assert all(math.isfinite(float(r["loss"])) for r in steps)
    [epoch] = [r for r in rows if r["kind"] == "epoch"]
    assert int(epoch["val_images"]) == 3 and epoch["CIDEr-D"] != ""
    assert json.loads((out / "config.json").read_text())["train"]["stage"] == "labels"
    capsys.readouterr()
    assert main(_stage_args(stage_files, out)) != 0  # an earlier run is never overwritten unasked
    assert f"{out} holds an earlier run" in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    (["--set", "train.init=null"], None),  # replaced below: no --init at all
    (["--resume"], "--init starts a new run from a checkpoint and --resume continues the run in --out"),
    (["--set", "train.labels.teacher=MISSING.json"], "MISSING.json"),
    (["--set", "train.labels.photos=500"], "fewer than the train.labels.photos=500 a step draws"),
])
def test_the_stage_refuses_bad_input_in_one_line(stage_files, tmp_path, capsys, change, message):
    args = _stage_args(stage_files, tmp_path / "run", *change)
    if message is None:
        at = args.index("--init")
        args = args[:at] + args[at + 2:]
        message = "train.stage=labels starts from a caption model that does not read labels: pass --init"
    assert main(args) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert message in err
    assert not (tmp_path / "run" / "best.safetensors").exists()


def test_the_stage_refuses_a_model_that_reads_labels_already_or_another_decoder(stage_files, tmp_path, capsys):
    for init, message in ((_init(tmp_path / "labelled.safetensors", labels=True), "this model reads labels already"),
                          (_init(tmp_path / "transformer.safetensors", decoder="transformer"),
                           "train.stage=labels trains a SAT decoder")):
        files = {**stage_files, "init": init}
        assert main(_stage_args(files, tmp_path / "run")) != 0
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, err


THIRD_RELEASE_WORDS = 2538  # the vocabulary the label stage grew: the shipped model's before its fourth release


def test_the_stage_grows_the_shipped_vocabulary_and_points_the_copy_and_veto_as_shipped(shared_data):
    """Known answer: from the COCO caption text (the everyday dev photos left out), the growth rule and
    ``use_vocabulary`` rebuild the shipped model's vocabulary and its copy and veto buffers exactly."""
    shipped = captioner.load("flickr8k")
    rows = read_text_rows(shared_data / "coco2017-mini/annotations/captions_val2017_text_only.json",
                          shared_data / "coco2014-val168/annotations/captions_val2014.json")
    assert len(rows) == 23378  # 841 captions of the dev photos left out
    base = Vocabulary(shipped.vocab.itos[4:THIRD_RELEASE_WORDS])
    grown, added = grown_vocabulary(base, [c for _, c in rows], LabelStageConfig().text_min_count)
    assert grown.itos == shipped.vocab.itos and len(added) == 763
    shipped_reading = shipped.model.decoder.extension
    cfg = ModelConfig(encoder=EncoderConfig(name="efficientnet_lite0", grid=7, labels=True),
                      decoder=SATConfig(embed_dim=8, hidden_dim=8, attention_dim=8))
    reading = build_model(cfg, len(grown), load_pretrained=False).decoder.extension
    reading.use_vocabulary(grown.stoi, categories=named_objects, tau=LabelStageConfig().veto_tau,
                           person_tau=LabelStageConfig().veto_person_tau)
    for name in ("copy_ids", "label_category", "word_category"):
        assert torch.equal(getattr(reading, name), getattr(shipped_reading, name).cpu()), name
    torch.testing.assert_close(reading.veto_tau, shipped_reading.veto_tau.float().cpu(), rtol=0, atol=1e-3)
