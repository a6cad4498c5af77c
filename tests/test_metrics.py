"""BLEU / CIDEr-D known answers, agreement with coco-caption (pycocoevalcap), results files."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
from collections import defaultdict

import pytest

from captioner.errors import DataError
from captioner.evaluation.metrics import (bleu, caption_metrics, cider_d, cider_d_scores, format_metrics,
                                          read_coco_results, write_coco_results)
from captioner.text import tokenize

try:
    import pycocoevalcap  # noqa: F401

    HAVE_COCOEVAL = True
except ImportError:
    HAVE_COCOEVAL = False
needs_cocoeval = pytest.mark.skipif(not HAVE_COCOEVAL, reason="pycocoevalcap (the 'metrics' extra) not installed")


def test_bleu_identical_is_one():
    refs = [["A man rides a horse on the beach.", "someone on a horse"], ["Two dogs play in the snow"]]
    scores = bleu(["a man rides a horse on the beach", "two dogs play in the snow!"], refs)
    assert scores == pytest.approx({"BLEU-1": 1.0, "BLEU-2": 1.0, "BLEU-3": 1.0, "BLEU-4": 1.0})


def test_bleu_hand_computed():
    # hyp "the cat sat on the mat" vs "the cat is on the mat": clipped matches 5/6 unigrams,
    # 3/5 bigrams, 1/4 trigrams, 0/3 4-grams; equal lengths -> no brevity penalty.
    s = bleu(["The cat sat on the mat."], [["the cat is on the mat"]])
    assert s["BLEU-1"] == pytest.approx(5 / 6)
    assert s["BLEU-2"] == pytest.approx(math.sqrt(5 / 6 * 3 / 5))
    assert s["BLEU-3"] == pytest.approx((5 / 6 * 3 / 5 * 1 / 4) ** (1 / 3))
    assert s["BLEU-4"] == 0.0
    # brevity penalty from the closest reference length: 2 words vs 6 -> exp(1 - 6/2)
    assert bleu(["the cat"], [["the cat is on the mat"]])["BLEU-1"] == pytest.approx(math.exp(-2))
    # ... but every reference counts: a 2-word reference removes the penalty
    assert bleu(["the cat"], [["the cat is on the mat", "a cat"]])["BLEU-1"] == pytest.approx(1.0)


def test_bleu_empty_hypotheses_and_bad_input():
    s = bleu(["", "a dog runs fast"], [["a cat"], ["a dog runs fast"]])
    assert 0.0 < s["BLEU-1"] < 1.0  # the empty caption costs brevity but does not crash
    assert bleu(["", ""], [["a cat"], ["a dog"]]) == {"BLEU-1": 0.0, "BLEU-2": 0.0, "BLEU-3": 0.0, "BLEU-4": 0.0}
    with pytest.raises(DataError, match="2 hypotheses but 1 reference lists"):
        bleu(["a", "b"], [["a"]])
    with pytest.raises(DataError, match="image 0 needs a non-empty list"):
        bleu(["a"], [[]])
    with pytest.raises(DataError, match="no hypotheses"):
        bleu([], [])


def test_cider_d_hand_checkable():
    refs = [["a b c d e"], ["f g h i j"]]  # every n-gram occurs for one image: idf = log 2 everywhere
    assert cider_d(["a b c d e", "f g h i j"], refs) == pytest.approx(10.0)  # cosine 1 for every n
    # shuffled: unigram cosine 1, no shared 2/3/4-grams -> 10 * (1 + 0 + 0 + 0) / 4
    assert cider_d_scores(["e d c b a", "f g h i j"], refs) == pytest.approx([2.5, 10.0])
    # clipping: "a" x5 may only use the reference's single "a": cosine = 1 / (5 * sqrt 5)
    assert cider_d_scores(["a a a a a", "x"], refs)[0] == pytest.approx(10 * (1 / (5 * math.sqrt(5))) / 4)
    assert cider_d_scores(["", "f g h i j"], refs) == pytest.approx([0.0, 10.0])
    # the Gaussian length penalty: same words, longer candidate scores lower
    longer = cider_d_scores(["a b c d e a b c d e", "f g h i j"], refs)[0]
    assert 0 < longer < 10.0 * math.exp(-(5 ** 2) / 72) + 1e-9


@needs_cocoeval
def test_cider_d_and_bleu_match_cocoeval_on_toy_input():
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider

    hyps = ["a man riding a horse", "two dogs in snow", "a red bus on a street in the city", "pizza"]
    refs = [["a man rides a horse on a beach", "a person on a horse"], ["two dogs play in the snow"],
            ["a red double decker bus", "a bus driving down a city street"], ["a pizza with cheese on a plate"]]
    gts = {i: [" ".join(tokenize(r)) for r in rs] for i, rs in enumerate(refs)}
    res = {i: [" ".join(tokenize(h))] for i, h in enumerate(hyps)}
    assert cider_d(hyps, refs) == pytest.approx(Cider().compute_score(gts, res)[0], abs=1e-9)
    # "pizza" has fewer than 2 words: nltk counts 1 in the 2/3/4-gram denominators, coco-caption 0
    ours, theirs = bleu(hyps, refs), Bleu(4).compute_score(gts, res, verbose=0)[0]
    assert ours["BLEU-1"] == pytest.approx(theirs[0], abs=1e-9)
    assert ours["BLEU-2"] < theirs[1]
    # no trigram matches: exactly 0 here, coco-caption's epsilons leave ~2e-6
    assert ours["BLEU-3"] == 0.0 and theirs[2] == pytest.approx(0.0, abs=1e-5)


def _coco_val(shared_data, n_images):
    path = shared_data / "coco2017-mini" / "annotations" / "captions_val2017_text_only.json"
    caps = defaultdict(list)
    for ann in json.loads(path.read_text())["annotations"]:
        caps[ann["image_id"]].append(ann["caption"])
    ids = sorted(caps)[:n_images]
    # each image: one human caption is the candidate, the others are its references
    return [caps[i][0] for i in ids], [caps[i][1:] for i in ids]


@needs_cocoeval
def test_bleu_and_cider_agree_with_cocoeval_on_real_coco(shared_data):
    """Same tokenization both sides. Observed agreement: ~1e-13 for BLEU and CIDEr-D.

    nltk and coco-caption differ only in (a) epsilons (1e-9 / 1e-15) in coco-caption and (b) nltk's
    n-gram denominator of at least 1 for hypotheses shorter than n words; no human COCO caption here is
    that short, so the scores agree to rounding. With short hypotheses nltk's BLEU-n is slightly lower.
    """
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider

    hyps, refs = _coco_val(shared_data, 400)
    gts = {i: [" ".join(tokenize(r)) for r in rs] for i, rs in enumerate(refs)}
    res = {i: [" ".join(tokenize(h))] for i, h in enumerate(hyps)}
    ours = bleu(hyps, refs)
    theirs = Bleu(4).compute_score(gts, res, verbose=0)[0]
    assert list(ours.values()) == pytest.approx(theirs, abs=1e-6)
    assert 0.15 < ours["BLEU-4"] < 0.3  # human vs human on COCO
    ref_cider = Cider().compute_score(gts, res)[0]
    assert cider_d(hyps, refs) == pytest.approx(ref_cider, abs=1e-9)
    # cut every 10th candidate to 3 words: BLEU-1..3 still agree closely, BLEU-4 within 1 %
    short = [" ".join(tokenize(h)[:3]) if i % 10 == 0 else h for i, h in enumerate(hyps)]
    res = {i: [" ".join(tokenize(h))] for i, h in enumerate(short)}
    ours, theirs = bleu(short, refs), Bleu(4).compute_score(gts, res, verbose=0)[0]
    assert list(ours.values())[:3] == pytest.approx(theirs[:3], abs=1e-9)
    assert ours["BLEU-4"] < theirs[3] and ours["BLEU-4"] == pytest.approx(theirs[3], rel=1e-2)


def test_caption_metrics_and_format_without_pycocoevalcap(monkeypatch):
    for mod in ("pycocoevalcap.meteor.meteor", "pycocoevalcap.rouge.rouge"):
        monkeypatch.setitem(sys.modules, mod, None)  # import fails as if the extra were absent
    hyps, refs = ["a dog runs on grass", "a cat"], [["a dog runs on the grass"], ["a cat sleeps"]]
    m = caption_metrics(hyps, refs)
    assert m["METEOR"] is None and m["ROUGE-L"] is None and m["SPICE"] is None
    assert m["BLEU-1"] == pytest.approx(bleu(hyps, refs)["BLEU-1"]) and m["CIDEr-D"] == cider_d(hyps, refs)
    text = format_metrics(m)
    assert "0-1 scale" in text and "x10" in text
    for key in ("METEOR", "ROUGE-L", "SPICE"):
        line = next(line for line in text.splitlines() if line.startswith(key))
        assert "unavailable" in line and "0.0" not in line


@needs_cocoeval
def test_meteor_failure_is_caught(monkeypatch, caplog):
    import pycocoevalcap.meteor.meteor as meteor_mod

    class NoJava:
        def __init__(self):
            raise FileNotFoundError(2, "No such file or directory: 'java'")

    monkeypatch.setattr(meteor_mod, "Meteor", NoJava)
    with caplog.at_level(logging.WARNING, logger="captioner.evaluation.metrics"):
        m = caption_metrics(["a dog"], [["a dog runs"]])
    assert m["METEOR"] is None and "METEOR unavailable" in caplog.text
    assert 0.0 < m["ROUGE-L"] <= 1.0  # pure-Python part of the extra still works


@pytest.mark.slow
@pytest.mark.skipif(not (HAVE_COCOEVAL and shutil.which("java")) or not os.environ.get("CAPTIONER_TEST_METEOR"),
                    reason="METEOR needs pycocoevalcap + Java and ~10-40 s; set CAPTIONER_TEST_METEOR=1")
def test_meteor_runs_with_java():
    m = caption_metrics(["a dog runs on the grass", "a cat"], [["a dog runs on the grass"], ["a bird flies"]])
    assert 0.0 < m["METEOR"] < 1.0


def test_coco_results_round_trip(tmp_path):
    path = write_coco_results(tmp_path / "res.json", [(42, "a dog"), {"image_id": 7, "caption": "ünïcode"}])
    assert json.loads(path.read_text()) == [{"image_id": 42, "caption": "a dog"}, {"image_id": 7, "caption": "ünïcode"}]
    assert read_coco_results(path) == [(42, "a dog"), (7, "ünïcode")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res.json"]
    with pytest.raises(DataError, match="result 0"):
        write_coco_results(tmp_path / "bad.json", [("x", "a dog")])
    (tmp_path / "broken.json").write_text('[{"image_id": "1"}]')
    with pytest.raises(DataError, match="broken.json: entry 0"):
        read_coco_results(tmp_path / "broken.json")
