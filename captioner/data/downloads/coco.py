"""Download and lay out COCO 2014 captions with the Karpathy split (needs internet).

    captioner download coco --root data/coco            # everything (~20 GB of zips)
    captioner download coco --root data/coco --dry-run  # list what it would do
    captioner download coco --only annotations karpathy # just the JSON files

Files it writes under ``--root`` (the layout ``load_caption_set`` reads)::

    train2014/COCO_train2014_*.jpg          82,783 images  (from train2014.zip)
    val2014/COCO_val2014_*.jpg              40,504 images  (from val2014.zip)
    annotations/captions_train2014.json     (from annotations_trainval2014.zip)
    annotations/captions_val2014.json
    annotations/instances_{train,val}2014.json   only with --instances
    dataset_coco.json                       Karpathy split (from caption_datasets.zip)
    downloads/*.zip                         the archives (deleted after extraction unless --keep-archives)

Downloads are resumable: bytes go to ``downloads/<name>.part`` and an interrupted run continues
with an HTTP Range request. Sizes and MD5 checksums are verified where they are known; a
mismatch deletes the ``.part`` file and fails with the file's name. The download, resume, checksum
and extraction code is shared with :mod:`captioner.data.downloads.flickr8k`
(:mod:`captioner.data.downloads.archives`). Anything already present
(an extracted folder with its ``.extracted`` marker, or the JSON files) is skipped.
``--mirror URL`` fetches every archive as ``URL/<archive name>`` (a local mirror, or file:// URLs).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from captioner.data.downloads.archives import Steps, open_zip, write_members
from captioner.data.downloads.archives import prepare as prepare_archives
from captioner.download import download
from captioner.errors import DataError

__all__ = ["ARCHIVES", "INSTANCE_MEMBERS", "Archive", "extract", "is_present", "prepare", "select_archives"]

log = logging.getLogger("captioner.download.coco")
MARKER = ".extracted"


@dataclass(frozen=True)
class Archive:
    """One file to fetch and what to take out of it.

    Attributes:
        key: short name for ``--only``.
        url: where it lives.
        size: expected bytes (None = unknown).  md5: expected MD5 hex (None = unknown).
        members: ``(prefix inside the zip, destination relative to root)`` pairs to extract.
        target: a path under root whose presence means "done" (a folder gets a marker file).
    """

    key: str
    url: str
    size: int | None
    md5: str | None
    members: tuple[tuple[str, str], ...]
    target: str

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]


ARCHIVES = (
    Archive("train", "http://images.cocodataset.org/zips/train2014.zip", 13510573713,
            "0da8c0bd3d6becc4dcb32757491aca88", (("train2014/", "train2014/"),), "train2014"),
    Archive("val", "http://images.cocodataset.org/zips/val2014.zip", 6645013297,
            "a3d79f5ed8d289b7a7554ce06a5782b3", (("val2014/", "val2014/"),), "val2014"),
    Archive("annotations", "http://images.cocodataset.org/annotations/annotations_trainval2014.zip", 252872794,
            "0a379cfc70b0e71301e0f377548639bd",
            (("annotations/captions_train2014.json", "annotations/captions_train2014.json"),
             ("annotations/captions_val2014.json", "annotations/captions_val2014.json")),
            "annotations/captions_val2014.json"),
    # Karpathy & Fei-Fei 2015 splits; no published checksum.
    Archive("karpathy", "https://cs.stanford.edu/people/karpathy/deepimagesent/caption_datasets.zip", None, None,
            (("dataset_coco.json", "dataset_coco.json"),), "dataset_coco.json"),
)
INSTANCE_MEMBERS = (("annotations/instances_train2014.json", "annotations/instances_train2014.json"),
                    ("annotations/instances_val2014.json", "annotations/instances_val2014.json"))


def select_archives(only: Sequence[str] | None = None, mirror: str | None = None,
                    instances: bool = False) -> list[Archive]:
    """The archives to process, with ``--only``, ``--mirror`` and ``--instances`` applied."""
    keys = [a.key for a in ARCHIVES]
    bad = sorted(set(only or ()) - set(keys))
    if bad:
        raise DataError(f"unknown archive(s) {', '.join(bad)}; choose from {', '.join(keys)}")
    out = []
    for a in ARCHIVES:
        if only and a.key not in only:
            continue
        url = f"{mirror.rstrip('/')}/{a.name}" if mirror else a.url
        members = a.members + INSTANCE_MEMBERS if instances and a.key == "annotations" else a.members
        out.append(Archive(a.key, url, a.size, a.md5, members, a.target))
    return out


def is_present(root: Path, archive: Archive) -> bool:
    """True when the archive's extracted content is already in place."""
    target = root / archive.target
    if target.is_dir():
        return (target / MARKER).exists()
    return all((root / dest).exists() for _, dest in archive.members)


def extract(zip_path: Path, root: Path, archive: Archive) -> list[Path]:
    """Extract the archive's members under ``root``; folders get a completion marker."""
    with open_zip(zip_path) as zf:
        names = zf.namelist()
        pairs = []
        for prefix, dest in archive.members:
            matched = [n for n in names if n == prefix or (prefix.endswith("/") and n.startswith(prefix))]
            if not matched:
                raise DataError(f"{zip_path}: has no {prefix!r} (is it the right archive?)")
            pairs += [(name, dest + name[len(prefix):] if prefix.endswith("/") else dest)
                      for name in matched if not name.endswith("/")]
        written = write_members(zf, zip_path, root, pairs)
    target = root / archive.target
    if target.is_dir():
        (target / MARKER).write_text(f"extracted from {zip_path.name}\n")
    return written


def _fetch(zip_path: Path, root: Path, a: Archive, progress: bool) -> None:
    if not zip_path.exists():
        download(a.url, zip_path, a.size, a.md5, progress=progress)


STEPS = Steps(is_present=is_present, where=lambda root, a: f"{root}/{{{', '.join(d for _, d in a.members)}}}",
              describe=lambda a: f"{a.size / 1e9:.2f} GB" if a.size else "size unknown",
              fetch=_fetch, extract=extract)


def prepare(root: Path, archives: Sequence[Archive], dry_run: bool = False, keep_archives: bool = False,
            progress: bool = True) -> list[str]:
    """Download, verify and extract each archive not yet present; returns the actions (done or planned)."""
    return prepare_archives(root, archives, STEPS, dry_run, keep_archives, progress)
