"""Concept detectors learnt from captions (captioner.models.concepts, captioner.training.concepts), the decoder extension that reads them, the
guide term, the ``captioner concepts`` command, and decoding that does not repeat."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from captioner.config import DecodeOptions, get_preset
from captioner.data.caption_set import CaptionSet, ImageRecord
from captioner.decoding.search import SearchRules, BlockRepeats, content_word_ids, decode
from captioner.errors import CheckpointError, ConfigError
from captioner.models.concepts import (CONCEPT_TOKENS, ConceptHead, OutOfFoldConcepts, SATConcepts, TransformerConcepts,
                                      build_extension, choose_concepts, feature_fold, load_concepts,
                                      load_concepts_with_folds, photo_tags, restrict_to_vocab, save_concepts)
from captioner.training.concepts import (ConceptGuide, RunConcepts, average_precision, concept_targets, run_concepts,
                                         train_concepts)
from captioner.models.lstm import SATDecoder
from captioner.models.model import build_model
from captioner.models.transformer import TransformerCaptionDecoder
from captioner.text import Vocabulary

REPO = Path(__file__).resolve().parents[1]
D, N = 12, 9


def _caption_set(captions: dict[int, list[str]]) -> CaptionSet:
    images = [ImageRecord(i, f"{i}.jpg", Path(f"{i}.jpg")) for i in captions]
    return CaptionSet("test", "train", images, captions, Path("."))


# ----------------------------------------------------------------------------- choosing and scoring


def test_choose_concepts_counts_images_not_mentions_and_leaves_out_function_words():
    captions = [["a", "dog", "dog", "dog", "on", "grass"], ["the", "dog", "runs"], ["a", "cat", "on", "grass"]]
    assert choose_concepts(captions, 10, min_images=1) == ["dog", "grass", "cat", "runs"]
    assert choose_concepts(captions, 1, min_images=1) == ["dog"]
    assert choose_concepts(captions, 10, min_images=2) == ["dog", "grass"]
    with pytest.raises(ConfigError, match="number of concepts"):
        choose_concepts(captions, 0)


def test_concept_targets_are_the_share_of_captions_using_the_word():
    cs = _caption_set({1: ["A dog runs.", "a brown dog", "grass", "a field", "dogs"], 2: ["a cat"]})
    targets = concept_targets(cs, ["dog", "grass", "cat"])
    torch.testing.assert_close(targets, torch.tensor([[0.4, 0.2, 0.0], [0.0, 0.0, 1.0]]))


def test_average_precision_known_answers():
    scores = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]])
    positives = torch.tensor([[1, 0], [0, 0], [1, 0], [0, 0]], dtype=torch.bool)
    ap = average_precision(scores, positives)
    assert ap[0].item() == pytest.approx((1 / 1 + 2 / 3) / 2)
    assert math.isnan(ap[1].item())  # no positive: not scored
    perfect = average_precision(torch.tensor([[0.1], [0.9]]), torch.tensor([[False], [True]]))
    assert perfect.item() == pytest.approx(1.0)


# ----------------------------------------------------------------------------- the head


@pytest.mark.parametrize("pooling", ["lse", "noisy_or"])
def test_head_shapes_maps_and_pooling(pooling):
    torch.manual_seed(0)
    head = ConceptHead(D, ["dog", "ball", "grass"], hidden_dim=8, pooling=pooling).eval()
    x = torch.randn(4, N, D)
    logits = head(x)
    assert logits.shape == (4, N, 3)
    maps = head.maps(x)
    assert maps.shape == (4, 3, N)
    torch.testing.assert_close(maps.sum(-1), torch.ones(4, 3))
    probs = head.probs(x)
    assert probs.shape == (4, 3) and bool(((probs > 0) & (probs < 1)).all())
    p = torch.sigmoid(logits)
    if pooling == "noisy_or":  # P = 1 - prod_i (1 - p_i)
        torch.testing.assert_close(probs, 1 - (1 - p).prod(dim=1), atol=1e-5, rtol=1e-4)
    else:  # a soft maximum: between the max region logit and max + log(N) / r
        top = logits.max(dim=1).values
        pooled = head.pool(logits)
        assert bool((pooled >= top - 1e-6).all()) and bool((pooled <= top + math.log(N) / head.sharpness + 1e-6).all())


def test_head_starts_with_most_concepts_absent():
    head = ConceptHead(D, ["w"] * 5, hidden_dim=8, pooling="noisy_or").eval()
    with torch.no_grad():
        assert float(head.probs(torch.randn(2, 49, D) * 0.01).max()) < 0.7  # not 1 - 0.5**49


def test_concepts_file_round_trip_and_one_line_errors(tmp_path):
    torch.manual_seed(0)
    head = ConceptHead(D, ["dog", "ball"], hidden_dim=6, pooling="noisy_or", sharpness=3.0).eval()
    path = save_concepts(head, tmp_path / "c.safetensors", {"dev_map": 0.5})
    back, extra = load_concepts(path)
    x = torch.randn(2, N, D)
    torch.testing.assert_close(back(x), head(x))
    assert back.words == ["dog", "ball"] and back.pooling == "noisy_or" and back.sharpness == 3.0
    assert extra == {"dev_map": 0.5}
    with pytest.raises(CheckpointError, match="does not exist"):
        load_concepts(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="junk.safetensors"):
        load_concepts(tmp_path / "junk.safetensors")


def test_restrict_to_vocab_keeps_each_kept_words_weights():
    torch.manual_seed(0)
    head = ConceptHead(D, ["dog", "zebra", "ball"], hidden_dim=6).eval()
    small = restrict_to_vocab(head, Vocabulary(["a", "dog", "ball"]))
    x = torch.randn(2, N, D)
    assert small.words == ["dog", "ball"]
    torch.testing.assert_close(small(x), head(x)[..., [0, 2]])
    with pytest.raises(ConfigError, match="none of the concept words"):
        restrict_to_vocab(head, Vocabulary(["cat"]))


# ----------------------------------------------------------------------------- learning


def _planted(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features where concept j, when present, shows as direction j in one random region; its index."""
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(n, N, D, generator=gen) * 0.3
    present = torch.rand(n, k, generator=gen) < 0.3
    where = torch.randint(0, N, (n, k), generator=gen)
    for i, j in present.nonzero().tolist():
        feats[i, where[i, j], j] += 3.0
    return feats, present.float(), where


def test_mil_learns_planted_concepts_and_their_maps_point_at_them():
    torch.manual_seed(0)
    k = 4
    train_x, train_y, _ = _planted(300, k, 0)
    dev_x, dev_y, dev_where = _planted(100, k, 1)
    head = ConceptHead(D, [f"w{j}" for j in range(k)], hidden_dim=32, dropout=0.0)
    report = train_concepts(head, train_x, train_y, dev_x, dev_y, epochs=20, batch_size=32, lr=1e-2, progress=False)
    assert report.dev_map > 0.85, report
    assert len(report.dev_map_by_epoch) == 20 and report.last_loss < report.first_loss
    maps = head.maps(dev_x)  # (C, K, N)
    hits = [int(maps[i, j].argmax()) == int(dev_where[i, j]) for i, j in (dev_y > 0).nonzero().tolist()]
    assert sum(hits) / len(hits) > 0.9


def test_train_concepts_refuses_mismatched_targets():
    head = ConceptHead(D, ["a1"], hidden_dim=4)
    with pytest.raises(Exception, match="targets"):
        train_concepts(head, torch.zeros(3, N, D), torch.zeros(2, 1), torch.zeros(1, N, D), torch.zeros(1, 1),
                       epochs=1, progress=False)



# ----------------------------------------------------------------------------- cross-fitting


def test_top_k_precision_known_answer():
    from captioner.training.concepts import top_k_precision

    scores = torch.tensor([[0.9, 0.8, 0.1], [0.1, 0.2, 0.3]])
    positives = torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=torch.bool)
    assert top_k_precision(scores, positives, k=2) == pytest.approx((0.5 + 1.0) / 2)
    assert top_k_precision(scores, positives, k=10) == pytest.approx(4 / 6)  # k beyond K: every concept
    assert math.isnan(top_k_precision(scores[:0], positives[:0]))


def test_feature_fold_is_a_function_of_the_regions_alone():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, N, D, generator=gen)
    fold = feature_fold(x, 3)
    assert fold.shape == (40,) and fold.dtype == torch.long and set(fold.tolist()) == {0, 1, 2}
    assert torch.equal(fold, (x > 0).flatten(1).sum(1) % 3)  # known answer
    assert torch.equal(feature_fold(x.half(), 3), fold)  # the cache's fp16 rows give the same folds
    assert torch.equal(torch.cat([feature_fold(x[i:i + 7], 3) for i in range(0, 40, 7)]), fold)  # any batching
    assert torch.equal(feature_fold(x[[5, 2]], 3), fold[[5, 2]])


def test_concepts_file_keeps_its_fold_heads_and_refuses_unlike_ones(tmp_path):
    torch.manual_seed(0)
    words = ["dog", "ball"]
    head, folds = ConceptHead(D, words, hidden_dim=6).eval(), [ConceptHead(D, words, hidden_dim=6) for _ in range(3)]
    path = save_concepts(head, tmp_path / "c.safetensors", {"folds": 3}, folds=folds)
    back, extra, back_folds = load_concepts_with_folds(path)
    x = torch.randn(2, N, D)
    torch.testing.assert_close(back(x), head(x))
    assert len(back_folds) == 3
    for mine, theirs in zip(folds, back_folds):
        torch.testing.assert_close(theirs(x), mine.eval()(x))
    assert load_concepts(path)[0].words == words  # a reader that knows nothing of folds gets the full head
    plain = save_concepts(head, tmp_path / "plain.safetensors")
    assert load_concepts_with_folds(plain)[2] == []
    with pytest.raises(ConfigError, match="fold head"):
        save_concepts(head, tmp_path / "bad.safetensors", folds=[ConceptHead(D, ["dog"], hidden_dim=6)])


def test_out_of_fold_reads_each_photo_with_the_head_of_its_fold():
    torch.manual_seed(0)
    heads = [ConceptHead(D, ["a", "b", "c"], hidden_dim=5).eval() for _ in range(3)]
    reader = OutOfFoldConcepts(heads)
    x = torch.randn(20, N, D)
    probs, maps = reader.read(x)
    fold = feature_fold(x, 3)
    for i in range(20):
        p, m = heads[int(fold[i])].read(x[i:i + 1])
        torch.testing.assert_close(probs[i:i + 1], p)
        torch.testing.assert_close(maps[i:i + 1], m)
    torch.testing.assert_close(reader.probs(x), probs)
    with pytest.raises(ConfigError, match="at least 2"):
        OutOfFoldConcepts(heads[:1])


def test_a_decoder_reads_the_fold_heads_while_training_and_its_own_head_otherwise():
    torch.manual_seed(0)
    decoder = _sat_with_concepts(concept_prior=True)
    folds = [ConceptHead(D, [""] * 3, hidden_dim=6).eval() for _ in range(2)]
    for h in folds:
        torch.nn.init.normal_(h.net[-1].weight, std=3.0)  # unlike the decoder's own head
    x = torch.randn(6, N, D)
    own = decoder.extension.concept_head.probs(x)
    decoder.extension.use_concept_folds(OutOfFoldConcepts(folds))
    decoder.train()
    crossed = OutOfFoldConcepts(folds).probs(x)
    torch.testing.assert_close(decoder.extension.concept_probs(x), crossed)
    probs, prior = decoder.extension.read_concepts(x)
    torch.testing.assert_close(probs, crossed)
    torch.testing.assert_close(prior["concept_maps"], OutOfFoldConcepts(folds).read(x)[1])
    decoder.eval()
    torch.testing.assert_close(decoder.extension.concept_probs(x), own)  # validation and decoding: the full head
    assert not any("fold" in key for key in decoder.state_dict())  # never saved with the weights
    decoder.extension.use_concept_folds(None)
    decoder.train()
    torch.testing.assert_close(decoder.extension.concept_probs(x), own)


def test_fold_heads_score_each_training_photo_without_having_seen_it():
    """Concepts that cannot be learnt (random targets over random features) are memorised in-sample; the
    out-of-fold scores of the same photos know nothing of them."""
    from captioner.training.concepts import image_scores, train_fold_heads

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(120, N, D, generator=gen)
    y = (torch.rand(120, 4, generator=gen) < 0.3).float()
    make = lambda: ConceptHead(D, [f"w{j}" for j in range(4)], hidden_dim=64, dropout=0.0)  # noqa: E731
    torch.manual_seed(0)
    full = make()
    train_concepts(full, x, y, x, y, epochs=60, batch_size=16, lr=1e-2, progress=False)
    in_sample = float(average_precision(image_scores(full, x), y > 0).nanmean())
    heads, measured = train_fold_heads(make, x, y, x[:20], y[:20], folds=3, epochs=60, progress=False)
    assert len(heads) == 3 and measured["folds"] == 3 and sum(measured["fold_sizes"]) == 120
    assert in_sample > 0.9, in_sample
    assert measured["out_of_fold_train_map"] < 0.55, measured  # chance is about 0.3
    with pytest.raises(ConfigError, match="at least 2"):
        train_fold_heads(make, x, y, x, y, folds=1, epochs=1, progress=False)


# ----------------------------------------------------------------------------- the guide term


def test_guide_targets_the_concept_map_on_concept_words_only():
    torch.manual_seed(0)
    vocab = Vocabulary(["a", "dog", "ball", "runs"])
    head = ConceptHead(D, ["dog", "ball"], hidden_dim=6).eval()
    guide = ConceptGuide(head, vocab, weight=1.0, min_prob=0.0)
    x = torch.randn(2, N, D)
    words = torch.tensor([[vocab.stoi["a"], vocab.stoi["dog"], vocab.stoi["ball"], 0]] * 2)
    target = guide.targets(x, words)
    assert target.shape == (2, 4, N)
    maps = head.maps(x)
    torch.testing.assert_close(target[:, 1], maps[:, 0])
    torch.testing.assert_close(target[:, 2], maps[:, 1])
    assert float(target[:, 0].abs().sum()) == 0 and float(target[:, 3].abs().sum()) == 0
    unsure = ConceptGuide(head, vocab, weight=1.0, min_prob=0.999)  # nothing found that surely: nothing guided
    assert float(unsure.targets(x, words).sum()) == 0
    # sharpness s: the map to the power s, renormalised; the same peak, more of the mass on it
    sharp = ConceptGuide(head, vocab, weight=1.0, min_prob=0.0, sharpness=3.0).targets(x, words)
    expected = maps[:, 0] ** 3 / (maps[:, 0] ** 3).sum(-1, keepdim=True)
    torch.testing.assert_close(sharp[:, 1], expected)
    torch.testing.assert_close(sharp[:, 1:3].sum(-1), torch.ones(2, 2))
    assert torch.equal(sharp[:, 1].argmax(-1), maps[:, 0].argmax(-1))
    assert bool((sharp[:, 1].amax(-1) > maps[:, 0].amax(-1)).all())
    assert float(sharp[:, 0].abs().sum()) == 0 and float(sharp[:, 3].abs().sum()) == 0


def test_guide_loss_is_zero_when_attention_is_the_map_and_positive_otherwise():
    torch.manual_seed(0)
    vocab = Vocabulary(["a", "dog"])
    head = ConceptHead(D, ["dog"], hidden_dim=6).eval()
    guide = ConceptGuide(head, vocab, weight=1.0, min_prob=0.0)
    x = torch.randn(1, N, D)
    tokens = torch.tensor([[vocab.bos_id, vocab.stoi["a"], vocab.stoi["dog"]]])
    batch = SimpleNamespace(x=x, tokens=tokens)
    on_map = torch.cat([torch.full((1, 1, N), 1.0 / N), head.maps(x)[:, :1]], dim=1)  # (1, 2, N)
    assert float(guide(SimpleNamespace(attention=on_map), batch)) == pytest.approx(0.0, abs=1e-5)
    uniform = torch.full((1, 2, N), 1.0 / N)
    assert float(guide(SimpleNamespace(attention=uniform), batch)) > 0.01
    assert float(guide.stats["concept_guided_words"]) == pytest.approx(0.5)


# ----------------------------------------------------------------------------- the decoder reads concepts


def _stepped(decoder, x: torch.Tensor, tokens: torch.Tensor, **state_options) -> tuple:  # noqa: ANN001
    """The teacher-forced output, and the log-probs (B,T,V) and attention (B,T,N) of stepping the same tokens."""
    with torch.no_grad():
        out = decoder(x, tokens)
        state = decoder.init_state(x, **state_options)
        steps, maps = [], []
        for t in range(tokens.shape[1]):
            lp, state, alpha = decoder.step(tokens[:, t], state)
            steps.append(lp)
            maps.append(alpha)
    return out, torch.stack(steps, 1), torch.stack(maps, 1), state


def _sat_with_concepts(k: int = 3, concept_prior: bool = False, **kw) -> SATDecoder:
    return SATDecoder(vocab_size=15, feature_dim=D, embed_dim=8, hidden_dim=10, attention_dim=7, dropout=0.3,
                      extension=SATConcepts(D, 10, k, 8, concept_prior, concept_hidden=6), **kw)


def test_sat_with_concepts_steps_as_it_teacher_forces_and_keeps_the_head_frozen():
    torch.manual_seed(0)
    decoder = _sat_with_concepts().eval()
    x = torch.randn(2, N, D)
    tokens = torch.randint(1, 15, (2, 5))
    out, steps, _, _ = _stepped(decoder, x, tokens)
    torch.testing.assert_close(out.logits.log_softmax(-1), steps, atol=1e-5, rtol=1e-5)
    decoder.train()
    assert not decoder.extension.concept_head.training  # no dropout in the frozen head
    decoder(x, tokens).logits.sum().backward()
    assert all(p.grad is None for p in decoder.extension.concept_head.parameters())
    assert decoder.extension.init_concepts.weight.grad is not None and decoder.extension.out_concepts.weight.grad is not None


def test_concepts_change_the_caption_distribution():
    torch.manual_seed(0)
    decoder = _sat_with_concepts().eval()
    x = torch.randn(1, N, D)
    tokens = torch.randint(1, 15, (1, 4))
    with torch.no_grad():
        before = decoder(x, tokens).logits
        decoder.extension.concept_head.net[-1].bias.fill_(5.0)  # every concept found
        after = decoder(x, tokens).logits
    assert not torch.allclose(before, after)


# ----------------------------------------------------------------------------- the concept prior


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_concept_prior_steps_as_it_teacher_forces_and_its_pointer_trains(attention):
    torch.manual_seed(0)
    decoder = _sat_with_concepts(attention=attention, concept_prior=True).eval()
    x = torch.randn(2, N, D)
    tokens = torch.randint(1, 15, (2, 5))
    out, steps, maps, _ = _stepped(decoder, x, tokens)
    torch.testing.assert_close(out.logits.log_softmax(-1), steps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.attention, maps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.attention.sum(-1), torch.ones(2, 5))
    log_q = out.aux["concept_pointer"]
    assert log_q.shape == (2, 5, 3 + 1)
    torch.testing.assert_close(log_q.exp().sum(-1), torch.ones(2, 5))
    decoder.train()
    decoder(x, tokens).aux["concept_pointer"][..., 0].sum().backward()
    assert decoder.extension.concept_query.weight.grad is not None and decoder.extension.concept_query.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in decoder.extension.concept_head.parameters())


def test_concept_prior_multiplies_attention_by_the_map_the_pointer_names():
    torch.manual_seed(0)
    decoder = _sat_with_concepts(concept_prior=True).eval()
    x = torch.randn(1, N, D)
    maps = decoder.extension.concept_head.maps(x)  # (1, K, N)
    tokens = torch.randint(1, 15, (1, 3))
    with torch.no_grad():
        decoder.extension.concept_query.bias.zero_()
        decoder.extension.concept_query.weight.zero_()
        decoder.extension.concept_query.bias[3] = 50.0  # "none": the prior is uniform, attention as without it
        plain = decoder(x, tokens).attention
        decoder.extension.concept_query.bias[3] = -50.0
        decoder.extension.concept_query.bias[1] = 50.0  # always concept 1: attention = own x its map, renormalised
        pointed = decoder(x, tokens).attention
        decoder.extension.prior_scale.fill_(0.0)  # lambda = 0: the prior is off
        off = decoder(x, tokens).attention
    torch.testing.assert_close(off, plain)
    assert not torch.allclose(pointed, plain)
    # at the first step (the same h either way) the ratio pointed / plain is the map of concept 1 up to a constant
    ratio = pointed[:, 0] / plain[:, 0]
    torch.testing.assert_close(ratio / ratio.sum(-1, keepdim=True), maps[:, 1])


def test_concept_pointer_targets_and_loss():
    from captioner.training.concepts import ConceptPointer

    vocab = Vocabulary(["a", "dog", "ball", "runs"])
    pointer = ConceptPointer(["dog", "ball"], vocab, weight=1.0, min_prob=0.5)
    words = torch.tensor([[vocab.stoi["a"], vocab.stoi["dog"], vocab.stoi["ball"], vocab.pad_id]])
    probs = torch.tensor([[0.9, 0.2]])  # the ball is not found in this photo: its target is "none"
    assert pointer.targets(words, probs).tolist() == [[2, 0, 2, 2]]
    right = torch.full((1, 4, 3), -30.0)
    for t, k in enumerate([2, 0, 2, 2]):
        right[0, t, k] = 0.0
    batch = SimpleNamespace(tokens=torch.cat([torch.tensor([[vocab.bos_id]]), words], dim=1))
    out = SimpleNamespace(aux={"concept_pointer": right.log_softmax(-1), "concept_probs": probs})
    assert float(pointer(out, batch)) == pytest.approx(0.0, abs=1e-6)
    assert float(pointer.stats["concept_pointer_words"]) == pytest.approx(1 / 3)
    uniform = SimpleNamespace(aux={"concept_pointer": torch.full((1, 4, 3), -math.log(3)), "concept_probs": probs})
    assert float(pointer(uniform, batch)) == pytest.approx(math.log(3))  # padding left out of the mean
    with pytest.raises(ConfigError, match="concepts.prior"):
        pointer(SimpleNamespace(aux={}), batch)


def test_concept_prior_needs_concepts():
    cfg = get_preset("sat_soft_flickr8k").override(**{"model.concepts.prior": True})
    with pytest.raises(ConfigError, match="concepts.prior needs"):
        build_extension(cfg.model.concepts, cfg.model.decoder, 1280)
    with pytest.raises(ConfigError, match="train.concepts"):
        run_concepts(cfg, Vocabulary(["a"]))
    with pytest.raises(ConfigError, match="concept_pointer"):
        get_preset("sat_soft_flickr8k").override(**{"train.concept_pointer": -1.0})


def test_training_sizes_the_decoder_from_the_head_and_installs_it(tmp_path):
    torch.manual_seed(0)
    vocab = Vocabulary(["a", "dog", "ball"])
    head = restrict_to_vocab(ConceptHead(1280, ["dog", "zebra", "ball"], hidden_dim=6), vocab)
    path = tmp_path / "c.safetensors"
    save_concepts(head, path)
    cfg = get_preset("sat_soft_flickr8k").override(**{"train.concepts": str(path)})
    sized = run_concepts(cfg, vocab)
    assert sized.head.words == head.words
    assert dataclasses.astuple(sized.cfg.model.concepts) == (2, 6, "lse", 5.0, False)
    assert sized.cfg.model.decoder == cfg.model.decoder  # the decoder's own config is not touched
    assert run_concepts(cfg.override(**{"train.concept_input": False}), vocab).cfg.model.concepts.count == 0
    decoder = build_model(sized.cfg.model, len(vocab), load_pretrained=False).decoder
    assert isinstance(decoder.extension, SATConcepts)
    sized.install(decoder)
    assert decoder.extension.concept_ids.tolist() == [vocab.stoi["dog"], vocab.stoi["ball"]]
    x = torch.randn(1, 4, 1280)
    torch.testing.assert_close(decoder.extension.concept_head(x), head(x))
    transformer = run_concepts(get_preset("transformer_flickr8k").override(**{"train.concepts": str(path)}), vocab)
    assert (transformer.cfg.model.decoder.name, transformer.cfg.model.concepts.count) == ("transformer", 2)
    decoder = TransformerCaptionDecoder(vocab_size=len(vocab), feature_dim=1280, grid=2, d_model=16, num_heads=4,
                                        extension=TransformerConcepts(1280, 16, 2, concept_hidden=6))
    RunConcepts(transformer.cfg, head, vocab).install(decoder)
    assert decoder.extension.concept_ids.tolist() == [vocab.stoi["dog"], vocab.stoi["ball"]]
    torch.testing.assert_close(decoder.extension.concept_head(x), head(x))


def test_config_checks_the_concept_keys():
    with pytest.raises(ConfigError, match="needs train.concepts"):
        get_preset("sat_soft_flickr8k").override(**{"train.concept_guide": 1.0})
    with pytest.raises(ConfigError, match="concept_guide must be"):
        get_preset("sat_soft_flickr8k").override(**{"train.concepts": "c", "train.concept_guide": -1.0})
    for bad in (0.0, -2.0, 1000.0):
        with pytest.raises(ConfigError, match="concept_guide_sharpness must be"):
            get_preset("sat_soft_flickr8k").override(**{"train.concept_guide_sharpness": bad})
    for preset in ("sat_soft_flickr8k", "transformer_flickr8k"):  # both families read concepts
        assert get_preset(preset).model.concepts.count == 0  # by default they do not
        assert get_preset(preset).override(**{"model.concepts.count": 4}).model.concepts.count == 4
        with pytest.raises(ConfigError, match="concepts.pooling"):
            get_preset(preset).override(**{"model.concepts.pooling": "max"})
        with pytest.raises(ConfigError, match="concepts.count"):
            get_preset(preset).override(**{"model.concepts.count": -1})
        with pytest.raises(ConfigError, match="unknown config key"):  # no longer a decoder field
            get_preset(preset).override(**{"model.decoder.concepts": 4})
    sat, transformer = get_preset("sat_soft_tiny").model, get_preset("transformer_tiny").model
    assert build_extension(sat.concepts, sat.decoder, 8) is None
    assert isinstance(build_extension(dataclasses.replace(sat.concepts, count=3), sat.decoder, 8), SATConcepts)
    assert isinstance(build_extension(dataclasses.replace(transformer.concepts, count=3), transformer.decoder, 8),
                      TransformerConcepts)


# ----------------------------------------------------------------------------- the Transformer reads concepts


def _transformer_with_concepts(k: int = 12, seed: int = 0, **kw) -> TransformerCaptionDecoder:
    """A small Transformer reading K concepts (vocabulary ids 3..3+K-1), head weights random."""
    torch.manual_seed(seed)
    prior = kw.pop("concept_prior", False)
    args = dict(vocab_size=15, feature_dim=D, grid=3, d_model=16, num_layers=2, num_heads=4, ff_dim=32,
                dropout=0.1, max_len=8)
    decoder = TransformerCaptionDecoder(**{**args, **kw}, extension=TransformerConcepts(D, 16, k, prior,
                                                                                       concept_hidden=6))
    decoder.extension.concept_ids.copy_(torch.arange(3, 3 + k))
    with torch.no_grad():
        decoder.extension.concept_head.net[-1].bias.normal_(0.0, 2.0)  # concepts of clearly different probabilities
    return decoder


@pytest.mark.parametrize("use_cache", [True, False])
def test_transformer_with_concepts_steps_as_it_teacher_forces(use_cache):
    decoder = _transformer_with_concepts().eval()
    x = torch.randn(2, N, D)
    tokens = torch.randint(1, 15, (2, 6))
    out, steps, attention, state = _stepped(decoder, x, tokens, use_cache=use_cache)
    assert state.static["memory_k"][0].shape[2] == N + CONCEPT_TOKENS  # the cache holds the concept tokens
    torch.testing.assert_close(out.logits.log_softmax(-1), steps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.attention, attention, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("use_cache", [True, False])
def test_transformer_concept_prior_steps_as_it_teacher_forces_and_follows_the_pointer(use_cache):
    torch.manual_seed(0)
    decoder = _transformer_with_concepts(concept_prior=True).eval()
    x = torch.randn(2, N, D)
    tokens = torch.randint(1, 15, (2, 6))
    out, steps, attention, _ = _stepped(decoder, x, tokens, use_cache=use_cache)
    torch.testing.assert_close(out.logits.log_softmax(-1), steps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.attention, attention, atol=1e-5, rtol=1e-5)
    k = decoder.extension.concepts
    assert out.aux["concept_pointer"].shape == (2, 6, k + 1) and out.aux["concept_probs"].shape == (2, k)
    with torch.no_grad():  # the pointer sure of "none": the prior adds nothing, as with lambda = 0
        decoder.extension.concept_query.weight.zero_()
        decoder.extension.concept_query.bias.fill_(-50.0)
        decoder.extension.concept_query.bias[k] = 50.0
        none = decoder(x, tokens).attention
        decoder.extension.prior_scale.fill_(0.0)
        off = decoder(x, tokens).attention
        decoder.extension.prior_scale.fill_(1.0)
        decoder.extension.concept_query.bias[k] = -50.0
        decoder.extension.concept_query.bias[0] = 50.0  # always concept 0: the first step's heads lean to its map
        pointed = decoder(x, tokens).attention
    torch.testing.assert_close(none, off, atol=1e-6, rtol=1e-5)
    maps = decoder.extension.concept_head.maps(x)[:, 0]  # (B, N)
    assert bool(((pointed[:, 0] * maps).sum(-1) > (off[:, 0] * maps).sum(-1)).all())
    decoder.train()
    decoder(x, tokens).aux["concept_pointer"][..., 0].sum().backward()
    assert decoder.extension.concept_query.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in decoder.extension.concept_head.parameters())


def test_transformer_reports_attention_over_the_regions_only():
    decoder = _transformer_with_concepts().eval()
    x = torch.randn(3, N, D)
    tokens = torch.randint(1, 15, (3, 5))
    with torch.no_grad():
        out = decoder(x, tokens, need_all_attention=True)
        _, _, att = decoder.step(tokens[:, 0], decoder.init_state(x))
    assert out.attention.shape == (3, 5, N) and out.all_attention.shape == (3, 5, 2, 4, N) and att.shape == (3, N)
    torch.testing.assert_close(out.attention.sum(-1), torch.ones(3, 5))
    torch.testing.assert_close(out.all_attention.sum(-1), torch.ones(3, 5, 2, 4))
    torch.testing.assert_close(att.sum(-1), torch.ones(3))
    torch.testing.assert_close(out.attention, out.all_attention[:, :, -1].mean(2))  # still the overlay view
    assert bool((out.attention_entropy <= math.log(N) + 1e-5).all())
    # the concept-token columns dropped, the region columns renormalised
    scores = torch.randn(2, 4, N + CONCEPT_TOKENS)
    torch.testing.assert_close(decoder.region_weights(scores.softmax(-1)), scores[..., :N].softmax(-1))
    plain = torch.softmax(torch.randn(2, N), -1)
    assert decoder.region_weights(plain) is plain  # no concept tokens: nothing to drop


def test_transformer_reads_the_concept_probabilities_and_keeps_the_head_frozen():
    decoder = _transformer_with_concepts(k=3, dropout=0.0).eval()  # K < CONCEPT_TOKENS: every concept read
    x = torch.randn(2, N, D)
    tokens = torch.randint(1, 15, (2, 5))
    with torch.no_grad():
        before = decoder(x, tokens).logits
        decoder.extension.concept_head.net[-1].bias += 1.0  # the same three concepts, each found more surely
        after = decoder(x, tokens).logits
        assert decoder.init_state(x).static["memory_k"][0].shape[2] == N + 3
    assert not torch.allclose(before, after, atol=1e-4)  # the tokens carry p_t
    many = _transformer_with_concepts(k=12, dropout=0.0).eval()
    with torch.no_grad():
        first = many(x, tokens).logits
        many.extension.concept_ids.copy_(many.extension.concept_ids.flip(0))  # other words behind the same probabilities
        assert not torch.allclose(first, many(x, tokens).logits, atol=1e-4)  # the tokens carry the words
    decoder.train()
    assert decoder.training and not decoder.extension.concept_head.training  # no dropout in the frozen head
    decoder(x, tokens).logits.sum().backward()
    assert all(not p.requires_grad and p.grad is None for p in decoder.extension.concept_head.parameters())
    tokens_module = decoder.extension.concept_tokens
    assert tokens_module.word.weight.grad is not None and float(tokens_module.prob.grad.abs().sum()) > 0
    assert float(decoder.embed.weight.grad[decoder.extension.concept_ids].abs().sum()) > 0  # E is read for the concepts


def test_transformer_with_concepts_checkpoint_round_trip_gives_the_same_captions(tmp_path):
    from captioner.checkpoint.store import load_checkpoint, save_checkpoint
    from captioner.inference import caption_features
    from captioner.models.model import build_model

    torch.manual_seed(0)
    vocab = Vocabulary([f"w{i}" for i in range(16)])
    cfg = get_preset("transformer_tiny", **{"model.concepts.count": 12, "model.concepts.hidden": 6})
    model = build_model(cfg.model, len(vocab), load_pretrained=False).eval()
    head = ConceptHead(model.encoder.out_dim, [f"w{i}" for i in range(12)], hidden_dim=6)
    with torch.no_grad():
        head.net[-1].bias.normal_(0.0, 2.0)
    RunConcepts(cfg, head, vocab).install(model.decoder)
    model.train()  # saving must not depend on the mode
    path = save_checkpoint(tmp_path / "m.safetensors", model, vocab)
    loaded = load_checkpoint(path)
    decoder = loaded.model.decoder
    assert decoder.extension.concepts == 12 and decoder.extension.concept_ids.tolist() == [vocab.stoi[f"w{i}"] for i in range(12)]
    assert not decoder.extension.concept_head.training
    features, grid = model.eval().encode(torch.randn(2, 3, 64, 64))
    options = DecodeOptions(beam_size=2, max_len=6)
    with torch.no_grad():
        ours = caption_features(model, features, vocab, options, grid)
        theirs = caption_features(loaded.model, features, vocab, options, grid)
    assert [c.tokens for c in ours] == [c.tokens for c in theirs]
    assert [c.score for c in ours] == [c.score for c in theirs]
    assert ours[0].concepts and ours[0].concepts == theirs[0].concepts  # Caption.concepts works for it as for SAT
    assert all(w.startswith("w") for w, _ in ours[0].concepts)
    torch.testing.assert_close(ours[0].concept_maps, theirs[0].concept_maps)


# ----------------------------------------------------------------------------- the command, end to end


@pytest.mark.slow
def test_concepts_command_then_a_run_that_reads_and_follows_them(tiny_shapes, tmp_path):
    """``captioner concepts`` over the feature cache, then a SAT run with concept input, guide and prior; the
    checkpoint captions and carries the concepts' vocabulary ids."""
    out = tmp_path / "concepts.safetensors"
    common = ["--preset", "sat_soft_demo", "--data", str(tiny_shapes), "--set", "encoder.fine_tune=false",
              "--set", f"data.feature_cache_dir={tmp_path / 'features'}"]
    done = subprocess.run([sys.executable, "-m", "captioner", "concepts", *common, "--out", str(out),
                           "--concepts", "12", "--epochs", "2", "--boxes", str(tiny_shapes), "--boxes-split", "test",
                           "--folds", "2", "--no-progress"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "dev mAP" in done.stdout and f"wrote {out}" in done.stdout
    assert "2 fold heads for cross-fitting" in done.stdout and "by the head that never saw it: 10 most" in done.stdout
    head, extra = load_concepts(out)
    assert head.size == 12 and 0.0 <= extra["dev_map"] <= 1.0
    assert extra["folds"] == 2 and sum(extra["fold_sizes"]) == 48 and 0.0 <= extra["out_of_fold_train_map"] <= 1.0
    assert len(load_concepts_with_folds(out)[2]) == 2
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "captioner", "train", *common, "--out", str(run), "--epochs", "1",
                           "--set", f"train.concepts={out}", "--set", "train.concept_guide=0.5",
                           "--set", "concepts.prior=true",
                           "--set", "train.time_budget=60", "--no-progress"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "from the fold head that never saw it (2 folds)" in done.stderr  # cross-fitted while training
    import captioner

    model = captioner.load(run / "best.safetensors")
    decoder = model.model.decoder
    assert 0 < decoder.extension.concepts <= 12
    assert not any("fold" in key for key in decoder.state_dict())  # the checkpoint holds the full head only
    assert [model.vocab.itos[i] for i in decoder.extension.concept_ids.tolist()] == [w for w in head.words
                                                                         if w in model.vocab.stoi]
    image = sorted((tiny_shapes / "images").glob("*.png"))[0]
    # a minute of training on a busy machine may write few words, or none
    caption = model.caption([image], attention=True, allow_empty=True)[0]
    assert all(w in model.vocab.stoi for w in caption.words) and caption.attention.shape[0] == len(caption.words)
    header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "concept_guide" in header and "share_concept_guide" in header
    assert decoder.extension.concept_prior  # the concept prior and its pointer term, kept by the checkpoint
    rows = [dict(zip(header, line.split(","))) for line in (run / "metrics.csv").read_text().splitlines()[1:]]
    assert any(row["concept_pointer"] and float(row["concept_pointer"]) > 0 for row in rows)


@pytest.mark.slow
def test_a_transformer_run_reads_the_concepts_and_its_checkpoint_lists_them(tiny_shapes, tmp_path):
    """``captioner train --preset transformer_demo`` with a concepts file, concept input on (the default) and
    the guide: the checkpoint holds a Transformer with concept tokens that captions and lists the concepts."""
    from captioner.data.shapes import COLORS, SHAPES
    from captioner.models.encoder import build_encoder

    cfg = get_preset("transformer_demo")
    words = [*SHAPES, *COLORS]  # more concepts than CONCEPT_TOKENS: the top ones become tokens
    assert len(words) > CONCEPT_TOKENS
    torch.manual_seed(0)
    head = ConceptHead(build_encoder(cfg.model.encoder, load_pretrained=False).out_dim, words, hidden_dim=16)
    concepts = save_concepts(head.eval(), tmp_path / "concepts.safetensors")
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "captioner", "train", "--preset", "transformer_demo",
                           "--data", str(tiny_shapes), "--out", str(run), "--epochs", "8",
                           "--set", "encoder.fine_tune=false",
                           "--set", f"data.feature_cache_dir={tmp_path / 'features'}",
                           "--set", f"train.concepts={concepts}", "--set", "train.concept_guide=0.5",
                           "--set", "train.time_budget=30", "--no-progress"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    import captioner

    model = captioner.load(run / "best.safetensors")
    decoder = model.model.decoder
    assert isinstance(decoder, TransformerCaptionDecoder)
    kept = [w for w in words if w in model.vocab.stoi]
    assert decoder.extension.concepts == len(kept) > CONCEPT_TOKENS
    assert [model.vocab.itos[i] for i in decoder.extension.concept_ids.tolist()] == kept
    assert decoder.extension.concept_tokens.count == CONCEPT_TOKENS
    image = sorted((tiny_shapes / "images").glob("*.png"))[0]
    result = model.caption([image], all_heads=True, allow_empty=True)[0]
    g = cfg.model.encoder.grid
    assert result.attention.shape == (len(result.words), g, g)  # 30 s of training may write few words
    # every layer's and head's maps over a given caption (teacher-forced, whatever the model writes): over
    # the regions only, never the concept tokens
    maps = model.teacher_forced(image, [model.vocab.stoi[w] for w in kept[:3]])
    assert maps.shape[0] == 3 and maps.shape[3:] == (g, g)
    torch.testing.assert_close(maps.sum((3, 4)), torch.ones(maps.shape[:3]))
    assert result.concepts is not None and all(w in kept for w, _ in result.concepts)
    header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "concept_guide" in header
    # a later stage from this checkpoint (here self-critical) names the same concepts file; without it the
    # run is refused in one line that says so
    stage = ["--preset", "transformer_demo", "--data", str(tiny_shapes), "--epochs", "1", "--init",
             str(run / "best.safetensors"), "--set", "encoder.fine_tune=false",
             "--set", f"data.feature_cache_dir={tmp_path / 'features'}", "--set", "train.objective=scst",
             "--set", "train.time_budget=5", "--no-progress"]
    done = subprocess.run([sys.executable, "-m", "captioner", "train", *stage, "--out", str(tmp_path / "bare")],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 1 and "--set train.concepts=FILE" in done.stderr and "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "captioner", "train", *stage, "--out", str(tmp_path / "scst"),
                           "--set", f"train.concepts={concepts}"], capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    again = captioner.load(tmp_path / "scst" / "best.safetensors").model.decoder
    assert again.extension.concepts == decoder.extension.concepts and again.extension.concept_ids.tolist() == decoder.extension.concept_ids.tolist()


@pytest.mark.slow  # two fresh processes of the command: about 4 s
def test_concepts_command_one_line_errors(tmp_path):
    done = subprocess.run([sys.executable, "-m", "captioner", "concepts", "--preset", "sat_soft_flickr8k",
                           "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "c.safetensors")],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 1
    assert done.stderr.startswith("captioner concepts: error:") and len(done.stderr.strip().splitlines()) == 1
    assert "Traceback" not in done.stderr
    folds = subprocess.run([sys.executable, "-m", "captioner", "concepts", "--preset", "sat_soft_flickr8k",
                            "--data", str(tmp_path), "--out", str(tmp_path / "c.safetensors"), "--folds", "1"],
                           capture_output=True, text=True, cwd=REPO, timeout=120)
    assert folds.returncode == 1 and folds.stderr.strip().splitlines() == [
        "captioner concepts: error: --folds must be 0 (no cross-fitting) or at least 2, got 1"]


# ----------------------------------------------------------------------------- decoding that does not repeat


def test_block_repeats_known_answers():
    block = BlockRepeats(ngram=3, word_ids=[5, 6], eos_id=2)
    words = torch.tensor([[4, 5, 7, 4, 5], [5, 8, 9, 1, 1], [2, 2, 2, 2, 2]])
    out = block(torch.zeros(3, 10), words)
    blocked = [(row == float("-inf")).nonzero().flatten().tolist() for row in out]
    assert blocked[0] == [5, 7]  # "4 5" was followed by 7 before; 5 is a content word already used
    assert blocked[1] == [5]
    assert blocked[2] == []  # <eos> is never blocked
    assert not BlockRepeats(0, ()) and BlockRepeats(0, (), eos_id=2)(torch.zeros(1, 4), words[:1]).eq(0).all()


def _repeating_decoder(vocab_size: int) -> SATDecoder:
    """An untrained SAT decoder whose output always prefers word 5 then word 6 (a caption that loops)."""
    torch.manual_seed(0)
    decoder = SATDecoder(vocab_size=vocab_size, feature_dim=D, embed_dim=8, hidden_dim=10, attention_dim=7,
                         dropout=0.0).eval()
    with torch.no_grad():
        decoder.out_word.bias.zero_()
        decoder.out_word.bias[5] = 8.0
        decoder.out_word.bias[6] = 7.5
        decoder.out_word.bias[2] = -30.0  # never end early
    return decoder


@pytest.mark.parametrize("beam", [1, 3])
def test_search_with_no_repeat_never_repeats_a_trigram_or_a_content_word(beam):
    vocab = Vocabulary(["a", "dog", "ball", "grass", "the", "in", "runs", "big", "red", "on"])
    decoder = _repeating_decoder(len(vocab))
    x = torch.randn(2, N, D)
    plain = decode(decoder, x, SearchRules(vocab.bos_id, vocab.eos_id, (0, 1, 3)), DecodeOptions(beam_size=beam, max_len=8))
    assert plain[0][0].tokens.count(5) > 1  # the loop it would write
    opts = DecodeOptions(beam_size=beam, max_len=8, no_repeat_ngram=3, no_repeat_words=True)
    for hyps in decode(decoder, x, SearchRules(vocab.bos_id, vocab.eos_id, (0, 1, 3), content_word_ids(vocab)), opts):
        toks = hyps[0].tokens
        grams = [tuple(toks[i:i + 3]) for i in range(len(toks) - 2)]
        assert len(grams) == len(set(grams)), toks
        content = [t for t in toks if t in set(content_word_ids(vocab))]
        assert len(content) == len(set(content)), toks


def test_decode_options_check_the_repeat_settings():
    with pytest.raises(ConfigError, match="no_repeat_ngram"):
        DecodeOptions(no_repeat_ngram=1)
    with pytest.raises(ConfigError, match="no_repeat_words"):
        DecodeOptions(no_repeat_words="yes")
    assert content_word_ids(Vocabulary(["a", "dog", "the", "runs"])) == (5, 7)


def test_captions_list_the_photos_top_concepts_with_their_maps():
    from captioner.inference import caption_features

    torch.manual_seed(0)
    vocab = Vocabulary(["a", "dog", "ball", "grass"])
    decoder = SATDecoder(vocab_size=len(vocab), feature_dim=D, embed_dim=8, hidden_dim=10, attention_dim=7,
                         dropout=0.0, extension=SATConcepts(D, 10, 3, 8, concept_hidden=6)).eval()
    decoder.extension.concept_ids.copy_(torch.tensor([vocab.stoi[w] for w in ("dog", "ball", "grass")]))
    with torch.no_grad():
        decoder.extension.concept_head.net[-1].bias.copy_(torch.tensor([6.0, -12.0, 2.0]))  # dog surely, ball never
    x = torch.randn(2, N, D)
    found = photo_tags(decoder.extension, x, vocab, (3, 3))
    words = [w for w, _ in found[0][0]]
    assert words == ["dog", "grass"] and found[0][1].shape == (2, 3, 3)
    torch.testing.assert_close(found[0][1].sum((1, 2)), torch.ones(2))
    assert found[0][0][0][1] > found[0][0][1][1]
    model = torch.nn.ModuleDict({"decoder": decoder})
    caption = caption_features(model, x, vocab, DecodeOptions(beam_size=1, max_len=3), grid=(3, 3))[0]
    assert [w for w, _ in caption.concepts] == ["dog", "grass"] and caption.concept_maps.shape == (2, 3, 3)
    plain = SATDecoder(vocab_size=len(vocab), feature_dim=D, embed_dim=8, hidden_dim=10, attention_dim=7).eval()
    assert photo_tags(plain.extension, x, vocab, (3, 3)) == [(None, None), (None, None)]


# ----------------------------------------------------------------------------- the command's checks come first


@pytest.mark.parametrize("option, value, message", [
    ("--epochs", "0", "argument --epochs: must be between 1 and 10000, got 0"),
    ("--epochs", "-2", "argument --epochs: must be between 1 and 10000, got -2"),
    ("--hidden", "-5", "argument --hidden: must be between 0 and 65536, got -5"),
    ("--hidden", "1e11", "argument --hidden: expected a whole number, got '1e11'"),
    ("--hidden", "100000000000", "argument --hidden: must be between 0 and 65536, got 100000000000"),
    ("--concepts", "0", "argument --concepts: must be between 1 and 100000, got 0"),
    ("--folds", "-1", "argument --folds: must be between 0 and 100, got -1"),
])
def test_concepts_numbers_are_checked_while_parsing(tmp_path, capsys, option, value, message):
    from captioner.cli import main

    assert main(["concepts", "--preset", "sat_soft_demo", "--out", str(tmp_path / "c.safetensors"), option,
                 value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match="--epochs must be a whole number from 1 to 10000, got 0"):
        learn_concepts_checks(epochs=0)


def learn_concepts_checks(**kwargs):
    from captioner.training.concepts import check_concept_options

    check_concept_options(**{"k": 10, "epochs": 1, "hidden": 0, **kwargs})


def test_concepts_output_and_boxes_are_checked_before_any_work(tiny_shapes, tmp_path, capsys, monkeypatch):
    from captioner.cli import main
    from captioner.training import concepts as detectors

    monkeypatch.setattr(detectors, "build_encoder", lambda *a, **k: pytest.fail("work started"))
    common = ["--preset", "sat_soft_demo", "--data", str(tiny_shapes), "--set", "encoder.fine_tune=false"]
    assert main(["concepts", *common, "--out", str(tmp_path)]) == 1
    assert f"--out {tmp_path}: is a folder; give the file to write" in capsys.readouterr().err
    existing = tmp_path / "c.safetensors"
    existing.write_bytes(b"mine")
    assert main(["concepts", *common, "--out", str(existing)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists, not written by captioner; choose another --out or pass --force" in err
    assert existing.read_bytes() == b"mine"
    assert main(["concepts", *common, "--out", str(tmp_path / "new.safetensors"), "--boxes",
                 str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nowhere" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]


def test_concepts_without_a_preset_say_what_they_download(tmp_path, capsys, caplog, monkeypatch):
    from captioner.cli import main
    from captioner.training import concepts as detectors

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # nothing downloaded there
    monkeypatch.setenv("CAPTIONER_OFFLINE", "1")
    assert main(["concepts", "--data", str(tmp_path), "--out", str(tmp_path / "c.safetensors")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no --preset: the default encoder needs resnet101 ResNet101_Weights" in err
    assert "offline mode is on (CAPTIONER_OFFLINE); use --preset sat_soft_lite" in err
    monkeypatch.delenv("CAPTIONER_OFFLINE")
    monkeypatch.setattr(detectors, "learn_concepts", lambda *a, **k: "(stopped before any download)")
    with caplog.at_level("WARNING"):
        assert main(["concepts", "--data", str(tmp_path), "--out", str(tmp_path / "c.safetensors")]) == 0
    said = [r.getMessage() for r in caplog.records if "no --preset" in r.getMessage()]
    assert len(said) == 1 and "downloads resnet101 ResNet101_Weights" in said[0]
    assert "--preset sat_soft_lite needs no download" in said[0]


@pytest.mark.parametrize("extra, message", [
    ("{not json", "its 'extra' metadata is not JSON"),
    ("[1, 2]", "its 'extra' metadata must be a JSON object, not a list"),
])
def test_a_concepts_file_with_bad_extra_metadata_is_one_line(tmp_path, extra, message):
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    head = ConceptHead(D, ["dog", "ball"], hidden_dim=6).eval()
    path = save_concepts(head, tmp_path / "c.safetensors", {"dev_map": 0.5})
    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata())
    save_file(load_file(str(path)), str(path), metadata={**meta, "extra": extra})
    with pytest.raises(CheckpointError, match=re.escape(f"concepts file {path} cannot be read: {message}")):
        load_concepts(path)


def _head_meta(**change: object) -> dict[str, str]:
    spec = {"feature_dim": D, "words": ["dog", "ball"], "hidden_dim": 6, "dropout": 0.3, "pooling": "lse",
            "sharpness": 5.0}
    return {"head": json.dumps({k: v for k, v in {**spec, **change}.items() if v is not _DROP})}


_DROP = object()
_NAN = float("nan")


@pytest.mark.parametrize("meta, tensors, message", [
    ({"head": "[1, 2]"}, {}, "its 'head' metadata must be a JSON object, not a list"),
    ({"head": "{"}, {}, "its 'head' metadata is not JSON ('{'...)"),
    (_head_meta(feature_dim="x"), {}, f"its head's 'feature_dim' must be an integer from 1 to 65536, got 'x'"),
    (_head_meta(feature_dim=8.5), {}, "its head's 'feature_dim' must be an integer from 1 to 65536, got 8.5"),
    (_head_meta(hidden_dim=True), {}, "its head's 'hidden_dim' must be an integer from 0 to 65536, got True"),
    (_head_meta(dropout="x"), {}, "its head's 'dropout' must be a number from 0 to 1, got 'x'"),
    (_head_meta(sharpness=_NAN), {}, "its head's 'sharpness' must be a number from 1e-06 to 1e+06, got nan"),
    (_head_meta(words="dog"), {}, "its head's 'words' must be a list of 1 to 100000 words, got 'dog'"),
    (_head_meta(words=[1, 2]), {}, "its head's 'words' must be a list of 1 to 100000 words, got [1, 2]"),
    (_head_meta(pooling=_DROP), {}, "its head's 'pooling' must be one of lse, noisy_or, got None"),
    (_head_meta(feature_dim=D + 1), {}, f"tensor 'net.0.weight' has shape ({D},); its head's widths and words need "
                                        f"({D + 1},)"),
    ({"head": None}, {}, "it has no 'head' metadata (the head's words and widths)"),
    ({"folds": "two"}, {}, "its 'folds' metadata must be a whole number from 0 to 100, got 'two'"),
    ({"folds": "-1"}, {}, "its 'folds' metadata must be a whole number from 0 to 100, got '-1'"),
    ({"folds": "1"}, {}, "it lacks tensor 'fold0.net.0.weight' of its head"),
    ({}, {"fold0.net.0.weight": torch.ones(D)}, "it holds tensor 'fold0.net.0.weight', but its 'folds' metadata says 0 fold heads"),
    ({}, {"net.4.weight": None}, "it lacks tensor 'net.4.weight' of its head"),
    ({}, {"net.4.weight": torch.zeros(3, 6)}, "tensor 'net.4.weight' has shape (3, 6); its head's widths and words "
                                               "need (2, 6)"),
    ({}, {"bogus": torch.zeros(1)}, "it holds tensor 'bogus', which its head does not have"),
    ({}, {"net.4.bias": torch.tensor([0.0, _NAN])}, "tensor 'net.4.bias' holds NaN or infinite values"),
    ({"extra": '{"grid": "7"}'}, {}, "its 'extra' field 'grid' must be a whole number >= 1, got '7'"),
    ({"extra": '{"encoder": 3}'}, {}, "its 'extra' field 'encoder' must be an encoder's name, got 3"),
])
def test_each_bad_field_of_a_concepts_file_is_one_line_in_words(tmp_path, meta, tensors, message):
    """The file and the field in words: never "list indices must be integers", "invalid literal for int()"
    or "Error(s) in loading state_dict for ConceptHead" (issue 54, item 7)."""
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    path = save_concepts(ConceptHead(D, ["dog", "ball"], hidden_dim=6).eval(), tmp_path / "c.safetensors", {})
    with safe_open(str(path), "pt") as f:
        header = {k: v for k, v in {**f.metadata(), **meta}.items() if v is not None}
    state = {k: v for k, v in {**load_file(str(path)), **tensors}.items() if v is not None}
    save_file(state, str(path), metadata=header)
    with pytest.raises(CheckpointError) as info:
        load_concepts(path)
    assert str(info.value) == f"concepts file {path} cannot be read: {message}"


def test_a_concepts_path_that_is_a_pipe_is_refused_before_opening(tmp_path):
    import os

    os.mkfifo(tmp_path / "c.safetensors")
    with pytest.raises(CheckpointError, match="c.safetensors: is a named pipe, not a regular file$"):
        load_concepts(tmp_path / "c.safetensors")
