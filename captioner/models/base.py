"""The interface every caption decoder keeps, so search, training and overlays never branch on type.

Shape legend: B batch, N regions (grid*grid), D feature width, T caption steps, V vocabulary,
L decoder layers, H attention heads.

A decoder is an ``nn.Module`` with:

* ``forward(features (B,N,D), tokens (B,T), need_all_attention=False) -> DecoderOutput`` —
  teacher forcing: ``tokens`` are the inputs ``[<bos> w1 .. wn <eos> <pad>..][:, :-1]``; logits at
  step t predict token t+1. Outputs are in input order (no sorting inside); padded steps are
  allowed and simply ignored by the loss.
* ``init_state(features (B,N,D)) -> State`` — everything ``step`` needs (encoder-side projections
  computed once here, caches, LSTM h/c).
* ``step(prev_tokens (B,), state) -> (log_probs (B,V), state, attention (B,N))`` — one decoding step.
* ``reorder_state(state, index (B',)) -> State`` — select/repeat batch rows (beam search). The
  default implementation index-selects dim 0 of every tensor in the (nested) state.

``State`` is a ``dict[str, Any]`` whose tensors are batch-first (dim 0 = batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

State = dict[str, Any]


@dataclass
class DecoderOutput:
    """What ``forward`` returns.

    Attributes:
        logits: (B, T, V) unnormalised next-token scores.
        attention: (B, T, N) attention over regions for each step (the overlay view; for the
            Transformer the last layer's cross-attention averaged over heads).
        all_attention: (B, T, L, H, N) per-layer, per-head cross-attention (Transformer, when
            ``need_all_attention=True``), else None.
        sample_log_probs: (B, T) log-probability of the sampled region at each step (hard
            attention in training mode only), else None. Used by the REINFORCE term.
        attention_entropy: (B, T) entropy of the attention distribution at each step (nats), or None.
        aux: extra named tensors a decoder wants to expose (e.g. the gate beta, (B, T)).
    """

    logits: torch.Tensor
    attention: torch.Tensor | None = None
    all_attention: torch.Tensor | None = None
    sample_log_probs: torch.Tensor | None = None
    attention_entropy: torch.Tensor | None = None
    aux: dict[str, torch.Tensor] = field(default_factory=dict)


def reorder_nested(value: Any, index: torch.Tensor) -> Any:
    """Index-select dim 0 of every tensor inside dicts/lists/tuples; other values pass through."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, index.to(value.device)) if value.dim() > 0 else value
    if isinstance(value, dict):
        return {k: reorder_nested(v, index) for k, v in value.items()}
    if isinstance(value, list):
        return [reorder_nested(v, index) for v in value]
    if isinstance(value, tuple):
        return tuple(reorder_nested(v, index) for v in value)
    return value


class CaptionDecoder(nn.Module):
    """Base class: subclasses implement ``forward``, ``init_state`` and ``step``."""

    vocab_size: int

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, need_all_attention: bool = False) -> DecoderOutput:
        raise NotImplementedError

    def init_state(self, features: torch.Tensor) -> State:
        raise NotImplementedError

    def step(self, prev_tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State, torch.Tensor]:
        raise NotImplementedError

    def reorder_state(self, state: State, index: torch.Tensor) -> State:
        return reorder_nested(state, index)


def attention_entropy(weights: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Entropy (nats) of attention distributions over the last dim: (..., N) -> (...)."""
    return -(weights * (weights + eps).log()).sum(-1)
