"""Logit filters: what every search and the SCST sampler apply to a step's log-probabilities.

A filter is a callable ``(..., V) log-probs -> (..., V) log-probs``, out of place. The one built in
is :class:`SuppressTokens` (ids a caption never contains: ``<pad>``, ``<bos>``, ``<unk>`` unless
allowed); greedy and beam search, the sampler and the SCST policy's rescoring all use it, so that
the policy that is trained is the one that sampled.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from captioner.decoding.hypotheses import NEG_INF

__all__ = ["SuppressTokens"]


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
