"""Download helpers shared by ``download_coco.py`` and ``download_flickr8k.py``.

``download`` fetches a URL through ``<dest>.part`` with a tqdm bar and resumes a partial file
with an HTTP Range request; ``verify`` checks size and checksum (MD5, SHA-256, ...) and removes a
file that fails (both live in :mod:`captioner.download`, which checkpoints given by URL use too,
and are re-exported here); ``write_members`` extracts chosen zip members, atomically and never outside the
destination folder. Errors are ``DataError`` with one line naming the file.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from captioner.cli import run_reporting_errors  # noqa: E402
from captioner.download import CHUNK, download, file_digest, verify  # noqa: E402,F401  (re-exported)
from captioner.errors import DataError  # noqa: E402

log = logging.getLogger("download")


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


def run_cli(prog: str, work: Callable[[], list[str]], dry_run: bool) -> int:
    """Run a script's ``work`` and print its actions, reporting failures as the ``captioner`` CLI does
    (one line and exit 1 on an error, 130 on Ctrl-C)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    def run() -> int:
        actions = work()
        print(("would do:\n  " if dry_run else "done:\n  ") + "\n  ".join(actions))
        return 0

    return run_reporting_errors(prog, run, interrupted="interrupted (run again to resume)")


def archive_parser(doc: str | None, default_root: str, archives: Sequence[Any]) -> argparse.ArgumentParser:
    """The options every download script has: --root, --only, --mirror, --keep-archives, --dry-run, --no-progress."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=default_root, help=f"dataset folder (default: {default_root})")
    p.add_argument("--only", nargs="+", metavar="NAME", choices=[a.key for a in archives],
                   help="process only these archives: " + ", ".join(a.key for a in archives))
    p.add_argument("--mirror", metavar="URL", help="fetch every archive as URL/<archive name>")
    p.add_argument("--keep-archives", action="store_true", help="keep the zip files after extraction")
    p.add_argument("--dry-run", action="store_true", help="list what would be done, do nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p
