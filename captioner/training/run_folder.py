"""Which run folders a training run may write into, checked before anything is read or written.

A folder that holds an earlier run (any of :data:`RUN_FILES`) is refused unless the run continues
it (``--resume``) or is told to start over (``--overwrite``); starting over moves the earlier run
aside to ``<folder>.old-<time>`` and never deletes it. A path that is a file, under a file, or in a
folder that cannot be written (read-only mount, ``chattr +i``) is refused in one line before the
data is read, so a failing run can never leave an earlier run half replaced.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from captioner.errors import ConfigError
from captioner.files import writable_folder

log = logging.getLogger(__name__)

# What a run writes: a folder holding any of these holds an earlier run.
RUN_FILES = ("train_state.pt", "latest.safetensors", "best.safetensors", "config.json", "vocab.json", "metrics.csv")


def earlier_run_files(run_dir: Path) -> list[str]:
    """The files of :data:`RUN_FILES` that ``run_dir`` holds (none when it is not a folder)."""
    if not run_dir.is_dir():
        return []
    return [name for name in RUN_FILES if os.path.lexists(run_dir / name)]


def check_run_folder(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse a run folder this run must not write into; writes nothing.

    Args:
        run_dir: the run folder (``--out``).
        resume: the run continues the one in ``run_dir``.
        overwrite: the run starts over; an earlier run there is moved aside (:func:`move_aside`).

    Raises:
        ConfigError: both ``resume`` and ``overwrite``; ``run_dir`` (or a parent) is a file; the
            folder cannot be written; or it holds an earlier run and neither flag is given.
    """
    if resume and overwrite:
        raise ConfigError("--resume continues the run in --out and --overwrite moves it aside to start over: "
                          "pass one of them")
    writable_folder(run_dir, ConfigError)
    found = earlier_run_files(run_dir)
    if found and not resume:
        if overwrite:
            writable_folder(run_dir.parent, ConfigError)  # the earlier run is renamed there
            return
        raise ConfigError(f"{run_dir} holds an earlier run ({', '.join(found[:3])}); pass --resume to continue it, "
                          f"--overwrite to move it to {run_dir.name}.old-<time> and start over, or another --out")


def move_aside(run_dir: Path) -> Path | None:
    """Rename a folder holding an earlier run to ``<name>.old-<YYYYmmdd-HHMMSS>`` (``-2``... if taken).

    Returns:
        The new name, or None when ``run_dir`` holds no earlier run (nothing is moved).

    Raises:
        ConfigError: the rename failed (the earlier run is then where it was).
    """
    if not earlier_run_files(run_dir):
        return None
    base = f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}"
    target, n = run_dir.with_name(base), 1
    while os.path.lexists(target):
        n += 1
        target = run_dir.with_name(f"{base}-{n}")
    try:
        os.rename(run_dir, target)
    except OSError as exc:
        raise ConfigError(f"{run_dir}: cannot move the earlier run aside to {target} "
                          f"({exc.strerror or exc}); nothing was changed") from None
    log.warning("moved the earlier run in %s to %s (--overwrite); starting a new run", run_dir, target)
    return target


def make_run_folder(run_dir: Path) -> None:
    """Create the run folder (and its parents); one ConfigError line when that fails."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{run_dir}: cannot create the run folder ({exc.strerror or exc})") from None
