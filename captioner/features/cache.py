"""On-disk cache of encoder region features for training a decoder over a frozen encoder.

Shape legend: C images in the cache, N regions (grid*grid), D feature width.

One cache file holds the features of every image of a caption set, row ``i`` belonging to
``caption_set.images[i]``::

    [ C*N*D 2-byte values ][ JSON trailer ][ trailer length: uint64 LE ][ MAGIC (8 bytes) ]

(``captioner.features.layout`` writes and checks it.)
The values are float16, or bfloat16 when an encoder's features exceed float16's range (its
trailer then says ``"dtype": "bfloat16"``, format version 2; see ``captioner.features.dtype``). A
build checks each batch before storing it and refuses NaN/inf features naming the encoder and
the image.

The features sit at offset 0 and are read through a read-only ``numpy.memmap``, so memory stays
flat however large the dataset is; they are also written batch by batch, never held in RAM. The
trailer (format version, C, N, D, grid, dtype, largest |value|, key, the indices of images that
failed to load) is written last. A build writes ``<path>.partial`` and renames it to ``<path>`` only when complete,
under an exclusive ``fcntl.flock`` on ``<path>.lock`` (``captioner.features.lock``); a killed build
therefore leaves only a ``.partial`` file, which is never opened as a cache, and its lock is dropped
by the kernel, so a crash never leaves the cache locked. ``cache_key`` hashes the encoder
configuration and the image list (``captioner.features.keys``); a cache whose key differs is stale
and is refused by ``FeatureCache.open(path, key=...)`` or rebuilt by ``get_feature_cache``. Images
are read through ``captioner.features.safe_images``, so an unreadable one is raised or skipped.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from captioner.config import ModelConfig
from captioner.data.dataset import image_loader
from captioner.errors import DataError, ImageLoadError
from captioner.features.dtype import (FLOAT16_MAX, check_range, decode_row, encode_rows, map_dtype, peak,
                                      stored_rows, widen_in_place)
from captioner.features.keys import cache_key, cache_path
from captioner.features.layout import MAGIC, cache_header, read_trailer, write_trailer
from captioner.features.lock import busy_error, lock_path, partial_path, wait_unlocked, write_lock
from captioner.features.rows import StoredRows, gather_stored
from captioner.features.safe_images import SafeImages, check_batch_errors, collate_safe

__all__ = ["MAGIC", "FeatureCache", "get_feature_cache"]

log = logging.getLogger(__name__)



# ----------------------------------------------------------------------------- the cache

class FeatureCache:
    """Read-only view of a complete cache file. Use ``build`` / ``open``, not the constructor.

    Attributes:
        path: the cache file.
        count: number of images C (rows).
        num_regions: N.  dim: D.  grid: (g, g) as reported by the encoder.
        dtype: the stored values, "float16" or "bfloat16" (``cache[i]`` reads a row as float32,
            ``loader()`` in this dtype).
        key: the ``cache_key`` it was built for ("" when built without one).
        valid: (C,) bool array, False for images that failed to load (rows of zeros).
    """

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.header = header
        self.count = int(header["count"])
        self.num_regions = int(header["num_regions"])
        self.dim = int(header["dim"])
        self.grid = tuple(header["grid"])
        self.dtype = str(header["dtype"])
        self.key = str(header.get("key", ""))
        self.valid = np.ones(self.count, dtype=bool)
        self.valid[np.asarray(header.get("invalid", []), dtype=np.int64)] = False
        self.invalid_names: list[str] = list(header.get("invalid_names", []))
        self._features: np.memmap | None = None

    @property
    def features(self) -> np.memmap:
        """The (C, N, D) memory map, float16 or raw bfloat16 bits as uint16 (opened lazily, also after
        unpickling in a worker)."""
        if self._features is None:
            self._features = np.memmap(self.path, dtype=map_dtype(self.dtype), mode="r",
                                       shape=(self.count, self.num_regions, self.dim))
        return self._features

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen the map, never copy it
        state = self.__dict__.copy()
        state["_features"] = None
        return state

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return f"FeatureCache({self.path}, count={self.count}, N={self.num_regions}, D={self.dim}, {self.dtype})"

    def __getitem__(self, index: int) -> torch.Tensor:
        """Row ``index`` as a float32 (N, D) tensor (a copy; the map stays on disk)."""
        return decode_row(self.features[self._check(index)], self.dtype)

    def stored(self, index: int) -> torch.Tensor:
        """Row ``index`` as an (N, D) tensor of the stored dtype, float16 or bfloat16 (a copy)."""
        return stored_rows(self.features[self._check(index)], self.dtype)

    def stored_batch(self, indices: Sequence[int]) -> torch.Tensor:
        """Rows ``indices`` as one (B, N, D) tensor of the stored dtype, read from the map in one copy
        (into shared memory inside a DataLoader worker: ``captioner.features.rows.gather_stored``)."""
        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        ok = (index >= 0) & (index < self.count)
        ok[ok] = self.valid[index[ok]]
        if not ok.all():
            self._check(int(index[np.argmin(ok)]))  # raises for the first bad index, as ``stored`` would
        return gather_stored(self.features, index, self.dtype)

    def loader(self) -> StoredRows:
        """A picklable ``load(index) -> (N, D)`` in the stored 2-byte dtype, for the caption datasets;
        ``load.stack(indices)`` reads a whole batch in one copy (the training loader's path).

        Rows stay float16/bfloat16 through the DataLoader (workers, collate, pinned memory) and are
        widened to float32 on the training device (``captioner.features.dtype.model_input``).
        """
        return StoredRows(self)

    def _check(self, index: int) -> int:
        index = int(index)
        if not 0 <= index < self.count:
            raise IndexError(f"feature cache {self.path} has {self.count} images, index {index} is out of range")
        if not self.valid[index]:
            raise ImageLoadError(f"image #{index} failed to load when feature cache {self.path} was built")
        return index

    def valid_indices(self) -> list[int]:
        """Indices (into ``caption_set.images``) whose features are present."""
        return np.flatnonzero(self.valid).tolist()

    # ------------------------------------------------------------------ open / build

    @classmethod
    def open(cls, path: str | os.PathLike, key: str | None = None, lock_timeout: float = 0.0) -> "FeatureCache":
        """Open a complete cache file.

        Args:
            path: the cache file.
            key: expected ``cache_key``; a different stored key raises (stale cache).
            lock_timeout: when the file is absent and another process is writing it, wait this
                many seconds for it to finish before raising.

        Raises:
            CaptionerError: missing, incomplete, truncated, foreign, stale, or being written.
        """
        path = Path(path)
        if not path.exists():
            if not wait_unlocked(path, lock_timeout):
                raise busy_error(path)
            if not path.exists():
                if partial_path(path).exists():
                    raise DataError(f"feature cache {path} is incomplete (an interrupted build left "
                                    f"{partial_path(path).name}); rebuild it")
                raise DataError(f"feature cache {path} does not exist")
        header = read_trailer(path)
        if key is not None and header.get("key") != key:
            raise DataError(f"feature cache {path} is stale: built for another encoder config or image list "
                            f"(key {str(header.get('key'))[:12]}, expected {key[:12]}); delete it or rebuild")
        return cls(path, header)

    @classmethod
    def build(
        cls,
        encoder: nn.Module,
        caption_set: Any,
        transform: Callable[[Any], torch.Tensor],
        path: str | os.PathLike,
        batch_size: int = 32,
        device: str | torch.device = "cpu",
        skip_bad: bool = False,
        progress: bool = True,
        num_workers: int = 0,
        key: str = "",
        lock_timeout: float = 0.0,
        encoder_name: str = "",
    ) -> "FeatureCache":
        """Encode every image of ``caption_set`` and write the cache atomically.

        Args:
            encoder: ``encoder(images (B,3,S,S)) -> (features (B,N,D), grid)``; run in eval mode
                under ``torch.inference_mode`` on ``device`` (its mode and device are restored).
            caption_set: the images, row i = ``caption_set.images[i]``.
            transform: PIL image -> (3,S,S) tensor (an ``ImageTransform``).
            path: the cache file to write.
            batch_size, device, num_workers: encoding batch size, device, DataLoader workers.
            skip_bad: store unreadable images as invalid rows instead of raising ``ImageLoadError``.
            progress: show a tqdm bar.
            key: the ``cache_key`` stored in the trailer.
            lock_timeout: seconds to wait when another process holds the lock; then raise.
            encoder_name: how errors and warnings name the encoder (default: its class name).

        Returns:
            The opened cache.

        Raises:
            DataError: the encoder produced NaN/inf (or beyond bfloat16's range) for an image.
            ImageLoadError: an unreadable image without ``skip_bad``.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if len(caption_set.images) == 0:
            raise DataError(f"feature cache {path}: the caption set has no images")
        with write_lock(path, lock_timeout):
            if key and path.exists():  # another process finished it while we waited for the lock
                with contextlib.suppress(DataError):
                    return cls.open(path, key=key)
            partial = partial_path(path)
            data = SafeImages(image_loader(caption_set, transform), len(caption_set.images))
            batches = DataLoader(data, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_safe)
            try:
                names = [str(rec.path) for rec in caption_set.images]
                header = _encode_to_file(encoder, encoder_name or type(encoder).__name__, batches, partial, path,
                                         names, device, progress, skip_bad)
                header["key"] = key
                header["invalid_names"] = [caption_set.images[i].file_name for i in header["invalid"]]
                with open(partial, "ab") as f:
                    write_trailer(f, header)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(partial, path)
            except BaseException:
                partial.unlink(missing_ok=True)
                raise
        if header["invalid"]:
            log.warning("feature cache %s: %d of %d images could not be loaded", path, len(header["invalid"]),
                        len(data))
        log.info("feature cache %s: %d images, %d regions x %d dims, %s", path, len(data), header["num_regions"],
                 header["dim"], header["dtype"])
        return cls.open(path)


def _encode_to_file(encoder: nn.Module, name: str, batches: DataLoader, out: Path, final: Path, images: list[str],
                    device: str | torch.device, progress: bool, skip_bad: bool) -> dict[str, Any]:
    """Write feature rows in image order to ``out``; returns the trailer fields.

    Each batch's largest |value| is checked before it is cast: NaN/inf is refused, and the first
    batch beyond float16's range switches the file to bfloat16 (earlier rows converted in place).
    """
    params = next(encoder.parameters(), None)
    old_device = params.device if params is not None else None
    was_training = encoder.training
    encoder.to(device).eval()
    shape: tuple[int, int] | None = None
    grid: tuple[int, int] | None = None
    dtype, top = "float16", 0.0
    invalid: list[int] = []
    pending_zeros = 0  # invalid rows seen before the row shape is known
    try:
        with open(out, "wb") as f, torch.inference_mode(), \
                tqdm(total=len(images), desc="encoding features", unit="img", disable=not progress) as bar:
            for pixels, indices, errors in batches:
                check_batch_errors(errors, skip_bad, f"feature cache {final}")
                rows = None
                if pixels is not None:
                    feats, grid = encoder(pixels.to(device, non_blocking=True))  # (b, N, D)
                    batch_top = peak(feats)
                    check_range(feats, batch_top, name, [images[i] for i, e in zip(indices, errors) if e is None],
                                f"feature cache {final}")
                    top = max(top, batch_top)
                    if dtype == "float16" and batch_top > FLOAT16_MAX:
                        log.warning("feature cache %s: encoder %s produces features up to %.4g, beyond float16's "
                                    "%g; storing bfloat16 (same size, 8 significant bits)", final, name, batch_top,
                                    FLOAT16_MAX)
                        f.flush()
                        widen_in_place(out, f.tell() // 2)
                        dtype = "bfloat16"
                    rows = encode_rows(feats, dtype)  # (b, N, D), 2-byte values
                    if shape is None:
                        shape = rows.shape[1:]
                        f.write(np.zeros((pending_zeros, *shape), np.uint16).tobytes())  # 0.0 in both dtypes
                it = iter(rows if rows is not None else ())
                for index, error in zip(indices, errors):
                    if error is None:
                        f.write(np.ascontiguousarray(next(it)).tobytes())
                        continue
                    invalid.append(index)
                    if shape is None:
                        pending_zeros += 1
                    else:
                        f.write(np.zeros(shape, np.uint16).tobytes())
                bar.update(len(indices))
    finally:
        encoder.train(was_training)
        if old_device is not None:
            encoder.to(old_device)
    if shape is None:
        raise DataError(f"feature cache {final}: none of the {len(images)} images could be loaded")
    return cache_header(len(images), shape[0], shape[1], grid, dtype, top, invalid)


def get_feature_cache(
    model_config: ModelConfig,
    encoder: nn.Module,
    caption_set: Any,
    transform: Callable[[Any], torch.Tensor],
    cache_dir: str | os.PathLike,
    hash_weights: bool = True,
    lock_timeout: float = 0.0,
    **build_kwargs: Any,
) -> FeatureCache:
    """Open the matching cache in ``cache_dir`` or build it (stale or broken files are rebuilt).

    Args:
        model_config, encoder, caption_set: as for ``cache_key`` (``hash_weights`` passes the
            encoder's weights into the key).
        transform: as for ``FeatureCache.build``.
        cache_dir: folder of cache files, named by ``cache_path``.
        lock_timeout: seconds to wait for another process writing the same cache.
        **build_kwargs: ``batch_size``, ``device``, ``skip_bad``, ``progress``, ``num_workers``.
    """
    key = cache_key(model_config, caption_set, encoder if hash_weights else None)
    path = cache_path(cache_dir, caption_set, key)
    if path.exists() or lock_path(path).exists():
        try:
            return FeatureCache.open(path, key=key, lock_timeout=lock_timeout)
        except DataError as exc:
            if "does not exist" not in str(exc):
                log.warning("%s; rebuilding", exc)
    enc = model_config.encoder
    name = enc.name if enc.pretrained else f"{enc.name} with random weights (model.encoder.pretrained=false)"
    return FeatureCache.build(encoder, caption_set, transform, path, key=key, lock_timeout=lock_timeout,
                              encoder_name=name, **build_kwargs)
