"""Scored captions and the bookkeeping of batched beam search (:func:`captioner.decoding.search.beam_search`).

Shape legend: A images still searching, W beams per image, R = A * W rows of the decoder batch,
T most words, N regions, V vocabulary, C candidates per image, H hypotheses read out, L their words.

Memory grows with the words actually generated, never with ``max_len``: each step stores only what
it chose (:class:`BeamHistory`), and a hypothesis is a :class:`Pending` record until the search
ends and reads the kept ones back.
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
class Pending:
    """A hypothesis still to be read out of a :class:`BeamHistory`: ``words`` words ending at ``row``
    of the decoder batch of step ``words`` (ranked by ``score``; tokens and attention come later)."""

    row: int
    words: int
    score: float
    log_prob: float
    finished: bool


class BeamHistory:
    """Back-pointers of a beam search: what each step kept, so memory grows with the words generated.

    Step ``t`` appends, for every row of the next decoder batch, the row of batch ``t`` it continues
    (``parents``), the word it chose (``words``) and the attention of the step that chose it (N,).
    A hypothesis is read back by walking the pointers (:meth:`read`), so no step copies the whole
    history of every beam: a step costs O(R * N) whatever ``max_len`` is.
    """

    def __init__(self) -> None:
        self.parents: list[torch.Tensor] = []  # step t: (R_{t+1},) row of batch t
        self.words: list[torch.Tensor] = []  # step t: (R_{t+1},) word emitted at step t
        self.attention: list[torch.Tensor] = []  # step t: (R_{t+1}, N) float32

    def append(self, parents: torch.Tensor, words: torch.Tensor, attention: torch.Tensor) -> None:
        self.parents.append(parents)
        self.words.append(words)
        self.attention.append(attention)

    def read(self, pending: list[Pending], n_regions: int) -> list[Hypothesis]:
        """The hypotheses of ``pending`` with their tokens and attention, all walked back at once."""
        if not pending:
            return []
        device = self.parents[0].device if self.parents else torch.device("cpu")
        count, longest = len(pending), max(p.words for p in pending)
        lengths = torch.tensor([p.words for p in pending], device=device)  # (H,)
        rows = torch.tensor([p.row for p in pending], device=device)  # (H,) row in batch ``words``
        tokens = torch.zeros(count, longest, dtype=torch.long, device=device)  # (H, L)
        attention = torch.zeros(count, longest, n_regions, dtype=torch.float32, device=device)  # (H, L, N)
        for t in range(longest - 1, -1, -1):
            active = lengths > t  # (H,) hypotheses whose word t was chosen at step t
            at = rows.clamp(max=self.parents[t].numel() - 1)  # inactive rows are masked out below
            tokens[:, t] = torch.where(active, self.words[t][at], tokens[:, t])
            attention[:, t] = torch.where(active[:, None], self.attention[t][at], attention[:, t])
            rows = torch.where(active, self.parents[t][at], rows)
        tokens_cpu, attention_cpu = tokens.cpu(), attention.cpu()
        return [Hypothesis(tokens_cpu[i, :p.words].tolist(), p.score, attention_cpu[i, :p.words].clone(), p.log_prob,
                           p.finished) for i, p in enumerate(pending)]


@dataclass
class LiveBeams:
    """The live beams of the images still searching.

    Group ``a`` holds the beams of image ``images[a]``: rows ``a * width .. (a + 1) * width - 1`` of
    the decoder batch; their words and attention are in the search's :class:`BeamHistory`.
    """

    scores: torch.Tensor  # (A, width) float64 raw log-prob sums
    images: list[int]  # (A,) image of each group

    @property
    def width(self) -> int:
        return self.scores.size(1)

    def pending(self, row: int, words: int, raw: float, alpha: float, finished: bool) -> Pending:
        """The first ``words`` words of ``row``; scored over ``words`` tokens, plus ``<eos>`` if finished."""
        return Pending(row, words, raw / length_penalty(words + int(finished), alpha), raw, finished)

    def unfinished(self, a: int, words: int, alpha: float, count: int) -> list[Pending]:
        """Group ``a``'s ``count`` best live beams (finite scores; at least one) as unfinished hypotheses."""
        order = self.scores[a].argsort(descending=True).tolist()
        beams = [i for i in order if math.isfinite(self.scores[a, i].item())] or order[:1]
        return [self.pending(a * self.width + i, words, self.scores[a, i].item(), alpha, finished=False)
                for i in beams[:count]]


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


def keep_best(hyps: list[Pending], hyp: Pending, n_best: int) -> None:
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
