"""Resumable downloads: one implementation for the dataset scripts and for checkpoints given by URL.

``download`` fetches a URL through ``<dest>.part`` with a tqdm bar, resumes a partial file with an
HTTP Range request (also when the connection is cut in the middle: up to ``retries`` times in one
call, and again on the next call, since the ``.part`` file is kept), checks size and checksum, and
only then renames the file into place, so ``dest`` is either absent or complete and verified.
``verify`` checks size and checksum and removes a file that fails. Every failure is one line
naming the URL or file, raised as ``error`` (``DataError`` by default).
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from captioner.errors import CaptionerError, DataError

__all__ = ["CHUNK", "DownloadError", "download", "file_digest", "verify"]

log = logging.getLogger(__name__)
CHUNK = 1 << 20


class DownloadError(DataError):
    """The server could not be reached or answered with an error (nothing usable was fetched).

    Attributes:
        status: the HTTP status, or None when no answer came (refused connection, DNS, timeout).
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return str(reason)


def _fetch_part(url: str, part: Path, size: int | None, progress: bool, opener: Callable[..., object],
                timeout: float, label: str) -> None:
    """One request: append what the server sends to ``part`` (from its current size, with Range)."""
    from tqdm import tqdm

    have = part.stat().st_size if part.exists() else 0
    if size is not None and have >= size:
        return
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = opener(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # nothing left to fetch: the part is complete
            return
        raise DownloadError(f"{url}: download failed (HTTP {exc.code} {exc.reason})", exc.code) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        raise DownloadError(f"{url}: download failed ({_reason(exc)})") from None
    with response:
        status = getattr(response, "status", None) or response.getcode()
        resumed = have > 0 and status == 206
        if have and not resumed:
            log.info("%s: server ignored the range request; downloading from the start", url)
            have = 0
        length = response.headers.get("Content-Length")
        total = have + int(length) if length and length.isdigit() else size
        with open(part, "ab" if resumed else "wb") as f, tqdm(
                total=total, initial=have, unit="B", unit_scale=True, desc=label, disable=not progress) as bar:
            try:
                while chunk := response.read(CHUNK):
                    f.write(chunk)
                    bar.update(len(chunk))
            finally:
                f.flush()
                os.fsync(f.fileno())
        got = part.stat().st_size
        if total is not None and got < total:  # a server that closed early without an error
            raise http.client.IncompleteRead(b"", total - got)


def download(url: str, dest: Path, size: int | None = None, checksum: str | None = None, progress: bool = True,
             opener: Callable[..., object] = urllib.request.urlopen, algorithm: str = "md5",
             error: type[CaptionerError] = DataError, retries: int = 0, timeout: float = 60) -> Path:
    """Fetch ``url`` to ``dest`` through ``dest.part``, resuming a partial file with HTTP Range.

    Args:
        url: what to fetch (``http(s)://`` or ``file://``).
        dest: the final file; bytes go to ``dest.part`` until it is complete and verified.
        size: expected bytes (None = unknown).
        checksum: expected hex digest of ``algorithm`` (None = not checked).
        progress: show a tqdm bar.
        opener: ``urllib.request.urlopen`` or a stand-in.
        algorithm: a ``hashlib`` name for ``checksum``.
        error: the exception type for a size or checksum mismatch and a cut connection.
        retries: how many times a connection cut in the middle is resumed within this call.
        timeout: seconds without an answer before giving up on a request.

    Raises:
        DownloadError: the server could not be reached or answered with an HTTP error.
        error: the connection was cut ``retries + 1`` times (the ``.part`` file is kept: run again
            to resume), or a size/checksum mismatch (the ``.part`` file is deleted).
    """
    dest = Path(dest)
    part = dest.with_name(dest.name + ".part")
    if size is not None and part.exists() and part.stat().st_size > size:
        log.warning("%s is larger than expected; starting over", part)
        part.unlink()
    for attempt in range(retries + 1):
        try:
            _fetch_part(url, part, size, progress, opener, timeout, dest.name)
            break
        except (http.client.HTTPException, OSError) as exc:  # cut connection, reset, timeout while reading
            have = part.stat().st_size if part.exists() else 0
            if attempt < retries:
                log.warning("%s: connection lost after %d bytes (%s); resuming", url, have, _reason(exc))
                continue
            raise error(f"{url}: connection lost after {have} bytes ({_reason(exc)}); the partial file "
                        f"{part} is kept: run again to resume") from None
    verify(part, size, checksum, label=dest.name, algorithm=algorithm, error=error)
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
           algorithm: str = "md5", error: type[CaptionerError] = DataError) -> None:
    """Check size and checksum; on mismatch delete ``path`` and raise a one-line ``error``."""
    label = label or path.name
    actual = path.stat().st_size
    if size is not None and actual != size:
        path.unlink()
        raise error(f"{label}: got {actual} bytes, expected {size}; the partial file was removed, run again")
    if checksum is not None:
        got = file_digest(path, algorithm)
        if got != checksum.lower():
            path.unlink()
            raise error(f"{label}: {algorithm.upper()} {got} does not match {checksum}; "
                        "the file was removed, run again")
