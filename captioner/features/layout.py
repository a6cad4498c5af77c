"""The feature cache's file layout: the rows, then a JSON trailer, its length and a magic tag.

Shape legend: C images, N regions, D feature width.

    [ C*N*D 2-byte values ][ JSON trailer ][ trailer length: uint64 LE ][ MAGIC (8 bytes) ]

:func:`cache_header` is the trailer a build writes, :func:`write_trailer` / :func:`read_trailer`
write and check it, and :func:`write_cache_file` writes a whole file from rows already in the
map's dtype (float16, or bfloat16 as uint16/int16 bits), for tests and benchmarks that need a cache
without an encoder. ``captioner.features.cache`` builds and opens caches through these.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from captioner.errors import DataError
from captioner.features.dtype import VERSIONS, version_of

__all__ = ["MAGIC", "cache_header", "read_trailer", "write_cache_file", "write_trailer"]

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
    """A cache file ``FeatureCache.open`` reads: ``blocks`` of rows (..., N, D) in the map's dtype, in
    order, then the trailer ``header`` (:func:`cache_header`). Not atomic and not locked: builds of
    real caches go through ``FeatureCache.build``."""
    path = Path(path)
    with open(path, "wb") as f:
        for block in [blocks] if isinstance(blocks, np.ndarray) else blocks:
            f.write(np.ascontiguousarray(block).tobytes())
        write_trailer(f, header)
    return path


def read_trailer(path: Path) -> dict[str, Any]:
    """Parse and check the trailer; the data size must match exactly."""
    size = path.stat().st_size
    end = _TAIL.size + len(MAGIC)
    bad = f"feature cache {path} is truncated or not a captioner feature cache"
    if size < end:
        raise DataError(bad)
    with open(path, "rb") as f:
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
