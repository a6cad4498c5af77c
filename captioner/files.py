"""Reading and writing files a user names: regular files only, every read bounded, writes atomic.

Every file read on a user's behalf goes through :func:`read_bytes` / :func:`read_text` /
:func:`read_json`, is opened with :func:`open_regular` or is checked with :func:`check_regular`, so a
named pipe cannot block, ``/dev/zero`` cannot fill memory and a huge file is refused from its size;
the error names the kind of file. Every write goes
through :func:`atomic_file` / :func:`atomic_write` (a temporary file in the same folder, fsync,
``os.replace``, folder fsync'ed): a symbolic link in the way is replaced, never followed, and a file
with other hard links is never written into; a file filled over time and resumed (a download's
``.part``) is opened with :func:`open_partial`, under the same two rules. Commands that
write into a folder a user names go through :class:`Outputs`, which never replaces a file captioner
did not write there (the folder's manifest, :data:`MANIFEST`, records its own files' size and
time) unless ``--force``. Two writers of one file take turns with :func:`hold_lock`, a ``filelock``
lock the operating system drops when its holder dies.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import signal
import stat
import tempfile
import threading
from importlib import resources
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from filelock import FileLock, Timeout

from captioner.errors import CaptionerError, CheckpointError, ConfigError

__all__ = ["MANIFEST", "MiB", "Outputs", "atomic_file", "atomic_write", "check_regular", "file_kind", "hold_lock", "lock_file",
           "lock_is_free", "open_regular", "package_texts", "read_bytes", "read_json", "read_text", "release_lock_file",
           "safe_name", "size_text", "interrupts_held", "open_partial", "writable_folder", "write_output"]

MiB = 1 << 20
_CHUNK = 8 * MiB
_LOCK_POLL = 0.1  # seconds between tries of a lock another process holds


def size_text(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units, as the limits are set)."""
    value = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{n} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def file_kind(mode: int) -> str | None:
    """What a ``st_mode`` is when it is not a regular file (``"named pipe"``, ``"directory"``, ...), else None."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISFIFO(mode):
        return "named pipe"
    if stat.S_ISCHR(mode):
        return "character device"
    if stat.S_ISBLK(mode):
        return "block device"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "special file"


def _os_reason(path: Path, exc: OSError) -> str:
    """One line for an OSError while opening or statting ``path``."""
    if isinstance(exc, FileNotFoundError):
        return f"{path}: {'broken symbolic link' if path.is_symlink() else 'file not found'}"
    if isinstance(exc, PermissionError):
        return f"{path}: permission denied"
    if exc.errno == errno.ELOOP:
        return f"{path}: symbolic link loop"
    if exc.errno == errno.ENXIO:
        return f"{path}: is a socket or a device without a reader, not a regular file"
    return f"{path}: cannot read file ({exc.strerror or exc})"


def check_regular(path: str | os.PathLike, limit: int | None, error: type[CaptionerError] = CaptionerError,
                  what: str = "file") -> int:
    """Refuse anything but a regular file of at most ``limit`` bytes (None: no bound), without opening it.

    Returns the size. Raises ``error``: missing, a broken link or loop, unreadable, not a regular file,
    or larger than ``limit`` (``what`` names it: ``"image file"``).
    """
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise error(_os_reason(path, exc)) from None
    except ValueError:  # an embedded NUL byte: no such file can exist
        raise error(f"{str(path)!r}: not a valid path (it holds a NUL byte)") from None
    _check_stat(path, st, limit, error, what)
    return st.st_size


def _check_stat(path: Path, st: os.stat_result, limit: int | None, error: type[CaptionerError], what: str) -> None:
    kind = file_kind(st.st_mode)
    if kind == "directory":
        raise error(f"{path}: is a directory, not {'an' if what[:1] in 'aeiou' else 'a'} {what}")
    if kind is not None:
        raise error(f"{path}: is a {kind}, not a regular file")
    if limit is not None and st.st_size > limit:
        raise error(f"{path}: {what} too large ({size_text(st.st_size)}, limit {size_text(limit)})")


def open_regular(path: str | os.PathLike, limit: int | None, error: type[CaptionerError] = CaptionerError,
                 what: str = "file") -> IO[bytes]:
    """Open a regular file for reading in binary, refusing anything else before a byte is read: checked,
    opened without blocking (a pipe with no writer cannot hang), checked again through the descriptor."""
    path = Path(path)
    check_regular(path, limit, error, what)  # names sockets and links before open() gets in the way
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise error(_os_reason(path, exc)) from None
    try:
        _check_stat(path, os.fstat(fd), limit, error, what)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | os.PathLike, limit: int, error: type[CaptionerError] = CaptionerError,
               what: str = "file") -> bytes:
    """The content of a regular file of at most ``limit`` bytes (opened with :func:`open_regular`).

    Read in chunks that stop one byte past ``limit``: a file that grows while it is read is still
    refused, not read whole.

    Raises:
        error: as :func:`open_regular`, or a read error (one line naming the file).
    """
    path = Path(path)
    with open_regular(path, limit, error, what) as f:
        chunks, total = [], 0
        try:
            while total <= limit:
                chunk = f.read(min(_CHUNK, limit + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
        except OSError as exc:
            raise error(f"{path}: cannot read file ({exc.strerror or exc})") from None
    if total > limit:
        raise error(f"{path}: {what} too large (more than {size_text(limit)})")
    return b"".join(chunks)


def read_text(path: str | os.PathLike, limit: int, error: type[CaptionerError] = CaptionerError,
              what: str = "file") -> str:
    """:func:`read_bytes` decoded as UTF-8; undecodable bytes are one ``error`` line naming the file."""
    data = read_bytes(path, limit, error, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte {exc.start})") from None


def read_json(path: str | os.PathLike, limit: int, error: type[CaptionerError] = CaptionerError,
              what: str = "JSON file", expect: type | None = None) -> Any:
    """:func:`read_text` parsed as JSON: every bounded JSON file the package reads comes through here.

    ``expect``: the type the top-level value must have (``list``, ``dict``); None accepts any. Raises
    ``error`` in one line naming the file: missing, too large, invalid JSON (line and column), nested
    too deeply, or not ``expect``.
    """
    if not os.path.lexists(path):
        raise error(f"{path}: {what} not found")
    text = read_text(path, limit, error, what).removeprefix("\ufeff")  # a UTF-8 byte order mark is allowed
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: invalid JSON at line {exc.lineno}, column {exc.colno} ({exc.msg})") from None
    except RecursionError:  # "[[[[..." nested deeper than the parser's recursion limit
        raise error(f"{path}: invalid JSON (nested too deeply)") from None
    if expect is not None and not isinstance(data, expect):
        kind = {dict: "object", list: "list"}.get(expect, expect.__name__)
        raise error(f"{path}: expected a JSON {kind}, got {type(data).__name__}")
    return data


def package_texts(package: str, stem: str, kinds: Iterable[str]) -> tuple[str, ...]:
    """The package data files ``<stem>.<kind>`` of ``package`` (a page's template, stylesheet, script), as UTF-8."""
    return tuple(resources.files(package).joinpath(f"{stem}.{kind}").read_text(encoding="utf-8") for kind in kinds)


def safe_name(name: str, fallback: str = "image") -> str:
    """A file name from user input that stays inside its folder: separators and control characters become ``_``.

    A name of dots only, or an empty one, becomes ``fallback``.
    """
    cleaned = "".join("_" if ch in "/\\" or ord(ch) < 32 or ch == "\x7f" else ch for ch in name)
    if not cleaned.strip("."):
        return fallback
    return cleaned


def writable_folder(path: str | os.PathLike, error: type[CaptionerError] = CaptionerError) -> Path:
    """The nearest existing folder of ``path``, checked writable by writing a hidden file there; creates nothing.

    Raises ``error`` when ``path`` or a parent is a file, or the folder cannot be written.
    """
    path = Path(path)
    probe = path
    while not probe.exists():
        if probe.is_symlink():
            raise error(f"{probe}: broken symbolic link, not a folder")
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        where = "" if probe == path else f" (so {path} cannot be created)"
        raise error(f"{probe}: is a file, not a folder{where}")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".captioner-write-test-", suffix=".tmp", dir=probe)
    except OSError as exc:
        raise error(f"{probe}: cannot write in this folder ({exc.strerror or exc})") from None
    os.close(fd)
    Path(tmp).unlink(missing_ok=True)
    return probe


def current_umask() -> int:
    """The process's umask (from /proc where there is one: reading it elsewhere means setting it briefly)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any],
                 error: type[CaptionerError] = CheckpointError,
                 after: Callable[[Path], Any] | None = None, sync: bool = True) -> Path:
    """Write a file so that readers see either the old or the complete new content.

    ``write(f)`` fills a temporary file in the same folder, renamed over ``path``; on any failure it
    is removed and ``path`` left untouched. The file gets a plain ``open``'s mode. ``after(path)``
    runs right after the rename, with Ctrl-C held until it returns (a manifest entry: an interrupted
    run leaves no file that its manifest does not name). See :func:`atomic_file`.
    """
    with atomic_file(path, error, after, sync) as f:
        write(f)
    return Path(path)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, error: type[CaptionerError] = CheckpointError,
                after: Callable[[Path], Any] | None = None, sync: bool = True) -> Iterator[IO[bytes]]:
    """The one write path: a binary file to fill in the ``with`` block, then renamed over ``path`` at once.

    A temporary file in the same folder (``.<name>.*.tmp``, created exclusively), fsync'ed, then
    ``os.replace``: a symbolic link at ``path`` is replaced, never followed, and a file with other
    hard links keeps its content (a new inode takes the name). On any failure or interrupt the
    temporary file is removed and ``path`` is untouched; an ``OSError`` becomes one ``error`` line.
    ``sync=False`` skips the fsyncs (thousands of files a command can make again, such as the shapes'
    images: still all or nothing for every reader, only not flushed to the disk one by one).
    """
    path = Path(path)
    folder = path.parent
    if not folder.is_dir():
        raise error(f"{path}: folder {folder} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:200]}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise error(f"{path}: cannot write ({exc.strerror or exc})") from None
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
        with interrupts_held():
            os.replace(tmp, path)
            if after is not None:
                after(path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise error(f"{path}: cannot write ({exc.strerror or exc})") from None
        raise
    if sync:
        _fsync_dir(folder)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) for a few statements that must finish together, then act on it.

    Only in the main thread (elsewhere, and where signals cannot be set, the block runs as is).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    except (ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and previous is not signal.SIG_IGN:
            if callable(previous):
                previous(signal.SIGINT, None)
            else:  # SIG_DFL, or a handler set outside Python
                raise KeyboardInterrupt


def open_partial(path: str | os.PathLike, append: bool, error: type[CaptionerError] = CaptionerError) -> IO[bytes]:
    """Open a partial file that captioner fills over time and renames when complete (a download's ``.part``).

    ``append``: continue the file; otherwise it starts empty (an old one is unlinked first, never
    truncated in place). Never through a symbolic link, never into a file with other hard links:
    both are one ``error`` line naming ``path``.
    """
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        if append:
            flags |= os.O_APPEND
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            flags |= os.O_EXCL
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise error(f"{path}: is a symbolic link; captioner does not write through it (remove it)") from None
        raise error(f"{path}: cannot write ({exc.strerror or exc})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        why = "has other hard links" if stat.S_ISREG(st.st_mode) else f"is a {file_kind(st.st_mode)}"
        raise error(f"{path}: {why}; captioner does not write into it (remove it)")
    return os.fdopen(fd, "ab" if append else "wb")


def write_output(path: str | os.PathLike, write: Callable[[IO[bytes]], Any], outputs: "Outputs | None" = None,
                 error: type[CaptionerError] = CaptionerError) -> Path:
    """:meth:`Outputs.write` when a command passes its ``outputs``, else :func:`atomic_write` (a library call)."""
    if outputs is not None:
        return outputs.write(path, write)
    return atomic_write(path, write, error)


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


def lock_file(path: str | os.PathLike) -> Path:
    """``<path>.lock``, the file the writers of ``path`` lock."""
    path = Path(path)
    return path.with_name(path.name + ".lock")


@contextlib.contextmanager
def hold_lock(lock: str | os.PathLike, timeout: float | None = None,
              busy: Callable[[], Exception] | None = None) -> Iterator[Path]:
    """Hold an exclusive lock on the file ``lock`` for the ``with`` block; yield it (a holder may write its pid).

    ``timeout``: seconds to wait (None: as long as it takes), then raise ``busy``.
    """
    held = FileLock(lock, timeout=-1 if timeout is None else max(0.0, timeout), poll_interval=_LOCK_POLL)
    try:
        held.acquire()
    except Timeout:
        raise (busy() if busy is not None else CaptionerError(f"{lock}: held by another process")) from None
    try:
        yield Path(lock)
    finally:
        held.release()


def lock_is_free(lock: str | os.PathLike, timeout: float) -> bool:
    """True when nobody holds ``lock`` (after waiting up to ``timeout`` s), or it does not exist."""
    if not Path(lock).exists():
        return True
    try:
        with hold_lock(lock, timeout):
            return True
    except CaptionerError:
        return False


def release_lock_file(lock: str | os.PathLike, remove_folder: bool = True) -> None:
    """Remove a lock file nobody holds, and (``remove_folder``) its folder when that is left empty (after a
    failed write into a folder of the cache's own)."""
    lock = Path(lock)
    try:
        with hold_lock(lock, 0.0):
            lock.unlink(missing_ok=True)  # a waiter that opened it sees an unlinked file and opens a new one
    except (CaptionerError, OSError):
        return
    if remove_folder:
        with contextlib.suppress(OSError):
            lock.parent.rmdir()


def file_sha256(path: str | os.PathLike, error: type[CaptionerError] = CaptionerError) -> str:
    """The SHA-256 of a regular file (:func:`open_regular`: never a device or a pipe), read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open_regular(path, None, error) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


MANIFEST = ".captioner-files.json"  # in a folder a command wrote into: the files it wrote there
MAX_MANIFEST = 256 * MiB  # a manifest larger than this is not read (nothing in the folder counts as captioner's)


@dataclass(frozen=True)
class Outputs:
    """The files one command writes into a folder the user named, and the rule that protects the rest.

    Writers call :meth:`check` with the paths they will write before any work and :meth:`record` after.

    Attributes:
        root: the folder the user named; the manifest lives there. ``option``: how (``"--out"``).
        force: replace any file (``--force``).
        replace_own: replace captioner's own earlier files without ``--force`` (False where an earlier
            result is work to keep: an evaluation, a run).
    """

    root: Path
    force: bool = False
    option: str = "--out"
    replace_own: bool = True
    error: type[CaptionerError] = ConfigError

    @property
    def manifest(self) -> Path:
        return Path(self.root) / MANIFEST

    def owned(self) -> dict[str, list[int]]:
        """The manifest's ``{path relative to root: [size, mtime_ns]}`` (empty when there is none or it is bad)."""
        try:
            data = json.loads(read_text(self.manifest, MAX_MANIFEST))
        except (CaptionerError, ValueError):
            return {}
        files = data.get("files") if isinstance(data, dict) else None
        return {k: v for k, v in files.items() if isinstance(v, list)} if isinstance(files, dict) else {}

    def owns(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` is a regular file captioner wrote there: in the manifest with its size and time."""
        try:
            st = os.lstat(path)
        except OSError:
            return False
        return self._mine(self.owned(), path, st)

    def _mine(self, owned: dict[str, list[int]], path: str | os.PathLike, st: os.stat_result) -> bool:
        """A regular file that ``owned`` (the manifest) lists with the size and time it has now."""
        return stat.S_ISREG(st.st_mode) and owned.get(self._key(path)) == [st.st_size, st.st_mtime_ns]

    def _key(self, path: str | os.PathLike) -> str:
        path, root = Path(path), Path(self.root)
        try:
            rel = path.relative_to(root)
        except ValueError:
            rel = Path(os.path.relpath(path.resolve(), root.resolve()))
        return rel.as_posix()

    def check(self, paths: Iterable[str | os.PathLike]) -> list[Path]:
        """Refuse, in one line naming the first such file, to replace what captioner did not write.

        Returns those of ``paths`` that exist now (they will be replaced).
        """
        owned = None
        present, refused = [], []
        root = os.path.realpath(self.root)
        for path in map(Path, paths):
            self._check_inside(path, root)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise self.error(f"{path}: cannot be checked before writing ({exc.strerror or exc})") from None
            if stat.S_ISDIR(st.st_mode):
                raise self.error(f"{path}: is a folder where a file is to be written; choose another {self.option}")
            present.append(path)
            if self.force:
                continue
            if owned is None:
                owned = self.owned()
            mine = self._mine(owned, path, st)
            if not mine or not self.replace_own:
                refused.append((path, mine))
        if refused:
            path, mine = refused[0]
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            whose = "written by an earlier run" if mine else "not written by captioner"
            raise self.error(f"{path}: already exists, {whose}{more}; choose another {self.option} or pass "
                             "--force to replace it")
        return present

    def _check_inside(self, path: Path, root: str) -> None:
        """Refuse a file below the root whose folder is reached through a symbolic link that leads out of it
        (``out/photo -> /elsewhere``): the write would land outside the folder the user named."""
        try:
            path.relative_to(self.root)
        except ValueError:
            return  # not below the root lexically: the caller named it on purpose
        folder = os.path.realpath(path.parent)
        if folder != root and not folder.startswith(root.rstrip(os.sep) + os.sep):
            raise self.error(f"{path.parent}: leads outside {self.root} ({folder}, through a symbolic link); "
                             f"remove the link or choose another {self.option}")

    def write(self, path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
        """Write one file with :func:`atomic_write` and record it in the manifest in the same step (Ctrl-C
        held between the two), so that an interrupted command leaves only complete files, each its own.

        Neither is fsync'ed (a command can write them again; the rename is still all or nothing for
        every reader): thousands of overlays would otherwise wait on the disk several times each."""
        return atomic_write(path, write, self.error, after=lambda written: self.record([written], sync=False),
                            sync=False)

    def record(self, paths: Iterable[str | os.PathLike], sync: bool = True) -> None:
        """Add ``paths`` (written by this command) to the manifest; entries of their folders whose file is
        gone are dropped. ``sync``: fsync the manifest (see :func:`atomic_file`)."""
        new = {}
        for path in map(Path, paths):
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                new[self._key(path)] = [st.st_size, st.st_mtime_ns]
        if not new:
            return
        lock = lock_file(self.manifest)
        try:
            with hold_lock(lock):  # two writers into one folder never lose each other's entries
                folders = {k.rpartition("/")[0] for k in new}  # only these are looked at: one stat per file
                files = {k: v for k, v in self.owned().items()
                         if k.rpartition("/")[0] not in folders or (Path(self.root) / k).is_file()}
                files.update(new)
                text = json.dumps({"format": "captioner-files", "version": 1, "files": files}, sort_keys=True,
                                  separators=(",", ":"))  # json's C encoder: no indent
                atomic_write(self.manifest, lambda f: f.write(text.encode("utf-8")), error=self.error, sync=sync)
        finally:
            release_lock_file(lock, remove_folder=False)
