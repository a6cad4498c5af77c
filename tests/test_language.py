"""Caption language models (``captioner.language``): the model, its file, its training, shallow fusion in
the search and the ``captioner lm`` command."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from captioner import pretrained
from captioner.cli import main
from captioner.config import DecodeOptions, get_preset
from captioner.decoding.search import SearchRules, decode
from captioner.errors import CheckpointError, ConfigError, DataError
from captioner.language import (CaptionLanguageModel, FusedDecoder, LanguageModelConfig, caption_texts,
                                language_model_for, load_language_model, save_language_model, train_language_model)
from captioner.models.model import build_model
from captioner.text import Vocabulary

WORDS = ("a", "red", "blue", "circle", "square", "on", "the", "left", "right")


def tiny_lm(vocab_size: int, seed: int = 0, hidden: int = 16) -> CaptionLanguageModel:
    torch.manual_seed(seed)
    lm = CaptionLanguageModel(LanguageModelConfig(vocab_size, embed_dim=8, hidden_dim=hidden))
    with torch.no_grad():
        for p in lm.parameters():
            p.mul_(4.0)  # far from uniform, so that fusion moves the search
    return lm.eval()


def test_step_by_step_equals_the_teacher_forced_pass():
    lm = tiny_lm(12)
    tokens = torch.tensor([[1, 3, 4, 5, 6], [1, 7, 7, 3, 2]])
    expected = torch.log_softmax(lm(tokens), -1)  # (B, T, V)
    state = lm.initial_state(2)
    for t in range(tokens.size(1)):
        log_probs, state = lm.step(tokens[:, t], state)
        torch.testing.assert_close(log_probs, expected[:, t], atol=1e-5, rtol=1e-5)


def test_config_widths_are_checked():
    with pytest.raises(ConfigError, match="hidden_dim must be a whole number"):
        LanguageModelConfig(10, hidden_dim=0)
    with pytest.raises(ConfigError, match="dropout must be in"):
        LanguageModelConfig(10, dropout=1.0)


class ConstantDecoder(torch.nn.Module):
    """A decoder whose next-word distribution depends only on the previous word (a fixed table)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table, self.vocab_size = table.log(), table.size(1)
        self.eval()

    def init_state(self, features):
        from captioner.models.base import State
        return State({}, {"t": torch.zeros(features.size(0))})

    def step(self, prev, state):
        from captioner.models.base import State
        n = state.dynamic["t"].size(0)
        return self.table[prev], State({}, {"t": state.dynamic["t"] + 1}), torch.full((n, 4), 0.25)


def test_fused_step_adds_the_weighted_language_model():
    torch.manual_seed(1)
    table = torch.softmax(torch.randn(7, 7), -1)
    lm = tiny_lm(7)
    fused = FusedDecoder(ConstantDecoder(table), lm, 0.7)
    state = fused.init_state(torch.zeros(2, 4, 3))
    prev = torch.tensor([1, 1])
    lm_state = lm.initial_state(2)
    for word in (3, 5):
        out, state, _ = fused.step(prev, state)
        lm_lp, lm_state = lm.step(prev, lm_state)
        torch.testing.assert_close(out, table[prev].log() + 0.7 * lm_lp)
        prev = torch.tensor([word, word])


def _brute_force(table: torch.Tensor, lm: CaptionLanguageModel, weight: float, max_len: int) -> tuple[list[int], float]:
    """The best caption under fused scores, every caption of at most ``max_len`` words scored."""
    best, best_score = None, -math.inf
    words = range(3, table.size(0))
    for n in range(0, max_len + 1):  # an empty caption too: <eos> first
        for caption in itertools.product(words, repeat=n):
            seq = [1, *caption, 2]
            tokens = torch.tensor([seq[:-1]])
            with torch.no_grad():
                lm_lp = torch.log_softmax(lm(tokens), -1)[0]
            score = sum(float(table[a, b].log()) + weight * float(lm_lp[i, b]) for i, (a, b) in enumerate(zip(seq, seq[1:])))
            if score > best_score:
                best, best_score = list(caption), score
    return best, best_score


@pytest.mark.parametrize("weight", [0.0, 0.5, 2.0])
def test_fused_beam_search_finds_the_fused_best_caption(weight):
    """A wide beam over a 4-word vocabulary finds what enumerating every caption finds, fused scores and all."""
    torch.manual_seed(3)
    table = torch.softmax(2.0 * torch.randn(7, 7), -1)
    table[:, :2] = 1e-9  # never <pad> or <bos>
    table = table / table.sum(1, keepdim=True)
    lm = tiny_lm(7, seed=4)
    options = DecodeOptions(beam_size=40, n_best=1, max_len=3, lm_weight=weight)
    found = decode(ConstantDecoder(table), torch.zeros(1, 4, 3), SearchRules(1, 2, (0, 1)), options, lm)[0][0]
    best, score = _brute_force(table, lm, weight, 3)
    assert found.tokens == best
    assert found.log_prob == pytest.approx(score, abs=1e-4)


def test_wrapping_a_training_decoder_leaves_the_language_model_in_eval_mode():
    lm = tiny_lm(7)
    decoder = ConstantDecoder(torch.full((7, 7), 1 / 7)).train()
    fused = FusedDecoder(decoder, lm, 1.0)
    assert fused.training and decoder.training and not lm.training  # the cached model keeps its dropout off


def test_weight_zero_or_no_model_is_the_plain_search():
    torch.manual_seed(5)
    table = torch.softmax(2.0 * torch.randn(7, 7), -1)
    table[1, 2] = 1e-3  # no empty caption
    table = table / table.sum(1, keepdim=True)
    lm = tiny_lm(7, seed=6)
    plain = decode(ConstantDecoder(table), torch.zeros(2, 4, 3), SearchRules(1, 2, (0, 1)), DecodeOptions(max_len=4))
    off = decode(ConstantDecoder(table), torch.zeros(2, 4, 3), SearchRules(1, 2, (0, 1)), DecodeOptions(max_len=4), lm)
    fused = decode(ConstantDecoder(table), torch.zeros(2, 4, 3), SearchRules(1, 2, (0, 1)), DecodeOptions(max_len=4, lm_weight=3.0), lm)
    assert [h[0].tokens for h in off] == [h[0].tokens for h in plain]
    assert [h[0].tokens for h in fused] != [h[0].tokens for h in plain]  # the language model moves this search


@pytest.mark.parametrize("preset", ["sat_soft_tiny", "transformer_tiny"])
@pytest.mark.parametrize("beam", [1, 3])
def test_fusion_batched_equals_one_by_one_on_real_decoders(preset, beam):
    """The language model's state follows its beams: a batch of images searches as each image alone."""
    torch.manual_seed(0)
    vocab = Vocabulary(list(WORDS))
    model = build_model(get_preset(preset).model, len(vocab), load_pretrained=False).eval()
    with torch.no_grad():
        features = model.encode(torch.rand(3, 3, 64, 64))[0]
    lm = tiny_lm(len(vocab), seed=7)
    options = DecodeOptions(beam_size=beam, max_len=6, lm_weight=1.0)
    together = decode(model.decoder, features, SearchRules(vocab.bos_id, vocab.eos_id, (0, 1, 3)), options, lm)
    for i in range(3):
        alone = decode(model.decoder, features[i:i + 1], SearchRules(vocab.bos_id, vocab.eos_id, (0, 1, 3)), options, lm)
        assert alone[0][0].tokens == together[i][0].tokens
        assert alone[0][0].log_prob == pytest.approx(together[i][0].log_prob, abs=1e-4)
        torch.testing.assert_close(alone[0][0].attention, together[i][0].attention, atol=1e-5, rtol=1e-5)


def test_file_round_trip_and_float16(tmp_path):
    vocab = Vocabulary(list(WORDS))
    lm = tiny_lm(len(vocab))
    path = save_language_model(tmp_path / "lm.safetensors", lm, vocab, {"files": [{"file": "x.json", "captions": 3}]})
    loaded, loaded_vocab, about = load_language_model(path)
    assert loaded_vocab == vocab and about["files"][0]["captions"] == 3 and not loaded.training
    tokens = torch.tensor([[1, 3, 4, 5]])
    torch.testing.assert_close(loaded(tokens), lm(tokens))
    half = save_language_model(tmp_path / "half.safetensors", lm, vocab, half=True)
    assert half.stat().st_size < 0.6 * path.stat().st_size
    torch.testing.assert_close(load_language_model(half)[0](tokens), lm(tokens), atol=0.05, rtol=0.01)
    assert language_model_for(str(path), vocab) is loaded  # read once per file version


def test_bad_files_are_refused_in_one_line_naming_them(tmp_path, untrained_checkpoint):
    vocab = Vocabulary(list(WORDS))
    with pytest.raises(CheckpointError, match="missing.safetensors"):
        load_language_model(tmp_path / "missing.safetensors")
    text = tmp_path / "captions.json"
    text.write_text('{"annotations": []}')
    with pytest.raises(CheckpointError, match=r"captions.json: not a captioner language model"):
        load_language_model(text)
    checkpoint = untrained_checkpoint(tmp_path, "sat_soft_tiny")
    with pytest.raises(CheckpointError, match=r"not a captioner language model \(its 'format' metadata is"):
        load_language_model(checkpoint)
    good = save_language_model(tmp_path / "lm.safetensors", tiny_lm(len(vocab)), vocab)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="cut.safetensors: not a captioner language model"):
        load_language_model(cut)
    rotten = tiny_lm(len(vocab))
    with torch.no_grad():
        rotten.lstm.weight_hh_l0[3, :5] = float("nan")  # a bit-rotted copy: refused, not fused into captions
    rotten = save_language_model(tmp_path / "rotten.safetensors", rotten, vocab)
    with pytest.raises(CheckpointError, match=r"rotten.safetensors: damaged weights: tensor lstm.weight_hh_l0 holds 5 "):
        load_language_model(rotten)
    other = Vocabulary(["a", "red", "green"])
    with pytest.raises(ConfigError, match=r"its vocabulary is not this captioner's \(word 6 is"):
        language_model_for(str(good), other)
    with pytest.raises(ConfigError, match="same|share one vocabulary"):
        FusedDecoder(ConstantDecoder(torch.full((4, 4), 0.25)), tiny_lm(len(vocab)), 1.0)


def test_options_are_checked():
    with pytest.raises(ConfigError, match="lm_weight"):
        DecodeOptions(lm_weight=-0.1)
    with pytest.raises(ConfigError, match="decoding lm must name"):
        DecodeOptions(lm="")


def _caption_file(path: Path, captions: list[tuple[int, str]]) -> Path:
    path.write_text(json.dumps({"images": [{"id": i} for i in sorted({i for i, _ in captions})],
                                "annotations": [{"image_id": i, "id": k, "caption": c}
                                                for k, (i, c) in enumerate(captions)]}))
    return path


def test_caption_texts_leave_out_a_dev_sets_ids(tmp_path):
    text = _caption_file(tmp_path / "text.json", [(1, "a red circle"), (2, "a blue square"), (3, "a dog")])
    dev = _caption_file(tmp_path / "dev.json", [(3, "a dog")])
    captions, read = caption_texts([text], [dev])
    assert captions == ["a red circle", "a blue square"]
    assert read == {"files": [{"file": str(text), "captions": 2}], "left_out": 1}
    (tmp_path / "bad.json").write_text('{"images": []}')
    with pytest.raises(DataError, match="bad.json: not a COCO caption file"):
        caption_texts([tmp_path / "bad.json"])


def test_training_learns_a_known_corpus():
    """Two sentences, each half the text: the model learns them (perplexity near 2 ** (1 / 7): one coin toss
    in a caption's seven predictions) and greedy continuation from <bos> writes one of them."""
    vocab = Vocabulary(list(WORDS))
    corpus = ["a red circle on the left", "a blue square on the right"] * 100
    lm, report = train_language_model(corpus, vocab, epochs=8, batch_size=16, lr=1e-2, progress=False,
                                      config=LanguageModelConfig(len(vocab), embed_dim=16, hidden_dim=32, dropout=0.0))
    assert 2 ** (1 / 7) - 0.01 < min(report["perplexity"]) < 1.15 < report["perplexity"][0]
    assert report["held_out"] == 20 and report["captions"] == 180
    words, state, prev = [], lm.initial_state(1), torch.tensor([vocab.bos_id])
    for _ in range(8):
        log_probs, state = lm.step(prev, state)
        prev = log_probs.argmax(-1)
        if int(prev) == vocab.eos_id:
            break
        words.append(vocab.itos[int(prev)])
    assert " ".join(words) in corpus
    with pytest.raises(ConfigError, match="at least 2 captions"):
        train_language_model(["one"], vocab, progress=False)


def test_lm_command_then_caption_with_it(tmp_path, capsys, untrained_checkpoint):
    from tests.conftest import UntrainedCheckpoints

    checkpoint = untrained_checkpoint(tmp_path, "sat_soft_tiny")
    text = _caption_file(tmp_path / "text.json", [(i, c) for i, c in enumerate(
        ["a red circle on the left", "a blue square on the right", "a green triangle on the left"] * 10)])
    dev = _caption_file(tmp_path / "dev.json", [(0, "a red circle on the left")])
    out = tmp_path / "lm.safetensors"
    argv = ["lm", "-c", str(checkpoint), "--captions", str(text), "--leave-out", str(dev), "--out", str(out),
            "--epochs", "2", "--hidden", "8", "--embed", "8", "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"{text}: 29 captions" in printed and "left out 1 captions" in printed and f"wrote {out}" in printed
    assert "epoch 1: held-out perplexity" in printed and "epoch 2: held-out perplexity" in printed
    lm, vocab, about = load_language_model(out)
    assert vocab.itos[4:] == list(UntrainedCheckpoints.words) and about["left_out"] == 1
    assert len(about["perplexity"]) == 2
    assert main(argv) == 1  # an existing file is kept without --force
    assert "--force" in capsys.readouterr().err
    assert main([*argv[:-9], "--out", str(tmp_path), "--epochs", "1"]) == 1  # a folder: named, with a file to give
    assert f"--out {tmp_path}: is a folder; give the file to write (e.g. {tmp_path / 'lm.safetensors'})" in \
        capsys.readouterr().err
    photo = tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(photo)
    assert main(["caption", str(photo), "-c", str(checkpoint), "--lm", str(out), "--lm-weight", "0.5",
                 "--max-len", "4"]) == 0
    assert len(capsys.readouterr().out.strip().split("\t")[1].split()) <= 4
    assert main(["caption", str(photo), "-c", str(checkpoint), "--lm", str(out)]) == 1
    assert "give --lm-weight too" in capsys.readouterr().err


def test_packaged_language_model_speaks_the_shipped_models_vocabulary(monkeypatch):
    """The packaged model ("coco") reads COCO's caption sentences: a sentence is far likelier than its own
    words shuffled, and it ends a finished sentence; fused, the shipped model captions a photo with it."""
    import captioner
    from captioner import language
    from captioner.pretrained import example_photos

    shipped = captioner.load("flickr8k")
    lm = language_model_for("coco", shipped.vocab)
    vocab = shipped.vocab

    def log_likelihood(sentence: str) -> float:
        ids = vocab.encode(sentence)
        with torch.no_grad():
            lp = torch.log_softmax(lm(torch.tensor([ids[:-1]])), -1)[0]
        return float(lp.gather(1, torch.tensor(ids[1:])[:, None]).sum())

    sentence = "a plate of food with broccoli and meat on a table"
    shuffled = "table a on meat and broccoli with food of plate a"
    assert log_likelihood(sentence) > log_likelihood(shuffled) + 20.0
    fused = shipped.caption([str(example_photos()[0])], lm_weight=0.3)[0]
    assert fused.finished and 3 <= len(fused.words) <= 20
    monkeypatch.setitem(pretrained.MODELS, "coco", dataclasses.replace(pretrained.MODELS["coco"], sha256="0" * 64))
    with pytest.raises(CheckpointError, match="differs from the registry"):
        load_language_model("coco")
