"""Training inputs: caption sets, vocabulary, feature caches and DataLoaders.

Shape legend: C images, B batch, N regions, D feature width, S image side, T tokens.

With a frozen encoder and ``data.feature_cache`` the datasets yield cached region features (N, D);
otherwise pixels (3, S, S), and the encoder runs in the training step. The order is a
``DistributedSampler`` seeded with ``train.seed + epoch``, so a resume recreates it and K processes
see the same global batches as one. A split that fits ``data.in_memory_mb`` is held as one tensor
(:class:`MemoryStore`) whose batches are bit for bit those of the ``DataLoader`` path.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Sampler, Subset
from tqdm import tqdm

from captioner.checkpoint.remote import cache_root
from captioner.config import Config
from captioner.data.caption_set import check_images
from captioner.data.coco import load_caption_set, load_validation_set
from captioner.data.dataset import (CaptionBatchDataset, CaptionEvalDataset, CaptionTrainDataset, collate_captions,
                                    collate_images, image_loader)
from captioner.data.images import DEFAULT_MAX_PIXELS, ImageTransform, load_image
from captioner.device import DistInfo, barrier
from captioner.errors import ConfigError, DataError, ImageLoadError
from captioner.features.cache import get_feature_cache
from captioner.features.dtype import stored_rows
from captioner.models.model import CaptionModel
from captioner.models.registry import resolve_encoder
from captioner.text import Vocabulary

log = logging.getLogger(__name__)


MIB = 1024 * 1024


class MemoryStore:
    """A split's inputs as one tensor, row i = ``caption_set.images[i]``.

    ``rows``: (C, N, D) features or (C, 3, S, S) uint8 pixels; ``normalize``: uint8 -> float input (None for features).
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
    """Every image of ``cs`` decoded once and resized, as uint8 in memory, when it fits and all are readable (else None)."""
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
    """One epoch's training batches cut from a ``MemoryStore``: what ``DataLoader`` + ``collate_captions`` give."""

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
    """Validation batches ``(x (B, ...), image_index (B,))`` of rows ``indices`` of a ``MemoryStore``."""

    def __init__(self, store: MemoryStore, indices: list[int], batch_size: int) -> None:
        self.store, self.indices, self.batch_size = store, torch.tensor(indices, dtype=torch.long), batch_size

    def __len__(self) -> int:
        return math.ceil(len(self.indices) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, len(self.indices), self.batch_size):
            index = self.indices[start:start + self.batch_size]
            yield self.store.gather(index), index


# Feature-cache building and validation run without gradients: they batch at least this many images
# even when the training batch is smaller (memory allows it, and small batches waste the encoder).
MIN_INFERENCE_BATCH = 32


@dataclass
class TrainData:
    """Everything the loop reads from disk."""

    train_set: Any
    val_set: Any
    vocab: Vocabulary  # the vocabulary (from the training captions, or from the run folder on resume)
    train_dataset: Dataset  # one item per training caption -> (x, tokens, image_index)
    val_dataset: Dataset  # one item per validation image -> (x, image_index)
    on_features: bool  # True when ``x`` is cached region features, False for pixels
    train_store: Any = None  # MemoryStore of the training images' inputs (``data.in_memory_mb``), or None
    val_store: Any = None  # the same for validation


def load_caption_sets(cfg: Config) -> tuple[Any, Any]:
    """Load and check the training and validation caption sets (before any training starts)."""
    d = cfg.data
    train_set = check_images(load_caption_set(d.root, d.train_split, d.images, files_outside=d.files_outside),
                             skip_missing=d.skip_missing)
    val_set = check_images(load_validation_set(d.root, d.val_split, d.images, d.files_outside),
                           skip_missing=d.skip_missing)
    if len(train_set) == 0:
        raise DataError(f"{d.root}: the {d.train_split!r} split has no usable images")
    if len(val_set) == 0:
        raise DataError(f"{d.root}: the {val_set.split!r} split has no usable images")
    cap = cfg.train.val_max_images
    if cap is not None and cap < len(val_set):
        if cap < 1:
            raise ConfigError(f"train.val_max_images must be >= 1 or null, got {cap}")
        val_set = val_set.subset(range(cap))
    return train_set, val_set


def training_vocabulary(train_set: Any, min_freq: int, max_caption_len: int | None = None) -> Vocabulary:
    """The words seen at least ``min_freq`` times in the first ``max_caption_len`` words of each training caption."""
    return Vocabulary.build(train_set.all_captions(), min_freq=min_freq, max_len=max_caption_len)


def load_or_build_vocab(train_set: Any, min_freq: int, run_dir: Path, resume: bool,
                        max_caption_len: int | None = None) -> Vocabulary:
    """The run's vocabulary: reused from ``run_dir/vocab.json`` on resume, else :func:`training_vocabulary`."""
    path = run_dir / "vocab.json"
    if resume and path.exists():
        return Vocabulary.load(path)
    vocab = training_vocabulary(train_set, min_freq, max_caption_len)
    if len(vocab) < 5:
        raise DataError(f"the training captions give a vocabulary of {len(vocab) - 4} words (min_freq={min_freq})")
    return vocab


class Remap:
    """``load(i) = base(index[i])`` over the images whose cached features are valid (picklable; ``stack`` kept)."""

    def __init__(self, base: Callable[[int], torch.Tensor], index: list[int]) -> None:
        self.base, self.index = base, index

    def __len__(self) -> int:
        return len(self.index)

    def __call__(self, i: int) -> torch.Tensor:
        return self.base(self.index[i])

    def stack(self, items: list[int]) -> torch.Tensor:
        return self.base.stack([self.index[i] for i in items])  # type: ignore[attr-defined]


def gathers_batches(load: Any) -> bool:
    """Whether ``load`` reads a batch's rows in one call (``load.stack(indices)``): a feature cache's."""
    if isinstance(load, Remap):
        return gathers_batches(load.base)
    return callable(getattr(load, "stack", None))


def _whole_batch(batch: Any) -> Any:
    """The collate of a loader over ``CaptionBatchDataset``: its items are batches already."""
    return batch


def _cached_loader(model: CaptionModel, cfg: Config, cs: Any, cache_dir: Path, info: DistInfo,
                   progress: bool) -> tuple[Callable[[int], torch.Tensor], Any, Any]:
    """Feature loader for ``cs`` (built by rank 0, opened by the others after a barrier), the
    caption set it serves, and a ``MemoryStore`` of the features when they fit in memory."""
    kwargs = dict(batch_size=max(cfg.train.batch_size, MIN_INFERENCE_BATCH), device=info.device,
                  skip_bad=cfg.data.skip_missing,
                  progress=progress and info.is_main, num_workers=cfg.data.num_workers)
    transform = ImageTransform(resolve_encoder(cfg.model.encoder))
    if info.is_main:
        cache = get_feature_cache(cfg.model, model.encoder, cs, transform, cache_dir, **kwargs)
    barrier(info)
    if not info.is_main:
        cache = get_feature_cache(cfg.model, model.encoder, cs, transform, cache_dir, lock_timeout=600.0, **kwargs)
    valid = cache.valid_indices()
    if len(valid) == cache.count:
        store = features_in_memory(cache, cfg.data.in_memory_mb, f"{cs.split} split")
        return (store or cache.loader()), cs, store
    if not valid:
        raise DataError(f"{cs.split}: no image could be loaded")
    log.warning("%s: training without %d unreadable images", cs.split, cache.count - len(valid))
    return Remap(cache.loader(), valid), cs.subset(valid), None


def feature_cache_dir(cfg: Config, default: Path) -> Path:
    """Where feature caches live: ``data.feature_cache_dir``, else ``$CAPTIONER_FEATURE_CACHE``, else (with
    ``data.shared_feature_cache``) ``<cache root>/features``, else ``default`` (the run's ``features/``)."""
    chosen = cfg.data.feature_cache_dir or os.environ.get("CAPTIONER_FEATURE_CACHE")
    if chosen:
        return Path(chosen)
    return cache_root() / "features" if cfg.data.shared_feature_cache else Path(default)


def prepare_data(cfg: Config, model: CaptionModel, vocab: Vocabulary, train_set: Any, val_set: Any,
                 run_dir: Path, info: DistInfo, progress: bool) -> TrainData:
    """Datasets over cached features (frozen encoder + ``data.feature_cache``) or over pixels.

    Caches live in ``data.feature_cache_dir``, else ``$CAPTIONER_FEATURE_CACHE``, else (with
    ``data.shared_feature_cache``) the cache root's ``features/``, else ``run_dir/features``. On pixels
    with ``data.skip_missing`` an unreadable image is dropped from its batch with a warning.
    """
    on_features = bool(cfg.data.feature_cache and not cfg.model.encoder.fine_tune)
    if on_features:
        cache_dir = feature_cache_dir(cfg, run_dir / "features")
        train_load, train_set, train_store = _cached_loader(model, cfg, train_set, cache_dir, info, progress)
        val_load, val_set, val_store = _cached_loader(model, cfg, val_set, cache_dir, info, progress)
    else:
        transform = ImageTransform(resolve_encoder(cfg.model.encoder))
        skip = cfg.data.skip_missing
        limit = cfg.data.in_memory_mb
        train_store = pixels_in_memory(train_set, transform, limit, f"{train_set.split} split", progress and info.is_main)
        val_store = pixels_in_memory(val_set, transform, limit, f"{val_set.split} split", progress and info.is_main)
        train_load = train_store or image_loader(train_set, transform, skip_bad=skip)
        val_load = val_store or image_loader(val_set, transform, skip_bad=skip)
    if info.device.type == "cuda":  # batches are then gathered on the GPU itself
        train_store, val_store = (s.to(info.device) if s is not None else None for s in (train_store, val_store))
    train_ds = CaptionTrainDataset(train_set, vocab, train_load, cfg.data.max_caption_len)
    val_ds = CaptionEvalDataset(val_set, val_load)
    return TrainData(train_set, val_set, vocab, train_ds, val_ds, on_features, train_store, val_store)


class LengthBuckets(Sampler[int]):
    """Another sampler's indices, reordered so that each batch holds captions of similar length.

    The base order is cut into pools of ``batch_size * pool_batches``, each sorted by length and cut
    into batches, shuffled by ``seed``: every caption once per epoch, with less padding.
    """

    def __init__(self, base: Sampler[int], lengths: Any, batch_size: int, pool_batches: int, seed: int) -> None:
        self.base, self.lengths = base, lengths
        self.batch_size, self.pool = batch_size, batch_size * pool_batches
        self.seed = seed

    def __iter__(self) -> Iterator[int]:
        order = list(self.base)
        gen = torch.Generator().manual_seed(self.seed)
        for start in range(0, len(order), self.pool):
            pool = sorted(order[start:start + self.pool], key=lambda i: int(self.lengths[i]))
            batches = [pool[b:b + self.batch_size] for b in range(0, len(pool), self.batch_size)]
            for b in torch.randperm(len(batches), generator=gen).tolist():
                yield from batches[b]

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]


class SkipSampler(Sampler[int]):
    """Drop the first ``skip`` indices of another sampler (resuming in the middle of an epoch)."""

    def __init__(self, base: Sampler[int], skip: int) -> None:
        self.base, self.skip = base, skip

    def __iter__(self) -> Iterator[int]:
        for i, index in enumerate(self.base):
            if i >= self.skip:
                yield index

    def __len__(self) -> int:
        return max(0, len(self.base) - self.skip)  # type: ignore[arg-type]


def rank_batch_size(batch_size: int, info: DistInfo) -> int:
    """Per-process batch: ``train.batch_size`` is the global batch, split evenly over ranks."""
    if batch_size % info.world_size:
        raise ConfigError(f"train.batch_size={batch_size} is not divisible by the {info.world_size} processes")
    return batch_size // info.world_size


def train_loader(dataset: Dataset, cfg: Config, epoch: int, info: DistInfo, skip_batches: int = 0,
                 store: Any = None) -> Any:
    """The epoch's training batches, order fixed by ``train.seed + epoch`` and sharded by rank.

    Over a feature cache whole batches are read in one copy. ``skip_batches``: batches of this epoch
    already done (mid-epoch resume). ``store``: a ``MemoryStore`` giving the same batches from memory.
    """
    batch = rank_batch_size(cfg.train.batch_size, info)
    sampler: Sampler[int] = DistributedSampler(dataset, num_replicas=info.world_size, rank=info.rank,
                                               shuffle=True, seed=cfg.train.seed, drop_last=False)
    sampler.set_epoch(epoch)
    if cfg.train.length_buckets:
        sampler = LengthBuckets(sampler, dataset.lengths, batch, cfg.train.length_buckets, cfg.train.seed + epoch)
    if skip_batches:
        sampler = SkipSampler(sampler, skip_batches * batch)
    if store is not None:
        return MemoryBatches(dataset, store, sampler, batch)
    # The loader's own generator (worker seeds) is seeded too, so it never draws from the global RNG.
    gen = torch.Generator().manual_seed(cfg.train.seed + epoch)
    pin = info.device.type == "cuda"
    if gathers_batches(getattr(dataset, "load", None)):
        return DataLoader(CaptionBatchDataset(dataset), batch_size=None,
                          sampler=BatchSampler(sampler, batch, drop_last=False), collate_fn=_whole_batch,
                          num_workers=cfg.data.num_workers, pin_memory=pin, generator=gen)
    return DataLoader(dataset, batch_size=batch, sampler=sampler, collate_fn=collate_captions,
                      num_workers=cfg.data.num_workers, pin_memory=pin, generator=gen)


def val_loader(dataset: Dataset, cfg: Config, info: DistInfo, store: Any = None,
               indices: list[int] | None = None) -> Any:
    """Validation images in dataset order (``indices``: a rank's shard), from ``store`` when given."""
    if store is not None:
        return MemoryEvalBatches(store, list(range(len(store))) if indices is None else indices,
                                 max(cfg.train.batch_size, MIN_INFERENCE_BATCH))
    if indices is not None:
        dataset = Subset(dataset, indices)
    return DataLoader(dataset, batch_size=max(cfg.train.batch_size, MIN_INFERENCE_BATCH), shuffle=False,
                      collate_fn=collate_images,
                      num_workers=cfg.data.num_workers, pin_memory=info.device.type == "cuda")
