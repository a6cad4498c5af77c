"""Training objectives: what loss a batch gives, and the loss terms a run sums and logs.

``Objective``, ``Batch``, ``LossResult``; ``CrossEntropy`` with its regularisers (``CaptionLoss``:
label smoothing, the doubly stochastic penalty, REINFORCE for hard attention) and ``LossTerm``s.
Self-critical training is ``captioner.training.scst``; docs/training.md explains each term.

Shape legend: B batch rows (caption items), T caption steps (with ``<bos>``/``<eos>``), N regions,
D feature width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from captioner.training.concepts import concept_terms
from captioner.config import Config, DecoderConfig, TrainConfig
from captioner.errors import ConfigError
from captioner.models.base import CaptionDecoder, DecoderOutput
from captioner.text import Vocabulary
from captioner.training.attention_terms import build_attention_supervision
from captioner.training.distill import build_word_distillation

log = logging.getLogger(__name__)


DS_FORMS = ("excess", "mean", "sum")
ADVANTAGE_CLIP = 5.0  # normalised advantages beyond this many running standard deviations are clipped
# Weighted regularisers (name of the term, name of its weight in ``terms``) compared with the cross-entropy.
REGULARISERS = ("doubly_stochastic", "entropy")


@dataclass
class LossResult:
    """The scalar to backpropagate, the objective worth logging and the named parts.

    Attributes:
        terms: named detached 0-d tensors (``ce``, ``doubly_stochastic``, ``reinforce``, ``entropy``,
            ``baseline``, ``advantage_scale``) and ``weighted_<name>`` as each regulariser enters the objective.
        captions: how many captions the loss averages over (the batch's weight in logged means).
    """

    total: torch.Tensor  # what to backpropagate (objective + REINFORCE surrogate)
    objective: torch.Tensor  # ``ce + alpha_c * doubly_stochastic - entropy_weight * entropy`` (detached)
    terms: dict[str, torch.Tensor]
    captions: int | None = None

    @property
    def parts(self) -> dict[str, float]:
        """``terms`` as plain floats (a host sync; for tests and one-off use)."""
        return {k: float(v) for k, v in self.terms.items() if not k.startswith("weighted_")}


def doubly_stochastic_penalty(attention: torch.Tensor, mask: torch.Tensor, form: str = "excess") -> torch.Tensor:
    """The doubly stochastic penalty (docs/training.md): (B,T,N), (B,T) -> scalar.

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
    """Loss for both decoder families: ``alpha_c`` and ``ds_form`` weigh (0: off) and shape the doubly
    stochastic penalty; ``baseline_decay`` is the decay of the moving averages of the reward and of the
    squared advantage (hard attention's REINFORCE)."""

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
        self.pad_id, self.label_smoothing = pad_id, label_smoothing
        self.alpha_c, self.ds_form = alpha_c, ds_form  # the doubly stochastic penalty
        self.reinforce_weight, self.entropy_weight = reinforce_weight, entropy_weight  # hard attention's terms
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

    def forward(self, output: DecoderOutput, targets: torch.Tensor) -> LossResult:
        """output.logits (B,T,V), targets (B,T) -> LossResult; moving averages update in training mode only."""
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


class Batch(NamedTuple):
    """One training batch on the device."""

    x: torch.Tensor  # images (B,3,S,S) or cached region features (B,N,D), one row per caption item
    tokens: torch.Tensor  # (B,T) the rows' reference captions ``[<bos> w.. <eos> pad..]``
    image_index: torch.Tensor  # (B,) the training image of each row (an index into the training ``CaptionSet``)


@dataclass(frozen=True)
class TrainModel:
    """What an objective trains through: ``forward(x, tokens)`` with gradients, and ``encode`` (None on features)."""

    forward: Callable[[torch.Tensor, torch.Tensor], DecoderOutput]
    decoder: CaptionDecoder  # the bare decoder, for decoding without gradients (sampling, greedy captions)
    encode: Callable[[torch.Tensor], torch.Tensor] | None = None


class Objective(nn.Module):
    """The interface every training objective has (an ``nn.Module``: ``train()``, ``state_dict()``)."""

    def loss(self, model: TrainModel, batch: Batch) -> LossResult:
        """This batch's loss, with ``captions`` (the weight of its terms in the logged means) set."""
        raise NotImplementedError


class LossTerm(Protocol):
    """An extra term of :class:`CrossEntropy`: ``weight * term(output, batch)``, logged unweighted and weighted."""

    name: str
    weight: float
    # optional: ``stats``, a dict of detached 0-d tensors about the last call, logged beside the term

    def __call__(self, output: DecoderOutput, batch: Batch) -> torch.Tensor:
        """The unweighted term: a scalar with a graph."""
        ...


class CrossEntropy(Objective, CaptionLoss):
    """Teacher-forced cross-entropy with :class:`CaptionLoss`'s regularisers and any ``extra_terms`` (:class:`LossTerm`)."""

    def __init__(self, extra_terms: Sequence[LossTerm] = (), **kwargs: float | int | str) -> None:
        super().__init__(**kwargs)
        self.extra_terms = list(extra_terms)

    @classmethod
    def from_config(cls, train_cfg: TrainConfig, decoder_cfg: DecoderConfig, pad_id: int,
                    extra_terms: Sequence[LossTerm] = ()) -> "CrossEntropy":
        """The objective of ``train.objective = "xe"`` (weights as :meth:`CaptionLoss.from_config` sets them)."""
        objective = super().from_config(train_cfg, decoder_cfg, pad_id)
        objective.extra_terms = list(extra_terms)
        return objective

    def loss(self, model: TrainModel, batch: Batch) -> LossResult:
        """``CaptionLoss`` of ``forward(x, tokens[:, :-1])`` (logits (B,T-1,V)) against ``tokens[:, 1:]``."""
        tokens = batch.tokens
        out = model.forward(batch.x, tokens[:, :-1])  # logits (B, T-1, V)
        result = self(out, tokens[:, 1:])
        total, objective, terms = result.total, result.objective, dict(result.terms)
        for term in self.extra_terms:
            value = term(out, batch)
            weighted = term.weight * value
            total, objective = total + weighted, objective + weighted.detach()
            terms[term.name] = value.detach()
            terms[f"weighted_{term.name}"] = weighted.detach()
            terms.update(getattr(term, "stats", None) or {})  # a term's own statistics of this batch, if any
        return dataclasses.replace(result, total=total, objective=objective, terms=terms,
                                   captions=int(tokens.size(0)))


def weighted_terms(means: dict[str, float]) -> dict[str, float]:
    """The regularisers as they enter the objective: ``{name: |weighted_<name>|}``."""
    return {k[len("weighted_"):]: abs(v) for k, v in means.items() if k.startswith("weighted_")}


def term_shares(means: dict[str, float]) -> dict[str, float]:
    """``{"share_ce", "share_<name>"}``: each term's share of the positive loss mass (empty without a finite ``ce``)."""
    ce = means.get("ce")
    if ce is None or not math.isfinite(ce):
        return {}
    weighted = weighted_terms(means)
    whole = ce + sum(weighted.values())
    if whole <= 0:
        return {}
    return {"share_ce": ce / whole, **{f"share_{k}": v / whole for k, v in weighted.items()}}


def build_cross_entropy(cfg: Config, train_set: Any, vocab: Vocabulary) -> CrossEntropy:
    """``train.objective = "xe"`` with box supervision, the concept terms and word distillation as configured."""
    terms = [build_attention_supervision(cfg, train_set, vocab), *concept_terms(cfg, vocab),
             build_word_distillation(cfg, train_set, vocab)]
    return CrossEntropy.from_config(cfg.train, cfg.model.decoder, vocab.pad_id,
                                    extra_terms=[term for term in terms if term is not None])
