"""Download helpers shared by ``download_coco.py`` and ``download_flickr8k.py``.

``download`` fetches a URL through ``<dest>.part`` with a tqdm bar and resumes a partial file
with an HTTP Range request; ``verify`` checks size and checksum (MD5, SHA-256, ...) and removes a
file that fails; ``write_members`` extracts chosen zip members, atomically and never outside the
destination folder. Errors are ``DataError`` with one line naming the file.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import sys
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from captioner.errors import DataError  # noqa: E402

log = logging.getLogger("download")
CHUNK = 1 << 20


def download(url: str, dest: Path, size: int | None = None, checksum: str | None = None, progress: bool = True,
             opener: Callable[..., object] = urllib.request.urlopen, algorithm: str = "md5") -> Path:
    """Fetch ``url`` to ``dest`` through ``dest.part``, resuming a partial file with HTTP Range.

    Args:
        url: what to fetch (``http(s)://`` or ``file://``).
        dest: the final file; bytes go to ``dest.part`` until it is complete and verified.
        size: expected bytes (None = unknown).
        checksum: expected hex digest of ``algorithm`` (None = not checked).
        progress: show a tqdm bar.
        opener: ``urllib.request.urlopen`` or a stand-in.
        algorithm: a ``hashlib`` name for ``checksum``.

    Raises:
        DataError: network failure, or a size/checksum mismatch (the ``.part`` file is deleted).
    """
    from tqdm import tqdm

    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    if size is not None and have > size:
        log.warning("%s is larger than expected; starting over", part)
        part.unlink()
        have = 0
    if size is None or have < size:
        request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
        try:
            response = opener(request, timeout=60)
        except urllib.error.HTTPError as exc:
            if exc.code != 416:  # 416: nothing left to fetch
                raise DataError(f"{url}: download failed (HTTP {exc.code} {exc.reason})") from None
            response = None
        except (urllib.error.URLError, OSError) as exc:
            raise DataError(f"{url}: download failed ({getattr(exc, 'reason', exc)})") from None
        if response is not None:
            with response:
                status = getattr(response, "status", None) or response.getcode()
                resumed = have > 0 and status == 206
                if have and not resumed:
                    log.info("%s: server ignored the range request; downloading from the start", url)
                    have = 0
                length = response.headers.get("Content-Length")
                total = have + int(length) if length else size
                with open(part, "ab" if resumed else "wb") as f, tqdm(
                        total=total, initial=have, unit="B", unit_scale=True, desc=dest.name,
                        disable=not progress) as bar:
                    while chunk := response.read(CHUNK):
                        f.write(chunk)
                        bar.update(len(chunk))
    verify(part, size, checksum, label=dest.name, algorithm=algorithm)
    part.replace(dest)
    return dest


def file_digest(path: Path, algorithm: str = "sha256") -> str:
    """Hex digest of a file, read in chunks."""
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify(path: Path, size: int | None, checksum: str | None, label: str | None = None,
           algorithm: str = "md5") -> None:
    """Check size and checksum; on mismatch delete ``path`` and raise a one-line ``DataError``."""
    label = label or path.name
    actual = path.stat().st_size
    if size is not None and actual != size:
        path.unlink()
        raise DataError(f"{label}: got {actual} bytes, expected {size}; the partial file was removed, run again")
    if checksum is not None:
        got = file_digest(path, algorithm)
        if got != checksum.lower():
            path.unlink()
            raise DataError(f"{label}: {algorithm.upper()} {got} does not match {checksum}; "
                            "the file was removed, run again")


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
