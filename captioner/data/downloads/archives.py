"""What the dataset downloads share: the archive loop and zip extraction.

``prepare`` downloads, checks and extracts each archive not yet present (``root/downloads/``
holds the zips); ``write_members`` extracts chosen zip members, atomically, never outside the
destination folder and within :class:`ArchiveBounds` (size per member and in all, expansion ratio:
zip bombs stop at the bound). Errors are ``DataError`` with one line naming the file; an archive
that cannot be extracted is removed, with the files it had written, so that the next run fetches
it again.
"""

from __future__ import annotations

import logging
import zipfile
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from captioner.download import CHUNK
from captioner.errors import DataError

__all__ = ["BOUNDS", "ArchiveBounds", "Steps", "open_zip", "prepare", "write_members"]

log = logging.getLogger("captioner.download")


@dataclass(frozen=True)
class ArchiveBounds:
    """What extracting one archive may write (a zip bomb stops at the first bound it crosses).

    Attributes:
        member_bytes: the largest member, counted as it is written (its stated size is checked first).
        ratio: the largest expansion of a member (bytes written per compressed byte), once it is
            past ``ratio_floor`` bytes (small files of repeated text compress well).
        total_bytes: everything extracted from one archive.
    """

    member_bytes: int = 4 << 30
    ratio: float = 200.0
    ratio_floor: int = 1 << 20
    total_bytes: int = 64 << 30


BOUNDS = ArchiveBounds()
_CORRUPT = (zipfile.BadZipFile, zlib.error, EOFError, RuntimeError, NotImplementedError, ValueError)


def open_zip(zip_path: Path) -> zipfile.ZipFile:
    """``ZipFile(zip_path)``; a file that is not a zip (or a truncated one) is a one-line ``DataError``."""
    try:
        return zipfile.ZipFile(zip_path)
    except (zipfile.BadZipFile, EOFError, ValueError) as exc:
        raise DataError(f"{zip_path}: not a valid zip archive ({_why(exc)})") from None


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


def _copy_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, tmp: Path, zip_path: Path, bounds: ArchiveBounds,
                 budget: int) -> int:
    """Stream one member into ``tmp`` with a running total; returns the bytes written."""
    limit = min(bounds.member_bytes, budget)
    where = f"{zip_path}: member {info.filename!r}"
    if info.flag_bits & 0x1:
        raise DataError(f"{where} cannot be extracted (it is encrypted: a password would be needed)")
    if info.file_size > limit:
        raise DataError(f"{where} states {info.file_size} bytes, over the limit of {limit} bytes (a zip bomb?)")
    written = 0
    with zf.open(info) as src, open(tmp, "wb") as dst:
        while chunk := src.read(CHUNK):
            written += len(chunk)
            if written > limit:
                raise DataError(f"{where} expands past {limit} bytes (a zip bomb?)")
            if written > bounds.ratio_floor and written > bounds.ratio * max(info.compress_size, 1):
                raise DataError(f"{where} expands more than {bounds.ratio:g} times its {info.compress_size} "
                                "compressed bytes (a zip bomb?)")
            dst.write(chunk)
    return written


def write_members(zf: zipfile.ZipFile, zip_path: Path, root: Path, pairs: Iterable[tuple[str, str]],
                  bounds: ArchiveBounds | None = None) -> list[Path]:
    """Extract ``(member name, destination relative to root)`` pairs, each through a ``.tmp`` file.

    Each member is streamed with a running total against ``bounds`` (default :data:`BOUNDS`). On
    any failure the ``.tmp`` file and the members this call wrote are removed.

    Raises:
        DataError: a destination would lie outside ``root`` (a ``../`` member name); a member over a
            bound; a corrupt, encrypted or unsupported member (one line naming it).
    """
    bounds = bounds or BOUNDS
    written: list[Path] = []
    base = root.resolve()
    total, tmp = 0, None
    try:
        for name, rel in pairs:
            out = (root / rel).resolve()
            if base not in out.parents:
                raise DataError(f"{zip_path}: member {name!r} would escape {root}")
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(out.name + ".tmp")
            try:
                total += _copy_member(zf, zf.getinfo(name), tmp, zip_path, bounds, bounds.total_bytes - total)
            except _CORRUPT as exc:
                raise DataError(f"{zip_path}: member {name!r} cannot be extracted ({_why(exc)})") from None
            tmp.replace(out)
            tmp = None
            written.append(out)
    except BaseException:
        for path in ([tmp] if tmp is not None else []) + written:
            path.unlink(missing_ok=True)
        raise
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
        try:
            steps.extract(zip_path, root, a)
        except DataError as exc:  # kept, it would fail the same way on every run
            zip_path.unlink(missing_ok=True)
            raise DataError(f"{exc}; {zip_path} was removed: run again to download it again") from None
        if not keep_archives:
            zip_path.unlink()
    return actions
