"""Additive (Bahdanau) attention over image regions, soft and hard (Xu et al. 2015).

Shape legend: B batch, N regions, D feature width, H LSTM width, A attention width.

Scores ``e_i = w . tanh(W_f f_i + W_h h)``, weights ``alpha = softmax(e)`` over regions.
``W_f f`` does not depend on the time step: callers compute it once per image with
``project(features)`` and pass it to every step.

Computed exactly, but faster: ``tanh(x) = 2 sigmoid(2x) - 1`` and softmax ignores a constant
added to every score, so ``alpha = softmax_i(2 w . sigmoid(2 W_f f_i + 2 W_h h))`` (on CPU
PyTorch's sigmoid is ~3x cheaper than tanh, and this runs over B*N*A values every step).
``project`` therefore returns ``2 W_f f`` and the query is ``2 W_h h``. The score layer ``w``
has no bias (softmax would cancel it).

* soft context: the expectation ``sum_i alpha_i f_i``;
* hard context: the feature of one region ``s ~ Multinoulli(alpha)`` (training), or at test
  time the expectation or the feature of ``argmax alpha`` (``decoder.hard_test_mode``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from captioner.config.decoders import HARD_TEST_MODES



class AdditiveAttention(nn.Module):
    """``alpha = softmax_i(w . tanh(W_f f_i + W_h h))``.

    Args:
        feature_dim: D, region feature width.
        hidden_dim: H, width of the query (the LSTM state).
        attention_dim: A, width of the additive scoring layer.
    """

    def __init__(self, feature_dim: int, hidden_dim: int, attention_dim: int) -> None:
        super().__init__()
        self.feature_proj = nn.Linear(feature_dim, attention_dim)  # W_f
        self.hidden_proj = nn.Linear(hidden_dim, attention_dim)  # W_h
        self.score = nn.Linear(attention_dim, 1, bias=False)  # w

    def doubled(self) -> dict[str, torch.Tensor]:
        """The layers times 2, as this module computes with them (module docstring): ``w_f``, ``b_f`` (2 W_f),
        ``w_h``, ``b_h`` (2 W_h) and ``w_s`` (2 w), for a step that fuses them into its own products:
        ``log alpha = log_softmax(w_s . sigmoid(w_f f + b_f + w_h h + b_h))``."""
        return {"w_f": 2.0 * self.feature_proj.weight, "b_f": 2.0 * self.feature_proj.bias,
                "w_h": 2.0 * self.hidden_proj.weight, "b_h": 2.0 * self.hidden_proj.bias, "w_s": 2.0 * self.score.weight}

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """features (B,N,D) -> 2 W_f f (B,N,A); compute once per image."""
        return F.linear(features, 2.0 * self.feature_proj.weight, 2.0 * self.feature_proj.bias)  # (B, N, A)

    def log_weights(self, projected: torch.Tensor, query: torch.Tensor, group: int = 1) -> torch.Tensor:
        """Log attention weights from ``project(f)`` (B,N,A) and the query ``W_h h`` (B*group,A).

        ``group``: queries per image (beams), consecutive rows: query row r reads image ``r // group``.
        """
        if group == 1:
            gates = (projected + 2.0 * query.unsqueeze(1)).sigmoid_()  # (B, N, A); tanh(x) = 2 sigmoid(2x) - 1
        else:
            b, n, a = projected.shape
            gates = (projected.unsqueeze(1) + 2.0 * query.view(b, group, 1, a)).sigmoid_().view(b * group, n, a)
        scores = F.linear(gates, 2.0 * self.score.weight).squeeze(-1)  # (B*group, N), up to a per-row constant
        return F.log_softmax(scores, dim=-1)  # (B*group, N)

    def forward(self, projected: torch.Tensor, hidden: torch.Tensor, group: int = 1) -> torch.Tensor:
        """projected = project(f) (B,N,A), hidden (B*group,H) -> log alpha (B*group,N)."""
        return self.log_weights(projected, self.hidden_proj(hidden), group)  # (B*group, N)


def soft_context(alpha: torch.Tensor, features: torch.Tensor, group: int = 1) -> torch.Tensor:
    """Expected context: alpha (B*group,N), features (B,N,D) -> (B*group,D); row r reads image ``r // group``."""
    b, n = features.shape[:2]
    return torch.bmm(alpha.view(b, group, n), features).view(b * group, -1)  # (B*group, D)


def region_features(features: torch.Tensor, index: torch.Tensor, group: int = 1) -> torch.Tensor:
    """The feature of one region per row: features (B,N,D), index (B*group,) -> (B*group,D)."""
    rows = torch.arange(index.shape[0], device=features.device) // group
    return features[rows, index]  # (B*group, D)


def sample_regions(log_alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one region per row, ``s ~ Multinoulli(alpha)``.

    Args:
        log_alpha: (B,N) log attention weights (keeps its graph: the log-probability of the draw
            is what REINFORCE differentiates).

    Returns:
        index (B,) of the sampled regions and their log-probability (B,).
    """
    index = torch.multinomial(log_alpha.detach().float().exp(), 1).squeeze(1)  # (B,)
    return index, log_alpha.gather(1, index.unsqueeze(1)).squeeze(1)  # (B,), (B,)


def hard_test_context(alpha: torch.Tensor, features: torch.Tensor, mode: str, group: int = 1) -> torch.Tensor:
    """Deterministic hard-attention context for evaluation: the expectation or the argmax region."""
    if mode == "expectation":
        return soft_context(alpha, features, group)  # (B*group, D)
    if mode == "argmax":
        return region_features(features, alpha.argmax(dim=-1), group)  # (B*group, D)
    raise ValueError(f"hard_test_mode={mode!r}: use one of {HARD_TEST_MODES}")
