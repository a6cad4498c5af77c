"""Scored captions and the bookkeeping of batched beam search (:func:`captioner.decoding.search.beam_search`).

Shape legend: A images still searching, W beams per image, R = A * W rows of the decoder batch,
T most words, N regions, V vocabulary, C candidates per image.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass
class Hypothesis:
    """One decoded caption.

    Attributes:
        tokens: emitted word ids, without ``<bos>``/``<eos>``.
        score: ``log_prob`` normalised by the length penalty (the ranking key).
        attention: (L, N) float32 on the CPU, one row per word: the attention the decoder returned at
            the step that emitted that word, for this beam.
        log_prob: raw sum of log-probabilities (including ``<eos>`` when finished).
        finished: False when ``<eos>`` never came within ``max_len`` words.
    """

    tokens: list[int]
    score: float
    attention: torch.Tensor
    log_prob: float = 0.0
    finished: bool = True


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ``((5 + length) / 6) ** alpha`` (1.0 when alpha is 0)."""
    return ((5.0 + length) / 6.0) ** alpha if alpha else 1.0


@dataclass
class LiveBeams:
    """The live beams of the images still searching.

    Group ``a`` holds the beams of image ``images[a]``: rows ``a * width .. (a + 1) * width - 1`` of
    the decoder batch.
    """

    scores: torch.Tensor  # (A, width) float64 raw log-prob sums
    tokens: torch.Tensor  # (R, T) the words of each beam so far
    attention: torch.Tensor  # (R, T, N) float32, from the step that emitted each word
    images: list[int]  # (A,) image of each group

    @property
    def width(self) -> int:
        return self.scores.size(1)

    def hypothesis(self, row: int, words: int, raw: float, alpha: float, finished: bool) -> Hypothesis:
        """The first ``words`` words of ``row``; scored over ``words`` tokens, plus ``<eos>`` if finished."""
        return Hypothesis(self.tokens[row, :words].tolist(), raw / length_penalty(words + int(finished), alpha),
                          self.attention[row, :words].cpu(), raw, finished)

    def unfinished(self, a: int, words: int, alpha: float, count: int) -> list[Hypothesis]:
        """Group ``a``'s ``count`` best live beams (finite scores; at least one) as unfinished hypotheses."""
        order = self.scores[a].argsort(descending=True).tolist()
        beams = [i for i in order if math.isfinite(self.scores[a, i].item())] or order[:1]
        return [self.hypothesis(a * self.width + i, words, self.scores[a, i].item(), alpha, finished=False)
                for i in beams[:count]]

    def advance(self, rows: torch.Tensor, words: torch.Tensor, attention: torch.Tensor, t: int,
                scores: torch.Tensor, keep: list[int]) -> LiveBeams:
        """The next beams: row i continues source row ``rows[i]`` with ``words[i]`` (R',) as word t,
        ``attention`` (R, N) of the step that chose it; ``scores`` (A', K'); ``keep`` the groups left."""
        tokens = self.tokens.index_select(0, rows)  # (R', T)
        tokens[:, t] = words
        history = self.attention.index_select(0, rows)  # (R', T, N)
        history[:, t] = attention.index_select(0, rows).float()
        return LiveBeams(scores, tokens, history, [self.images[a] for a in keep])


def top_candidates(scores: torch.Tensor, log_probs: torch.Tensor, count: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best (beam, word) extensions of each group's beams, best first.

    Args:
        scores: (A, W) raw log-prob sums of the live beams.
        log_probs: (A * W, V) next-word log-probs of their rows.
        count: candidates per group (at most W * V are returned).

    Returns:
        (raw sums, source rows, words), (A, C) each.
    """
    A, W = scores.shape
    V = log_probs.size(1)
    cand = (scores.view(-1, 1) + log_probs).view(A, W * V)  # (A, W*V)
    top_s, top_i = cand.topk(min(count, W * V), dim=1)  # (A, C)
    src = torch.arange(A, device=scores.device).view(-1, 1) * W + top_i // V  # (A, C)
    return top_s, src, top_i % V


def keep_best(hyps: list[Hypothesis], hyp: Hypothesis, n_best: int) -> None:
    """Add ``hyp`` to ``hyps`` (best score first, ties in arrival order) and keep the ``n_best`` best."""
    hyps.append(hyp)
    hyps.sort(key=lambda h: h.score, reverse=True)
    del hyps[n_best:]


def best_reachable(raw: torch.Tensor, t: int, max_len: int, alpha: float) -> torch.Tensor:
    """Best normalised score a live beam of raw sum ``raw`` (A,) after step ``t`` can still reach.

    Log-probs are <= 0, so a raw sum only falls, and lp(L) is monotonic in L: the optimum sits at the
    shortest (t + 2 scored tokens: one more word and ``<eos>``) or the longest (max_len + 1) length.
    """
    return torch.maximum(raw / length_penalty(t + 2, alpha), raw / length_penalty(max_len + 1, alpha))
