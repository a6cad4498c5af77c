"""An exclusive write lock and the temporary name of a cache file that is being built.

A build holds an ``fcntl.flock`` on ``<path>.lock`` (the file holds the writer's pid) and writes
``<path>.partial``, renamed to ``<path>`` only when complete. The kernel drops the lock of a
killed process, so a crash never leaves a cache locked, and a ``.partial`` file is never opened as
a cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from captioner.errors import CaptionerError
from captioner.files import read_text


def lock_path(path: Path) -> Path:
    """``<path>.lock``, the file a writer holds the lock on."""
    return path.with_name(path.name + ".lock")


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
    """Hold an exclusive flock on ``<path>.lock``; wait up to ``timeout`` s, then raise."""
    lock = lock_path(path)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise busy_error(path) from None
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def wait_unlocked(path: Path, timeout: float) -> bool:
    """True when nobody holds the write lock (after waiting up to ``timeout`` s)."""
    lock = lock_path(path)
    if not lock.exists():
        return True
    fd = os.open(lock, os.O_RDONLY)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.1)
    finally:
        os.close(fd)
