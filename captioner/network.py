"""The one HTTP implementation: resumable, bounded downloads for the dataset archives and checkpoint URLs.

``download`` fetches through ``<dest>.part``, resumes with HTTP Range (also within one call, up to
``retries`` times), checks size and checksum and only then renames into place. Every transfer is
bounded (:class:`Bounds`) in bytes and in time (a stalled or trickling transfer is abandoned), and
``inspect`` can refuse a file from its first bytes. Every failure is one line naming the URL (its
credentials never shown) or file.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import http.client
import logging
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from captioner.errors import CaptionerError, ConfigError, DataError
from captioner.files import open_partial, open_regular

__all__ = ["CHUNK", "Bounds", "DownloadError", "Inspect", "Refused", "download", "file_digest", "read_head", "redact",
           "verify"]

log = logging.getLogger(__name__)
CHUNK = 1 << 20
HEAD_LIMIT = 16 << 20  # bytes kept in memory for ``inspect`` at most
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@?#]*@")

# ``inspect(first bytes) -> (done, expected total size or None)``; it raises :class:`Refused` for a
# file that is not what was asked for, and is called again with more bytes while ``done`` is False.
Inspect = Callable[[bytes], tuple[bool, "int | None"]]


@dataclass(frozen=True)
class Bounds:
    """How much one transfer may take: ``max_bytes``, ``timeout`` per read, ``min_rate`` bytes/s over ``window`` seconds."""

    max_bytes: int | None = None
    timeout: float = 60.0
    min_rate: float = 1024.0
    window: float = 60.0

    def __post_init__(self) -> None:
        for name in ("timeout", "min_rate", "window"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not (value > 0 and value < float("inf")):
                raise ConfigError(f"download bound {name} must be a finite number > 0, got {value!r}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ConfigError(f"download bound max_bytes must be >= 1, got {self.max_bytes}")


class DownloadError(DataError):
    """The server could not be reached or answered with an error; ``status`` is the HTTP status or None."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Refused(Exception):
    """Raised by an ``inspect`` function: the file's first bytes are not what was asked for (the reason)."""


class _Stalled(Exception):
    """The transfer moved less than the bound over the window."""


class _TooLarge(Exception):
    """The body is larger than ``limit`` (``max_bytes``, or the size the file's header states)."""

    def __init__(self, got: int, limit: int, what: str) -> None:
        super().__init__(f"{got} bytes where {what} {limit} bytes" if "states" in what
                         else f"{got} bytes or more where {what} {limit} bytes")


class _CannotWrite(Exception):
    """Writing the ``.part`` file failed (a full disk, a read-only folder): not the network's fault."""

    def __init__(self, exc: OSError) -> None:
        super().__init__(exc.strerror or str(exc))
        self.errno = exc.errno


def redact(url: str) -> str:
    """``url`` with any ``user:password@`` replaced by ``***@``, for messages."""
    return _USERINFO.sub(r"\1***@", url)


def _request(url: str, have: int) -> urllib.request.Request:
    """The GET for ``url`` from byte ``have``; ``user:password@`` in it becomes a Basic authorization
    that is sent to that host only (not after a redirect)."""
    match = _USERINFO.match(url)
    request = urllib.request.Request(_USERINFO.sub(r"\1", url) if match else url,
                                     headers={"Range": f"bytes={have}-"} if have else {})
    if match:
        userinfo = urllib.parse.unquote(url[len(match.group(1)):match.end() - 1])
        request.add_unredirected_header("Authorization", "Basic " + base64.b64encode(userinfo.encode()).decode())
    return request


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return str(reason)


class _Progress:
    """Bytes moved per window, across the attempts of one call."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.start = time.monotonic()
        self.moved = 0

    def add(self, n: int) -> None:
        self.moved += n
        self.check()

    def check(self) -> None:
        elapsed = time.monotonic() - self.start
        if elapsed < self.bounds.window:
            return
        if self.moved < self.bounds.min_rate * self.bounds.window:
            raise _Stalled()
        self.start, self.moved = time.monotonic(), 0

    def stalled(self) -> bool:
        """The window is over and too little moved in it (a read that timed out at its end)."""
        return (time.monotonic() - self.start >= self.bounds.window
                and self.moved < self.bounds.min_rate * self.bounds.window)

    def read_timeout(self) -> float:
        """The per-read timeout: never past the end of the current window (plus a little)."""
        left = self.bounds.window - (time.monotonic() - self.start)
        return max(0.05, min(self.bounds.timeout, left + 0.05))


class _Head:
    """The file's first bytes, handed to ``inspect`` until it has seen enough."""

    def __init__(self, inspect: Inspect | None, part: Path, have: int) -> None:
        self.inspect, self.data, self.size = inspect, bytearray(), None
        if inspect is not None and have:
            with open(part, "rb") as f:
                self.feed(f.read(min(have, HEAD_LIMIT)))

    def feed(self, chunk: bytes) -> None:
        if self.inspect is None:
            return
        self.data += chunk[: HEAD_LIMIT - len(self.data)]
        done, size = self.inspect(bytes(self.data))
        if done or len(self.data) >= HEAD_LIMIT:
            self.inspect, self.data, self.size = None, bytearray(), size

    def finish(self) -> None:
        """The file ended: a header still incomplete is a truncated file."""
        if self.inspect is not None:
            raise Refused(f"truncated: only {len(self.data)} bytes, its header is incomplete")


def _read(response: object, n: int) -> bytes:
    """What the server has sent so far, up to ``n`` bytes (not waiting for all ``n``: a trickle is seen)."""
    read1 = getattr(response, "read1", None)
    return read1(n) if read1 is not None else response.read(n)


def _open(opener: Callable[..., object], request: urllib.request.Request, shown: str, moved: "_Progress") -> object:
    """``opener(request)`` within the current window's timeout; failing to get an answer is a ``DownloadError``."""
    try:
        return opener(request, timeout=moved.read_timeout())
    except urllib.error.HTTPError as exc:
        raise DownloadError(f"{shown}: download failed (HTTP {exc.code} {exc.reason})", exc.code) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        raise DownloadError(f"{shown}: download failed ({_reason(exc)})") from None


def _fetch_part(url: str, part: Path, size: int | None, progress: bool | None, opener: Callable[..., object],
                bounds: Bounds, label: str, moved: _Progress, inspect: Inspect | None) -> int | None:
    """One request appending to ``part`` (Range from its size); returns the size ``inspect`` found, or None."""
    from tqdm import tqdm

    have = part.stat().st_size if part.exists() else 0
    if size is not None and have >= size:
        return size
    shown = redact(url)
    try:
        response = _open(opener, _request(url, have), shown, moved)
    except DownloadError as exc:
        if exc.status == 416 and have:  # nothing left to fetch: the part is complete
            return size
        raise
    with response:
        status = getattr(response, "status", None) or response.getcode()
        resumed = have > 0 and status == 206
        if have and not resumed:
            log.info("%s: server ignored the range request; downloading from the start", shown)
            have = 0
        length = response.headers.get("Content-Length")
        total = have + int(length) if length and length.isdigit() else size
        if bounds.max_bytes is not None and total is not None and total > bounds.max_bytes:
            raise _TooLarge(total, bounds.max_bytes, "the limit is")
        head = _Head(inspect, part, have)
        f = open_partial(part, resumed, DataError)  # never through a link, never into another file's inode
        with f, tqdm(total=total, initial=have, unit="B", unit_scale=True, desc=label,
                        disable=not show_progress(progress)) as bar:
            sock = getattr(getattr(getattr(response, "fp", None), "raw", None), "_sock", None)
            got = have
            while True:
                if sock is not None:
                    sock.settimeout(moved.read_timeout())
                chunk = _read(response, CHUNK)
                if not chunk:
                    break
                got += len(chunk)
                if bounds.max_bytes is not None and got > bounds.max_bytes:
                    raise _TooLarge(got, bounds.max_bytes, "the limit is")
                try:
                    f.write(chunk)
                except OSError as exc:
                    raise _CannotWrite(exc) from None
                head.feed(chunk)
                if head.size is not None:  # what the file claims, checked as soon as it is known
                    if bounds.max_bytes is not None and head.size > bounds.max_bytes:
                        raise _TooLarge(head.size, bounds.max_bytes, "its header states it, the limit is")
                    if total is not None and total != head.size:
                        raise Refused(f"the server sends {total} bytes, the file's header says {head.size}")
                    if got > head.size:
                        raise _TooLarge(got, head.size, "the file's header says")
                bar.update(len(chunk))
                moved.add(len(chunk))
            try:
                f.flush()
                os.fsync(f.fileno())
            except OSError as exc:
                raise _CannotWrite(exc) from None
        got = part.stat().st_size
        if total is not None and got < total:  # a server that closed early without an error
            raise http.client.IncompleteRead(b"", total - got)
        head.finish()
        return head.size


def _bound_text(bounds: Bounds) -> str:
    return f"{bounds.min_rate / 1024:g} KiB/s over {bounds.window:g} s"


def show_progress(progress: bool | None) -> bool:
    """Whether to draw a progress bar: ``progress`` when the caller says, else only when stderr is a
    terminal, so that a bar's redraws never fill a log file."""
    return sys.stderr.isatty() if progress is None else progress


def download(url: str, dest: Path, size: int | None = None, checksum: str | None = None, progress: bool | None = None,
             opener: Callable[..., object] = urllib.request.urlopen, algorithm: str = "md5",
             error: type[CaptionerError] = DataError, retries: int = 0, timeout: float | None = None,
             bounds: Bounds | None = None, inspect: Inspect | None = None) -> Path:
    """Fetch ``url`` (``http(s)://`` or ``file://``) to ``dest`` through ``dest.part``, resuming with HTTP Range.

    ``size``, ``checksum``, ``algorithm``: expected bytes and ``hashlib`` digest (None: not checked);
    ``progress``: a tqdm bar (None: only when stderr is a terminal); ``opener``: ``urllib.request.urlopen``
    or a stand-in; ``retries``: cuts resumed within this call; ``bounds`` (``max_bytes`` defaults to
    ``size``); ``inspect``: a check of the first bytes. Raises DownloadError when the server cannot be
    reached or answers an HTTP error; ``error`` when cut too often or stalled (``.part`` kept to resume),
    or for a mismatch, an oversize body, a refused header or a failed write (``.part`` deleted).
    """
    bounds = bounds or Bounds(max_bytes=size)
    if timeout is not None:
        bounds = Bounds(bounds.max_bytes, timeout, bounds.min_rate, bounds.window)
    if bounds.max_bytes is None and size is not None:
        bounds = Bounds(size, bounds.timeout, bounds.min_rate, bounds.window)
    dest, shown = Path(dest), redact(url)
    part = dest.with_name(dest.name + ".part")
    if size is not None and part.exists() and part.stat().st_size > size:
        log.warning("%s is larger than expected; starting over", part)
        part.unlink()
    moved = _Progress(bounds)
    found = None
    for attempt in range(retries + 1):
        try:
            found = _fetch_part(url, part, size, progress, opener, bounds, dest.name, moved, inspect)
            break
        except _TooLarge as exc:
            _remove(part)
            raise error(f"{shown}: too large: {exc}; nothing was kept") from None
        except _CannotWrite as exc:
            _remove(part)
            hint = "; free some space and run again" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
            raise error(f"{part}: cannot write the download ({exc}); the partial file was removed{hint}") from None
        except Refused as exc:
            _remove(part)
            raise error(f"{shown}: {exc}; nothing was kept") from None
        except (http.client.HTTPException, OSError, _Stalled) as exc:  # cut connection, reset, a stall
            have = part.stat().st_size if part.exists() else 0
            if isinstance(exc, _Stalled) or moved.stalled():
                raise error(f"{shown}: the transfer stalled (less than {_bound_text(bounds)}) after {have} "
                            f"bytes; the partial file {part} is kept: run again to resume") from None
            if attempt < retries:
                log.warning("%s: connection lost after %d bytes (%s); resuming", shown, have, _reason(exc))
                continue
            raise error(f"{shown}: connection lost after {have} bytes ({_reason(exc)}); the partial file "
                        f"{part} is kept: run again to resume") from None
    if found is not None and size is None and part.stat().st_size != found:
        got = part.stat().st_size
        _remove(part)
        raise error(f"{shown}: got {got} bytes, the file's header says {found}; the partial file was removed, "
                    "run again")
    verify(part, size, checksum, label=dest.name, algorithm=algorithm, error=error)
    part.replace(dest)
    return dest


def read_head(url: str, inspect: Inspect, headers: Mapping[str, str] | None = None, label: str | None = None,
              bounds: Bounds | None = None, opener: Callable[..., object] = urllib.request.urlopen,
              error: type[CaptionerError] = DataError) -> int | None:
    """Read only as much of ``url`` as ``inspect`` needs to judge the file, then close the connection.

    For a file another client will download (a Hub file): its header is checked first, and a lying
    or pickled file is refused before its body is fetched. Nothing is written to disk.
    Redirects are followed; an ``Authorization`` header in ``headers`` is not sent on to another host.
    ``label``: the file's name in messages (default: ``url`` with any password hidden). Returns the file's
    size as its header states it (None when ``inspect`` names none). Raises DownloadError when the server
    cannot be reached or answers an HTTP error; ``error`` for a header ``inspect`` refused, a file that ends
    inside its header, or a stalled transfer.
    """
    bounds, shown = bounds or Bounds(), label or redact(url)
    moved = _Progress(bounds)
    request = _request(url, 0)
    for key, value in (headers or {}).items():
        if key.lower() == "authorization":
            request.add_unredirected_header(key, value)
        else:
            request.add_header(key, value)
    response = _open(opener, request, shown, moved)
    head = _Head(inspect, Path(), 0)
    try:
        with response:
            while head.inspect is not None:
                chunk = _read(response, CHUNK)
                if not chunk:
                    head.finish()
                moved.add(len(chunk))
                head.feed(chunk)
    except Refused as exc:
        raise error(f"{shown}: {exc}; nothing was fetched") from None
    except (http.client.HTTPException, OSError, _Stalled) as exc:
        raise error(f"{shown}: reading its header failed ({_reason(exc)}); nothing was fetched") from None
    return head.size


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def file_digest(path: Path, algorithm: str = "sha256") -> str:
    """Hex digest of a regular file (never a device or a pipe: :func:`captioner.files.open_regular`), read in chunks."""
    digest = hashlib.new(algorithm)
    with open_regular(path, None, DataError) as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify(path: Path, size: int | None, checksum: str | None, label: str | None = None,
           algorithm: str = "md5", error: type[CaptionerError] = DataError, remove: bool = True) -> None:
    """Check size and checksum; on mismatch delete ``path`` (unless ``remove`` is False: a file captioner did
    not write, which it never deletes) and raise a one-line ``error``."""
    label = label or path.name
    kept = f"; {path} is not a file captioner wrote, so it was left in place: replace or remove it"
    actual = path.stat().st_size
    if size is not None and actual != size:
        if not remove:
            raise error(f"{label}: got {actual} bytes, expected {size}{kept}")
        path.unlink()
        raise error(f"{label}: got {actual} bytes, expected {size}; the partial file was removed, run again")
    if checksum is not None:
        got = file_digest(path, algorithm)
        if got != checksum.lower():
            if not remove:
                raise error(f"{label}: {algorithm.upper()} {got} does not match {checksum}{kept}")
            path.unlink()
            raise error(f"{label}: {algorithm.upper()} {got} does not match {checksum}; "
                        "the file was removed, run again")
