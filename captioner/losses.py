"""Caption training loss: cross-entropy, the doubly stochastic attention penalty, and REINFORCE
for hard attention (Xu et al. 2015).

Shape legend: B batch, T caption steps, V vocabulary, N regions.

Step t of the decoder output predicts ``targets[:, t]``; steps whose target is ``pad_id`` are
ignored everywhere (the decoder computes them, the loss masks them).

* ``ce``: cross-entropy averaged over non-pad target tokens (optional label smoothing).
* ``doubly_stochastic``: ``alpha_c * sum_i (1 - sum_t alpha_ti)^2`` (t over non-pad steps),
  summed over regions and averaged over the batch: every region should receive about one unit
  of attention over the whole caption.
* ``reinforce`` (hard attention, when the output carries ``sample_log_probs``): reward per
  caption ``r = log p(y | s)`` (minus its summed cross-entropy, no label smoothing, detached),
  a moving-average baseline ``b`` (a buffer, initialised from the first batch's mean reward,
  then ``b <- decay * b + (1 - decay) * mean r``; the advantage uses ``b`` before the update),
  term ``-reinforce_weight * mean_B((r - b) * sum_t log p(s_t))`` plus the entropy bonus
  ``-entropy_weight * mean attention entropy`` over non-pad steps.

``parts`` reports plain floats: ``ce``; ``doubly_stochastic``; ``reinforce`` (the REINFORCE term
without the entropy bonus); ``entropy`` (mean attention entropy in nats: near ``log N`` means the
model has not learnt to attend); ``baseline`` (b used for this batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from captioner.errors import ConfigError
from captioner.models.base import DecoderOutput


@dataclass
class LossResult:
    """The scalar to backpropagate and its named parts (floats, for logging)."""

    total: torch.Tensor
    parts: dict[str, float]


def doubly_stochastic_penalty(attention: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``mean_B sum_i (1 - sum_t alpha_ti)^2`` with t over unmasked steps: (B,T,N), (B,T) -> scalar."""
    total = (attention * mask.unsqueeze(-1).to(attention.dtype)).sum(dim=1)  # (B, N)
    return ((1.0 - total) ** 2).sum(dim=1).mean()


class CaptionLoss(nn.Module):
    """Loss for both decoder families.

    Args:
        pad_id: target id ignored by every term.
        label_smoothing: passed to ``F.cross_entropy``.
        alpha_c: weight of the doubly stochastic penalty (0 disables it).
        reinforce_weight: weight of the REINFORCE term (hard attention).
        entropy_weight: weight of the attention-entropy bonus (hard attention).
        baseline_decay: decay of the moving-average reward baseline.
    """

    def __init__(self, pad_id: int = 0, label_smoothing: float = 0.0, alpha_c: float = 0.0,
                 reinforce_weight: float = 1.0, entropy_weight: float = 0.0, baseline_decay: float = 0.9) -> None:
        super().__init__()
        if not 0.0 <= label_smoothing < 1.0:
            raise ConfigError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        if not 0.0 <= baseline_decay < 1.0:
            raise ConfigError(f"baseline_decay must be in [0, 1), got {baseline_decay}")
        if alpha_c < 0:
            raise ConfigError(f"alpha_c must be >= 0, got {alpha_c}")
        self.pad_id = pad_id
        self.label_smoothing = label_smoothing
        self.alpha_c = alpha_c
        self.reinforce_weight = reinforce_weight
        self.entropy_weight = entropy_weight
        self.baseline_decay = baseline_decay
        self.register_buffer("baseline", torch.zeros(()))  # moving-average reward
        self.register_buffer("baseline_updates", torch.zeros((), dtype=torch.long))  # 0 = not yet initialised

    def forward(self, output: DecoderOutput, targets: torch.Tensor) -> LossResult:
        """output.logits (B,T,V), targets (B,T) -> LossResult(total, parts).

        The baseline is updated only in training mode (``loss.train()``, the default).
        """
        logits = output.logits
        if logits.shape[:2] != targets.shape:
            raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
        mask = targets != self.pad_id  # (B, T)
        flat_logits = logits.reshape(-1, logits.shape[-1]).float()  # (B*T, V)
        flat_targets = targets.reshape(-1)  # (B*T,)
        if mask.any():
            ce = F.cross_entropy(flat_logits, flat_targets, ignore_index=self.pad_id,
                                 label_smoothing=self.label_smoothing)
        else:  # an all-padding batch contributes nothing (but keeps the graph)
            ce = flat_logits.sum() * 0.0
        total = ce
        parts = {"ce": ce.item()}

        if self.alpha_c > 0 and output.attention is not None:
            penalty = doubly_stochastic_penalty(output.attention.float(), mask)
            total = total + self.alpha_c * penalty
            parts["doubly_stochastic"] = penalty.item()

        if output.sample_log_probs is not None:
            term, bonus, stats = self._reinforce(output, flat_logits, flat_targets, mask)
            total = total + term + bonus
            parts.update(stats)
        return LossResult(total=total, parts=parts)

    def _reinforce(self, output: DecoderOutput, flat_logits: torch.Tensor, flat_targets: torch.Tensor,
                   mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """REINFORCE term, entropy bonus and their logging stats."""
        fmask = mask.to(flat_logits.dtype)  # (B, T)
        with torch.no_grad():
            token_nll = F.cross_entropy(flat_logits, flat_targets, ignore_index=self.pad_id, reduction="none")
            reward = -(token_nll.view(mask.shape) * fmask).sum(dim=1)  # (B,) log p(y | s)
            if self.baseline_updates.item() == 0:
                baseline = reward.mean()
            else:
                baseline = self.baseline.clone()
            if self.training:
                new = reward.mean() if self.baseline_updates.item() == 0 else (
                    self.baseline_decay * self.baseline + (1.0 - self.baseline_decay) * reward.mean())
                self.baseline.copy_(new)
                self.baseline_updates += 1
            advantage = reward - baseline  # (B,)
        log_prob = (output.sample_log_probs.float() * fmask).sum(dim=1)  # (B,) sum_t log p(s_t)
        term = -self.reinforce_weight * (advantage * log_prob).mean()
        stats = {"reinforce": term.item(), "baseline": baseline.item()}
        bonus = term.new_zeros(())
        if output.attention_entropy is not None:
            n = fmask.sum().clamp(min=1.0)
            entropy = (output.attention_entropy.float() * fmask).sum() / n
            bonus = -self.entropy_weight * entropy
            stats["entropy"] = entropy.item()
        return term, bonus, stats
