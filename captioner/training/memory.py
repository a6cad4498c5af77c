"""Small datasets held in memory: one tensor per split, batches cut by indexing.

Shape legend: C images, B batch, N regions, D feature width, S image side, T tokens.

When a split's cached features, or (training the encoder) its resized uint8 pixels, take at most
``data.in_memory_mb``, training keeps them in one tensor: every image is decoded once, and a batch
is one gather instead of B ``__getitem__`` calls and a collate. The batches are exactly the ones
the ``DataLoader`` path gives (same sampler, same order, same padding, bit-identical values), so
switching between the two paths never changes a run. Features are the one difference in form: the
``DataLoader`` carries them in the cache's stored float16/bfloat16 and ``model_input`` widens them
on the device, while the store (on the GPU in a CUDA run) widens its gathered rows itself; both
give the model the same float32 values.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler
from tqdm import tqdm

from captioner.data.images import DEFAULT_MAX_PIXELS, load_image
from captioner.errors import ImageLoadError
from captioner.features.dtype import stored_rows

log = logging.getLogger(__name__)

MIB = 1024 * 1024


class MemoryStore:
    """A split's inputs as one tensor, row i = ``caption_set.images[i]``.

    Args:
        rows: (C, N, D) features (any float dtype) or (C, 3, S, S) uint8 pixels.
        normalize: uint8 pixels -> float input (``ImageTransform.normalize``); None for features.
    """

    def __init__(self, rows: torch.Tensor, normalize: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.rows = rows
        self.normalize = normalize

    def __len__(self) -> int:
        return self.rows.shape[0]

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        """Inputs of the images ``index`` (B,) as float32 (B, ...), as the model receives them (stored
        float16/bfloat16 features widened exactly, where the rows live: on the GPU in a CUDA run)."""
        x = self.rows.index_select(0, index.to(self.rows.device))
        return self.normalize(x) if self.normalize is not None else x.float()

    def to(self, device: torch.device) -> "MemoryStore":
        """Move the rows to ``device`` (a GPU then gathers batches with no host-to-device copy)."""
        self.rows = self.rows.to(device)
        return self

    def __call__(self, index: int) -> torch.Tensor:
        """One image's input (the ``load(index)`` contract of the caption datasets)."""
        return self.gather(torch.tensor([int(index)]))[0].cpu()


def features_in_memory(cache: Any, limit_mb: float, what: str) -> MemoryStore | None:
    """A complete ``FeatureCache`` as a ``MemoryStore`` when it fits under ``limit_mb`` (else None)."""
    nbytes = cache.count * cache.num_regions * cache.dim * np.dtype(cache.features.dtype).itemsize
    if limit_mb <= 0 or nbytes > limit_mb * MIB or not bool(cache.valid.all()):
        return None
    rows = stored_rows(cache.features, cache.dtype)  # one read of the whole map: float16, or bfloat16 (not its bits)
    log.info("%s: holding %d images' features in memory (%.0f MiB)", what, cache.count, nbytes / MIB)
    return MemoryStore(rows)


def pixels_in_memory(cs: Any, transform: Any, limit_mb: float, what: str, progress: bool = False) -> MemoryStore | None:
    """Every image of ``cs`` decoded once and resized, as uint8 in memory, when it fits (else None).

    An unreadable image returns None too: the streaming path then reports (or skips) it exactly
    as it would have without this one.
    """
    side = transform.size
    nbytes = len(cs.images) * 3 * side * side
    if limit_mb <= 0 or nbytes > limit_mb * MIB or not len(cs.images):
        return None
    rows = torch.empty(len(cs.images), 3, side, side, dtype=torch.uint8)
    bar = tqdm(cs.images, desc=f"decoding {what}", unit="img", leave=False, disable=not progress or None)
    try:
        for i, record in enumerate(bar):
            rows[i] = transform.pixels(load_image(record.path, max_pixels=DEFAULT_MAX_PIXELS))
    except ImageLoadError as exc:
        log.debug("%s: not holding the images in memory (%s)", what, exc)
        return None
    finally:
        bar.close()
    log.info("%s: holding %d decoded images in memory (%.0f MiB)", what, len(cs.images), nbytes / MIB)
    return MemoryStore(rows, transform.normalize)


class MemoryBatches:
    """The training batches of one epoch from a ``MemoryStore``: what ``DataLoader`` + ``collate_captions`` give.

    Args:
        dataset: a ``CaptionTrainDataset`` (its token arrays and image index are read).
        store: the inputs of ``dataset``'s images.
        sampler: the epoch's caption order (a ``DistributedSampler``, possibly skipping batches).
        batch_size: captions per batch (the last one may be smaller).
    """

    def __init__(self, dataset: Any, store: MemoryStore, sampler: Sampler[int], batch_size: int) -> None:
        self.store = store
        self.sampler = sampler
        self.batch_size = batch_size
        self.image_index = torch.from_numpy(dataset.image_index)  # (num_captions,)
        self.padded, self.lengths = padded_tokens(dataset)

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        order = torch.tensor(list(self.sampler), dtype=torch.long)
        for start in range(0, len(order), self.batch_size):
            items = order[start:start + self.batch_size]  # (B,)
            images = self.image_index.index_select(0, items)  # (B,)
            width = int(self.lengths.index_select(0, items).max())
            tokens = self.padded.index_select(0, items)[:, :width]  # (B, T_max) right-padded with <pad>
            yield self.store.gather(images), tokens, images


def padded_tokens(dataset: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Every caption of a ``CaptionTrainDataset`` right-padded with 0: (num_captions, T_max) int64, lengths."""
    lengths = np.diff(dataset.offsets)  # (num_captions,)
    padded = np.zeros((len(lengths), int(lengths.max()) if len(lengths) else 1), dtype=np.int64)
    columns = np.arange(padded.shape[1])
    fill = columns[None, :] < lengths[:, None]  # (num_captions, T_max)
    padded[fill] = dataset.tokens  # row-major order of ``fill`` is caption by caption, word by word
    return torch.from_numpy(padded), torch.from_numpy(lengths)


class MemoryEvalBatches:
    """Validation batches ``(x (B, ...), image_index (B,))`` in dataset order from a ``MemoryStore``.

    Args:
        store: inputs of the images.
        indices: which rows, in order (a rank's shard under torchrun).
        batch_size: images per batch.
    """

    def __init__(self, store: MemoryStore, indices: list[int], batch_size: int) -> None:
        self.store, self.indices, self.batch_size = store, torch.tensor(indices, dtype=torch.long), batch_size

    def __len__(self) -> int:
        return math.ceil(len(self.indices) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, len(self.indices), self.batch_size):
            index = self.indices[start:start + self.batch_size]
            yield self.store.gather(index), index
