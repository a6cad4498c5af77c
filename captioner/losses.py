"""Caption training loss: cross-entropy, the doubly stochastic attention penalty, and REINFORCE
for hard attention (Xu et al. 2015).

Shape legend: B batch, T caption steps, V vocabulary, N regions.

Step t of the decoder output predicts ``targets[:, t]``; steps whose target is ``pad_id`` are
ignored everywhere (the decoder computes them, the loss masks them).

* ``ce``: cross-entropy averaged over non-pad target tokens (optional label smoothing).
* ``doubly_stochastic``: the coverage of region i over the caption is ``c_i = sum_t alpha_ti`` (t
  over non-pad steps); the paper asks ``c_i = 1`` for every region, ``sum_i (1 - c_i)^2``
  (``ds_form="sum"``). With N regions and T < N words that cannot hold and the penalty's minimum is
  uniform attention: looking at one region per word costs ``T (N - T) / N`` more than looking
  everywhere (11 nats per caption at 14 x 14). ``ds_form="mean"`` (the widely used tutorial)
  averages over regions, which shrinks that pull by N but keeps its direction; measured on the
  demo it still halves attention correctness. ``ds_form="excess"`` (default) keeps only the half
  that can hold, ``mean_i max(0, c_i - 1)^2``: no region should receive more than one unit over
  the caption. Uniform and one-region-per-word attention both cost 0; staring at one region for
  the whole caption costs ``(T - 1)^2 / N``. Averaged over the batch, weighted by ``alpha_c``.
* ``reinforce`` (hard attention, when the output carries ``sample_log_probs``): the reward of a
  caption is its mean per-word log-likelihood given the sampled regions, ``r = mean_t log p(y_t)``
  (no label smoothing, detached; the mean makes it independent of the caption length). A moving
  average ``b`` of the batch-mean reward is the baseline and a moving average ``v`` of the
  squared advantage its scale (buffers, initialised from the first batch, then
  ``x <- decay * x + (1 - decay) * batch value``; the advantage uses them before the update). The
  normalised advantage ``a = clamp((r - b) / sqrt(v), -5, 5)`` weighs the log-probability of every
  sampled region: ``-reinforce_weight * sum_{b,t} a_b log p(s_bt) / (non-pad tokens)``, a token
  mean like the cross-entropy, so its gradient stays on the cross-entropy's scale. The entropy
  bonus ``-entropy_weight * mean attention entropy`` (non-pad steps) is added.

``LossResult.total`` is what to backpropagate; ``LossResult.objective`` is the value worth
watching: cross-entropy plus the weighted regularisers, without the REINFORCE surrogate, whose
value is not a loss (its gradient is the point). ``LossResult.terms`` holds detached scalar
tensors on the loss's device (reading them is a host sync: the training loop reads them only
when it logs); ``LossResult.parts`` converts them to floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from captioner.errors import ConfigError
from captioner.models.base import DecoderOutput

DS_FORMS = ("excess", "mean", "sum")
ADVANTAGE_CLIP = 5.0  # normalised advantages beyond this many running standard deviations are clipped
# Weighted regularisers (name of the term, name of its weight in ``terms``) compared with the cross-entropy.
REGULARISERS = ("doubly_stochastic", "entropy")


@dataclass
class LossResult:
    """The scalar to backpropagate, the objective worth logging and the named parts.

    Attributes:
        total: what to backpropagate (objective + REINFORCE surrogate).
        objective: ``ce + alpha_c * doubly_stochastic - entropy_weight * entropy`` (detached).
        terms: named detached 0-d tensors: ``ce``, ``doubly_stochastic`` (unweighted),
            ``reinforce`` (the surrogate term), ``entropy`` (mean attention entropy, nats),
            ``baseline``, ``advantage_scale``, and ``weighted_<name>`` for each regulariser as
            it enters the objective (``alpha_c * doubly_stochastic``, ``entropy_weight * entropy``).
        captions: how many captions the loss averages over: the weight of this batch's terms in
            the logged means (set by the training objectives; None from ``CaptionLoss`` alone).
    """

    total: torch.Tensor
    objective: torch.Tensor
    terms: dict[str, torch.Tensor]
    captions: int | None = None

    @property
    def parts(self) -> dict[str, float]:
        """``terms`` as plain floats (a host sync; for tests and one-off use)."""
        return {k: float(v) for k, v in self.terms.items() if not k.startswith("weighted_")}


def doubly_stochastic_penalty(attention: torch.Tensor, mask: torch.Tensor, form: str = "excess") -> torch.Tensor:
    """The doubly stochastic penalty (see the module docstring): (B,T,N), (B,T) -> scalar.

    ``form``: ``"excess"`` ``mean_i relu(c_i - 1)^2``, ``"mean"`` ``mean_i (1 - c_i)^2`` or ``"sum"``
    ``sum_i (1 - c_i)^2`` (Xu et al.), with ``c_i = sum_t alpha_ti`` over unmasked steps; then the
    batch mean.
    """
    if form not in DS_FORMS:
        raise ConfigError(f"doubly stochastic form {form!r}: use one of {', '.join(DS_FORMS)}")
    coverage = (attention * mask.unsqueeze(-1).to(attention.dtype)).sum(dim=1)  # (B, N)
    if form == "excess":
        return (torch.relu(coverage - 1.0) ** 2).mean(dim=1).mean()
    per_region = (1.0 - coverage) ** 2  # (B, N)
    return (per_region.sum(dim=1) if form == "sum" else per_region.mean(dim=1)).mean()


class CaptionLoss(nn.Module):
    """Loss for both decoder families.

    Args:
        pad_id: target id ignored by every term.
        label_smoothing: passed to ``F.cross_entropy``.
        alpha_c: weight of the doubly stochastic penalty (0 disables it).
        ds_form: ``"excess"``, ``"mean"`` or ``"sum"`` (the paper's form): that penalty's form.
        reinforce_weight: weight of the REINFORCE term (hard attention).
        entropy_weight: weight of the attention-entropy bonus (hard attention).
        baseline_decay: decay of the moving averages of the reward and of the squared advantage.
    """

    def __init__(self, pad_id: int = 0, label_smoothing: float = 0.0, alpha_c: float = 0.0, ds_form: str = "excess",
                 reinforce_weight: float = 1.0, entropy_weight: float = 0.0, baseline_decay: float = 0.9) -> None:
        super().__init__()
        if not 0.0 <= label_smoothing < 1.0:
            raise ConfigError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        if not 0.0 <= baseline_decay < 1.0:
            raise ConfigError(f"baseline_decay must be in [0, 1), got {baseline_decay}")
        if alpha_c < 0:
            raise ConfigError(f"alpha_c must be >= 0, got {alpha_c}")
        if ds_form not in DS_FORMS:
            raise ConfigError(f"ds_form={ds_form!r}: use one of {', '.join(DS_FORMS)}")
        self.pad_id = pad_id
        self.label_smoothing = label_smoothing
        self.alpha_c = alpha_c
        self.ds_form = ds_form
        self.reinforce_weight = reinforce_weight
        self.entropy_weight = entropy_weight
        self.baseline_decay = baseline_decay
        self.register_buffer("baseline", torch.zeros(()))  # moving-average reward
        self.register_buffer("advantage_var", torch.ones(()))  # moving average of (r - b)^2
        self.register_buffer("baseline_updates", torch.zeros((), dtype=torch.long))  # 0 = not yet initialised

    @classmethod
    def from_config(cls, train_cfg, decoder_cfg, pad_id: int) -> "CaptionLoss":  # noqa: ANN001
        """The cross-entropy stage's loss for a ``TrainConfig`` and a decoder config (the doubly
        stochastic penalty only where ``decoder_cfg.doubly_stochastic``: SAT)."""
        t = train_cfg
        return cls(pad_id=pad_id, label_smoothing=t.label_smoothing,
                   alpha_c=t.alpha_c if decoder_cfg.doubly_stochastic else 0.0, ds_form=t.ds_form,
                   reinforce_weight=t.reinforce_weight, entropy_weight=t.entropy_weight,
                   baseline_decay=t.baseline_decay)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        # States saved before ``advantage_var`` existed resume with a fresh scale.
        state_dict.setdefault(prefix + "advantage_var", torch.ones(()))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, output: DecoderOutput, targets: torch.Tensor) -> LossResult:
        """output.logits (B,T,V), targets (B,T) -> LossResult.

        The moving averages are updated only in training mode (``loss.train()``, the default).
        """
        logits = output.logits
        if logits.shape[:2] != targets.shape:
            raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
        mask = targets != self.pad_id  # (B, T)
        flat_logits = logits.reshape(-1, logits.shape[-1]).float()  # (B*T, V)
        flat_targets = targets.reshape(-1)  # (B*T,)
        # sum / max(count, 1): an all-padding batch gives 0 and keeps the graph, with no host sync
        token_ce = F.cross_entropy(flat_logits, flat_targets, ignore_index=self.pad_id,
                                   label_smoothing=self.label_smoothing, reduction="sum")
        ce = token_ce / mask.sum().clamp(min=1)
        objective = ce
        terms: dict[str, torch.Tensor] = {"ce": ce.detach()}

        if self.alpha_c > 0 and output.attention is not None:
            penalty = doubly_stochastic_penalty(output.attention.float(), mask, self.ds_form)
            objective = objective + self.alpha_c * penalty
            terms["doubly_stochastic"] = penalty.detach()
            terms["weighted_doubly_stochastic"] = self.alpha_c * penalty.detach()

        total = objective
        if output.sample_log_probs is not None:
            term, bonus, stats = self._reinforce(output, flat_logits, flat_targets, mask)
            objective = objective + bonus
            total = total + term + bonus
            terms.update(stats)
        return LossResult(total=total, objective=objective.detach(), terms=terms)

    def _reinforce(self, output: DecoderOutput, flat_logits: torch.Tensor, flat_targets: torch.Tensor,
                   mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """REINFORCE term, entropy bonus and their logging stats (all on the loss's device)."""
        fmask = mask.to(flat_logits.dtype)  # (B, T)
        words = fmask.sum(dim=1).clamp(min=1.0)  # (B,)
        with torch.no_grad():
            token_nll = F.cross_entropy(flat_logits, flat_targets, ignore_index=self.pad_id, reduction="none")
            reward = -(token_nll.view(mask.shape) * fmask).sum(dim=1) / words  # (B,) mean_t log p(y_t | s)
            first = self.baseline_updates == 0
            baseline = torch.where(first, reward.mean(), self.baseline)
            advantage = reward - baseline  # (B,)
            var = torch.where(first, (advantage ** 2).mean().clamp(min=1e-8), self.advantage_var)
            scale = var.sqrt().clamp(min=1e-4)
            normalised = (advantage / scale).clamp(-ADVANTAGE_CLIP, ADVANTAGE_CLIP)  # (B,)
            if self.training:
                d = self.baseline_decay
                self.baseline.copy_(torch.where(first, reward.mean(), d * self.baseline + (1 - d) * reward.mean()))
                self.advantage_var.copy_(d * var + (1 - d) * (advantage ** 2).mean())
                self.baseline_updates += 1
        log_prob = output.sample_log_probs.float() * fmask  # (B, T) log p(s_t), 0 where the soft context was used
        term = -self.reinforce_weight * (normalised.unsqueeze(1) * log_prob).sum() / fmask.sum().clamp(min=1.0)
        stats = {"reinforce": term.detach(), "baseline": baseline, "advantage_scale": scale}
        bonus = term.new_zeros(())
        if output.attention_entropy is not None:
            entropy = (output.attention_entropy.float() * fmask).sum() / fmask.sum().clamp(min=1.0)
            bonus = -self.entropy_weight * entropy
            stats["entropy"] = entropy.detach()
            if self.entropy_weight > 0:
                stats["weighted_entropy"] = self.entropy_weight * entropy.detach()
        return term, bonus, stats
