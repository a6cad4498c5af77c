"""Image batches that survive unreadable files: the caller decides whether to raise or skip.

Used to encode images for the feature cache (:mod:`captioner.features.cache`) and by
``captioner evaluate``. Shape legend: B items in a batch, b of them readable, S image side.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.utils.data import Dataset

from captioner.errors import ImageLoadError

__all__ = ["SafeImages", "check_batch_errors", "collate_safe"]

log = logging.getLogger(__name__)


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


def check_batch_errors(errors: list[str | None], skip_bad: bool, what: str) -> None:
    """Raise ``ImageLoadError`` for the first error unless ``skip_bad``; then log each skipped image."""
    bad = [e for e in errors if e is not None]
    if bad and not skip_bad:
        raise ImageLoadError(bad[0])
    for message in bad:
        log.warning("%s: skipping unreadable image (%s)", what, message)
