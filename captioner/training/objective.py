"""The training objectives: what loss a batch gives, and the loss terms a run sums and logs.

One module for one idea: the objective interface (:class:`Objective`, :class:`Batch`, :class:`TrainModel`),
the cross-entropy objective with its regularisers (:class:`CaptionLoss`), the attention supervision by object
boxes (:func:`grounding_loss`, :class:`GroundingTargets`, :class:`AttentionSupervision`) and the device-side sums
of the loss terms between log lines (:class:`DeviceStats`). Self-critical training, the other objective, is
:mod:`captioner.training.scst`.

Training objectives as objects: one call, ``objective.loss(model, batch) -> LossResult``.

Shape legend: B batch rows (caption items), T caption steps (with ``<bos>``/``<eos>``), N regions,
D feature width, V vocabulary.

The training step (:mod:`captioner.training.step`) never asks which objective it holds: it calls
``loss``, backpropagates ``LossResult.total``, logs ``LossResult.objective`` and ``terms``, and
weighs them by ``LossResult.captions``. An objective's ``state_dict`` (e.g. the REINFORCE moving
averages of hard attention) is saved in ``train_state.pt`` under ``"criterion"``.

* :class:`CrossEntropy` (``train.objective = "xe"``): teacher forcing on the batch's reference
  captions, scored by :class:`captioner.training.objective.CaptionLoss`, plus any :class:`LossTerm` added to it.
* :class:`captioner.training.scst.SelfCritical` (``train.objective = "scst"``): sampled captions,
  rewarded.

Which objective a run trains with is chosen once, when the run is built
(:func:`captioner.training.loop.build_objective`).

Caption training loss: cross-entropy, the doubly stochastic attention penalty, and REINFORCE
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

Attention supervision from object boxes (Liu et al. 2017, "Attention Correctness in Neural Image
Captioning"): the term that pulls a word's attention onto the box of the object it names.

Shape legend: B batch, T caption steps, N regions.

``coverage`` (B, T, N) holds, for each target word that names an object, each region's share of
area inside that object's box (``captioner.evaluation.attention_metrics.box_coverage``), and zeros for every
other word: a word with an all-zero row is not supervised and contributes nothing. Two forms:

* ``"mass"``: ``-log sum_n alpha_n coverage_n``, minus the log of the attention mass
  inside the box: exactly the quantity attention correctness measures. It is 0 once all the
  attention is in the box, wherever in the box it sits, so the decoder may stay as sharp as it
  likes; and for an ambiguous word whose target is the union of several boxes it asks for "one of
  them", never for all of them.
* ``"cross_entropy"`` (Liu et al.; default): ``-sum_n p_n log alpha_n`` with ``p = coverage / sum(coverage)``,
  the cross-entropy to the box's normalised mask; it also asks the attention to spread over the box
  as its area is (its minimum is ``alpha = p``). The value returned is that cross-entropy minus the
  target's own entropy ``-sum_n p_n log p_n``, a constant per word: the KL divergence
  ``KL(p || alpha)``, with the same gradient, 0 at the optimum. So, like the other terms, its
  logged value and its share of the loss say how far the attention is from the target (the raw
  cross-entropy never falls below the entropy of the box, log 4 for a box over four regions).

Either is averaged over the supervised words of the batch and weighted by ``weight``
(``train.attention_supervision``). docs/grounding.md says which was chosen and why.

``train.attention_supervision``: the training step's hook for attention supervised by object boxes.

Shape legend: B batch, T caption steps, N regions.

:class:`GroundingTargets` turns a training batch's target words and image indices into box
coverages (B, T, N): the words are matched to objects as attention correctness matches them
(``captioner.evaluation.attention_metrics.find_mentions``: the scenes' shapes with their colour and size
words, COCO categories with synonyms and plurals, or the dataset's own category names), bound to
boxes by ``captioner.evaluation.attention_metrics.bind_mentions``, and each box is laid on the region grid by
``box_coverage``. Images without boxes (no entry in ``instances_<split>.json``) give all-zero rows:
their captions train without the term. A caption's binding is computed once and remembered.

:class:`AttentionSupervision` is the term :func:`grounding_loss` as
one of the cross-entropy objective's extra terms (``captioner.training.objective.LossTerm``): the
objective adds ``weight *`` it to the loss and logs ``grounding`` (unweighted, per supervised word)
and ``weighted_grounding`` (so ``share_grounding`` and the regulariser warning see it), and the
term's ``stats``: ``grounded_words`` (share of target words supervised) and ``grounding_in_box``
(their attention mass inside the box). :func:`build_attention_supervision` makes it for a run
(``captioner.training.objective.build_cross_entropy`` asks), or returns None.

Loss statistics kept on the device between log lines, so a training step never waits for the host.

Every step adds its caption-weighted loss terms to one device tensor and records, still on the
device, the first step whose loss or gradient norm was not finite. ``read()`` (at ``log_every``,
at the end of an epoch and when the time budget runs out) is the one host synchronisation: it
returns the means since the last read and the first non-finite step, which the loop turns into
the same one-line error as a per-step check would (the weights of a failed window are never
saved: the epoch-end save refuses non-finite weights).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from captioner.config import Config, DecoderConfig, TrainConfig
from captioner.data.coco import load_instances
from captioner.evaluation.attention_metrics import bind_mentions, box_coverage
from captioner.data.transforms import crop_box
from captioner.errors import ConfigError, DataError
from captioner.evaluation.attention_metrics import WordTable, detect_vocabulary, find_mentions, word_table
from captioner.models.base import CaptionDecoder, DecoderOutput
from captioner.models.concepts import ConceptHead, read_concepts
from captioner.text import Vocabulary

log = logging.getLogger(__name__)


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


FORMS = ("mass", "cross_entropy")
_EPS = 1e-6  # floor of the in-box mass (a box outside the grid's view has coverage 0 and is not supervised)


@dataclass
class GroundingTerm:
    """What :func:`grounding_loss` returns.

    Attributes:
        loss: the unweighted term, mean over supervised words (0 when none; keeps the graph).
        words: supervised words in the batch (0-d tensor).
        in_box: mean attention mass inside the box over the supervised words (detached).
    """

    loss: torch.Tensor
    words: torch.Tensor
    in_box: torch.Tensor


def grounding_loss(attention: torch.Tensor, coverage: torch.Tensor, form: str = "cross_entropy") -> GroundingTerm:
    """The supervision term for attention maps and box coverages.

    Args:
        attention: (B, T, N) attention over regions per step, rows summing to 1 (SAT's alpha, the
            Transformer's head-averaged cross-attention of its last layer).
        coverage: (B, T, N) each region's area share inside the target box(es) of the word that step
            T predicts; all-zero rows are not supervised.
        form: ``"mass"`` or ``"cross_entropy"`` (module docstring).

    Returns:
        ``GroundingTerm`` (no host sync).
    """
    if form not in FORMS:
        raise ConfigError(f"attention supervision form {form!r}: use one of {', '.join(FORMS)}")
    if attention.shape != coverage.shape:
        raise ValueError(f"attention {tuple(attention.shape)} and box coverage {tuple(coverage.shape)} differ")
    attention = attention.float()
    coverage = coverage.to(attention.dtype)
    area = coverage.sum(dim=-1)  # (B, T)
    supervised = (area > 0).to(attention.dtype)  # (B, T)
    words = supervised.sum()
    mass = (attention * coverage).sum(dim=-1)  # (B, T) attention inside the box
    if form == "mass":
        per_word = -mass.clamp(min=_EPS).log()  # (B, T)
    else:
        target = coverage / area.clamp(min=_EPS).unsqueeze(-1)  # (B, T, N), rows sum to 1 where supervised
        log_ratio = target.clamp(min=_EPS).log() - attention.clamp(min=_EPS).log()  # (B, T, N)
        per_word = (target * log_ratio).sum(dim=-1)  # (B, T) KL(p || alpha) = cross-entropy - H(p)
    loss = (per_word * supervised).sum() / words.clamp(min=1.0)
    in_box = (mass.detach() * supervised).sum() / words.clamp(min=1.0)
    return GroundingTerm(loss, words.detach(), in_box)


class Batch(NamedTuple):
    """One training batch on the device.

    Attributes:
        x: images (B,3,S,S) or cached region features (B,N,D), one row per caption item.
        tokens: (B,T) the rows' reference captions ``[<bos> w.. <eos> pad..]``.
        image_index: (B,) the training image of each row (an index into the training ``CaptionSet``).
    """

    x: torch.Tensor
    tokens: torch.Tensor
    image_index: torch.Tensor


@dataclass(frozen=True)
class TrainModel:
    """What an objective trains through.

    Attributes:
        forward: ``forward(x, tokens) -> DecoderOutput`` with gradients: the training module
            (:class:`captioner.training.run.TrainForward`), DDP-wrapped under torchrun.
        decoder: the bare decoder, for decoding without gradients (sampling, greedy captions).
        encode: images (B,3,S,S) -> features (B,N,D) through the bare encoder, or None when the
            batches hold cached features.
    """

    forward: Callable[[torch.Tensor, torch.Tensor], DecoderOutput]
    decoder: CaptionDecoder
    encode: Callable[[torch.Tensor], torch.Tensor] | None = None


class Objective(nn.Module):
    """The interface every training objective has (an ``nn.Module``: ``train()``, ``state_dict()``)."""

    def loss(self, model: TrainModel, batch: Batch) -> LossResult:
        """This batch's loss, with ``captions`` (the weight of its terms in the logged means) set."""
        raise NotImplementedError


class LossTerm(Protocol):
    """An extra term of :class:`CrossEntropy`: ``weight * term(output, batch)`` joins the loss.

    It is logged as ``<name>`` (unweighted) and ``weighted_<name>`` (as it enters the objective;
    the training loop warns when such a term outweighs the cross-entropy and logs its share).
    """

    name: str
    weight: float
    # optional: ``stats``, a dict of detached 0-d tensors about the last call, logged beside the term

    def __call__(self, output: DecoderOutput, batch: Batch) -> torch.Tensor:
        """The unweighted term: a scalar with a graph."""
        ...


class CrossEntropy(Objective, CaptionLoss):
    """Teacher-forced cross-entropy of the references, with the attention regularisers of
    :class:`captioner.training.objective.CaptionLoss` (whose buffers and ``state_dict`` it has) and any extra
    :class:`LossTerm`.

    Args:
        extra_terms: terms added to the loss after ``CaptionLoss``'s, in order.
        **kwargs: ``CaptionLoss``'s arguments.
    """

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


@dataclass
class StatsReading:
    """What ``DeviceStats.read`` returns.

    Attributes:
        means: caption-weighted means of ``loss`` (the objective) and every loss term.
        captions: captions added since the last read.
        bad_loss: ``(step, value)`` of the first non-finite loss, or None.
        bad_grad_step: the first step whose gradient norm was not finite, or None.
    """

    means: dict[str, float]
    captions: float
    bad_loss: tuple[int, float] | None
    bad_grad_step: int | None


class DeviceStats:
    """Caption-weighted sums of the loss terms on the device, read in one go."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.keys: list[str] | None = None
        self.sums: torch.Tensor | None = None
        self.captions = 0.0
        self.bad: torch.Tensor | None = None  # (3,) first bad-loss step, its value, first bad-grad step (-1: none)

    def add(self, result: LossResult, captions: int, step: int, grad_norm: torch.Tensor | float | None) -> None:
        """Add one step's terms (no host sync)."""
        terms = {"loss": result.objective, **result.terms}
        if self.keys is None:
            self.keys = sorted(terms)
        vec = torch.stack([terms[k].float() for k in self.keys]) * float(captions)
        self.sums = vec if self.sums is None else self.sums + vec
        self.captions += captions
        total = result.total.detach().float()
        if self.bad is None:
            self.bad = torch.tensor([-1.0, 0.0, -1.0], dtype=torch.float64, device=total.device)
        loss_bad = ~torch.isfinite(total) & (self.bad[0] < 0)
        grad_bad = (self.bad[2] < 0) & ~torch.isfinite(torch.as_tensor(grad_norm if grad_norm is not None else 0.0,
                                                                       device=total.device, dtype=torch.float32))
        self.bad = torch.stack([torch.where(loss_bad, float(step), self.bad[0]),
                                torch.where(loss_bad, total.double(), self.bad[1]),
                                torch.where(grad_bad, float(step), self.bad[2])])

    def read(self) -> StatsReading:
        """Means since the last read and the first non-finite steps (one host sync); then reset."""
        if self.sums is None or self.keys is None:
            self._reset()
            return StatsReading({}, 0.0, None, None)
        sums = self.sums.double().cpu().tolist()
        bad = self.bad.cpu().tolist() if self.bad is not None else [-1.0, 0.0, -1.0]
        n = self.captions
        means = {k: v / n for k, v in zip(self.keys, sums)} if n else {}
        reading = StatsReading(means, n, (int(bad[0]), bad[1]) if bad[0] >= 0 else None,
                               int(bad[2]) if bad[2] >= 0 else None)
        self._reset()
        return reading


def weighted_terms(means: dict[str, float]) -> dict[str, float]:
    """The regularisers as they enter the objective: ``{name: |weighted_<name>|}``."""
    return {k[len("weighted_"):]: abs(v) for k, v in means.items() if k.startswith("weighted_")}


def term_shares(means: dict[str, float]) -> dict[str, float]:
    """Each term's share of the positive loss mass: ``ce`` and every ``weighted_<name>`` regulariser.

    Returns ``{"share_ce": ..., "share_<name>": ...}`` (empty without a finite ``ce``).
    """
    ce = means.get("ce")
    if ce is None or not math.isfinite(ce):
        return {}
    weighted = weighted_terms(means)
    whole = ce + sum(weighted.values())
    if whole <= 0:
        return {}
    return {"share_ce": ce / whole, **{f"share_{k}": v / whole for k, v in weighted.items()}}


class GroundingTargets:
    """Box coverages for the target words of training batches.

    Args:
        images: the training ``ImageRecord`` list (batch image indices index it).
        instances: ``{image_id: [ObjectBox]}`` (``load_instances``); images absent or with no boxes
            are not supervised.
        vocab: the training vocabulary (target ids -> words).
        view: ``(width, height) -> (left, top, right, bottom)``, the part of the image the grid covers.
        grid: g, regions per side.
        vocabulary: ``"shapes"``, ``"coco"`` or a ``WordTable`` (None: from the instances' categories).
    """

    def __init__(self, images: Sequence[Any], instances: dict[int, list[Any]], vocab: Vocabulary, view: Any,
                 grid: int, vocabulary: str | WordTable | None = None) -> None:
        self.images = list(images)
        self.instances = instances
        self.vocab = vocab
        self.view = view
        self.grid = grid
        self.table = word_table(vocabulary if vocabulary is not None else detect_vocabulary(instances))
        self._bindings: dict[tuple[int, tuple[int, ...]], list[tuple[int, int]]] = {}  # caption -> (t, bank row)
        self._rows: dict[tuple[int, tuple[int, ...]], int] = {}  # (image, box indices) -> bank row
        self._bank: list[np.ndarray] = []  # (N,) coverages

    @classmethod
    def for_encoder(cls, images: Sequence[Any], instances: dict[int, list[Any]], vocab: Vocabulary,
                    encoder: Any) -> "GroundingTargets":
        """Targets on the grid of ``encoder`` (an ``EncoderConfig``: its ``grid``, and the crop it sees)."""
        return cls(images, instances, vocab, lambda w, h: crop_box(w, h, encoder), encoder.grid)

    def _row(self, image: int, boxes: tuple[int, ...]) -> int:
        key = (image, boxes)
        if key not in self._rows:
            record = self.images[image]
            objects = self.instances.get(record.image_id, [])
            width, height = record.size()
            self._bank.append(box_coverage([objects[i].bbox for i in boxes], self.view(width, height), self.grid))
            self._rows[key] = len(self._bank) - 1
        return self._rows[key]

    def binding(self, image: int, ids: Sequence[int]) -> list[tuple[int, int]]:
        """``(target step, bank row)`` for one caption: target ids (``tokens[1:]``) of training image ``image``."""
        key = (image, tuple(ids))
        found = self._bindings.get(key)
        if found is None:
            objects = self.instances.get(self.images[image].image_id) or []
            found = []
            if objects:
                words = self.vocab.decode_tokens(ids)
                found = [(t, self._row(image, boxes))
                         for t, boxes in bind_mentions(find_mentions(words, self.table), objects)]
            self._bindings[key] = found
        return found

    def bound_words(self, image: int, ids: Sequence[int]) -> list[tuple[int, np.ndarray]]:
        """``(word id, coverage (N,))`` for each word of one caption (target ids) that names a box."""
        return [(int(ids[t]), self._bank[row]) for t, row in self.binding(image, ids)]

    def coverage(self, targets: torch.Tensor, image_index: torch.Tensor) -> torch.Tensor:
        """targets (B, T) word ids, image_index (B,) -> box coverage (B, T, N) float32 on the CPU."""
        rows = targets.tolist()
        images = image_index.tolist()
        out = np.zeros((len(rows), targets.shape[1], self.grid * self.grid), dtype=np.float32)  # (B, T, N)
        for b, (ids, image) in enumerate(zip(rows, images)):
            for t, row in self.binding(int(image), ids):
                out[b, t] = self._bank[row]
        return torch.from_numpy(out)


class AttentionSupervision:
    """The box-supervision term of :class:`captioner.training.objective.CrossEntropy` (a ``LossTerm``).

    ``CrossEntropy`` adds ``weight * term(output, batch)`` to the loss and logs it as ``grounding``
    and ``weighted_grounding``; ``stats`` (the last batch's ``grounded_words`` and
    ``grounding_in_box``) is logged beside them.

    Args:
        targets: the batch targets' box coverages.
        weight: lambda, the term's weight (``train.attention_supervision``).
        form: ``"cross_entropy"`` or ``"mass"`` (``train.attention_supervision_form``).
        pad_id: id of padding in the targets.
    """

    name = "grounding"

    def __init__(self, targets: GroundingTargets, weight: float, form: str = "cross_entropy", pad_id: int = 0) -> None:
        self.targets = targets
        self.weight = weight
        self.form = form
        self.pad_id = pad_id
        self.stats: dict[str, torch.Tensor] = {}

    def __call__(self, output: DecoderOutput, batch: Any) -> torch.Tensor:
        """The unweighted term for a teacher-forced ``output`` of ``batch`` (``tokens``, ``image_index``).

        ``output.attention`` (B, T-1, N) is supervised for the targets ``batch.tokens[:, 1:]``.
        """
        targets = batch.tokens[:, 1:]  # (B, T-1)
        coverage = self.targets.coverage(targets.cpu(), batch.image_index.cpu()).to(output.attention.device,
                                                                                     non_blocking=True)
        term = grounding_loss(output.attention, coverage, self.form)
        words = (targets != self.pad_id).sum().clamp(min=1).to(term.words.dtype)
        self.stats = {"grounded_words": term.words / words, "grounding_in_box": term.in_box}
        return term.loss


def _cross_entropy_only(key: str, objective: str) -> bool:
    """Whether a term of cross-entropy training applies under ``train.objective``; warns when it does not."""
    if objective != "xe":
        log.warning("%s applies to cross-entropy training only; train.objective=%s trains without it", key, objective)
        return False
    return True


def build_attention_supervision(cfg: Any, train_set: Any, vocab: Vocabulary) -> AttentionSupervision | None:
    """The hook for a run, or None when ``train.attention_supervision`` is 0 or nothing can be supervised.

    Args:
        cfg: the run's ``Config`` (``train.attention_supervision``, ``train.attention_supervision_form``,
            ``train.objective``, ``data``, ``model.encoder`` for the grid and the crop).
        train_set: the training ``CaptionSet`` (batch image indices index its images).
        vocab: the training vocabulary.
    """
    t = cfg.train
    if not t.attention_supervision:
        return None
    if not _cross_entropy_only("train.attention_supervision", t.objective):
        return None
    split = cfg.data.train_split
    instances = load_instances(cfg.data.root, split, cfg.data.images)
    if instances is None:
        log.warning("train.attention_supervision=%g: %s has no instances_%s.json with object boxes; training "
                    "without it", t.attention_supervision, cfg.data.root, split)
        return None
    with_boxes = sum(bool(instances.get(r.image_id)) for r in train_set.images)
    if not with_boxes:
        log.warning("train.attention_supervision=%g: none of the %d training images has a box in %s's "
                    "instances_%s.json; training without it", t.attention_supervision, len(train_set.images),
                    cfg.data.root, split)
        return None
    targets = GroundingTargets.for_encoder(train_set.images, instances, vocab, cfg.model.encoder)
    log.info("attention supervision (weight %g, form %s): %d of %d training images have boxes; words matched "
             "as %s", t.attention_supervision, t.attention_supervision_form, with_boxes, len(train_set.images),
             targets.table.name)
    return AttentionSupervision(targets, t.attention_supervision, t.attention_supervision_form, vocab.pad_id)


class ConceptGuide:
    """The concept-guide term of cross-entropy training (a ``LossTerm``, ``train.concept_guide``).

    For every target word that is a concept, the decoder's attention at the step that predicts it
    is pulled towards that concept's map in the image (KL divergence to the map, as box
    supervision's ``cross_entropy`` form; logged as ``concept_guide`` and ``concept_guided_words``).

    Args:
        head: the trained concept head (frozen here).
        vocab: the decoder's vocabulary (concept words outside it are never targets).
        weight: the term's weight.
        min_prob: a step is guided only where the head finds the concept in the image with at least
            this probability (a map of a concept it cannot see is noise).
        sharpness: the target is the map raised to this power, renormalised (1: the map itself).
    """

    name = "concept_guide"

    def __init__(self, head: ConceptHead, vocab: Vocabulary, weight: float, min_prob: float = 0.1,
                 sharpness: float = 1.0) -> None:
        self.head = head.eval().requires_grad_(False)
        self.weight = weight
        self.min_prob = min_prob
        self.sharpness = sharpness
        self.pad_id = vocab.pad_id
        table = torch.full((len(vocab),), -1, dtype=torch.long)  # vocab id -> concept index, -1: none
        for k, word in enumerate(head.words):
            if word in vocab.stoi:
                table[vocab.stoi[word]] = k
        self.table = table
        self.stats: dict[str, torch.Tensor] = {}

    def targets(self, features: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """features (B,N,D), target words (B,T) -> soft targets (B,T,N); all-zero rows are not guided."""
        with torch.no_grad():
            self.head.to(features.device)
            probs, maps = self.head.read(features)  # (B, K), (B, K, N)
            present = probs >= self.min_prob  # (B, K)
            k = self.table.to(words.device)[words]  # (B, T)
            guided = k >= 0
            kk = k.clamp(min=0)
            target = maps.gather(1, kk.unsqueeze(-1).expand(-1, -1, maps.shape[-1]))  # (B, T, N)
            if self.sharpness != 1.0:  # in log space: a sharp power of small values underflows
                target = torch.softmax(self.sharpness * target.clamp(min=1e-30).log(), dim=-1)
            keep = guided & present.gather(1, kk)  # (B, T)
            return target * keep.unsqueeze(-1).to(target.dtype)

    def __call__(self, output: DecoderOutput, batch: Any) -> torch.Tensor:
        if batch.x.dim() != 3:
            raise DataError("train.concept_guide needs cached region features (a frozen encoder and "
                            "data.feature_cache=true)")
        words = batch.tokens[:, 1:]  # (B, T-1)
        target = self.targets(batch.x, words)
        term = grounding_loss(output.attention, target, "cross_entropy")
        real = (words != self.pad_id).sum().clamp(min=1).to(term.words.dtype)
        self.stats = {"concept_guided_words": term.words / real}
        return term.loss


def build_concept_guide(cfg: Any, vocab: Vocabulary) -> ConceptGuide | None:
    """The ``train.concept_guide`` term of cross-entropy training, or None when it is off."""
    t = cfg.train
    if not t.concept_guide:
        return None
    if not _cross_entropy_only("train.concept_guide", t.objective):
        return None
    head = read_concepts(t.concepts, cfg.model.encoder, vocab)
    log.info("concept guide (weight %g, sharpness %g): %d concepts of %s", t.concept_guide,
             t.concept_guide_sharpness, head.size, t.concepts)
    return ConceptGuide(head, vocab, t.concept_guide, t.concept_guide_min_prob, t.concept_guide_sharpness)


def build_cross_entropy(cfg: Config, train_set: Any, vocab: Vocabulary) -> CrossEntropy:
    """``train.objective = "xe"``: teacher forcing with the decoder's regularisers, and the attention
    supervision by object boxes when ``train.attention_supervision`` asks for it (and boxes exist)."""
    terms = [build_attention_supervision(cfg, train_set, vocab), build_concept_guide(cfg, vocab)]
    return CrossEntropy.from_config(cfg.train, cfg.model.decoder, vocab.pad_id,
                                    extra_terms=[term for term in terms if term is not None])
