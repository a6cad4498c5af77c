"""Dataset archives behind ``captioner download flickr8k|coco`` (docs/data.md).

The shared archive loop (:func:`prepare`: download, check and extract each archive not yet present;
``root/downloads/`` holds the zips) and bounded zip extraction (:func:`write_members`: atomic, never
outside the destination, within :class:`ArchiveBounds`, so zip bombs stop at a bound), then each
dataset's archives and layout, grouped as :data:`flickr8k` and :data:`coco`. The HTTP transfer
(resume, checksum) is :mod:`captioner.network`. Errors are one-line ``DataError`` naming the file;
an archive that cannot be extracted is removed with what it wrote, so the next run fetches it again.

COCO 2014's sizes and MD5s are checked where known. Flickr8k's mirror (jbrownlee/Datasets) publishes no
digests, so ``Flickr8k.sha256`` keeps the zips' digests as downloaded and ``--sha256 KEY=HEX`` checks a
new download against known ones. A zip in ``downloads/`` that captioner
did not write (a user's) is read, never replaced or deleted.
"""

from __future__ import annotations

import contextlib
import errno
import os
import logging
import zipfile
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from types import SimpleNamespace
from typing import Any

from captioner.network import CHUNK, Bounds, download, file_digest, verify
from captioner.errors import ConfigError, DataError
from captioner.files import (MiB, Outputs, atomic_file, atomic_write, check_regular, hold_lock, read_text,
                             release_lock_file)

__all__ = ["BOUNDS", "COCO_ARCHIVES", "FLICKR8K_ARCHIVES", "FLICKR8K_BASE", "INSTANCE_MEMBERS", "ArchiveBounds",
           "CocoArchive", "Flickr8kArchive", "Steps", "coco", "coco_is_present", "extract_coco", "extract_flickr8k",
           "flickr8k", "flickr8k_is_present", "mirror_url", "open_zip", "parse_sha256", "prepare", "prepare_coco",
           "prepare_flickr8k", "record_digest", "select_coco_archives", "select_flickr8k_archives", "write_members"]

log = logging.getLogger("captioner.download")
_flickr8k_log = logging.getLogger("captioner.download.flickr8k")
MARKER = ".extracted"  # in an extracted folder: its archive was extracted completely
LOCK = ".captioner-download.lock"  # in a dataset folder: held by the download writing into it


# --- archives: what both datasets share ---

@dataclass(frozen=True)
class ArchiveBounds:
    """What extracting one archive may write (a zip bomb stops at the first bound it crosses).

    Attributes:
        member_bytes: the largest member, counted as it is written (its stated size is checked first).
        ratio: the largest expansion (bytes written per compressed byte), of each member and of all
            members together, once past ``ratio_floor`` bytes.
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
    check_regular(zip_path, None, DataError, "zip archive")  # a pipe would block, /dev/zero never end
    try:
        return zipfile.ZipFile(zip_path)
    except (zipfile.BadZipFile, EOFError, ValueError) as exc:
        raise DataError(f"{zip_path}: not a valid zip archive ({_why(exc)})") from None


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


class _Budget:
    """What one archive may still write: bytes in all, and bytes per compressed byte over all members."""

    def __init__(self, zip_path: Path, bounds: ArchiveBounds) -> None:
        self.zip_path, self.bounds = zip_path, bounds
        self.written = 0
        self.compressed = 0

    def check(self, what: str) -> None:
        """Raise when past a bound; ``what`` says what was counted (``"its members state"``, ``"at member 'x'"``)."""
        b = self.bounds
        if self.written > b.total_bytes:
            raise DataError(f"{self.zip_path}: {what} {self.written} bytes in all, over the limit of "
                            f"{b.total_bytes} bytes (a zip bomb?)")
        if self.written > b.ratio_floor and self.written > b.ratio * max(self.compressed, 1):
            raise DataError(f"{self.zip_path}: {what} {self.written} bytes in all from {self.compressed} "
                            f"compressed bytes, more than {b.ratio:g} times (a zip bomb?)")


def _check_stated(zf: zipfile.ZipFile, zip_path: Path, names: Sequence[str], bounds: ArchiveBounds) -> None:
    """Refuse from the stated sizes alone, before anything is written: a member over ``member_bytes``,
    all members over ``total_bytes``, or over ``ratio`` times their compressed bytes in all."""
    budget = _Budget(zip_path, bounds)
    for name in names:
        info = zf.getinfo(name)
        if info.file_size > bounds.member_bytes:
            raise DataError(f"{zip_path}: member {name!r} states {info.file_size} bytes, over the limit of "
                            f"{bounds.member_bytes} bytes (a zip bomb?)")
        budget.written += info.file_size
        budget.compressed += info.compress_size
    budget.check("its members state")


def _copy_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, dst: Any, out: Path, zip_path: Path,
                 bounds: ArchiveBounds, budget: _Budget) -> int:
    """Stream one member into ``dst`` (the temporary file of ``out``), counted against the member bound and
    the archive's ``budget``."""
    limit = bounds.member_bytes
    where = f"{zip_path}: member {info.filename!r}"
    if info.flag_bits & 0x1:
        raise DataError(f"{where} cannot be extracted (it is encrypted: a password would be needed)")
    budget.compressed += info.compress_size
    written = 0
    with zf.open(info) as src:
        while chunk := src.read(CHUNK):
            written += len(chunk)
            budget.written += len(chunk)
            if written > limit:
                raise DataError(f"{where} expands past {limit} bytes (a zip bomb?)")
            if written > bounds.ratio_floor and written > bounds.ratio * max(info.compress_size, 1):
                raise DataError(f"{where} expands more than {bounds.ratio:g} times its {info.compress_size} "
                                "compressed bytes (a zip bomb?)")
            budget.check(f"up to member {info.filename!r} it expands to")
            try:
                dst.write(chunk)
            except OSError as exc:
                raise _cannot_write(out, zip_path, exc) from None
    return written


def _cannot_write(path: Path, zip_path: Path, exc: OSError) -> DataError:
    hint = "; free some space and run again" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return DataError(f"{path}: cannot write while extracting {zip_path} ({exc.strerror or exc}); what this "
                     f"archive had written was removed{hint}")


def write_members(zf: zipfile.ZipFile, zip_path: Path, root: Path, pairs: Iterable[tuple[str, str]],
                  bounds: ArchiveBounds | None = None) -> list[Path]:
    """Extract ``(member name, destination relative to root)`` pairs, each written atomically, within ``bounds``.

    On any failure what this call wrote is removed. Raises ``DataError`` (one line naming it) for a
    destination outside ``root``, a bound crossed, a corrupt, encrypted or unsupported member, or a
    failed write.
    """
    bounds = bounds or BOUNDS
    pairs = list(pairs)
    written: list[Path] = []
    base = root.resolve()
    try:
        _check_stated(zf, zip_path, [name for name, _ in pairs], bounds)
        budget = _Budget(zip_path, bounds)
        for name, rel in pairs:
            out = (root / rel).resolve()
            if base not in out.parents:
                raise DataError(f"{zip_path}: member {name!r} would escape {root}")
            try:
                out.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise _cannot_write(out.parent, zip_path, exc) from None
            try:
                with atomic_file(out, DataError, after=written.append) as dst:
                    _copy_member(zf, zf.getinfo(name), dst, out, zip_path, bounds, budget)
            except _CORRUPT as exc:
                raise DataError(f"{zip_path}: member {name!r} cannot be extracted ({_why(exc)})") from None
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return written


@dataclass(frozen=True)
class Steps:
    """What one dataset does with one of its archives (an object with ``key``, ``name``, ``url``).

    Attributes:
        is_present: ``(root, archive) -> bool``: its content is already extracted.
        where: ``(root, archive) -> str``: what it fills; ``describe``: ``archive -> str``, what is checked.
        fetch: ``(zip_path, root, archive, progress) -> None``: download and check it.
        check: ``(zip_path, archive) -> None``: check a user's zip, never removing it.
        extract: ``(zip_path, root, archive, outputs) -> list[Path]``: the files written, none of them a user's.
        writes: ``(root, archive) -> list[Path]``: the files known before the download.
    """

    is_present: Callable[[Path, Any], bool]
    where: Callable[[Path, Any], str]
    describe: Callable[[Any], str]
    fetch: Callable[[Path, Path, Any, bool], None]
    check: Callable[[Path, Any], None]
    extract: Callable[[Path, Path, Any, Outputs], list[Path]]
    writes: Callable[[Path, Any], list[Path]]


def mirror_url(mirror: str | None, archive_url: str) -> str:
    """``archive_url``, or ``MIRROR/<its file name>``; ``DataError`` unless ``mirror`` is an http(s):// or file:// URL."""
    if mirror is None:
        return archive_url
    scheme = mirror.partition("://")[0].lower() if "://" in mirror else ""
    if scheme not in ("http", "https", "file") or not mirror.partition("://")[2].strip("/ ") and scheme != "file":
        raise DataError(f"--mirror {mirror[:200]!r}: not a mirror URL; give http(s)://HOST/PATH or file:///FOLDER")
    return f"{mirror.rstrip('/')}/{archive_url.rsplit('/', 1)[-1]}"


def _remove_empty(folders: Sequence[Path]) -> None:
    """Remove each of ``folders`` (deepest first) that is empty: what a failed run created and left unused."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break


def prepare(root: Path, archives: Sequence[Any], steps: Steps, dry_run: bool = False, keep_archives: bool = False,
            progress: bool | None = None, force: bool = False) -> list[str]:
    """Download, check and extract each archive not yet present; return the actions done or planned.

    A user's file under ``root`` is never replaced unless ``force`` (``ConfigError``); a failure leaves
    no empty folder it created.
    """
    outputs = Outputs(root, force=force, option="--root")
    downloads = root / "downloads"
    made = [d for d in (downloads, root, *root.parents) if not d.exists()]  # deepest first
    lock = root / LOCK
    locked = dry_run  # the folders made are ours to remove only once the root is ours
    try:
        with contextlib.ExitStack() as held:
            if not dry_run:  # one download into a root at a time: another would share its .part files
                try:
                    root.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise DataError(f"{root}: cannot create the dataset folder ({exc.strerror or exc})") from None
                held.callback(release_lock_file, lock, False)
                held.enter_context(hold_lock(lock, 0.0, busy=lambda: DataError(
                    f"{root}: another captioner download is writing into this folder (it holds {lock}); wait "
                    "for it to finish, then run again")))
                locked = True
            for a in archives:
                if not steps.is_present(root, a):
                    outputs.check(steps.writes(root, a))
            return _prepare(root, archives, steps, dry_run, keep_archives, progress, outputs)
    except BaseException:
        if locked:  # refused the lock: the folders may be the holder's, which is writing into them now
            _remove_empty(made)
        raise


def _prepare(root: Path, archives: Sequence[Any], steps: Steps, dry_run: bool, keep_archives: bool, progress: bool,
             outputs: Outputs) -> list[str]:
    actions = []
    downloads = root / "downloads"
    for a in archives:
        zip_path = downloads / a.name
        if steps.is_present(root, a):
            actions.append(f"skip {a.key}: {steps.where(root, a)} is present")
            continue
        users = os.path.lexists(zip_path) and not outputs.owns(zip_path)  # read, never replaced or deleted
        if users:
            actions.append(f"use {zip_path} (not downloaded by captioner: read, checked, never deleted)")
        elif zip_path.exists():
            actions.append(f"use {zip_path} (already downloaded)")
        else:
            part = zip_path.with_name(zip_path.name + ".part")
            resume = f", resuming at {part.stat().st_size} bytes" if part.exists() else ""
            actions.append(f"download {a.url} -> {zip_path} ({steps.describe(a)}{resume})")
        actions.append(f"extract {a.name} -> {steps.where(root, a)}")
        if not keep_archives and not users:
            actions.append(f"delete {zip_path}")
        if dry_run:
            continue
        downloads.mkdir(parents=True, exist_ok=True)
        if users:
            steps.check(zip_path, a)
        else:
            steps.fetch(zip_path, root, a, progress)
        own = [] if users else [zip_path]  # recorded while it stays: a later run may use or delete it
        log.info("extracting %s", zip_path)
        try:
            outputs.record(steps.extract(zip_path, root, a, outputs) + (own if keep_archives else []))
        except ConfigError:  # a user's file in the way: the zip is kept for the next run
            outputs.record(own)
            raise
        except DataError as exc:  # kept, it would fail the same way on every run
            if users:
                raise DataError(f"{exc}; {zip_path} is not a file captioner wrote, so it was left in place: "
                                "replace or remove it") from None
            zip_path.unlink(missing_ok=True)
            raise DataError(f"{exc}; {zip_path} was removed: run again to download it again") from None
        if not keep_archives and not users:
            zip_path.unlink()
    return actions


# --- COCO 2014 ---

@dataclass(frozen=True)
class CocoArchive:
    """One file to fetch (``key`` for ``--only``; ``size``/``md5`` None when unknown), its members and ``target``."""

    key: str
    url: str
    size: int | None
    md5: str | None
    members: tuple[tuple[str, str], ...]
    target: str

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]


COCO_ARCHIVES = (
    CocoArchive("train", "http://images.cocodataset.org/zips/train2014.zip", 13510573713,
            "0da8c0bd3d6becc4dcb32757491aca88", (("train2014/", "train2014/"),), "train2014"),
    CocoArchive("val", "http://images.cocodataset.org/zips/val2014.zip", 6645013297,
            "a3d79f5ed8d289b7a7554ce06a5782b3", (("val2014/", "val2014/"),), "val2014"),
    CocoArchive("annotations", "http://images.cocodataset.org/annotations/annotations_trainval2014.zip", 252872794,
            "0a379cfc70b0e71301e0f377548639bd",
            (("annotations/captions_train2014.json", "annotations/captions_train2014.json"),
             ("annotations/captions_val2014.json", "annotations/captions_val2014.json")),
            "annotations/captions_val2014.json"),
    # Karpathy & Fei-Fei 2015 splits; no published checksum.
    CocoArchive("karpathy", "https://cs.stanford.edu/people/karpathy/deepimagesent/caption_datasets.zip", None, None,
            (("dataset_coco.json", "dataset_coco.json"),), "dataset_coco.json"),
)
INSTANCE_MEMBERS = (("annotations/instances_train2014.json", "annotations/instances_train2014.json"),
                    ("annotations/instances_val2014.json", "annotations/instances_val2014.json"))


def select_coco_archives(only: Sequence[str] | None = None, mirror: str | None = None,
                         instances: bool = False) -> list[CocoArchive]:
    """The archives to process, with ``--only``, ``--mirror`` and ``--instances`` applied."""
    keys = [a.key for a in COCO_ARCHIVES]
    bad = sorted(set(only or ()) - set(keys))
    if bad:
        raise DataError(f"unknown archive(s) {', '.join(bad)}; choose from {', '.join(keys)}")
    out = []
    for a in COCO_ARCHIVES:
        if only and a.key not in only:
            continue
        url = mirror_url(mirror, a.url)
        members = a.members + INSTANCE_MEMBERS if instances and a.key == "annotations" else a.members
        out.append(CocoArchive(a.key, url, a.size, a.md5, members, a.target))
    return out


def coco_is_present(root: Path, archive: CocoArchive) -> bool:
    """True when the archive's extracted content is already in place."""
    target = root / archive.target
    if target.is_dir():
        return (target / MARKER).exists()
    return all((root / dest).exists() for _, dest in archive.members)


def coco_writes(root: Path, archive: CocoArchive) -> list[Path]:
    """The files known before the download: single members (a folder's files are known from the zip)."""
    return [root / dest for prefix, dest in archive.members if not prefix.endswith("/")] + _coco_marker(root, archive)


def _coco_marker(root: Path, archive: CocoArchive) -> list[Path]:
    """The completion marker of an archive extracted into a folder (``train2014/.extracted``), if it has one."""
    return [root / archive.target / MARKER] if any(p.endswith("/") for p, _ in archive.members) else []


def extract_coco(zip_path: Path, root: Path, archive: CocoArchive, outputs: Outputs | None = None) -> list[Path]:
    """Extract the archive's members under ``root`` (folders get a completion marker); return the files written."""
    outputs = outputs or Outputs(root, option="--root")
    with open_zip(zip_path) as zf:
        names = zf.namelist()
        pairs = []
        for prefix, dest in archive.members:
            matched = [n for n in names if n == prefix or (prefix.endswith("/") and n.startswith(prefix))]
            if not matched:
                raise DataError(f"{zip_path}: has no {prefix!r} (is it the right archive?)")
            pairs += [(name, dest + name[len(prefix):] if prefix.endswith("/") else dest)
                      for name in matched if not name.endswith("/")]
        outputs.check([root / dest for _, dest in pairs] + _coco_marker(root, archive))
        written = write_members(zf, zip_path, root, pairs)
    target = root / archive.target
    if target.is_dir():
        _write_marker(target, zip_path)
        written.append(target / MARKER)
    return written


def _fetch_coco(zip_path: Path, root: Path, a: CocoArchive, progress: bool | None) -> None:
    if not zip_path.exists():
        download(a.url, zip_path, a.size, a.md5, progress=progress)


COCO_STEPS = Steps(is_present=coco_is_present, where=lambda root, a: f"{root}/{{{', '.join(d for _, d in a.members)}}}",
                   describe=lambda a: f"{a.size / 1e9:.2f} GB" if a.size else "size unknown",
                   fetch=_fetch_coco, extract=extract_coco, writes=coco_writes,
                   check=lambda path, a: verify(path, a.size, a.md5, remove=False))


def prepare_coco(root: Path, archives: Sequence[CocoArchive], dry_run: bool = False, keep_archives: bool = False,
                 progress: bool | None = None, force: bool = False) -> list[str]:
    """Download, verify and extract each archive not yet present; returns the actions (done or planned)."""
    return prepare(root, archives, COCO_STEPS, dry_run, keep_archives, progress, force)


# --- Flickr8k ---

FLICKR8K_BASE = "https://github.com/jbrownlee/Datasets/releases/download/Flickr8k"
FLICKR8K_RECORD = "Flickr8k.sha256"
# the mirror states no sizes: bounds a few times over the real ones (1.1 GB and 2.3 MB)
FLICKR8K_BOUNDS = {"images": Bounds(max_bytes=4 << 30), "text": Bounds(max_bytes=64 << 20)}


@dataclass(frozen=True)
class Flickr8kArchive:
    """One zip of the mirror: ``key`` (``--only``, ``--sha256 KEY=HEX``), its ``folder``, member ``suffix`` and a ``needed`` file."""

    key: str
    url: str
    sha256: str | None
    folder: str
    suffix: str
    needed: str | None

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]


FLICKR8K_ARCHIVES = (
    Flickr8kArchive("images", f"{FLICKR8K_BASE}/Flickr8k_Dataset.zip", None, "Flicker8k_Dataset", ".jpg", None),
    Flickr8kArchive("text", f"{FLICKR8K_BASE}/Flickr8k_text.zip", None, "Flickr8k_text", "", "Flickr8k.token.txt"),
)


def parse_sha256(items: Sequence[str] | None) -> dict[str, str]:
    """``["images=HEX", ...]`` -> ``{"images": "hex"}``; DataError for a bad key or digest."""
    keys = [a.key for a in FLICKR8K_ARCHIVES]
    out = {}
    for item in items or ():
        key, _, value = item.partition("=")
        value = value.strip().lower()
        if key not in keys or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
            raise DataError(f"--sha256 {item!r}: expected KEY=HEX with KEY one of {', '.join(keys)} "
                            "and a 64-digit SHA-256")
        out[key] = value
    return out


def select_flickr8k_archives(only: Sequence[str] | None = None, mirror: str | None = None,
                             sha256: dict[str, str] | None = None) -> list[Flickr8kArchive]:
    """The archives to process, with ``--only``, ``--mirror`` and ``--sha256`` applied."""
    out = []
    for a in FLICKR8K_ARCHIVES:
        if only and a.key not in only:
            continue
        url = mirror_url(mirror, a.url)
        out.append(replace(a, url=url, sha256=(sha256 or {}).get(a.key, a.sha256)))
    return out


def flickr8k_is_present(root: Path, archive: Flickr8kArchive) -> bool:
    """True when the archive was extracted completely (its folder has the marker)."""
    return (root / archive.folder / MARKER).exists()


def _flickr8k_members(names: Sequence[str], archive: Flickr8kArchive) -> list[tuple[str, str]]:
    """``(member, destination)`` pairs: the files to take, flattened into the archive's folder."""
    pairs: dict[str, str] = {}
    for name in names:
        path = PurePosixPath(name)
        if name.endswith("/") or "__MACOSX" in path.parts or path.name.startswith(".") \
                or not path.name.lower().endswith(archive.suffix):
            continue
        pairs.setdefault(path.name, name)  # the first of two same-named files wins
    return [(member, f"{archive.folder}/{base}") for base, member in sorted(pairs.items())]


def flickr8k_writes(root: Path, archive: Flickr8kArchive) -> list[Path]:
    """The files known before the download: the folder's marker, the needed file and the SHA-256 record."""
    folder = root / archive.folder
    return [folder / MARKER, root / FLICKR8K_RECORD] + ([folder / archive.needed] if archive.needed else [])


def extract_flickr8k(zip_path: Path, root: Path, archive: Flickr8kArchive, outputs: Outputs | None = None
                     ) -> list[Path]:
    """Extract the archive flattened into ``root/<folder>/`` and only then record its SHA-256; return the files written."""
    outputs = outputs or Outputs(root, option="--root")
    with open_zip(zip_path) as zf:
        pairs = _flickr8k_members(zf.namelist(), archive)
        what = archive.needed or f"*{archive.suffix}"
        if not pairs or (archive.needed and archive.needed not in {PurePosixPath(d).name for _, d in pairs}):
            raise DataError(f"{zip_path}: has no {what} (is it the right archive?)")
        outputs.check([root / dest for _, dest in pairs] + flickr8k_writes(root, archive))
        written = write_members(zf, zip_path, root, pairs)
    _write_marker(root / archive.folder, zip_path)
    digest = archive.sha256 or file_digest(zip_path, "sha256")
    record_digest(root, zip_path.name, digest)
    written += [root / archive.folder / MARKER, root / FLICKR8K_RECORD]
    _flickr8k_log.info("%s: %d bytes, SHA-256 %s%s", zip_path.name, zip_path.stat().st_size, digest,
                       " (checked)" if archive.sha256 else f" (recorded in {root / FLICKR8K_RECORD})")
    return written


def record_digest(root: Path, name: str, digest: str) -> None:
    """Add or replace ``name``'s line in ``root/Flickr8k.sha256``."""
    path = root / FLICKR8K_RECORD
    lines = read_text(path, MiB, DataError, "SHA-256 record").splitlines() if path.exists() else []
    lines = [line for line in lines if not line.endswith(f"  {name}")] + [f"{digest}  {name}"]
    text = "\n".join(sorted(lines, key=lambda line: line.split("  ", 1)[-1])) + "\n"
    atomic_write(path, lambda f: f.write(text.encode("utf-8")), DataError)


def _write_marker(folder: Path, zip_path: Path) -> None:
    """The completion marker of an extracted folder."""
    atomic_write(folder / MARKER, lambda f: f.write(f"extracted from {zip_path.name}\n".encode("utf-8")), DataError)


def _fetch_flickr8k(zip_path: Path, root: Path, a: Flickr8kArchive, progress: bool | None) -> None:
    """Download (unless kept from an earlier run) and check the SHA-256 when one is known."""
    if not zip_path.exists():
        download(a.url, zip_path, progress=progress, bounds=FLICKR8K_BOUNDS[a.key])
    if a.sha256:  # also a zip kept from an earlier run; a mismatch removes it
        verify(zip_path, None, a.sha256, label=a.name, algorithm="sha256")


FLICKR8K_STEPS = Steps(is_present=flickr8k_is_present, where=lambda root, a: f"{root / a.folder}/",
                       describe=lambda a: "SHA-256 checked" if a.sha256 else "SHA-256 recorded, not checked",
                       fetch=_fetch_flickr8k, extract=extract_flickr8k, writes=flickr8k_writes,
                       check=lambda path, a: verify(path, None, a.sha256, label=a.name, algorithm="sha256",
                                                    remove=False))


def prepare_flickr8k(root: Path, archives: Sequence[Flickr8kArchive], dry_run: bool = False,
                     keep_archives: bool = False, progress: bool | None = None, force: bool = False) -> list[str]:
    """Download, check and extract each archive not yet present; returns the actions (done or planned)."""
    return prepare(root, archives, FLICKR8K_STEPS, dry_run, keep_archives, progress, force)


# --- each dataset's names under the names the command and the tests use (``flickr8k.prepare``...) ---

coco = SimpleNamespace(Archive=CocoArchive, ARCHIVES=COCO_ARCHIVES, INSTANCE_MEMBERS=INSTANCE_MEMBERS,
                       select_archives=select_coco_archives, is_present=coco_is_present, extract=extract_coco,
                       prepare=prepare_coco)
flickr8k = SimpleNamespace(Archive=Flickr8kArchive, ARCHIVES=FLICKR8K_ARCHIVES, BASE=FLICKR8K_BASE,
                           parse_sha256=parse_sha256, select_archives=select_flickr8k_archives,
                           is_present=flickr8k_is_present, extract=extract_flickr8k, record_digest=record_digest,
                           prepare=prepare_flickr8k)
