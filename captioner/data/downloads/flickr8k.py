"""Download Flickr8k from the widely used public mirror and unzip it into the official layout.

    captioner download flickr8k --root data/flickr8k             # both zips (about 1 GB)
    captioner download flickr8k --root data/flickr8k --dry-run   # list what it would do
    captioner download flickr8k --root data/flickr8k --sha256 images=HEX --sha256 text=HEX
    captioner train --preset sat_soft_lite --data data/flickr8k --set data.val_split=dev

The mirror is the "Flickr8k" release of github.com/jbrownlee/Datasets (the official form-based
download of Hodosh et al. is gone): ``Flickr8k_Dataset.zip`` (about 1 GB) and
``Flickr8k_text.zip`` (about 2 MB). Files it writes under ``--root`` (the layout
``load_caption_set`` reads as ``--data``, splits ``train``, ``dev``, ``test``)::

    Flicker8k_Dataset/*.jpg                  the 8,091 photos (sic: "Flicker", as in the original)
    Flickr8k_text/Flickr8k.token.txt         the captions, NAME.jpg#0..#4<TAB>caption
    Flickr8k_text/Flickr_8k.{train,dev,test}Images.txt   the standard split lists (6,000 / 1,000 / 1,000)
    Flickr8k_text/...                        the zip's other files (lemma tokens, expert judgements, readme)
    Flickr8k.sha256                          the SHA-256 of each zip as downloaded (``sha256sum`` format)
    downloads/*.zip                          the archives (deleted after extraction unless --keep-archives)

Checksums: the mirror publishes none and the package does not know them, so by default nothing is
compared: each zip's size and SHA-256 are printed and recorded in ``Flickr8k.sha256``. Pass them
back with ``--sha256 images=HEX --sha256 text=HEX`` (from an earlier download, a colleague, or a
copy you trust) to have a new download checked; a mismatch removes the file, prints one line and
exits 1. Downloads are resumable (``downloads/<name>.part``, HTTP Range; just run it again), and
what is already extracted is skipped. Members are flattened into the two folders, so the zip's
inner folder names and ``__MACOSX`` entries do not matter. ``--mirror URL`` fetches each zip as
``URL/<zip name>``. The download code is shared with :mod:`captioner.data.downloads.coco`
(:mod:`captioner.data.downloads.archives`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from captioner.data.downloads.archives import Steps, open_zip, write_members
from captioner.data.downloads.archives import prepare as prepare_archives
from captioner.download import Bounds, download, file_digest, verify
from captioner.errors import DataError

__all__ = ["ARCHIVES", "BASE", "Archive", "extract", "is_present", "parse_sha256", "prepare",
           "record_digest", "select_archives"]

log = logging.getLogger("captioner.download.flickr8k")
BASE = "https://github.com/jbrownlee/Datasets/releases/download/Flickr8k"
MARKER = ".extracted"
RECORD = "Flickr8k.sha256"
# the mirror states no sizes: bounds a few times over the real ones (1.1 GB and 2.3 MB)
BOUNDS = {"images": Bounds(max_bytes=4 << 30), "text": Bounds(max_bytes=64 << 20)}


@dataclass(frozen=True)
class Archive:
    """One zip of the mirror.

    Attributes:
        key: short name for ``--only`` and ``--sha256 KEY=HEX``.
        url: where it lives.  sha256: expected digest (None = not checked).
        folder: where its files go, relative to the root.
        suffix: only members whose name ends with it (lowercase) are taken ("" = every file).
        needed: a file that must come out of it (else it is the wrong archive).
    """

    key: str
    url: str
    sha256: str | None
    folder: str
    suffix: str
    needed: str | None

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]


ARCHIVES = (
    Archive("images", f"{BASE}/Flickr8k_Dataset.zip", None, "Flicker8k_Dataset", ".jpg", None),
    Archive("text", f"{BASE}/Flickr8k_text.zip", None, "Flickr8k_text", "", "Flickr8k.token.txt"),
)


def parse_sha256(items: Sequence[str] | None) -> dict[str, str]:
    """``["images=HEX", ...]`` -> ``{"images": "hex"}``; DataError for a bad key or digest."""
    keys = [a.key for a in ARCHIVES]
    out = {}
    for item in items or ():
        key, _, value = item.partition("=")
        value = value.strip().lower()
        if key not in keys or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
            raise DataError(f"--sha256 {item!r}: expected KEY=HEX with KEY one of {', '.join(keys)} "
                            "and a 64-digit SHA-256")
        out[key] = value
    return out


def select_archives(only: Sequence[str] | None = None, mirror: str | None = None,
                    sha256: dict[str, str] | None = None) -> list[Archive]:
    """The archives to process, with ``--only``, ``--mirror`` and ``--sha256`` applied."""
    out = []
    for a in ARCHIVES:
        if only and a.key not in only:
            continue
        url = f"{mirror.rstrip('/')}/{a.name}" if mirror else a.url
        out.append(replace(a, url=url, sha256=(sha256 or {}).get(a.key, a.sha256)))
    return out


def is_present(root: Path, archive: Archive) -> bool:
    """True when the archive was extracted completely (its folder has the marker)."""
    return (root / archive.folder / MARKER).exists()


def _members(names: Sequence[str], archive: Archive) -> list[tuple[str, str]]:
    """``(member, destination)`` pairs: the files to take, flattened into the archive's folder."""
    pairs: dict[str, str] = {}
    for name in names:
        path = PurePosixPath(name)
        if name.endswith("/") or "__MACOSX" in path.parts or path.name.startswith(".") \
                or not path.name.lower().endswith(archive.suffix):
            continue
        pairs.setdefault(path.name, name)  # the first of two same-named files wins
    return [(member, f"{archive.folder}/{base}") for base, member in sorted(pairs.items())]


def extract(zip_path: Path, root: Path, archive: Archive) -> list[Path]:
    """Extract the archive into ``root/<folder>/`` (flattened), mark the folder complete and record
    the zip's SHA-256 (only now: a zip that cannot be extracted is not recorded as good)."""
    with open_zip(zip_path) as zf:
        pairs = _members(zf.namelist(), archive)
        what = archive.needed or f"*{archive.suffix}"
        if not pairs or (archive.needed and archive.needed not in {PurePosixPath(d).name for _, d in pairs}):
            raise DataError(f"{zip_path}: has no {what} (is it the right archive?)")
        written = write_members(zf, zip_path, root, pairs)
    (root / archive.folder / MARKER).write_text(f"extracted from {zip_path.name}\n")
    digest = archive.sha256 or file_digest(zip_path, "sha256")
    record_digest(root, zip_path.name, digest)
    log.info("%s: %d bytes, SHA-256 %s%s", zip_path.name, zip_path.stat().st_size, digest,
             " (checked)" if archive.sha256 else f" (recorded in {root / RECORD})")
    return written


def record_digest(root: Path, name: str, digest: str) -> None:
    """Add or replace ``name``'s line in ``root/Flickr8k.sha256``."""
    path = root / RECORD
    lines = path.read_text().splitlines() if path.exists() else []
    lines = [line for line in lines if not line.endswith(f"  {name}")] + [f"{digest}  {name}"]
    path.write_text("\n".join(sorted(lines, key=lambda line: line.split("  ", 1)[-1])) + "\n")


def _fetch(zip_path: Path, root: Path, a: Archive, progress: bool) -> None:
    """Download (unless kept from an earlier run) and check the SHA-256 when one is known."""
    if not zip_path.exists():
        download(a.url, zip_path, progress=progress, bounds=BOUNDS[a.key])
    if a.sha256:  # also a zip kept from an earlier run; a mismatch removes it
        verify(zip_path, None, a.sha256, label=a.name, algorithm="sha256")


STEPS = Steps(is_present=is_present, where=lambda root, a: f"{root / a.folder}/",
              describe=lambda a: "SHA-256 checked" if a.sha256 else "SHA-256 recorded, not checked",
              fetch=_fetch, extract=extract)


def prepare(root: Path, archives: Sequence[Archive], dry_run: bool = False, keep_archives: bool = False,
            progress: bool = True) -> list[str]:
    """Download, check and extract each archive not yet present; returns the actions (done or planned)."""
    return prepare_archives(root, archives, STEPS, dry_run, keep_archives, progress)
