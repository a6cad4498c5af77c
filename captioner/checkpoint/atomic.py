"""Atomic file writes: readers see either the old file or the complete new one, never a torn one.

Every file a run folder or a checkpoint command writes goes through :func:`atomic_write`: a
temporary ``.<name>.*.tmp`` in the same folder, fsync'ed, renamed over the target with
``os.replace``, then the folder itself fsync'ed so the rename survives a power cut.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from captioner.errors import CheckpointError

__all__ = ["atomic_write"]


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
    """Write a file so that readers see either the old or the complete new content.

    ``write(f)`` fills a temporary file in the same folder; it is flushed and fsync'ed, renamed over
    ``path`` with ``os.replace`` and the folder is fsync'ed. On any failure the temporary file is
    removed and the previous ``path`` is left untouched.

    Raises:
        CheckpointError: the folder is missing or the file cannot be written.
    """
    path = Path(path)
    folder = path.parent
    if not folder.is_dir():
        raise CheckpointError(f"{path}: folder {folder} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot write ({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise CheckpointError(f"{path}: cannot write ({exc.strerror or exc})") from None
        raise
    _fsync_dir(folder)
    return path


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory; the rename is still atomic
        pass
    finally:
        os.close(fd)
