"""An exclusive write lock and the temporary name of a cache file that is being built.

A build holds an ``fcntl.flock`` on ``<path>.lock`` (``captioner.files.hold_lock``; the file holds the writer's pid) and writes
``<path>.partial``, renamed to ``<path>`` only when complete. The kernel drops the lock of a
killed process, so a crash never leaves a cache locked, and a ``.partial`` file is never opened as
a cache.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from captioner.errors import CaptionerError
from captioner.files import hold_lock, lock_file, lock_is_free, read_text


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
    """Hold an exclusive flock on ``<path>.lock`` (holding this process's pid); wait up to ``timeout`` s, then raise."""
    with hold_lock(lock_path(path), timeout, busy=lambda: busy_error(path)) as fd:
        if fd is not None:
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
        try:
            yield
        finally:
            if fd is not None:
                os.ftruncate(fd, 0)


def wait_unlocked(path: Path, timeout: float) -> bool:
    """True when nobody holds the write lock (after waiting up to ``timeout`` s)."""
    return lock_is_free(lock_path(path), timeout)
