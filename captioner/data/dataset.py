"""PyTorch datasets over a ``CaptionSet`` and their collate functions.

Items refer to images by their index into ``cs.images`` so that references and boxes can be
looked up after batching. ``x`` is whatever ``load(index)`` returns: pixels (3, S, S) from
:func:`image_loader` or cached region features (N, D); the datasets do not care.

Image batches that survive unreadable files: the caller decides whether to raise or skip.

Used to encode images for the feature cache (:mod:`captioner.features.cache`) and by
``captioner evaluate``. Shape legend: B items in a batch, b of them readable, S image side.
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
    """``index -> transform(load_image(cs.images[index].path))``; picklable for DataLoader workers.

    With ``skip_bad`` an unreadable image gives ``None`` (and one warning naming the file) instead
    of an ``ImageLoadError``; the collate functions drop such items, so a bad file found in the
    middle of an epoch costs one batch item, not the run.
    """

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
    """A callable mapping an index into ``cs.images`` to the transformed image tensor.

    Args:
        cs: the caption set whose images are loaded.
        transform: e.g. :class:`captioner.data.images.ImageTransform`.
        max_pixels: passed to :func:`load_image`.
        skip_bad: return ``None`` for an unreadable image (logged once) instead of raising; the
            collate functions drop those items (``data.skip_missing`` in training).

    Returns:
        ``load(index) -> Tensor (3, S, S)``; raises ``ImageLoadError`` for a bad file unless
        ``skip_bad``.
    """
    return ImageLoader([r.path for r in cs.images], transform, max_pixels, skip_bad)


class CaptionTrainDataset(Dataset):
    """One item per (image, caption) pair: ``(x, tokens LongTensor (T_i,), image_index)``.

    Captions are encoded once, up front, as ``[<bos>, w1 .. wn, <eos>]`` with at most ``max_len``
    words, and kept in one flat int32 array (COCO's 590k captions stay small).

    Args:
        cs: the caption set.
        vocab: vocabulary used to encode the captions.
        load: ``index -> x``, e.g. from :func:`image_loader`.
        max_len: maximum number of words per caption.
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
    """Whole training batches of a ``CaptionTrainDataset`` whose ``load`` gathers many rows at once.

    ``batches[items]`` (``items``: the caption indices of one batch, e.g. from a ``BatchSampler``) is
    ``collate_captions([dataset[i] for i in items])``, bit for bit: ``x (B, ...)`` from one
    ``dataset.load.stack(image indices)`` call (a feature cache reads the rows from its memory map in
    one copy, into shared memory inside a DataLoader worker: ``captioner.features.cache``), tokens
    ``(B, T_max)`` right-padded with ``<pad>``, and ``image_index (B,)``. Use it in a ``DataLoader``
    with ``batch_size=None``.

    Args:
        dataset: the caption dataset; ``dataset.load.stack(indices) -> (B, ...)`` must equal
            ``torch.stack([dataset.load(i) for i in indices])``.
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
    """One item per image: ``(x, image_index)``; references come from ``cs``.

    Args:
        cs: the caption set.
        load: ``index -> x``, e.g. from :func:`image_loader`.
    """

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
    """Stack ``x``, right-pad tokens with ``<pad>`` (0); items whose ``x`` is ``None`` are dropped.

    Returns:
        ``x (B, ...)``, ``tokens (B, T_max)`` LongTensor, ``image_index (B,)`` LongTensor; ``None``
        when every item was dropped (unreadable images with ``skip_bad``).
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
    """Stack ``x``; returns ``x (B, ...)`` and ``image_index (B,)`` LongTensor.

    Items whose ``x`` is ``None`` are dropped; ``None`` when nothing is left.
    """
    batch = [item for item in batch if item[0] is not None]
    if not batch:
        return None
    xs, indices = zip(*batch)
    return torch.stack(xs), torch.tensor(indices, dtype=torch.long)  # (B, ...), (B,)


class SafeImages(Dataset):
    """Items ``(pixels or None, index, error or None)``: an unreadable image never kills a batch.

    The caller decides what an error means (raise, or skip the image), also with DataLoader workers,
    whose exceptions would otherwise reach the main process wrapped in a traceback.
    """

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
    """``DataLoader(data, batch_size, collate_fn=collate_safe)`` without worker processes: ``threads``
    threads read the next batch while the caller works on the current one (PIL releases the GIL
    while it decodes and resizes). At most two batches are held; items come in order."""
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
