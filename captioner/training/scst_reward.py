"""Caption-level rewards for self-critical training: CIDEr-D against the training references.

The document frequencies (DF) of CIDEr-D's TF-IDF weights come from the **whole training corpus**
(every reference set of the training split, one per image), counted **once** when the reward is
built (:func:`captioner.evaluation.metrics.ngram_document_frequencies`). Self-critical training (Rennie et al.
2017; also self-critical.pytorch's ``coco-train-idxs``) uses these corpus DFs; an evaluation
(``captioner.evaluation.metrics.cider_d``) counts them over the evaluated images' references instead, so the
same caption scores slightly differently under the two. With the same ``DocFrequencies`` the
reward equals ``captioner.evaluation.metrics.cider_d_scores(..., doc_freq=...)`` (tested to 1e-9).

Per call, each distinct image's reference vectors are built once and reused for all the captions
scored against it (K samples plus the greedy caption): the cost is per batch, never per corpus.

Optional BLEU-4 mix: ``reward = (1 - w) * CIDEr-D + w * BLEU-4`` with ``w = bleu_weight``;
BLEU-4 is nltk's sentence-level BLEU-4 against all the image's references, with smoothing
``method1`` (a plain sentence BLEU-4 is 0 for most captions), on the 0-1 scale.
"""

from __future__ import annotations

from collections.abc import Sequence

from captioner.errors import DataError
from captioner.evaluation.metrics import (DocFrequencies, _ngram_counts, _tfidf, cider_d_similarity,
                               ngram_document_frequencies)
from captioner.text import tokenize


class CaptionReward:
    """CIDEr-D (optionally mixed with BLEU-4) of tokenized captions against per-image references.

    Args:
        references: per training image (indexed like the training ``CaptionSet.images``), all its
            reference captions (raw text; tokenized here once).
        bleu_weight: weight ``w`` of sentence BLEU-4 in ``(1 - w) * CIDEr-D + w * BLEU-4``.
        sigma, n: CIDEr-D's length-penalty width and longest n-gram (6 and 4, as coco-caption).
        doc_freq: document frequencies to use; default: counted from ``references``.
    """

    def __init__(self, references: Sequence[Sequence[str]], bleu_weight: float = 0.0, sigma: float = 6.0,
                 n: int = 4, doc_freq: DocFrequencies | None = None) -> None:
        if not 0.0 <= bleu_weight <= 1.0:
            raise DataError(f"bleu_weight must be in [0, 1], got {bleu_weight}")
        self.references = [[tokenize(r) for r in refs] for refs in references]
        if any(not refs for refs in self.references):
            raise DataError("every training image needs at least one reference caption for the reward")
        self.bleu_weight = float(bleu_weight)
        self.sigma, self.n = sigma, n
        self.doc_freq = doc_freq if doc_freq is not None else ngram_document_frequencies(self.references, n)

    def cider_d(self, captions: Sequence[Sequence[str]], images: Sequence[int]) -> list[float]:
        """CIDEr-D (x10 scale) of each tokenized caption against all references of its image."""
        if len(captions) != len(images):
            raise DataError(f"{len(captions)} captions but {len(images)} image indices")
        df, n = self.doc_freq, self.n
        ref_vectors: dict[int, list] = {}
        for image in dict.fromkeys(images):  # each image's references once, in first-seen order
            ref_vectors[image] = [_tfidf(_ngram_counts(r, n), df.df, df.log_images, n)
                                  for r in self.references[image]]
        return [cider_d_similarity(_ngram_counts(list(c), n), (), df, self.sigma, n, ref_vectors=ref_vectors[i])
                for c, i in zip(captions, images)]

    def bleu4(self, captions: Sequence[Sequence[str]], images: Sequence[int]) -> list[float]:
        """Sentence BLEU-4 (0-1, nltk, smoothing method1) of each caption against its image's references."""
        from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

        smooth = SmoothingFunction().method1
        return [float(sentence_bleu(self.references[i], list(c), smoothing_function=smooth)) if c else 0.0
                for c, i in zip(captions, images)]

    def __call__(self, captions: Sequence[Sequence[str]], images: Sequence[int]) -> list[float]:
        """The reward of each tokenized caption (``images[j]``: the training image of caption j)."""
        rewards = self.cider_d(captions, images)
        if self.bleu_weight:
            w = self.bleu_weight
            rewards = [(1.0 - w) * c + w * b for c, b in zip(rewards, self.bleu4(captions, images))]
        return rewards
