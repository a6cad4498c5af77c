"""The training objectives by ``train.objective`` name: chosen once, when a run is built.

The names are the config's (``captioner.config.schema.OBJECTIVES``, validated there); each maps
to a builder ``fn(cfg, train_set, vocab) -> Objective``. Adding an objective adds a class (an
:class:`captioner.training.objective.Objective`), its name in the config and a row here; the
training step does not change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from captioner.config import Config
from captioner.text import Vocabulary
from captioner.training.detectors import build_concept_guide
from captioner.training.grounding import build_attention_supervision
from captioner.training.objective import CrossEntropy, Objective
from captioner.training.scst import build_self_critical

ObjectiveBuilder = Callable[[Config, Any, Vocabulary], Objective]


def build_cross_entropy(cfg: Config, train_set: Any, vocab: Vocabulary) -> CrossEntropy:
    """``train.objective = "xe"``: teacher forcing with the decoder's regularisers, and the attention
    supervision by object boxes when ``train.attention_supervision`` asks for it (and boxes exist)."""
    terms = [build_attention_supervision(cfg, train_set, vocab), build_concept_guide(cfg, vocab)]
    return CrossEntropy.from_config(cfg.train, cfg.model.decoder, vocab.pad_id,
                                    extra_terms=[term for term in terms if term is not None])


BUILDERS: dict[str, ObjectiveBuilder] = {"xe": build_cross_entropy, "scst": build_self_critical}  # keys: OBJECTIVES


def build_objective(cfg: Config, train_set: Any, vocab: Vocabulary, device: torch.device) -> Objective:
    """The objective ``cfg.train.objective`` names, over the training set ``train_set``, on ``device``.

    Args:
        cfg: the run's config.
        train_set: the training ``CaptionSet`` (self-critical rewards read its references).
        vocab: the run's vocabulary.
        device: where the objective's buffers live.
    """
    return BUILDERS[cfg.train.objective](cfg, train_set, vocab).to(device)
