"""Checkpoints: round trips with the real tiny presets, safety, clear refusals, atomic writes."""

from __future__ import annotations

import json
import os
import pickle
import random
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from captioner.checkpoint.store import (build_empty, load_checkpoint, load_train_state, read_checkpoint_metadata,
                                        save_checkpoint, save_train_state)
from captioner.config import get_preset
from captioner.errors import CheckpointError
from captioner.text import Vocabulary

VOCAB = Vocabulary([f"w{i}" for i in range(16)])  # 20 tokens


def _model(preset: str = "sat_soft_tiny", **overrides):
    from captioner.models.model import build_model

    torch.manual_seed(0)
    return build_model(get_preset(preset, **overrides).model, vocab_size=len(VOCAB)).eval()


def _logits(model):
    g = torch.Generator().manual_seed(1)
    images = torch.randn(2, 3, 64, 64, generator=g)
    tokens = torch.randint(4, len(VOCAB), (2, 5), generator=g)
    with torch.no_grad():
        return model(images, tokens).logits


def _rewrite_header(path, **changes):
    """Re-save a safetensors checkpoint with some header fields changed (to fake other files)."""
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta.update(changes)
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize("preset,overrides,suffix", [
    ("sat_soft_tiny", {}, ".safetensors"),
    ("sat_hard_tiny", {}, ".pt"),
    ("transformer_tiny", {"model.decoder.tie_embeddings": True}, ".safetensors"),
])
def test_round_trip_gives_identical_logits(tmp_path, preset, overrides, suffix):
    model = _model(preset, **overrides)
    model.train()  # saving must not depend on the mode; loading returns eval mode
    path = save_checkpoint(tmp_path / f"m{suffix}", model, VOCAB, metadata={"epoch": 3, "metrics": {"BLEU-4": 0.25}})
    assert sorted(os.listdir(tmp_path)) == [f"m{suffix}"]  # no temp file left behind
    loaded = load_checkpoint(path)
    assert not loaded.model.training
    assert loaded.vocab == VOCAB and loaded.config == model.config
    assert loaded.metadata["epoch"] == 3 and loaded.metadata["metrics"]["BLEU-4"] == 0.25
    assert loaded.metadata["torch_version"] == torch.__version__ and "created" in loaded.metadata
    torch.testing.assert_close(_logits(loaded.model), _logits(model.eval()), rtol=0, atol=0)
    if overrides:  # tied embeddings stay tied after loading
        dec = loaded.model.decoder
        assert dec.out.weight is dec.embed.weight  # one parameter, as in the saved model
        assert len(list(loaded.model.parameters())) == len(list(model.parameters()))
        with safe_open(str(path), framework="pt") as f:
            assert json.loads(f.metadata()["aliases"]) and len(list(f.keys())) == len(model.state_dict()) - 1


def test_read_metadata_does_not_build_the_model(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path / "m.safetensors", _model(), VOCAB, metadata={"step": 7})

    def boom(*a, **k):
        raise AssertionError("model built")

    monkeypatch.setattr("captioner.models.model.build_model", boom)
    info = read_checkpoint_metadata(path)
    assert info["config"]["decoder"]["name"] == "sat" and info["vocab_size"] == 20
    assert Vocabulary.from_dict(info["vocab"]) == VOCAB and info["metadata"]["step"] == 7


def test_missing_and_foreign_files_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "nope.safetensors")
    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "other.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="not a captioner checkpoint"):
        load_checkpoint(tmp_path / "other.safetensors")
    torch.save(_model().state_dict(), tmp_path / "bare.pt")
    with pytest.raises(CheckpointError, match="bare state dict"):
        load_checkpoint(tmp_path / "bare.pt")
    (tmp_path / "notes.txt").write_text("just some text, not weights\n")
    with pytest.raises(CheckpointError, match="not a captioner checkpoint"):
        load_checkpoint(tmp_path / "notes.txt")


@pytest.mark.parametrize("field,value,says", [
    ("aliases", "[]", "aliases must be a JSON object"),
    ("aliases", '{"decoder.out.weight": 3}', "does not name a tensor"),
    ("metadata", '"text"', "metadata must be a JSON object"),
    ("config", "[" * 50_000, "config is not valid JSON"),
    ("vocab_size", "²", "vocab_size"),
    ("format_version", "1.0", "format version"),
])
def test_header_fields_of_the_wrong_type_are_refused(tmp_path, field, value, says):
    path = save_checkpoint(tmp_path / "m.safetensors", _model(), VOCAB)
    _rewrite_header(path, **{field: value})
    with pytest.raises(CheckpointError, match=says) as err:
        load_checkpoint(path)
    assert str(err.value).startswith(f"{path}: ") and "\n" not in str(err.value)


@pytest.mark.parametrize("preset", ["sat_soft_tiny", "transformer_tiny"])
def test_build_empty_draws_no_random_numbers_and_load_state_dict_fills_it(tmp_path, preset):
    """The loading's build step: the model its config describes, every tensor on the device with the file's
    names and shapes, built without random initialisation (the global RNG untouched); the weights come from
    ``load_state_dict`` on top."""
    model = _model(preset)
    path = save_checkpoint(tmp_path / "m.safetensors", model, VOCAB)
    state = model.state_dict()
    before = torch.random.get_rng_state()
    empty = build_empty(path, model.config, len(VOCAB), state, torch.device("cpu"))
    assert torch.equal(torch.random.get_rng_state(), before)
    assert {k: v.shape for k, v in empty.state_dict().items()} == {k: v.shape for k, v in state.items()}
    assert not any(t.is_meta for t in [*empty.parameters(), *empty.buffers()])
    empty.load_state_dict(state, strict=True)
    torch.testing.assert_close(_logits(empty.eval()), _logits(model), rtol=0, atol=0)
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(path))}: weights do not match the model built from"):
        build_empty(path, model.config, len(VOCAB) + 1, state, torch.device("cpu"))


def test_absurd_layer_count_is_refused_quickly(tmp_path):
    path = save_checkpoint(tmp_path / "m.safetensors", _model("transformer_tiny"), VOCAB)
    cfg = read_checkpoint_metadata(path)["config"]
    cfg["decoder"]["num_layers"] = 10**9  # built naively, even on the meta device, this never ends
    _rewrite_header(path, config=json.dumps(cfg))
    with pytest.raises(CheckpointError, match="far more tensors than the 79 in the file"):
        load_checkpoint(path)


def test_format_is_sniffed_from_content_not_name(tmp_path):
    model = _model("transformer_tiny")
    pt = save_checkpoint(tmp_path / "m.pt", model, VOCAB)
    renamed = tmp_path / "m.safetensors"
    renamed.write_bytes(pt.read_bytes())  # torch.load would hand a .safetensors path to safetensors
    torch.testing.assert_close(_logits(load_checkpoint(renamed).model), _logits(model), rtol=0, atol=0)


def test_vocab_size_mismatch_and_newer_format_refused(tmp_path):
    path = save_checkpoint(tmp_path / "m.safetensors", _model(), VOCAB)
    _rewrite_header(path, vocab_size="21")  # a header that disagrees with its vocabulary: see also
    with pytest.raises(CheckpointError, match="vocab size mismatch: vocabulary has 20 tokens, checkpoint says 21"):
        load_checkpoint(path)  # test_reliability_checkpoints (the vocabulary side)
    path = save_checkpoint(tmp_path / "n.safetensors", _model(), VOCAB)
    _rewrite_header(path, format_version="99")
    with pytest.raises(CheckpointError, match="newer"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="vocabulary has 5 tokens but the model was built for 20"):
        save_checkpoint(tmp_path / "x.safetensors", _model(), Vocabulary(["a"]))


def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path / "m.safetensors", _model(), VOCAB, metadata={"epoch": 1})
    before = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(CheckpointError, match="No space left"):
        save_checkpoint(path, _model("sat_hard_tiny"), VOCAB, metadata={"epoch": 2})
    with pytest.raises(CheckpointError, match="No space left"):
        save_train_state(tmp_path / "state.pt", {"step": 1})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]
    assert load_checkpoint(path).metadata["epoch"] == 1


def test_train_state_round_trip_and_refusals(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(1, 3, 64, 64), torch.tensor([[1, 5, 6]])).logits.sum().backward()
    opt.step()
    state = {"optimizer": opt.state_dict(), "rng": torch.get_rng_state(), "py_rng": random.getstate(),
             "step": 12, "history": [{"loss": 1.5, "note": None}]}
    path = save_train_state(tmp_path / "state.pt", state)
    back = load_train_state(path)
    assert back["step"] == 12 and back["history"] == state["history"]
    assert torch.equal(back["rng"], state["rng"])
    random.setstate(back["py_rng"])  # a usable Python RNG state
    opt2 = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt2.load_state_dict(back["optimizer"])
    saved = opt.state_dict()["state"]
    assert saved
    for k, v in saved.items():
        torch.testing.assert_close(opt2.state_dict()["state"][k]["exp_avg"], v["exp_avg"])
    with pytest.raises(CheckpointError, match=r"history\[0\]\.obj is a object"):
        save_train_state(tmp_path / "bad.pt", {"history": [{"obj": object()}]})
    assert not (tmp_path / "bad.pt").exists()
    with pytest.raises(CheckpointError, match="not found"):
        load_train_state(tmp_path / "none.pt")
    (tmp_path / "junk.pt").write_bytes(pickle.dumps([1, 2], protocol=2)[:3])
    with pytest.raises(CheckpointError, match="junk.pt"):
        load_train_state(tmp_path / "junk.pt")
