"""The ImageNet lexicon (package data) and the encoder's ImageNet head read as a label detector."""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

import captioner
from captioner.models.labels import (IMAGENET_CLASSES, LEXICON_FILE, ImageNetLabels, Lexicon, SATLabels,
                                       TransformerLabels, label_head, read_lexicon)
from captioner.config import DecodeOptions, EncoderConfig
from captioner.decoding.rules import AbsentVeto, ConfidentWords, fill_slots, read_photos
from captioner.decoding.search import SearchRules
from captioner.data.images import ImageTransform, load_image
from captioner.errors import ConfigError, DataError
from captioner.evaluation.chair import CHAIR_SYNONYMS, named_objects
from captioner.models.base import CaptionDecoder, State
from captioner.models.encoder import build_encoder
from captioner.models.registry import resolve_encoder
from captioner.text import Vocabulary

DOG_BREEDS = range(151, 269)  # Chihuahua .. Mexican hairless
BEAR_PHOTO = "coco2014-val168/val2014/COCO_val2014_000000000285.jpg"  # a grizzly bear in the grass


@pytest.fixture(scope="module")
def lexicon() -> Lexicon:
    return read_lexicon()


# ----------------------------------------------------------------------------- the lexicon


def test_the_lexicon_has_the_1000_classes_in_the_classifiers_order(lexicon):
    assert len(lexicon.wnids) == len(lexicon.names) == len(lexicon.word_index) == IMAGENET_CLASSES
    assert (lexicon.wnids[0], lexicon.names[0]) == ("n01440764", "tench")
    assert (lexicon.wnids[-1], lexicon.names[-1]) == ("n15075141", "toilet tissue")
    assert lexicon.wnids == tuple(sorted(lexicon.wnids))  # ImageNet-1k's outputs are in WordNet-id order
    timm_data = pytest.importorskip("timm.data")
    info = timm_data.ImageNetInfo()
    assert lexicon.wnids == tuple(info.index_to_label_name(i) for i in range(IMAGENET_CLASSES))


def test_known_classes_map_to_the_words_captions_use(lexicon):
    assert {lexicon.word_of(i) for i in DOG_BREEDS} == {"dog"}
    assert lexicon.classes_of("dog") == [*DOG_BREEDS, 273, 274, 275]  # + dingo, dhole, African hunting dog
    assert [lexicon.word_of(i) for i in range(281, 286)] == ["cat"] * 5  # tabby .. Egyptian cat
    known = {"wall clock": "clock", "analog clock": "clock", "digital clock": "clock", "broccoli": "broccoli",
             "ram": "sheep", "cheeseburger": "burger", "racket": "racket", "laptop": "laptop",
             "notebook": "laptop", "warplane": "airplane", "airliner": "airplane", "hotdog": "hot dog",
             "teddy": "teddy bear", "American black bear": "bear", "Granny Smith": "apple", "tabby": "cat"}
    for name, word in known.items():
        assert lexicon.word_of(lexicon.names.index(name)) == word, name
    # traps: the carpenter's plane is no airplane, the kite (21) is a bird, the crane (134) a bird too
    assert lexicon.word_of(726) is None and lexicon.names[726] == "plane"
    assert lexicon.word_of(21) == "bird" and lexicon.word_of(134) == "bird" and lexicon.word_of(517) == "crane"
    assert lexicon.word_of(lexicon.names.index("abacus")) is None
    assert sum(i >= 0 for i in lexicon.word_index) == 776


def test_every_word_is_a_plain_lowercase_word(lexicon):
    assert all(re.fullmatch(r"[a-z]+( [a-z]+)?", w) for w in lexicon.words)
    assert len(lexicon.words) == len(set(lexicon.words)) == 382
    assert lexicon.matrix().sum() == 776 and lexicon.matrix().sum(dim=1).max() == 1


def test_the_lexicon_reaches_63_of_the_80_coco_categories(lexicon):
    reached = {c for w in lexicon.words for c in named_objects(w)}
    assert len(reached) == 63
    # those without an ImageNet class
    assert set(CHAIR_SYNONYMS) - reached == {
        "baseball bat", "baseball glove", "cake", "carrot", "donut", "fire hydrant", "fork", "frisbee", "giraffe",
        "kite", "scissors", "skateboard", "snowboard", "stop sign", "suitcase", "surfboard", "toothbrush"}


def test_the_lexicon_is_package_data():
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["captioner"]
    assert LEXICON_FILE.relative_to(LEXICON_FILE.parents[1]).as_posix() in {p.replace("*.tsv", LEXICON_FILE.name)
                                                                           for p in patterns}


def _write(path, rows, header="index\twnid\tname\tword"):
    path.write_text("# a comment\n" + header + "\n" + "".join(r + "\n" for r in rows))
    return path


def _rows(n=IMAGENET_CLASSES):
    return [f"{i}\tn{i:08d}\tclass {i}\t" for i in range(n)]


@pytest.mark.parametrize("change, message", [
    (lambda rows: rows[:999], r": 999 classes, expected 1000"),
    (lambda rows: rows[:5] + rows[6:] + rows[5:6], r":8: index '6', expected 5 \(the classifier's order\)"),
    (lambda rows: rows[:3] + ["3\tn00000003\tclass 3\tDog"] + rows[4:], r":6: word 'Dog' is not one or two plain"),
    (lambda rows: rows[:3] + ["3\tn00000003\tclass 3\thot dog stand"] + rows[4:], r":6: word 'hot dog stand'"),
    (lambda rows: rows[:3] + ["3\tx3\tclass 3\tdog"] + rows[4:], r":6: WordNet id 'x3'"),
    (lambda rows: rows[:3] + ["3\tn00000003\tdog"] + rows[4:], r":6: 3 fields, expected 4"),
])
def test_a_bad_lexicon_is_one_line_naming_file_and_line(tmp_path, change, message):
    path = _write(tmp_path / "lex.tsv", change(_rows()))
    with pytest.raises(DataError, match=re.escape(str(path)) + message):
        read_lexicon(path)


def test_a_lexicon_without_its_header_or_missing_is_refused(tmp_path):
    with pytest.raises(DataError, match="the first row must be the header 'index wnid name word'"):
        read_lexicon(_write(tmp_path / "lex.tsv", _rows(), header="i\tw\tn\tword"))
    with pytest.raises(DataError, match="nothing.tsv"):
        read_lexicon(tmp_path / "nothing.tsv")
    good = read_lexicon(_write(tmp_path / "ok.tsv", _rows()[:2] + ["2\tn00000002\tx\thot dog"] + _rows()[3:]))
    assert good.words == ("hot dog",) and good.word_of(2) == "hot dog" and good.word_of(0) is None


# ----------------------------------------------------------------------------- the head


def _toy_head() -> ImageNetLabels:
    """3 classes over D=3 features: class 0 and 1 are "dog", class 2 has no word."""
    lexicon = Lexicon(("n1", "n2", "n3"), ("terrier", "poodle", "abacus"), ("dog",), (0, 0, -1))
    return ImageNetLabels(torch.eye(3) * 4.0, torch.zeros(3), lexicon)


def test_a_words_probability_is_the_sum_of_its_classes_and_its_map_peaks_where_they_are():
    head = _toy_head()
    features = torch.zeros(1, 4, 3)  # 4 regions, a 2x2 grid
    features[0, 0, 0] = 1.0  # region 0 looks like class 0 (terrier)
    features[0, 3, 1] = 1.0  # region 3 like class 1 (poodle)
    features[0, 1, 2] = 1.0  # region 1 like class 2 (no word)
    pooled = torch.softmax(features.mean(dim=1) @ (torch.eye(3) * 4.0).T, dim=-1)  # (1, 3)
    probs, top, maps = head(features, k=1)
    assert torch.allclose(probs, pooled[:, :2].sum(dim=1, keepdim=True))
    assert top.tolist() == [[0]] and maps.shape == (1, 1, 4)
    assert torch.allclose(maps.sum(dim=-1), torch.ones(1, 1))
    # both dog classes equally probable: the map is theirs, mixed equally: a softmax of the mixed logits
    logits = torch.tensor([2.0, 0.0, 0.0, 2.0])  # 0.5 * 4 where a dog class is, else 0
    assert torch.allclose(maps[0, 0], torch.softmax(logits, dim=0))
    [[(word, p, grid_map)]] = head.top(features, (2, 2), k=3)
    assert word == "dog" and p == round(float(probs[0, 0]), 4) and grid_map.shape == (2, 2)


def test_a_photo_the_same_everywhere_has_uniform_maps_and_min_prob_filters():
    head = _toy_head()
    [[(_, p, grid_map)]] = head.top(torch.zeros(1, 4, 3), (2, 2))
    assert p == round(2 / 3, 4) and torch.allclose(grid_map, torch.full((2, 2), 0.25))
    assert head.top(torch.zeros(2, 4, 3), (2, 2), min_prob=0.7) == [[], []]
    with pytest.raises(ConfigError, match="k must be an integer >= 1, got 0"):
        head.top(torch.zeros(1, 4, 3), (2, 2), k=0)
    with pytest.raises(ConfigError, match=r"needs a \(3, D\) weight and a bias"):
        ImageNetLabels(torch.eye(2), torch.zeros(2), head.lexicon)


def test_label_head_reads_the_wheels_classifier_and_refuses_encoders_without_one():
    head = label_head(EncoderConfig(name="efficientnet_lite0"))
    assert head.weight.shape == (IMAGENET_CLASSES, 1280) and head.bias.shape == (IMAGENET_CLASSES,)
    assert head.to_words.shape == (IMAGENET_CLASSES, len(head.words))
    with pytest.raises(ConfigError, match="encoder 'tiny' has no shipped ImageNet classifier"):
        label_head(EncoderConfig(name="tiny"))


def test_the_imagenet_encoder_sees_the_bear(shared_data):
    """Known answer: the wheel's trunk and head name the grizzly of a COCO photo (class order = lexicon order)."""
    cfg = resolve_encoder(EncoderConfig(name="efficientnet_lite0", grid=7, resize="stretch"))  # the wheel's preprocessing
    encoder = build_encoder(cfg).eval()
    pixels = ImageTransform(cfg)(load_image(shared_data / BEAR_PHOTO)).unsqueeze(0)
    with torch.no_grad():
        features, grid = encoder(pixels)
    [labels] = label_head(cfg).top(features, grid, k=3)
    assert labels[0][0] == "bear" and labels[0][1] > 0.5


def test_captioner_returns_labels_on_request(shared_data):
    model = captioner.load("flickr8k", device="cpu")
    photo = shared_data / BEAR_PHOTO
    plain, labelled = model.caption(photo)[0], model.caption(photo, labels=3)[0]
    assert plain.labels is None and labelled.text == plain.text
    assert [w for w, _, _ in labelled.labels][0] == "bear" and len(labelled.labels) == 3
    probs = [p for _, p, _ in labelled.labels]
    assert probs == sorted(probs, reverse=True) and probs[0] > 0.5
    for _, _, grid_map in labelled.labels:
        assert grid_map.shape == (7, 7) and abs(float(grid_map.sum()) - 1) < 1e-4
    with pytest.raises(ConfigError, match="labels must be an integer >= 0"):
        model.caption(photo, labels=-1)
    nbest = model.caption_nbest(photo, n_best=2, beam=3, labels=3)  # the server's call: the same labels on each
    assert nbest[0].text == plain.text and len(nbest) == 2
    for c in nbest:
        assert [(w, p) for w, p, _ in c.labels] == [(w, p) for w, p, _ in labelled.labels]
        np.testing.assert_allclose(np.stack([m.numpy() for _, _, m in c.labels]),
                                   np.stack([m.numpy() for _, _, m in labelled.labels]), atol=1e-6)
    assert model.caption_nbest(photo, n_best=1).pop().labels is None


# ----------------------------------------------------------------------------- the label channels and their reading


@pytest.fixture(scope="module")
def lite_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """Lite0 at 7x7 from the wheel, without and with ``encoder.labels``."""
    cfg = EncoderConfig(name="efficientnet_lite0", grid=7, image_size=224)
    return build_encoder(cfg).eval(), build_encoder(dataclasses.replace(cfg, labels=True)).eval()


def test_the_label_channels_are_the_original_top_stage_on_each_region(lite_pair):
    plain, labelled = lite_pair
    assert (plain.label_dim, labelled.label_dim, labelled.out_dim) == (0, 1280, 1280)
    pixels = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        regions, grid = plain(pixels)
        features, same_grid = labelled(pixels)
    assert features.shape == (2, 49, 1280 + 1280) and grid == same_grid == (7, 7)
    torch.testing.assert_close(features[..., :1280], regions)  # the regions are untouched
    # the top stage is the wheel's here, so the label channels are the regions again: the classifier's input
    torch.testing.assert_close(features[..., 1280:], regions, rtol=1e-4, atol=1e-4)
    head = label_head(EncoderConfig(name="efficientnet_lite0"))
    torch.testing.assert_close(head.class_maps(features), regions @ head.weight.T + head.bias, rtol=1e-4, atol=2e-3)
    torch.testing.assert_close(head.class_probs(features), head.class_probs(regions), rtol=1e-4, atol=1e-5)


def test_a_labelled_model_reads_the_labels_with_the_wheels_classifier():
    from captioner.config import ModelConfig
    from captioner.config.decoders import SATConfig
    from captioner.models.model import build_model

    cfg = ModelConfig(encoder=EncoderConfig(name="efficientnet_lite0", grid=7, labels=True),
                      decoder=SATConfig(embed_dim=8, hidden_dim=8, attention_dim=8))
    reading = build_model(cfg, 8).decoder.extension
    head = label_head(EncoderConfig(name="efficientnet_lite0"))
    assert torch.equal(reading.classifier.weight, head.weight) and torch.equal(reading.classifier.bias, head.bias)
    assert not any(p.requires_grad for p in reading.classifier.parameters())
    features = torch.rand(2, 5, 1280 + 1280)
    # the classifier on the mean of the label channels: the mean of the regions' class logits (their CAMs)
    torch.testing.assert_close(reading.class_probs(features), head.class_probs(features[..., 1280:]))
    torch.testing.assert_close(reading.class_probs(features), head.class_probs(features))  # 2 x 1280: the labels


def test_the_label_top_stays_frozen_and_in_eval_mode_while_the_top_stage_trains():
    cfg = EncoderConfig(name="efficientnet_lite0", grid=7, image_size=224, labels=True, fine_tune=True,
                        fine_tune_stages=1)
    encoder = build_encoder(cfg).train()
    top = encoder.trunk.label_top
    assert not top.training and not any(p.requires_grad for p in top.parameters())
    assert any(p.requires_grad for p in encoder.trunk.conv_head.parameters())
    before = {k: v.clone() for k, v in top.state_dict().items()}
    features, _ = encoder(torch.randn(2, 3, 224, 224))
    features[..., :1280].sum().backward()  # the regions train; the label channels hold no gradient path
    assert all(torch.equal(v, top.state_dict()[k]) for k, v in before.items())  # BatchNorm statistics too
    with pytest.raises(ConfigError, match="encoder 'tiny' has no shipped ImageNet classifier"):
        build_encoder(EncoderConfig(name="tiny", grid=2, labels=True))
    with pytest.raises(ConfigError, match="encoder.labels must be true or false"):
        EncoderConfig(labels="yes")


def _reading(feature_dim: int = 8) -> tuple[SATLabels, Vocabulary]:
    rest = IMAGENET_CLASSES - 2  # class 0 is a terrier, 1 a tabby, the others have no word
    lexicon = Lexicon(tuple(f"n{i:08d}" for i in range(IMAGENET_CLASSES)), ("terrier", "tabby", *["x"] * rest),
                      ("dog", "cat"), (0, 1, *[-1] * rest))
    reading = SATLabels(feature_dim, hidden_dim=6, embed_dim=4, vocab_size=7, lexicon=lexicon)
    _pass_through(reading)
    with torch.no_grad():
        reading.person_mu.zero_()
    vocab = Vocabulary(["a", "dog", "runs"])  # no "cat": its label cannot be copied
    reading.use_vocabulary(vocab.stoi)
    return reading, vocab


def _pass_through(reading: SATLabels) -> None:
    """A classifier that reads the class logits off the first 1000 label channels (the CAM is those channels)."""
    reading.use_classifier(torch.eye(IMAGENET_CLASSES, 1280), torch.zeros(IMAGENET_CLASSES))


def _labelled_features(batch: int = 2, n: int = 4, d: int = 8, dog: float = 6.0) -> torch.Tensor:
    """Regions, then label channels whose first 1000 are the class logits under :func:`_pass_through`."""
    cam = torch.zeros(batch, n, 1280)
    cam[:, :, 0] = dog  # every region says terrier
    return torch.cat([torch.randn(batch, n, d), cam], dim=-1)


def test_the_reading_gives_the_words_the_person_score_and_the_regions():
    reading, _ = _reading()
    features = _labelled_features()
    labels = reading.read(features)["labels"]
    assert labels.shape == (2, 3) and reading.width == 3  # dog, cat, person
    probs = torch.softmax(features[0, :, 8:8 + IMAGENET_CLASSES].mean(0), -1)
    torch.testing.assert_close(labels[0, :2], torch.stack([probs[0], probs[1]]))
    torch.testing.assert_close(labels[:, 2], torch.full((2,), 0.5))  # an unfitted person probe: w = 0, b = 0
    torch.testing.assert_close(reading.regions(features), features[..., :8])
    assert reading.copy_ids.tolist() == [5, -1]  # "dog" is id 5 (after the 4 specials and "a"); "cat" is absent
    with pytest.raises(ConfigError, match="need 8 region and 1280 label channels"):
        reading.read(torch.randn(2, 4, 8))


def test_the_copy_mixes_the_label_word_into_a_distribution():
    reading, vocab = _reading()
    static = reading.read(_labelled_features())
    logits = torch.zeros(2, 3, len(vocab))  # a generator with no opinion, at 3 steps
    hidden = torch.zeros(2, 3, 4)
    scores, outputs = reading.word_scores(logits, hidden, static)
    torch.testing.assert_close(scores.exp().sum(-1), torch.ones(2, 3))
    g = torch.sigmoid(torch.tensor(-3.0))  # the gate's start
    dog = vocab.stoi["dog"]
    torch.testing.assert_close(scores[0, 0, dog].exp(), (1 - g) / len(vocab) + g)  # the only copyable word
    # the step reports the copy's share of each copyable word's probability (here "dog" alone)
    assert outputs["copy_share"].shape == (2, 3, 1)
    torch.testing.assert_close(outputs["copy_share"][0, 0, 0], g / ((1 - g) / len(vocab) + g))
    with torch.no_grad():
        reading.gate.bias.fill_(8.0)  # the gate open: the copy's word wins
    assert int(reading.word_scores(logits[:, 0], hidden[:, 0], static)[0].argmax(-1)[0]) == dog


@pytest.mark.parametrize("family", ["sat", "transformer"])
def test_both_decoders_read_labels_through_the_extension(family):
    from captioner.config.decoders import SATConfig, TransformerConfig
    from captioner.decoding.search import SearchRules, search
    from captioner.models.registry import build_decoder
    from captioner.models.model import build_extension
    from captioner.config import ConceptsConfig

    cfg = SATConfig(embed_dim=8, hidden_dim=8, attention_dim=8) if family == "sat" else \
        TransformerConfig(d_model=8, num_layers=1, num_heads=2, ff_dim=16)
    ext = build_extension(ConceptsConfig(), cfg, feature_dim=6, labels=True, vocab_size=7)
    _pass_through(ext)
    assert type(ext).__name__ == ("SATLabels" if family == "sat" else "TransformerLabels")
    vocab = Vocabulary(["a", "dog", "runs"])
    ext.use_vocabulary(vocab.stoi)
    decoder = build_decoder(cfg, feature_dim=6, vocab_size=len(vocab), grid=2, extension=ext).eval()
    features = _labelled_features(d=6)
    out = decoder(features, torch.tensor([[1, 4, 5], [1, 5, 6]]))
    assert out.logits.shape == (2, 3, len(vocab)) and out.attention.shape == (2, 3, 4)
    torch.testing.assert_close(out.logits.exp().sum(-1), torch.ones(2, 3))  # the copy gives log-probabilities
    with torch.no_grad():
        hyps = search(decoder, features, DecodeOptions(beam_size=2, max_len=4), SearchRules(vocab.bos_id, vocab.eos_id))
    assert len(hyps) == 2 and all(len(h) == 1 for h in hyps)
    from captioner.inference import search_features
    assert len(search_features(decoder, features, vocab, DecodeOptions(veto=10.0))) == 2
    assert not {"veto", "attributing", "_shares"} & set(vars(ext))  # the model holds no test-time switch
    low = search_features(decoder, features, vocab, DecodeOptions(precision="bfloat16"))  # a bfloat16 copy decodes
    assert len(low) == 2 and all(torch.isfinite(h[0].attention).all() for h in low)
    with pytest.raises(ConfigError, match="reads concepts .* or the encoder's labels"):
        build_extension(ConceptsConfig(count=3), cfg, feature_dim=6, labels=True)


def test_a_labelled_model_round_trips_through_a_checkpoint(tmp_path, lite_pair, monkeypatch):
    from captioner.checkpoint import store
    from captioner.checkpoint.store import load_checkpoint, save_checkpoint
    from captioner.config import ModelConfig
    from captioner.config.decoders import SATConfig
    from captioner.models.model import build_model

    vocab = Vocabulary(["a", "dog", "runs", "cat"])
    cfg = ModelConfig(encoder=EncoderConfig(name="efficientnet_lite0", grid=7, labels=True),
                      decoder=SATConfig(embed_dim=8, hidden_dim=8, attention_dim=8))
    model = build_model(cfg, len(vocab)).eval()
    model.decoder.extension.use_vocabulary(vocab.stoi)
    path = save_checkpoint(tmp_path / "m.safetensors", model, vocab)
    materialised = []
    real = store._materialise
    monkeypatch.setattr(store, "_materialise", lambda *a: materialised.append(real(*a)) or materialised[-1])
    loaded = load_checkpoint(path).model.eval()
    assert materialised == [True]  # built on the meta device, no second, randomly initialised build
    assert torch.equal(loaded.decoder.extension.to_words, model.decoder.extension.to_words)  # not stored: rebuilt
    assert loaded.decoder.extension.copy_ids.tolist() == model.decoder.extension.copy_ids.tolist()
    pixels, tokens = torch.randn(1, 3, 224, 224), torch.tensor([[1, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(pixels, tokens).logits, model(pixels, tokens).logits)


def test_the_veto_silences_object_words_whose_labels_say_absent():
    from captioner.evaluation.chair import named_objects
    from captioner.inference import search_features

    reading, _ = _reading()
    vocab = Vocabulary(["a", "dog", "man", "cat", "runs"])
    reading = SATLabels(8, hidden_dim=6, embed_dim=4, vocab_size=len(vocab), lexicon=reading.lexicon)
    _pass_through(reading)
    reading.use_vocabulary(vocab.stoi, categories=named_objects)
    with torch.no_grad():
        reading.person_b.fill_(-5.0)  # nobody in the photo
    features = _labelled_features()  # every region says terrier: a dog, no cat

    class Uniform(CaptionDecoder):  # every word alike at every step
        vocab_size = len(vocab)

        def init_state(self, f):
            return State({"f": f}, {})

        def step(self, prev, state):
            return torch.full((len(prev), len(vocab)), -math.log(len(vocab))), state, torch.full((len(prev), 4), 0.25)

    vetoed = AbsentVeto(Uniform(), reading, 10.0)  # the decoder's steps less the penalty, renormalised
    drop = vetoed.penalty(read_photos(reading, features))[0]
    assert drop[vocab.stoi["man"]] == drop[vocab.stoi["cat"]] == 10.0  # person and cat absent
    assert drop[vocab.stoi["dog"]] == drop[vocab.stoi["a"]] == drop[vocab.stoi["runs"]] == 0.0
    log_probs = vetoed.step(torch.tensor([1, 1]), vetoed.init_state(features))[0]
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(2))
    row = log_probs[0]
    assert row[vocab.stoi["dog"]] == row[vocab.stoi["a"]] and row[vocab.stoi["dog"]] - row[vocab.stoi["cat"]] == \
        pytest.approx(10.0)

    from captioner.config.decoders import SATConfig
    from captioner.models.registry import build_decoder
    plain_decoder = build_decoder(SATConfig(embed_dim=4, hidden_dim=6, attention_dim=4), feature_dim=8,
                                  vocab_size=len(vocab), grid=2).eval()
    with pytest.raises(ConfigError, match="veto=10 needs a model that reads the encoder's labels"):
        search_features(plain_decoder, torch.randn(1, 4, 8), vocab, DecodeOptions(veto=10.0))
    with pytest.raises(ConfigError, match="decoding veto must be a finite number >= 0"):
        DecodeOptions(veto=-1.0)


def _filling_setup(family: str = "sat") -> tuple[SATLabels | TransformerLabels, Vocabulary, torch.Tensor]:
    """A reading (the SAT's or the Transformer's) whose photo holds a cat in region 2 only (a tabby CAM there,
    present by the photo's labels), no dog and nobody; its vocabulary can write both, singular and plural."""
    from captioner.evaluation.chair import named_objects

    lexicon = _reading()[0].lexicon
    vocab = Vocabulary(["a", "dog", "dogs", "cat", "cats", "man", "person", "people", "runs"])
    reading = SATLabels(8, hidden_dim=6, embed_dim=4, vocab_size=len(vocab), lexicon=lexicon).eval() \
        if family == "sat" else TransformerLabels(8, d_model=8, vocab_size=len(vocab), lexicon=lexicon).eval()
    _pass_through(reading)
    reading.use_vocabulary(vocab.stoi, categories=named_objects)
    with torch.no_grad():
        reading.person_b.fill_(-5.0)
    features = _labelled_features(batch=1, dog=0.0)
    features[0, 2, 8 + 1] = 20.0  # the tabby: region 2 is sure of it, and the photo's label is 0.13
    return reading, vocab, features


def _hypothesis(vocab: Vocabulary, words: list[str], looks: list[int]):
    from captioner.decoding.search import Hypothesis

    attention = torch.nn.functional.one_hot(torch.tensor(looks), 4).float()  # word t looked at region looks[t]
    return Hypothesis([vocab.stoi[w] for w in words], -1.5, attention, -1.5, True)


def test_an_absent_objects_word_is_filled_with_what_the_labels_see_where_it_looked():
    """Slots filled by detections (after Neural Baby Talk): "dog", "dogs" and "man" are absent by the labels;
    each becomes "cat"/"cats" where it looked at the cat's region, and stays where it looked at nothing."""
    from captioner.text import plural_forms

    reading, vocab, features = _filling_setup()
    labels = reading.labels(reading.class_probs(features))[0]
    assert labels[1] > 0.05 > labels[0] and labels[2] < 0.01  # cat present; dog and person absent
    hyps = [_hypothesis(vocab, ["a", "dog", "runs"], [0, 2, 2]), _hypothesis(vocab, ["dogs", "runs"], [2, 0]),
            _hypothesis(vocab, ["a", "man", "cat"], [1, 2, 2]), _hypothesis(vocab, ["a", "dog"], [1, 0]),
            _hypothesis(vocab, ["cats", "runs"], [0, 1]), _hypothesis(vocab, ["people", "runs"], [2, 2])]
    before = [h.attention.clone() for h in hyps]
    filled = fill_slots(read_photos(reading, features.expand(len(hyps), -1, -1)), [[h] for h in hyps], tau=0.5,
                        word_forms=plural_forms(vocab))  # a photo each, the same photo
    assert [vocab.decode(h.tokens) for h in hyps] == ["a cat runs", "cats runs", "a cat cat", "a dog", "cats runs",
                                                      "cats runs"]
    assert filled == 4  # the dog that looked at nothing stays: nothing there is 0.5 likely
    assert all(torch.equal(h.attention, a) and h.score == -1.5 for h, a in zip(hyps, before))
    # nothing present is sure enough, or the word is present: nothing changes
    again = [_hypothesis(vocab, ["a", "dog", "runs"], [0, 2, 2])]
    assert fill_slots(read_photos(reading, features), [again], 1.0, {}) == 0
    assert vocab.decode(again[0].tokens) == "a dog runs"
    # an n-best list holds each caption once: the second, equal to the first once filled, is dropped
    nbest = [_hypothesis(vocab, ["a", "dog", "runs"], [0, 2, 2]), _hypothesis(vocab, ["a", "cat", "runs"], [0, 2, 2]),
             _hypothesis(vocab, ["a", "cat"], [0, 2])]
    first = nbest[0]
    assert fill_slots(read_photos(reading, features), [nbest], 0.5, {}) == 1
    assert [vocab.decode(h.tokens) for h in nbest] == ["a cat runs", "a cat"] and nbest[0] is first


@pytest.mark.parametrize("family", ["sat", "transformer"])
def test_decoding_fills_the_slots_of_the_searched_captions_and_only_when_asked(family):
    from captioner.config.decoders import SATConfig, TransformerConfig
    from captioner.text import plural_forms
    from captioner.inference import search_features
    from captioner.models.registry import build_decoder

    torch.manual_seed(0)
    reading, vocab, features = _filling_setup(family)
    cfg = SATConfig(embed_dim=4, hidden_dim=6, attention_dim=4) if family == "sat" else \
        TransformerConfig(d_model=8, num_layers=1, num_heads=2, ff_dim=16)
    decoder = build_decoder(cfg, feature_dim=8, vocab_size=len(vocab), grid=2, extension=reading).eval()
    out = decoder.out_word if family == "sat" else decoder.out
    with torch.no_grad():
        reading.gate.bias.fill_(-30.0)  # no copy
        out.bias[vocab.stoi["dog"]] += 6.0  # an untrained decoder that names a dog
    plain = search_features(decoder, features, vocab, DecodeOptions(max_len=4))[0][0]
    assert vocab.stoi["dog"] in plain.tokens
    filled = search_features(decoder, features, vocab, DecodeOptions(max_len=4, fill_slots=0.01))[0][0]
    fill_slots(read_photos(reading, features), [[plain]], 0.01, plural_forms(vocab))  # the search's caption, filled by hand
    assert filled.tokens == plain.tokens and vocab.stoi["dog"] not in filled.tokens
    assert filled.score == pytest.approx(plain.score)
    off = search_features(decoder, features, vocab, DecodeOptions(max_len=4, fill_slots=0.0))[0][0]
    assert vocab.stoi["dog"] in off.tokens


@pytest.mark.parametrize("gate", [-30.0, 8.0])
def test_a_copied_word_looks_where_its_label_is(gate):
    """decode gives a word the copy wrote its label's map, in the share the copy had of its probability."""
    from captioner.config.decoders import SATConfig
    from captioner.decoding.search import decode, search
    from captioner.models.registry import build_decoder

    torch.manual_seed(0)
    reading, vocab = _reading()
    decoder = build_decoder(SATConfig(embed_dim=4, hidden_dim=6, attention_dim=4), feature_dim=8,
                            vocab_size=len(vocab), grid=2, extension=reading).eval()
    features = _labelled_features(batch=1, dog=0.0)
    features[0, 2, 8] = 8.0  # the terrier is in region 2 only
    with torch.no_grad():
        reading.gate.bias.fill_(gate)
    # greedy: with the gate open "dog" is the likeliest word at every step, while a beam may rank the empty
    # caption level with "dog dog dog" (the closing <eos> costs both the same)
    options = DecodeOptions(beam_size=1, max_len=3)
    with torch.no_grad():
        plain = search(decoder, features, options, SearchRules(vocab.bos_id, vocab.eos_id))[0][0]
    found = decode(decoder, features, SearchRules(vocab.bos_id, vocab.eos_id), options)[0][0]
    assert found.tokens == plain.tokens
    torch.testing.assert_close(found.attention.sum(-1), torch.ones(len(found.tokens)))
    dog = [t for t, w in enumerate(found.tokens) if w == vocab.stoi["dog"]]
    if gate < 0:  # the copy's share is nil: the decoder's own attention, unchanged
        torch.testing.assert_close(found.attention, plain.attention)
    else:  # the copy wrote "dog": it looked at region 2, whatever the decoder's attention said
        assert dog and all(int(found.attention[t].argmax()) == 2 and found.attention[t, 2] > 0.9 for t in dog)
        others = [t for t in range(len(found.tokens)) if t not in dog]
        torch.testing.assert_close(found.attention[others], plain.attention[others])


def _constrained_setup():
    from captioner.config.decoders import SATConfig
    from captioner.models.registry import build_decoder

    torch.manual_seed(0)
    reading, vocab = _reading()
    decoder = build_decoder(SATConfig(embed_dim=4, hidden_dim=6, attention_dim=4), feature_dim=8,
                            vocab_size=len(vocab), grid=2, extension=reading).eval()
    with torch.no_grad():
        reading.gate.bias.fill_(-30.0)  # no copy, and a decoder that would rather not say "dog"
        decoder.out_word.bias[vocab.stoi["dog"]] -= 4.0
    return decoder, vocab


@pytest.mark.parametrize("beam", [1, 3])
def test_constrained_search_writes_a_confident_label_word(beam):
    """Constrained beam search (Anderson et al. 2017): a photo whose labels are sure of "dog" gets it."""
    from captioner.inference import search_features

    decoder, vocab = _constrained_setup()
    features = _labelled_features(batch=3, dog=8.0)
    features[2, :, 8:] = 0.0  # a photo whose labels are sure of nothing: no constraint
    dog = vocab.stoi["dog"]
    plain = search_features(decoder, features, vocab, DecodeOptions(beam_size=beam, max_len=6))
    forced = search_features(decoder, features, vocab, DecodeOptions(beam_size=beam, max_len=6, constrain=0.5))
    assert not any(dog in h[0].tokens for h in plain)  # the untrained decoder does not say it by itself
    for b in (0, 1):
        assert dog in forced[b][0].tokens and forced[b][0].finished
        assert forced[b][0].attention.shape == (len(forced[b][0].tokens), 4)
    assert forced[2][0].tokens == plain[2][0].tokens  # no confident label: plain beam search
    assert forced[2][0].score == pytest.approx(plain[2][0].score)
    assert ConfidentWords(0.5, {})(read_photos(decoder.extension, features)) == [[dog], [dog], []]


@pytest.mark.parametrize("option", ["constrain", "fill_slots"])
def test_constrain_and_fill_slots_need_a_model_that_reads_labels_and_a_probability(option):
    from captioner.config.decoders import SATConfig
    from captioner.inference import search_features
    from captioner.models.registry import build_decoder

    vocab = Vocabulary(["a", "dog", "runs"])
    plain_decoder = build_decoder(SATConfig(embed_dim=4, hidden_dim=6, attention_dim=4), feature_dim=8,
                                  vocab_size=len(vocab), grid=2).eval()
    with pytest.raises(ConfigError, match=f"{option}=0.3 needs a model that reads the encoder's labels"):
        search_features(plain_decoder, torch.randn(1, 4, 8), vocab, DecodeOptions(**{option: 0.3}))
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError, match=f"decoding {option} must be a probability"):
            DecodeOptions(**{option: bad})


def test_a_constraint_that_cannot_be_met_falls_back_to_the_best_caption_without_it():
    from captioner.decoding.search import search

    decoder, vocab = _constrained_setup()
    features = _labelled_features(batch=1, dog=8.0)
    dog = vocab.stoi["dog"]
    options = DecodeOptions(beam_size=2, max_len=4, n_best=2)
    with torch.no_grad():
        found = search(decoder, features, options, SearchRules(vocab.bos_id, vocab.eos_id, [vocab.pad_id, vocab.bos_id, vocab.unk_id, dog]), [[dog]])[0]
    assert len(found) == 2 and all(dog not in h.tokens for h in found)  # "dog" banned: never met
    assert all(h.attention.shape == (len(h.tokens), 4) for h in found)
    assert found[0].score >= found[1].score


def test_a_constraint_on_a_word_is_met_by_its_plural_too():
    from captioner.text import plural_forms

    vocab = Vocabulary(["a", "dog", "dogs", "bus", "buses", "pony", "ponies", "grass", "man", "men", "people"])
    forms = plural_forms(vocab)
    assert forms[vocab.stoi["man"]] == [vocab.stoi["men"]] and vocab.stoi["people"] not in forms  # no "person"
    assert forms[vocab.stoi["dog"]] == [vocab.stoi["dogs"]] and forms[vocab.stoi["bus"]] == [vocab.stoi["buses"]]
    assert forms[vocab.stoi["pony"]] == [vocab.stoi["ponies"]] and vocab.stoi["grass"] not in forms
