"""On-disk cache of encoder region features for training a decoder over a frozen encoder.

Shape legend: C images in the cache, B rows in a batch, N regions (grid*grid), D feature width.

One file holds the features of every image of a caption set, row ``i`` for ``caption_set.images[i]``::

    [ C*N*D 2-byte values ][ JSON trailer ][ trailer length: uint64 LE ][ MAGIC (8 bytes) ]

Values are float16, or bfloat16 when an encoder's features exceed float16's range
(``captioner.features.dtype``); NaN/inf features are refused. Rows are read through a read-only
``numpy.memmap`` and written batch by batch, so memory stays flat. A build holds a lock on
``<path>.lock`` and writes ``<path>.partial``, renamed only when complete: a killed build leaves
neither a half cache nor a held lock. A file is named ``<set>_<split>_<key[:16]>.feats``; the key
hashes the encoder configuration, the image list (and a sample of their contents) and the weights,
and a cache whose key differs is stale. :func:`gather_stored` reads a batch's rows with one copy,
into shared memory inside a DataLoader worker.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, get_worker_info
from tqdm import tqdm

from captioner.config import ModelConfig
from captioner.data.dataset import SafeImages, check_batch_errors, collate_safe, image_loader, prefetched_batches
from captioner.errors import CaptionerError, DataError, ImageLoadError
from captioner.features.dtype import (FLOAT16_MAX, VERSIONS, check_range, decode_row, encode_rows, map_dtype, peak,
                                      stored_rows, version_of, widen_in_place)
from captioner.files import (atomic_file, check_regular, hold_lock, lock_file, lock_is_free, open_partial,
                             open_regular, read_text, release_lock_file)
from captioner.models.registry import resolve_encoder

log = logging.getLogger(__name__)


_HELD = {"float16": torch.float16, "bfloat16": torch.int16}  # torch dtype the bits are gathered into


def empty_batch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor, its storage created shared when called inside a DataLoader worker."""
    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    storage = torch.UntypedStorage._new_shared(nbytes)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def gather_stored(rows: np.ndarray, index: np.ndarray, dtype: str) -> torch.Tensor:
    """Rows ``index`` (B,) of a cache's memory map as one (B, N, D) tensor of the stored dtype.

    Bit for bit ``torch.stack([stored_rows(rows[i], dtype) for i in index])``; ``index`` must be in range.
    """
    index = np.asarray(index, dtype=np.intp)
    out = empty_batch((len(index), *rows.shape[1:]), _HELD[dtype])  # (B, N, D)
    np.take(rows, index, axis=0, out=out.numpy().view(rows.dtype), mode="clip")
    return out if dtype == "float16" else out.view(torch.bfloat16)


class StoredRows:
    """What ``FeatureCache.loader()`` returns; picklable (the map is reopened in workers).

    ``load(index)`` is one (N, D) row in the stored dtype; ``load.stack(indices)`` a (B, N, D) batch in one copy.
    """

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def __call__(self, index: int) -> torch.Tensor:
        return self.cache.stored(index)

    def stack(self, indices: Sequence[int]) -> torch.Tensor:
        return self.cache.stored_batch(indices)


def lock_path(path: Path) -> Path:
    """``<path>.lock``, the file a writer holds the lock on."""
    return lock_file(path)


def partial_path(path: Path) -> Path:
    """``<path>.partial``, what a build writes before renaming it to ``path``."""
    return path.with_name(path.name + ".partial")


def busy_error(path: Path) -> CaptionerError:
    """One line naming the lock and, when it says, the pid of the process writing ``path``."""
    lock = lock_path(path)
    try:
        holder = read_text(lock, 4096).strip()
    except CaptionerError:
        holder = ""
    who = f", pid {holder}" if holder.isdigit() else ""
    return CaptionerError(f"feature cache {path} is being written by another process (lock {lock}{who})")


@contextlib.contextmanager
def write_lock(path: Path, timeout: float) -> Iterator[None]:
    """Hold an exclusive lock on ``<path>.lock`` (holding this process's pid); wait up to ``timeout`` s, then raise."""
    try:
        with hold_lock(lock_path(path), timeout, busy=lambda: busy_error(path)) as lock:
            lock.write_text(str(os.getpid()))
            try:
                yield
            finally:
                lock.write_text("")
    finally:  # no 0-byte lock file is left behind
        release_lock_file(lock_path(path), remove_folder=False)


def wait_unlocked(path: Path, timeout: float) -> bool:
    """True when nobody holds the write lock (after waiting up to ``timeout`` s)."""
    return lock_is_free(lock_path(path), timeout)


FORMAT_VERSION = 1  # of float16 caches, and part of every cache_key (bfloat16 caches are version 2)
SUFFIX = ".feats"


def cache_key(model_config: ModelConfig, caption_set: Any, encoder: nn.Module | None = None) -> str:
    """Hex SHA-256 of everything that decides the cached features.

    The encoder part of ``model_config``; ``caption_set``'s ordered image list (relative paths, so a moved
    dataset keeps its caches) with the size and content hash of up to 64 images; ``encoder``'s weights
    when given (needed for randomly initialised encoders).
    """
    enc = resolve_encoder(model_config.encoder)  # the preprocessing the encoder really sees, not "unset"
    h = hashlib.sha256()
    conf = {
        "format": FORMAT_VERSION,
        "encoder": {k: getattr(enc, k) for k in ("name", "weights", "pretrained", "grid", "width", "image_size",
                                                   "resize", "interpolation")},
        "mean": list(enc.mean),
        "std": list(enc.std),
    }
    if enc.dilate:  # only when set, so the caches built before the option keep their keys
        conf["encoder"]["dilate"] = True
    if enc.labels:  # the label channels after the regions: the original top stage's (the classifier's input)
        conf["encoder"]["labels"] = "top stage"
    h.update(json.dumps(conf, sort_keys=True).encode())
    images = caption_set.images
    paths = [Path(rec.path).resolve() for rec in images]
    root = _common_folder(paths)
    for rec, path in zip(images, paths):
        h.update(f"{rec.image_id}\t{path.relative_to(root).as_posix()}\n".encode())
    step = max(1, len(images) // 64)
    for path in paths[::step]:
        h.update(_sample_digest(path))
    if encoder is not None:
        for name, tensor in sorted(encoder.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _common_folder(paths: Sequence[Path]) -> Path:
    """The deepest folder holding every one of ``paths`` (absolute): the part of a path a move changes."""
    if not paths:
        return Path()
    if len(paths) == 1:
        return paths[0].parent
    return Path(os.path.commonpath(paths))


def _sample_digest(path: Path, limit: int = 1 << 20) -> bytes:
    """One sampled image's part of a cache key: its size and the hash of its first ``limit`` bytes."""
    try:
        with open_regular(path, None, DataError) as f:  # an image that is a named pipe cannot hang the key
            head = f.read(limit)
            size = os.fstat(f.fileno()).st_size
    except (OSError, DataError):
        return b"missing\n"
    return f"{size}:{hashlib.sha256(head).hexdigest()}\n".encode()


def cache_path(cache_dir: str | os.PathLike, caption_set: Any, key: str) -> Path:
    """``<cache_dir>/<set name>_<split>_<key[:16]>.feats``."""
    name = f"{caption_set.name}_{caption_set.split}".replace(os.sep, "_").replace(" ", "_")
    return Path(cache_dir) / f"{name}_{key[:16]}{SUFFIX}"


MAGIC = b"CAPFEAT1"
_TAIL = struct.Struct("<Q")  # trailer length


def cache_header(count: int, num_regions: int, dim: int, grid: Sequence[int], dtype: str, max_abs: float,
                 invalid: Sequence[int] = (), **extra: Any) -> dict[str, Any]:
    """The trailer of a cache of ``count`` rows of (num_regions, dim) ``dtype`` values; ``extra`` keys
    (``key``, ``invalid_names``) follow the standard ones."""
    return {"format": "captioner-features", "version": version_of(dtype), "count": count,
            "num_regions": num_regions, "dim": dim, "grid": [int(g) for g in grid], "dtype": dtype,
            "max_abs": max_abs, "invalid": list(invalid), **extra}


def write_trailer(f: Any, header: dict[str, Any]) -> None:
    """Append the trailer ``header``, its length and ``MAGIC`` to the open file ``f``."""
    blob = json.dumps(header, separators=(",", ":")).encode()
    f.write(blob)
    f.write(_TAIL.pack(len(blob)))
    f.write(MAGIC)


def write_cache_file(path: str | os.PathLike, blocks: np.ndarray | Iterable[np.ndarray],
                     header: dict[str, Any]) -> Path:
    """A cache file of ``blocks`` of rows (..., N, D) in the map's dtype, then ``header``, written atomically (not locked)."""
    path = Path(path)
    with atomic_file(path, DataError) as f:
        for block in [blocks] if isinstance(blocks, np.ndarray) else blocks:
            f.write(np.ascontiguousarray(block).tobytes())
        write_trailer(f, header)
    return path


def read_trailer(path: Path) -> dict[str, Any]:
    """Parse and check the trailer; the data size must match exactly."""
    size = check_regular(path, None, DataError, "feature cache")
    end = _TAIL.size + len(MAGIC)
    bad = f"feature cache {path} is truncated or not a captioner feature cache"
    if size < end:
        raise DataError(bad)
    with open_regular(path, None, DataError, "feature cache") as f:
        f.seek(size - end)
        tail = f.read(end)
        if tail[_TAIL.size:] != MAGIC:
            raise DataError(bad)
        (length,) = _TAIL.unpack(tail[:_TAIL.size])
        if length > size - end:
            raise DataError(bad)
        f.seek(size - end - length)
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise DataError(bad) from None
    if not isinstance(header, dict) or header.get("format") != "captioner-features":
        raise DataError(bad)
    version = header.get("version")
    if version not in VERSIONS:
        raise DataError(f"feature cache {path} has format version {version}, "
                        f"this captioner reads {' and '.join(map(str, VERSIONS))}; rebuild it")
    header.setdefault("dtype", "float16")
    if header["dtype"] != VERSIONS[version]:
        raise DataError(f"feature cache {path} says dtype {header['dtype']!r} with format version {version}, "
                        f"which stores {VERSIONS[version]}; rebuild it")
    expected = int(header["count"]) * int(header["num_regions"]) * int(header["dim"]) * 2  # 2-byte values
    if size - end - length != expected:
        raise DataError(f"feature cache {path} is truncated: {size - end - length} data bytes, expected {expected}")
    return header


class FeatureCache:
    """Read-only view of a complete cache file. Use ``build`` / ``open``, not the constructor.

    Attributes: ``count`` C, ``num_regions`` N, ``dim`` D, ``grid``, ``dtype`` ("float16" or "bfloat16"),
    ``key`` (its ``cache_key``) and ``valid`` (C,) (False for images that failed to load).
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
        (into shared memory inside a DataLoader worker: ``captioner.features.cache.gather_stored``)."""
        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        ok = (index >= 0) & (index < self.count)
        ok[ok] = self.valid[index[ok]]
        if not ok.all():
            self._check(int(index[np.argmin(ok)]))  # raises for the first bad index, as ``stored`` would
        return gather_stored(self.features, index, self.dtype)

    def loader(self) -> StoredRows:
        """A picklable ``load(index) -> (N, D)`` in the stored 2-byte dtype (widened on the training device)."""
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
        """Open a complete cache file, expecting ``key`` when given.

        ``lock_timeout``: seconds to wait for a process that is writing the file. Raises ``CaptionerError``
        for a missing, incomplete, truncated, foreign, stale or busy cache.
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
    def build(cls, encoder: nn.Module, caption_set: Any, transform: Callable[[Any], torch.Tensor],
              path: str | os.PathLike, batch_size: int = 32, device: str | torch.device = "cpu", skip_bad: bool = False,
              progress: bool = True, num_workers: int = 0, key: str = "", lock_timeout: float = 0.0,
              encoder_name: str = "") -> "FeatureCache":
        """Encode every image of ``caption_set`` and write the cache atomically; return it opened.

        Args:
            encoder: ``encoder(images (B,3,S,S)) -> (features (B,N,D), grid)``, run in eval mode on ``device``.
            transform: PIL image -> (3,S,S) tensor (an ``ImageTransform``).
            skip_bad: store unreadable images as invalid rows instead of raising ``ImageLoadError``.
            key: the ``cache_key`` stored in the trailer; ``lock_timeout``: seconds to wait for the lock.
            encoder_name: how errors name the encoder (default: its class name).
        DataError when the encoder produces NaN/inf (or beyond bfloat16's range) for an image.
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
            if num_workers:
                batches = DataLoader(data, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_safe)
            else:  # threads read the next batch while this one is encoded
                batches = prefetched_batches(data, batch_size)
            try:
                names = [str(rec.path) for rec in caption_set.images]
                header = _encode_to_file(encoder, encoder_name or type(encoder).__name__, batches, partial, path,
                                         names, device, progress, skip_bad)
                header["key"] = key
                header["invalid_names"] = [caption_set.images[i].file_name for i in header["invalid"]]
                with open_partial(partial, True, DataError) as f:
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
    """Write checked feature rows in image order to ``out`` (switching to bfloat16 if needed); return the trailer fields."""
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
        with open_partial(out, False, DataError) as f, torch.inference_mode(), \
                tqdm(total=len(images), desc="encoding features", unit="img", disable=not progress or None) as bar:
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


def get_feature_cache(model_config: ModelConfig, encoder: nn.Module, caption_set: Any,
                      transform: Callable[[Any], torch.Tensor], cache_dir: str | os.PathLike, hash_weights: bool = True,
                      lock_timeout: float = 0.0, **build_kwargs: Any) -> FeatureCache:
    """Open the matching cache in ``cache_dir`` or build it (stale or broken files are rebuilt).

    ``hash_weights`` puts the encoder's weights into the key; ``**build_kwargs`` go to ``FeatureCache.build``.
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
