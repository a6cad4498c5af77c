"""Reading cache rows for training: one row per call, or a whole batch gathered in one copy.

Shape legend: B rows in a batch, N regions, D feature width.

Read row by row, a training batch of cached features is copied four times on the host: each row
out of the memory map (in a DataLoader worker), ``torch.stack`` of the rows (the collate), the
stacked batch into shared memory (to reach the main process), and into pinned memory (for the
device copy). At COCO scale (196 x 2048 values a row, 800 KB in float16) those copies keep the
training loop waiting. :func:`gather_stored` reads a batch's rows with one ``np.take`` straight
into the batch tensor, which inside a worker is allocated in shared memory up front (as torch's
default collate does), so the rows are copied once there and the batch crosses to the main
process as it is; only the pinned copy remains.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

_HELD = {"float16": torch.float16, "bfloat16": torch.int16}  # torch dtype the bits are gathered into


def empty_batch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor, in shared memory when called inside a DataLoader worker.

    ``tensor.share_memory_()`` would allocate a second buffer and copy into it; the storage is
    created shared instead, so the worker's result is sent to the main process without a copy.
    """
    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    storage = torch.UntypedStorage._new_shared(nbytes)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def gather_stored(rows: np.ndarray, index: np.ndarray, dtype: str) -> torch.Tensor:
    """Rows ``index`` (B,) of a cache's memory map as one (B, N, D) tensor of the stored dtype.

    The same tensor as ``torch.stack([stored_rows(rows[i], dtype) for i in index])``, bit for bit:
    float16, or bfloat16 from the map's raw uint16 bits. ``index`` must be in range (the caller
    checks it; ``mode="clip"`` also lets numpy write into ``out`` directly, where ``"raise"``
    would gather into a temporary buffer first).
    """
    index = np.asarray(index, dtype=np.intp)
    out = empty_batch((len(index), *rows.shape[1:]), _HELD[dtype])  # (B, N, D)
    np.take(rows, index, axis=0, out=out.numpy().view(rows.dtype), mode="clip")
    return out if dtype == "float16" else out.view(torch.bfloat16)


class StoredRows:
    """What ``FeatureCache.loader()`` returns; picklable for DataLoader workers (the map is reopened there).

    ``load(index)`` is one (N, D) row in the stored dtype (``FeatureCache.stored``);
    ``load.stack(indices)`` is the (B, N, D) batch of those rows, equal to
    ``torch.stack([load(i) for i in indices])`` but read in one copy (``FeatureCache.stored_batch``).
    The training loader fetches whole batches from a ``load`` that has ``stack``.
    """

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def __call__(self, index: int) -> torch.Tensor:
        return self.cache.stored(index)

    def stack(self, indices: Sequence[int]) -> torch.Tensor:
        return self.cache.stored_batch(indices)
