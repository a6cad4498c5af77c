"""PyTorch datasets over a ``CaptionSet`` and their collate functions.

Items refer to images by their index into ``cs.images``, so references and boxes can be looked up
after batching. ``x`` is pixels (3, S, S) from :func:`image_loader` or cached features (N, D).
:class:`SafeImages` gives batches that survive unreadable files (the caller raises or skips).

Shape legend: B items in a batch, b of them readable, S image side.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from captioner.data.coco import CaptionSet
from captioner.data.images import DEFAULT_MAX_PIXELS, load_image
from captioner.errors import ImageLoadError
from captioner.text import Vocabulary

log = logging.getLogger(__name__)


PAD_ID = Vocabulary.pad_id


class ImageLoader:
    """``index -> transform(load_image(cs.images[index].path))``; picklable; ``skip_bad`` gives None (warned) instead of raising."""

    def __init__(self, paths: Sequence[str | os.PathLike], transform: Callable[[Image.Image], torch.Tensor],
                 max_pixels: int | None = DEFAULT_MAX_PIXELS, skip_bad: bool = False) -> None:
        self.paths = list(paths)
        self.transform = transform
        self.max_pixels = max_pixels
        self.skip_bad = skip_bad
        self._reported: set[int] = set()

    def __call__(self, index: int) -> torch.Tensor | None:
        try:
            image = load_image(self.paths[index], max_pixels=self.max_pixels,
                               reduce_to=getattr(self.transform, "size", None))  # decode no more than it keeps
            return self.transform(image)  # (3, S, S)
        except ImageLoadError as exc:
            if not self.skip_bad:
                raise
            if index not in self._reported:  # once per file (and per DataLoader worker)
                self._reported.add(index)
                log.warning("skipping unreadable image (%s)", exc)
            return None

    def __len__(self) -> int:
        return len(self.paths)


def image_loader(cs: CaptionSet, transform: Callable[[Image.Image], torch.Tensor],
                 max_pixels: int | None = DEFAULT_MAX_PIXELS, skip_bad: bool = False) -> ImageLoader:
    """``load(index) -> Tensor (3, S, S)`` over ``cs.images``; ``skip_bad``: None for an unreadable image (dropped by collate)."""
    return ImageLoader([r.path for r in cs.images], transform, max_pixels, skip_bad)


class CaptionTrainDataset(Dataset):
    """One item per (image, caption) pair: ``(x, tokens LongTensor (T_i,), image_index)``.

    Captions are encoded once as ``[<bos>, w1 .. wn, <eos>]`` (at most ``max_len`` words) in one flat
    int32 array.
    """

    def __init__(self, cs: CaptionSet, vocab: Vocabulary, load: Callable[[int], torch.Tensor],
                 max_len: int) -> None:
        self.cs = cs
        self.load = load
        self.max_len = max_len
        image_index: list[int] = []
        flat: list[int] = []
        offsets = [0]
        for index, record in enumerate(cs.images):
            for caption in cs.captions[record.image_id]:
                ids = vocab.encode(caption, max_len)
                flat.extend(ids)
                offsets.append(len(flat))
                image_index.append(index)
        self.tokens = np.asarray(flat, dtype=np.int32)  # (sum of T_i,)
        self.offsets = np.asarray(offsets, dtype=np.int64)  # (num_captions + 1,)
        self.image_index = np.asarray(image_index, dtype=np.int64)  # (num_captions,)

    def __len__(self) -> int:
        return len(self.image_index)

    @property
    def lengths(self) -> np.ndarray:
        """Token count of every item (``<bos>`` and ``<eos>`` included), e.g. for length bucketing."""
        return np.diff(self.offsets)

    def __getitem__(self, item: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        start, end = self.offsets[item], self.offsets[item + 1]
        tokens = torch.from_numpy(self.tokens[start:end].astype(np.int64))  # (T_i,)
        index = int(self.image_index[item])
        return self.load(index), tokens, index


class CaptionBatchDataset(Dataset):
    """Whole training batches of a ``CaptionTrainDataset`` whose ``load`` has ``stack``.

    ``batches[items]`` equals ``collate_captions([dataset[i] for i in items])`` bit for bit, with ``x``
    from one ``load.stack`` call. Use in a ``DataLoader`` with ``batch_size=None``.
    """

    def __init__(self, dataset: CaptionTrainDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, items: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ds = self.dataset
        items = np.asarray(items, dtype=np.int64)  # (B,)
        images = ds.image_index[items]  # (B,)
        starts, ends = ds.offsets[items], ds.offsets[items + 1]
        tokens = np.full((len(items), int((ends - starts).max())), PAD_ID, dtype=np.int64)  # (B, T_max)
        for row, (start, end) in enumerate(zip(starts, ends)):
            tokens[row, :end - start] = ds.tokens[start:end]
        return ds.load.stack(images.tolist()), torch.from_numpy(tokens), torch.from_numpy(images)


class CaptionEvalDataset(Dataset):
    """One item per image: ``(load(index), image_index)``; references come from ``cs``."""

    def __init__(self, cs: CaptionSet, load: Callable[[int], torch.Tensor]) -> None:
        self.cs = cs
        self.load = load

    def __len__(self) -> int:
        return len(self.cs.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.load(index), index


def collate_captions(
    batch: Sequence[tuple[torch.Tensor | None, torch.Tensor, int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``x (B, ...)``, tokens right-padded with ``<pad>`` (B, T_max), ``image_index (B,)``; None items dropped.

    ``None`` when every item was dropped.
    """
    batch = [item for item in batch if item[0] is not None]
    if not batch:
        return None
    xs, token_lists, indices = zip(*batch)
    x = torch.stack(xs)  # (B, ...)
    t_max = max(len(t) for t in token_lists)
    tokens = torch.full((len(batch), t_max), PAD_ID, dtype=torch.long)  # (B, T_max)
    for row, t in enumerate(token_lists):
        tokens[row, : len(t)] = t
    return x, tokens, torch.tensor(indices, dtype=torch.long)  # (B,)


def collate_images(batch: Sequence[tuple[torch.Tensor | None, int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``x (B, ...)`` and ``image_index (B,)``, None items dropped; ``None`` when nothing is left."""
    batch = [item for item in batch if item[0] is not None]
    if not batch:
        return None
    xs, indices = zip(*batch)
    return torch.stack(xs), torch.tensor(indices, dtype=torch.long)  # (B, ...), (B,)


class SafeImages(Dataset):
    """Items ``(pixels or None, index, error or None)``: an unreadable image never kills a batch, even in workers."""

    def __init__(self, load: Callable[[int], torch.Tensor], count: int) -> None:
        self.load, self.count = load, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor | None, int, str | None]:
        try:
            return self.load(index), index, None
        except ImageLoadError as exc:
            return None, index, str(exc)


def collate_safe(batch: list[tuple[torch.Tensor | None, int, str | None]]
                 ) -> tuple[torch.Tensor | None, list[int], list[str | None]]:
    """-> (pixels of the readable images (b, ...) or None, indices (B), error per item or None)."""
    pixels = [x for x, _, _ in batch if x is not None]
    return (torch.stack(pixels) if pixels else None), [i for _, i, _ in batch], [e for _, _, e in batch]


def prefetched_batches(data: Dataset, batch_size: int, threads: int = 2) -> Iterator[Any]:
    """Batches of ``data`` (``collate_safe``), in order, read ahead by ``threads`` threads (no worker processes)."""
    starts = range(0, len(data), batch_size)
    if not starts:
        return
    with ThreadPoolExecutor(threads) as pool:
        def submit(start: int) -> list[Future]:
            return [pool.submit(data.__getitem__, i) for i in range(start, min(start + batch_size, len(data)))]

        pending = submit(starts[0])
        for k in range(len(starts)):
            batch = [f.result() for f in pending]
            if k + 1 < len(starts):
                pending = submit(starts[k + 1])
            yield collate_safe(batch)


def check_batch_errors(errors: list[str | None], skip_bad: bool, what: str) -> None:
    """Raise ``ImageLoadError`` for the first error unless ``skip_bad``; then log each skipped image."""
    bad = [e for e in errors if e is not None]
    if bad and not skip_bad:
        raise ImageLoadError(bad[0])
    for message in bad:
        log.warning("%s: skipping unreadable image (%s)", what, message)
