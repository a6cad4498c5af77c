"""Training objectives as objects: one call, ``objective.loss(model, batch) -> LossResult``.

Shape legend: B batch rows (caption items), T caption steps (with ``<bos>``/``<eos>``), N regions,
D feature width, V vocabulary.

The training step (:mod:`captioner.training.step`) never asks which objective it holds: it calls
``loss``, backpropagates ``LossResult.total``, logs ``LossResult.objective`` and ``terms``, and
weighs them by ``LossResult.captions``. An objective's ``state_dict`` (e.g. the REINFORCE moving
averages of hard attention) is saved in ``train_state.pt`` under ``"criterion"``.

* :class:`CrossEntropy` (``train.objective = "xe"``): teacher forcing on the batch's reference
  captions, scored by :class:`captioner.losses.CaptionLoss`, plus any :class:`LossTerm` added to it.
* :class:`captioner.training.scst.SelfCritical` (``train.objective = "scst"``): sampled captions,
  rewarded.

Which objective a run trains with is chosen once, when the run is built
(:func:`captioner.training.objectives.build_objective`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import nn

from captioner.config import DecoderConfig, TrainConfig
from captioner.losses import CaptionLoss, LossResult
from captioner.models.base import CaptionDecoder, DecoderOutput


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
    :class:`captioner.losses.CaptionLoss` (whose buffers and ``state_dict`` it has) and any extra
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
