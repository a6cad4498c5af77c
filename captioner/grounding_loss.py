"""Attention supervision from object boxes (Liu et al. 2017, "Attention Correctness in Neural Image
Captioning"): the term that pulls a word's attention onto the box of the object it names.

Shape legend: B batch, T caption steps, N regions.

``coverage`` (B, T, N) holds, for each target word that names an object, each region's share of
area inside that object's box (``captioner.data.grounding.box_coverage``), and zeros for every
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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from captioner.errors import ConfigError

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
