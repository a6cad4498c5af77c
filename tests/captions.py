"""A :class:`captioner.inference.Caption` built from plain arrays, as the inference pipeline returns one."""

from __future__ import annotations

import numpy as np
import torch

from captioner.inference import Caption


def make_caption(words, attention, box=None, all_attention=None, text=None, image_size=None) -> Caption:
    """The caption of ``words`` with (L, g, g) ``attention`` (and optional (L, layers, heads, g, g) maps)."""
    g = np.asarray(attention).shape[-1]
    return Caption(text if text is not None else " ".join(words), list(words), [], 0.0, (g, g),
                   torch.as_tensor(np.asarray(attention, dtype=np.float32)),
                   None if all_attention is None else torch.as_tensor(np.asarray(all_attention, dtype=np.float32)),
                   image_size=image_size, box=box)
