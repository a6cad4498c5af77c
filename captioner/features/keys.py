"""Feature-cache keys and file names: what decides a cache's content, hashed.

A cache file is named ``<set name>_<split>_<key[:16]>.feats`` (:func:`cache_path`), where the key
(:func:`cache_key`) hashes the encoder configuration, the ordered image list (plus size and mtime
of a sample of the images) and, for randomly initialised encoders, the encoder's weights. A cache
whose key differs from the one expected is stale (:mod:`captioner.features.cache`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from captioner.config import ModelConfig

__all__ = ["FORMAT_VERSION", "SUFFIX", "cache_key", "cache_path"]

FORMAT_VERSION = 1  # of float16 caches, and part of every cache_key (bfloat16 caches are version 2)
SUFFIX = ".feats"


def cache_key(model_config: ModelConfig, caption_set: Any, encoder: nn.Module | None = None) -> str:
    """Hash of everything that decides the cached features.

    Args:
        model_config: its encoder part counts (name, weights, pretrained, grid, width, image size,
            resize, mean/std, interpolation); the decoder part does not.
        caption_set: a ``CaptionSet``; its ordered image list (ids and paths) counts, plus size
            and mtime of up to 64 evenly spaced images, so regenerated images invalidate the cache.
        encoder: when given, its weights are hashed too (needed for randomly initialised encoders).

    Returns:
        A hex SHA-256 digest.
    """
    enc = model_config.encoder
    h = hashlib.sha256()
    conf = {
        "format": FORMAT_VERSION,
        "encoder": {k: getattr(enc, k) for k in ("name", "weights", "pretrained", "grid", "width", "image_size",
                                                   "resize", "interpolation")},
        "mean": list(enc.mean),
        "std": list(enc.std),
    }
    h.update(json.dumps(conf, sort_keys=True).encode())
    images = caption_set.images
    for rec in images:
        h.update(f"{rec.image_id}\t{Path(rec.path).resolve()}\n".encode())
    step = max(1, len(images) // 64)
    for rec in images[::step]:
        try:
            st = os.stat(rec.path)
            h.update(f"{st.st_size}:{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(b"missing\n")
    if encoder is not None:
        for name, tensor in sorted(encoder.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def cache_path(cache_dir: str | os.PathLike, caption_set: Any, key: str) -> Path:
    """``<cache_dir>/<set name>_<split>_<key[:16]>.feats``."""
    name = f"{caption_set.name}_{caption_set.split}".replace(os.sep, "_").replace(" ", "_")
    return Path(cache_dir) / f"{name}_{key[:16]}{SUFFIX}"
