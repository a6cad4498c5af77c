"""coco-caption scoring (PTB tokenisation + pycocoevalcap) and its agreement with the built-in scorers.

Java start-up: each PTB tokenisation starts one JVM (about 0.5 s here), so these tests call it as
few times as they can; METEOR (a second JVM, 10+ s on a busy 2-core machine) is never started.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from captioner.errors import DataError
from captioner.evaluation import metrics as cc
from captioner.evaluation.metrics import BLEU_KEYS, bleu, cider_d
from captioner.text import tokenize

FLICKR8K = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "flickr8k"
needs_coco = pytest.mark.skipif(cc.unavailable_reason() is not None,
                                reason=f"coco-caption scoring unavailable: {cc.unavailable_reason()}")


@needs_coco
def test_ptb_tokenize_keeps_one_caption_per_line() -> None:
    out = cc.ptb_tokenize({"a": ["A man's dog, running.", ""], "b": ["x\u2028y", "two\x85lines\r\nhere"],
                           "c": ["... ; !", "A t-shirt — “quoted” (here)."]})
    # without the line-break cleaning, \u2028 and \x85 split captions and shift every later one;
    # "-lrb-" stays: pycocoevalcap lowercases before its punctuation filter looks for "-LRB-" (as in the papers)
    assert out == {"a": ["a man 's dog running", ""], "b": ["x y", "two lines here"],
                   "c": ["", "a t-shirt quoted -lrb- here -rrb-"]}


@needs_coco
def test_coco_caption_metrics_on_toy_input() -> None:
    hyps = ["A man riding a horse.", "Two dogs in the snow!", ""]
    refs = [["A man rides a horse on a beach.", "A person on a horse."], ["Two dogs play in the snow."], ["A cat."]]
    scores, note = cc.coco_caption_metrics(hyps, refs, meteor=False)
    assert set(scores) == set(cc.COCO_KEYS) and scores["coco/METEOR"] is None
    assert note.endswith("METEOR off")
    assert 0.0 < scores["coco/BLEU-4"] < scores["coco/BLEU-1"] < 1.0 and 0.0 < scores["coco/ROUGE-L"] < 1.0
    assert scores["coco/CIDEr-D"] > 0.0
    with pytest.raises(DataError, match="2 hypotheses but 1 reference lists"):
        cc.coco_caption_metrics(hyps[:2], refs[:1])


def test_unavailable_means_none_and_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    if cc.unavailable_reason() is None or "pycocoevalcap" not in cc.unavailable_reason():
        scores, note = cc.coco_caption_metrics(["a dog"], [["a dog runs"]])
        assert scores == dict.fromkeys(cc.COCO_KEYS) and note == ("coco-caption scores not computed: "
                                                                  "needs Java on PATH for the PTB tokeniser")
    monkeypatch.setitem(sys.modules, "pycocoevalcap.tokenizer.ptbtokenizer", None)  # as if the extra were absent
    scores, note = cc.coco_caption_metrics(["a dog"], [["a dog runs"]])
    assert scores == dict.fromkeys(cc.COCO_KEYS)
    assert note == "coco-caption scores not computed: needs pycocoevalcap: pip install 'captioner[metrics]'"


@pytest.fixture(scope="module")
def flickr8k_dev() -> tuple[list[str], list[list[str]]]:
    """Flickr8k dev: each image's first caption as the hypothesis, its other four as the references."""
    if not (FLICKR8K / "captions_coco_format.json").is_file():
        pytest.skip(f"Flickr8k not available at {FLICKR8K}")
    from captioner.data.coco import load_caption_set

    cs = load_caption_set(FLICKR8K, "dev")
    assert len(cs) == 1000 and cs.num_captions == 5000
    return [cs.references(r.image_id)[0] for r in cs.images], [cs.references(r.image_id)[1:] for r in cs.images]


@pytest.fixture(scope="module")
def builtin(flickr8k_dev) -> dict[str, float]:
    """The built-in BLEU-1..4 and CIDEr-D of :func:`flickr8k_dev` (about 2 s, computed once)."""
    hyps, refs = flickr8k_dev
    return {**bleu(hyps, refs), "CIDEr-D": cider_d(hyps, refs)}


@pytest.mark.skipif("pycocoevalcap" in (cc.unavailable_reason() or ""), reason="needs pycocoevalcap")
def test_builtin_bleu_and_cider_d_equal_pycocoevalcap_on_flickr8k_dev(flickr8k_dev, builtin) -> None:
    """Same tokens on both sides (the built-in tokenizer's). Measured gaps (1,000 images, 4 refs each):
    BLEU-1/2 and CIDEr-D ~1e-13; BLEU-3 1.1e-5 and BLEU-4 3.7e-5, the built-in lower, because 5 of the
    hypotheses have fewer than 4 words and nltk counts at least one n-gram in each hypothesis's
    precision denominator where coco-caption counts none (no Java needed)."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider

    hyps, refs = flickr8k_dev
    gts = {i: [" ".join(tokenize(r)) for r in rs] for i, rs in enumerate(refs)}
    res = {i: [" ".join(tokenize(h))] for i, h in enumerate(hyps)}
    ours = builtin
    theirs = Bleu(4).compute_score(gts, res, verbose=0)[0]
    assert [ours[k] for k in BLEU_KEYS] == pytest.approx(theirs, abs=1e-3)
    assert [ours[k] for k in BLEU_KEYS[:2]] == pytest.approx(theirs[:2], abs=1e-9)
    assert ours["CIDEr-D"] == pytest.approx(Cider().compute_score(gts, res)[0], abs=1e-9)
    assert 0.18 < ours["BLEU-4"] < 0.25  # human against human on Flickr8k


@pytest.mark.slow  # a JVM plus 6,000 captions through the PTB tokeniser: 3-4 s on top of the fixtures
@needs_coco
def test_coco_caption_scores_on_flickr8k_dev_differ_from_builtin_by_the_tokeniser(flickr8k_dev, builtin) -> None:
    """The whole coco-caption pipeline (PTB tokens: "man 's", "t-shirt" kept whole) against the built-in
    scores (own tokens: "man s", "t shirt"). Measured: BLEU-1..4 0.6275 / 0.4434 / 0.3071 / 0.2116 vs
    0.6284 / 0.4443 / 0.3077 / 0.2120, CIDEr-D 0.8037 vs 0.8085: under 1e-3 for BLEU, 5e-3 for CIDEr-D."""
    hyps, refs = flickr8k_dev
    scores, _ = cc.coco_caption_metrics(hyps, refs, meteor=False)
    for key in BLEU_KEYS:
        assert scores[f"coco/{key}"] == pytest.approx(builtin[key], abs=1.5e-3)
    assert scores["coco/CIDEr-D"] == pytest.approx(builtin["CIDEr-D"], abs=1e-2)
    assert scores["coco/BLEU-4"] != builtin["BLEU-4"]  # the tokenisers do differ on these captions
    assert 0.45 < scores["coco/ROUGE-L"] < 0.55
