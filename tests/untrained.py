"""Untrained models made usable by tests that caption with them."""

from __future__ import annotations

import torch

from captioner.text import Vocabulary


def never_eos_first(model: torch.nn.Module, vocab: Vocabulary) -> torch.nn.Module:
    """``model`` with its output layers' ``<eos>`` bias at -30, so an untrained decoder always writes a word
    (an empty caption is an error, which the tests that use this do not test); returns ``model``."""
    with torch.no_grad():
        for module in model.decoder.modules():
            if isinstance(module, torch.nn.Linear) and module.out_features == len(vocab) and module.bias is not None:
                module.bias[vocab.eos_id] = -30.0
    return model
