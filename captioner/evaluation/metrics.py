"""Caption metrics: corpus BLEU-1..4 (nltk), CIDEr-D (written here), METEOR / ROUGE-L (pycocoevalcap).

Every metric tokenizes hypotheses and all references alike (``captioner.text.tokenize``); BLEU,
METEOR and ROUGE-L are on the 0-1 scale, CIDEr-D on coco-caption's. Main names: ``caption_metrics``,
``bleu``, ``cider_d``, ``coco_caption_metrics``, ``write_coco_results``.
docs/evaluation.md explains how each compares with coco-caption.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from captioner.errors import DataError
from captioner.files import MiB, atomic_write, read_json
from captioner.text import tokenize


logger = logging.getLogger(__name__)

BLEU_KEYS = ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4")
METRIC_KEYS = (*BLEU_KEYS, "CIDEr-D", "METEOR", "ROUGE-L", "SPICE")
SCALE_NOTE = "BLEU, METEOR and ROUGE-L on 0-1 scale; CIDEr-D on coco-caption's x10 scale"
UNAVAILABLE_NOTES = {
    "METEOR": "needs pycocoevalcap and Java",
    "ROUGE-L": "needs pycocoevalcap",
    "SPICE": "needs Stanford CoreNLP models, which cannot be downloaded offline",
}


def _tokenized(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> tuple[
        list[list[str]], list[list[list[str]]]]:
    """Validate and tokenize: hypotheses -> token lists, references -> per image, token lists."""
    if isinstance(hypotheses, str) or isinstance(references, str):
        raise DataError("hypotheses and references must be lists (one entry per image), not a string")
    if len(hypotheses) != len(references):
        raise DataError(f"{len(hypotheses)} hypotheses but {len(references)} reference lists")
    if not hypotheses:
        raise DataError("no hypotheses to score")
    hyps, refs = [], []
    for i, (hyp, image_refs) in enumerate(zip(hypotheses, references)):
        if not isinstance(hyp, str):
            raise DataError(f"hypothesis {i} is {type(hyp).__name__}, expected a string")
        if isinstance(image_refs, str) or not image_refs:
            raise DataError(f"image {i} needs a non-empty list of reference strings")
        hyps.append(tokenize(hyp))
        refs.append([tokenize(r) for r in image_refs])
    return hyps, refs


def bleu(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """Corpus BLEU-1..4 on the 0-1 scale (nltk ``corpus_bleu``, no smoothing) of raw captions against all references."""
    from nltk.translate.bleu_score import corpus_bleu

    hyps, refs = _tokenized(hypotheses, references)
    weights = [(1.0,), (0.5, 0.5), (1 / 3, 1 / 3, 1 / 3), (0.25, 0.25, 0.25, 0.25)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nltk warns when an n-gram order has no match
        scores = corpus_bleu(refs, hyps, weights=weights)
    if not isinstance(scores, list):  # nltk returns a bare 0 when no unigram matches at all
        scores = [0.0] * 4
    # Without smoothing nltk stands in sys.float_info.min for a zero precision, so a missing order
    # yields ~1e-77 instead of 0: report the true 0.
    return {key: (float(s) if s > 1e-50 else 0.0) for key, s in zip(BLEU_KEYS, scores)}


# ----------------------------------------------------------------------------- CIDEr-D
def _ngram_counts(tokens: list[str], n: int = 4) -> Counter:
    counts: Counter = Counter()
    for k in range(1, n + 1):
        for i in range(len(tokens) - k + 1):
            counts[tuple(tokens[i:i + k])] += 1
    return counts


def _tfidf(counts: Counter, df: Mapping[tuple, float], log_images: float, n: int) -> tuple[
        list[dict[tuple, float]], list[float], int]:
    """Per order: {ngram: tf * idf}, the vector norms, and the length used by the penalty."""
    vec: list[dict[tuple, float]] = [{} for _ in range(n)]
    norm = [0.0] * n
    for gram, tf in counts.items():
        weight = tf * (log_images - math.log(max(1.0, df.get(gram, 0.0))))
        vec[len(gram) - 1][gram] = weight
        norm[len(gram) - 1] += weight * weight
    # coco-caption measures length as the number of bigrams; for captions with at least one word the
    # difference of two such lengths is the difference in words.
    length = sum(tf for gram, tf in counts.items() if len(gram) == 2)
    return vec, [math.sqrt(x) for x in norm], length


@dataclass(frozen=True)
class DocFrequencies:
    """CIDEr-D document frequencies: ``df[ngram]`` reference sets containing it, out of ``images``."""

    df: Mapping[tuple, float]
    images: int

    @property
    def log_images(self) -> float:
        return math.log(float(self.images))


def ngram_document_frequencies(references: Iterable[Sequence[Sequence[str]]], n: int = 4) -> DocFrequencies:
    """Document frequencies over tokenized reference sets (one set of token lists per image)."""
    df: Counter = Counter()
    images = 0
    for image_refs in references:
        df.update({gram for ref in image_refs for gram in _ngram_counts(list(ref), n)})  # one per image
        images += 1
    if images == 0:
        raise DataError("no reference sets to count document frequencies from")
    return DocFrequencies(df, images)


def document_frequencies(references: Sequence[Sequence[str]], n: int = 4) -> DocFrequencies:
    """Document frequencies of raw reference captions (per image, all its references)."""
    return ngram_document_frequencies(([tokenize(r) for r in refs] for refs in references), n)


def cider_d_similarity(counts: Counter, ref_counts: Sequence[Counter], doc_freq: DocFrequencies,
                       sigma: float = 6.0, n: int = 4,
                       ref_vectors: Sequence[tuple[list[dict[tuple, float]], list[float], int]] | None = None) -> float:
    """CIDEr-D (x10 scale) of one caption's n-gram counts against its references' (``ref_vectors`` precomputed or not)."""
    log_images = doc_freq.log_images
    vec, norm, length = _tfidf(counts, doc_freq.df, log_images, n)
    if ref_vectors is None:
        ref_vectors = [_tfidf(rcounts, doc_freq.df, log_images, n) for rcounts in ref_counts]
    total = [0.0] * n
    for rvec, rnorm, rlength in ref_vectors:
        penalty = math.exp(-((length - rlength) ** 2) / (2 * sigma ** 2))
        for k in range(n):
            dot = sum(min(w, rvec[k].get(g, 0.0)) * rvec[k].get(g, 0.0) for g, w in vec[k].items())
            if norm[k] != 0 and rnorm[k] != 0:
                dot /= norm[k] * rnorm[k]
            total[k] += dot * penalty
    return 10.0 * (sum(total) / n) / len(ref_vectors)


def cider_d_tokenized(captions: Sequence[Sequence[str]], images: Sequence[int],
                      references: Sequence[Sequence[Sequence[str]]], doc_freq: DocFrequencies,
                      sigma: float = 6.0, n: int = 4) -> list[float]:
    """CIDEr-D (x10 scale) of each token list ``captions[j]`` against ``references[images[j]]``.

    Each image's reference vectors are built once per call (the self-critical reward's scorer).
    """
    ref_vectors: dict[int, list] = {}
    for image in dict.fromkeys(images):
        ref_vectors[image] = [_tfidf(_ngram_counts(list(r), n), doc_freq.df, doc_freq.log_images, n)
                              for r in references[image]]
    return [cider_d_similarity(_ngram_counts(list(c), n), (), doc_freq, sigma, n, ref_vectors=ref_vectors[i])
            for c, i in zip(captions, images)]


def cider_d_scores(hypotheses: Sequence[str], references: Sequence[Sequence[str]], sigma: float = 6.0,
                   n: int = 4, doc_freq: DocFrequencies | None = None) -> list[float]:
    """Per-image CIDEr-D (x10 scale); ``doc_freq`` defaults to counts over the references given (coco-caption's way)."""
    hyps, refs = _tokenized(hypotheses, references)
    hyp_counts = [_ngram_counts(h, n) for h in hyps]
    ref_counts = [[_ngram_counts(r, n) for r in rs] for rs in refs]
    if doc_freq is None:
        doc_freq = ngram_document_frequencies(refs, n)
    return [cider_d_similarity(counts, image_refs, doc_freq, sigma, n)
            for counts, image_refs in zip(hyp_counts, ref_counts)]


def cider_d(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Corpus CIDEr-D (mean over images, coco-caption's x10 scale)."""
    scores = cider_d_scores(hypotheses, references)
    return sum(scores) / len(scores)


# ----------------------------------------------------------------------------- pycocoevalcap extras
def _coco_inputs(hyps: list[list[str]], refs: list[list[list[str]]]) -> tuple[dict, dict]:
    gts = {i: [" ".join(r) for r in rs] for i, rs in enumerate(refs)}
    res = {i: [" ".join(h)] for i, h in enumerate(hyps)}
    return gts, res


def _meteor(gts: dict, res: dict) -> float | None:
    """METEOR through pycocoevalcap's Java wrapper; None (with a warning) when it cannot run."""
    try:
        from pycocoevalcap.meteor.meteor import Meteor
    except ImportError:
        return None
    scorer = None
    try:
        scorer = Meteor()
        # METEOR's Java side cannot parse an empty hypothesis line: score it as a lone space.
        res = {k: [v[0] or " "] for k, v in res.items()}
        score, _ = scorer.compute_score(gts, res)
        return float(score)
    except Exception as exc:  # no Java, jar crash, broken pipe, unparsable output
        logger.warning("METEOR unavailable: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
    finally:
        proc = getattr(scorer, "meteor_p", None)
        if proc is not None:
            proc.kill()
            proc.wait()
            if scorer.lock.locked():  # its __del__ takes the lock again
                scorer.lock.release()


def _rouge_l(gts: dict, res: dict) -> float | None:
    try:
        from pycocoevalcap.rouge.rouge import Rouge
    except ImportError:
        return None
    return float(Rouge().compute_score(gts, res)[0])


def caption_metrics(hypotheses: Sequence[str], references: Sequence[Sequence[str]],
                    meteor: bool = True) -> dict[str, float | None]:
    """All caption metrics on one tokenization: ``BLEU-1..4``, ``CIDEr-D``, ``METEOR``, ``ROUGE-L``, ``SPICE``.

    A metric that cannot be computed here is None (never 0); ``meteor`` starts a Java process.
    """
    out: dict[str, float | None] = dict(bleu(hypotheses, references))
    out["CIDEr-D"] = cider_d(hypotheses, references)
    gts, res = _coco_inputs(*_tokenized(hypotheses, references))
    out["METEOR"] = _meteor(gts, res) if meteor else None
    out["ROUGE-L"] = _rouge_l(gts, res)
    out["SPICE"] = None
    return out


def format_metrics(metrics: Mapping[str, float | None]) -> str:
    """Readable block, one metric per line, with the scale; None shows as ``unavailable (why)``."""
    keys = [k for k in METRIC_KEYS if k in metrics] + [k for k in metrics if k not in METRIC_KEYS]
    width = max((len(k) for k in keys), default=0)
    lines = []
    for key in keys:
        value = metrics[key]
        if value is None:
            note = UNAVAILABLE_NOTES.get(key)
            lines.append(f"{key:<{width}}  unavailable" + (f" ({note})" if note else ""))
        elif isinstance(value, (int, float)):
            lines.append(f"{key:<{width}}  {value:.4f}")
        else:
            lines.append(f"{key:<{width}}  {value}")
    lines.append(f"({SCALE_NOTE})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- COCO results files
def write_coco_results(path: str | Path, items: Iterable[tuple[int, str] | Mapping[str, Any]]) -> Path:
    """Write ``[{"image_id": int, "caption": str}, ...]`` atomically from pairs or mappings."""
    rows = []
    for i, item in enumerate(items):
        try:
            image_id, caption = (item["image_id"], item["caption"]) if isinstance(item, Mapping) else item
            ok = not isinstance(image_id, bool) and int(image_id) == image_id and isinstance(caption, str)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise DataError(f"result {i}: need an integer image_id and a string caption, got {item!r}")
        rows.append({"image_id": int(image_id), "caption": caption})
    data = json.dumps(rows, ensure_ascii=False).encode("utf-8")
    atomic_write(path, lambda f: f.write(data))
    return Path(path)


def read_coco_results(path: str | Path) -> list[tuple[int, str]]:
    """Read a COCO captioning results file back as ``(image_id, caption)`` pairs."""
    data = read_json(path, 1024 * MiB, DataError, "results file", expect=list)
    out = []
    for i, row in enumerate(data):
        if not (isinstance(row, dict) and isinstance(row.get("image_id"), int)
                and isinstance(row.get("caption"), str)):
            raise DataError(f"{path}: entry {i} is not {{\"image_id\": int, \"caption\": str}}")
        out.append((row["image_id"], row["caption"]))
    return out


COCO_KEYS = ("coco/BLEU-1", "coco/BLEU-2", "coco/BLEU-3", "coco/BLEU-4", "coco/METEOR", "coco/ROUGE-L",
             "coco/CIDEr-D")
LABEL = "coco-caption scores (pycocoevalcap, PTB tokenisation: the papers' scoring)"
# Characters Java (or Python's splitlines) may take for a line end: the tokeniser reads one caption per line.
_LINE_BREAKS = re.compile("[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")
_SENTINEL = "captionersentinel"


def unavailable_reason() -> str | None:
    """Why coco-caption scores cannot be computed here, or None when they can."""
    try:
        from pycocoevalcap.bleu.bleu import Bleu  # noqa: F401
        from pycocoevalcap.cider.cider import Cider  # noqa: F401
        from pycocoevalcap.rouge.rouge import Rouge  # noqa: F401
        from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer  # noqa: F401
    except ImportError:
        return "needs pycocoevalcap: pip install 'captioner[metrics]'"
    if shutil.which("java") is None:
        return "needs Java on PATH for the PTB tokeniser"
    return None


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[list[str]]:
    """Send file descriptor 2 to a temporary file (Java's progress line); yields its lines afterwards."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines += tmp.read().decode(errors="replace").splitlines()


def ptb_tokenize(captions: Mapping[Hashable, Sequence[str]]) -> dict[Hashable, list[str]]:
    """``{key: [caption, ...]}`` PTB-tokenised by pycocoevalcap's ``PTBTokenizer`` in one Java process.

    Raises ``RuntimeError`` when it fails or its lines do not line up with the captions.
    """
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    sentinel = ("captioner", "sentinel")  # its tokens show that no caption was split over two lines
    data = {k: [{"caption": _LINE_BREAKS.sub(" ", c)} for c in caps] for k, caps in captions.items()}
    data[sentinel] = [{"caption": _SENTINEL}]
    with _quiet_stderr() as messages:
        try:
            out = PTBTokenizer().tokenize(data)
        except Exception as exc:  # Java missing or crashing, an unwritable package folder
            raise RuntimeError(f"PTB tokeniser failed: {exc}") from None
    if out.get(sentinel) != [_SENTINEL] or any(len(out.get(k, ())) != len(v) for k, v in captions.items()):
        detail = next((m for m in reversed(messages) if m.strip()), "output lines do not match the captions")
        raise RuntimeError(f"PTB tokeniser failed: {detail}")
    del out[sentinel]
    return out


def coco_caption_metrics(hypotheses: Sequence[str], references: Sequence[Sequence[str]],
                         meteor: bool = True) -> tuple[dict[str, float | None], str]:
    """coco-caption scores of one caption per image: ``({"coco/BLEU-1": .., ...}, note)``.

    Every value None, and the note saying why, when they cannot be computed here; ``coco/METEOR``
    None when ``meteor`` is off or fails.
    """
    _tokenized(hypotheses, references)  # the built-in scorers' input checks, one message for both
    empty: dict[str, float | None] = dict.fromkeys(COCO_KEYS)
    reason = unavailable_reason()
    if reason is not None:
        return empty, f"coco-caption scores not computed: {reason}"
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    raw: dict[Hashable, Sequence[str]] = {("hyp", i): [h] for i, h in enumerate(hypotheses)}
    raw.update({("ref", i): list(refs) for i, refs in enumerate(references)})
    try:
        tokens = ptb_tokenize(raw)
    except RuntimeError as exc:
        return empty, f"coco-caption scores not computed: {str(exc).splitlines()[0]}"
    gts = {i: tokens[("ref", i)] for i in range(len(references))}
    res = {i: tokens[("hyp", i)] for i in range(len(hypotheses))}
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    out: dict[str, float | None] = {f"coco/BLEU-{n + 1}": float(b) for n, b in enumerate(bleu)}
    out["coco/METEOR"] = _meteor(gts, res) if meteor else None
    out["coco/ROUGE-L"] = float(Rouge().compute_score(gts, res)[0])
    out["coco/CIDEr-D"] = float(Cider().compute_score(gts, res)[0])
    note = "PTB tokenisation and scorers of pycocoevalcap, as in the papers"
    if out["coco/METEOR"] is None:
        note += "; METEOR " + ("off" if not meteor else "failed (see the log)")
    return out, note
