"""Logit filters: what every search and the SCST sampler apply to a step's log-probabilities.

A filter is a callable ``(..., V) log-probs -> (..., V) log-probs``, out of place. The one built in
is :class:`SuppressTokens` (ids a caption never contains: ``<pad>``, ``<bos>``, ``<unk>`` unless
allowed); greedy and beam search, the sampler and the SCST policy's rescoring all use it, so that
the policy that is trained is the one that sampled. :class:`BlockRepeats` also reads each row's
words so far: the searches apply it when ``DecodeOptions`` asks captions not to repeat themselves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from captioner.decoding.hypotheses import NEG_INF

__all__ = ["BlockRepeats", "SuppressTokens"]


class SuppressTokens:
    """Set the log-probabilities of ``ids`` to -inf; the others are not renormalised.

    Args:
        ids: vocabulary ids never emitted.
        eos_id: the id that ends a caption; it is never suppressed, even when listed, so that a
            caption can always finish.
    """

    def __init__(self, ids: Sequence[int], eos_id: int) -> None:
        self.ids = tuple(sorted({int(i) for i in ids} - {int(eos_id)}))

    def __repr__(self) -> str:
        return f"SuppressTokens({list(self.ids)})"

    def __call__(self, log_probs: torch.Tensor) -> torch.Tensor:
        """(..., V) -> (..., V), a new tensor unless nothing is suppressed."""
        if not self.ids:
            return log_probs
        return log_probs.index_fill(-1, torch.tensor(self.ids, device=log_probs.device), NEG_INF)


class BlockRepeats:
    """Forbid what would repeat: an n-gram the caption already holds, and a listed word it already used.

    Args:
        ngram: n > 1: the word that would complete an n-gram already in the caption is set to -inf
            ("a blue shirt and a blue shirt": the second "shirt"); 0 = off.
        word_ids: ids used at most once per caption (the content words); empty = off.
        eos_id: never blocked, so that a caption can always finish.
    """

    def __init__(self, ngram: int = 0, word_ids: Sequence[int] = (), eos_id: int = 2) -> None:
        self.ngram = int(ngram)
        self.word_ids = tuple(sorted({int(i) for i in word_ids} - {int(eos_id)}))
        self.eos_id = int(eos_id)
        self._mask: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return self.ngram > 1 or bool(self.word_ids)

    def __repr__(self) -> str:
        return f"BlockRepeats(ngram={self.ngram}, words={len(self.word_ids)})"

    def _word_mask(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        if self._mask is None or self._mask.numel() != vocab_size or self._mask.device != device:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            ids = [i for i in self.word_ids if i < vocab_size]
            mask[torch.tensor(ids, dtype=torch.long, device=device)] = True
            self._mask = mask
        return self._mask

    def __call__(self, log_probs: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """log_probs (R, V), words so far (R, t) -> (R, V), a new tensor unless nothing is blocked."""
        R, V = log_probs.shape
        t = words.shape[1]
        if not self or t == 0:
            return log_probs
        blocked = torch.zeros(R, V, dtype=torch.bool, device=log_probs.device)  # (R, V)
        if self.word_ids:
            used = torch.zeros_like(blocked).scatter_(1, words, True)  # (R, V)
            blocked |= used & self._word_mask(V, log_probs.device)
        n = self.ngram
        if n > 1 and t >= n - 1:
            prefix = words[:, t - (n - 1):]  # (R, n-1): the last n-1 words
            starts = t - (n - 1)  # earlier n-grams start at 0 .. starts-1 and end at a word already written
            if starts > 0:
                match = torch.ones(R, starts, dtype=torch.bool, device=words.device)  # (R, S)
                for j in range(n - 1):
                    match &= words[:, j:j + starts] == prefix[:, j:j + 1]
                nxt = words[:, n - 1:n - 1 + starts]  # (R, S) the word that followed each match
                rows = torch.arange(R, device=words.device).unsqueeze(1).expand_as(nxt)
                blocked[rows[match], nxt[match]] = True
        blocked[:, self.eos_id] = False
        return log_probs.masked_fill(blocked, NEG_INF) if bool(blocked.any()) else log_probs
