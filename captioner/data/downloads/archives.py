"""What the dataset downloads share: the archive loop and zip extraction.

``prepare`` downloads, checks and extracts each archive not yet present (``root/downloads/``
holds the zips); ``write_members`` extracts chosen zip members, atomically and never outside the
destination folder. Errors are ``DataError`` with one line naming the file.
"""

from __future__ import annotations

import logging
import shutil
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from captioner.download import CHUNK
from captioner.errors import DataError

__all__ = ["Steps", "open_zip", "prepare", "write_members"]

log = logging.getLogger("captioner.download")


def open_zip(zip_path: Path) -> zipfile.ZipFile:
    """``ZipFile(zip_path)``; a file that is not a zip is a one-line ``DataError``."""
    try:
        return zipfile.ZipFile(zip_path)
    except zipfile.BadZipFile:
        raise DataError(f"{zip_path}: not a valid zip archive") from None


def write_members(zf: zipfile.ZipFile, zip_path: Path, root: Path, pairs: Iterable[tuple[str, str]]) -> list[Path]:
    """Extract ``(member name, destination relative to root)`` pairs, each through a ``.tmp`` file.

    Raises:
        DataError: a destination would lie outside ``root`` (a ``../`` member name).
    """
    written = []
    base = root.resolve()
    for name, rel in pairs:
        out = (root / rel).resolve()
        if base not in out.parents:
            raise DataError(f"{zip_path}: member {name!r} would escape {root}")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        with zf.open(name) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, CHUNK)
        tmp.replace(out)
        written.append(out)
    return written


@dataclass(frozen=True)
class Steps:
    """What one dataset's script does with one of its archives (an object with ``key``, ``name``, ``url``).

    Attributes:
        is_present: ``(root, archive) -> bool``: its content is already extracted.
        where: ``(root, archive) -> str``: what it fills, for the messages.
        describe: ``archive -> str``: what the download knows or checks (size, checksum).
        fetch: ``(zip_path, root, archive, progress) -> None``: download and check it.
        extract: ``(zip_path, root, archive) -> Any``: take its files out.
    """

    is_present: Callable[[Path, Any], bool]
    where: Callable[[Path, Any], str]
    describe: Callable[[Any], str]
    fetch: Callable[[Path, Path, Any, bool], None]
    extract: Callable[[Path, Path, Any], Any]


def prepare(root: Path, archives: Sequence[Any], steps: Steps, dry_run: bool = False, keep_archives: bool = False,
            progress: bool = True) -> list[str]:
    """Download, check and extract each archive not yet present (``root/downloads/`` holds the zips).

    Returns:
        The actions, done or (``dry_run``) planned, one line each.
    """
    actions = []
    downloads = root / "downloads"
    for a in archives:
        zip_path = downloads / a.name
        if steps.is_present(root, a):
            actions.append(f"skip {a.key}: {steps.where(root, a)} is present")
            continue
        if zip_path.exists():
            actions.append(f"use {zip_path} (already downloaded)")
        else:
            part = zip_path.with_name(zip_path.name + ".part")
            resume = f", resuming at {part.stat().st_size} bytes" if part.exists() else ""
            actions.append(f"download {a.url} -> {zip_path} ({steps.describe(a)}{resume})")
        actions.append(f"extract {a.name} -> {steps.where(root, a)}")
        if not keep_archives:
            actions.append(f"delete {zip_path}")
        if dry_run:
            continue
        downloads.mkdir(parents=True, exist_ok=True)
        steps.fetch(zip_path, root, a, progress)
        log.info("extracting %s", zip_path)
        steps.extract(zip_path, root, a)
        if not keep_archives:
            zip_path.unlink()
    return actions
