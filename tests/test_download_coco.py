"""``captioner download coco`` against tiny stand-in archives served on 127.0.0.1 (never a real host)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
from range_server import RangeHandler, serve

from captioner.cli import main as captioner_main
from captioner.data.archives import coco as dc
from captioner.network import download
from captioner.errors import DataError
from zips import zip_bytes as _zip


def main(argv: list[str]) -> int:
    """``captioner download coco ARGV``'s exit code."""
    return captioner_main(["download", "coco", *argv])


ARCHIVE_FILES = {
    "train2014.zip": _zip({"train2014/COCO_train2014_000000000009.jpg": b"t" * 3000,
                           "train2014/COCO_train2014_000000000025.jpg": b"u" * 10}),
    "val2014.zip": _zip({"val2014/COCO_val2014_000000000042.jpg": b"v" * 20}),
    "annotations_trainval2014.zip": _zip({
        "annotations/captions_train2014.json": json.dumps({"images": [], "annotations": []}).encode(),
        "annotations/captions_val2014.json": b"{}",
        "annotations/instances_train2014.json": b"{}",
        "annotations/instances_val2014.json": b"{}",
        "annotations/person_keypoints_val2014.json": b"{}",
    }),
    "caption_datasets.zip": _zip({"dataset_coco.json": b'{"images": []}', "dataset_flickr8k.json": b"{}"}),
}


_Handler: type[RangeHandler] = RangeHandler  # the running server's handler class (set by the fixture)


@pytest.fixture()
def server():
    global _Handler
    with serve(ARCHIVE_FILES, "mirror") as (url, handler):
        _Handler = handler
        yield url


def _archives(mirror: str, **kwargs) -> list:
    """The real archive list pointed at the mirror, with the stand-ins' sizes and checksums."""
    out = []
    for a in dc.select_archives(mirror=mirror, **kwargs):
        data = ARCHIVE_FILES[a.name]
        out.append(dataclasses.replace(a, size=len(data), md5=hashlib.md5(data).hexdigest()))
    return out


def test_prepare_writes_the_loader_layout_then_skips(server: str, tmp_path: Path) -> None:
    root = tmp_path / "coco"
    dc.prepare(root, _archives(server), progress=False)
    assert (root / "train2014" / "COCO_train2014_000000000009.jpg").read_bytes() == b"t" * 3000
    assert (root / "train2014" / "COCO_train2014_000000000025.jpg").exists()
    assert (root / "val2014" / "COCO_val2014_000000000042.jpg").exists()
    assert json.loads((root / "annotations" / "captions_train2014.json").read_text()) == {"images": [],
                                                                                           "annotations": []}
    assert (root / "annotations" / "captions_val2014.json").exists()
    assert not (root / "annotations" / "instances_val2014.json").exists()  # only with instances=True
    assert not (root / "annotations" / "person_keypoints_val2014.json").exists()
    assert (root / "dataset_coco.json").read_bytes() == b'{"images": []}'
    assert not (root / "dataset_flickr8k.json").exists()
    assert list((root / "downloads").iterdir()) == []  # archives deleted after extraction
    requests = len(_Handler.log)
    assert requests == 4

    actions = dc.prepare(root, _archives(server), progress=False)
    assert len(_Handler.log) == requests  # nothing fetched again
    assert all(a.startswith("skip") for a in actions) and len(actions) == 4


def test_resume_partial_download_with_range(server: str, tmp_path: Path) -> None:
    data = ARCHIVE_FILES["train2014.zip"]
    dest = tmp_path / "train2014.zip"
    dest.with_name("train2014.zip.part").write_bytes(data[:1000])
    download(f"{server}/train2014.zip", dest, len(data), hashlib.md5(data).hexdigest(), progress=False)
    assert dest.read_bytes() == data
    assert _Handler.log == [("train2014.zip", "bytes=1000-")]
    assert _Handler.sent == len(data) - 1000
    assert not dest.with_name("train2014.zip.part").exists()


def test_resume_when_server_ignores_range_restarts(server: str, tmp_path: Path) -> None:
    _Handler.honour_range = False
    data = ARCHIVE_FILES["val2014.zip"]
    dest = tmp_path / "val2014.zip"
    dest.with_name("val2014.zip.part").write_bytes(b"garbage")
    download(f"{server}/val2014.zip", dest, len(data), hashlib.md5(data).hexdigest(), progress=False)
    assert dest.read_bytes() == data


def test_complete_part_is_verified_without_refetching(server: str, tmp_path: Path) -> None:
    data = ARCHIVE_FILES["val2014.zip"]
    dest = tmp_path / "val2014.zip"
    dest.with_name("val2014.zip.part").write_bytes(data)
    download(f"{server}/val2014.zip", dest, len(data), hashlib.md5(data).hexdigest(), progress=False)
    assert dest.read_bytes() == data and _Handler.log == []


def test_checksum_mismatch_names_file_and_removes_part(server: str, tmp_path: Path) -> None:
    data = ARCHIVE_FILES["val2014.zip"]
    dest = tmp_path / "val2014.zip"
    with pytest.raises(DataError, match=r"val2014\.zip: MD5 .* does not match 0{32}"):
        download(f"{server}/val2014.zip", dest, len(data), "0" * 32, progress=False)
    assert not dest.exists() and not dest.with_name("val2014.zip.part").exists()


def test_size_mismatch_and_http_error(server: str, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"val2014\.zip: too large: \d+ bytes or more where the limit is 5 bytes; "
                                        "nothing was kept"):
        download(f"{server}/val2014.zip", tmp_path / "val2014.zip", 5, None, progress=False)
    with pytest.raises(DataError, match=r"nothing\.zip: download failed \(HTTP 404"):
        download(f"{server}/nothing.zip", tmp_path / "nothing.zip", None, None, progress=False)


def test_instances_option_and_only(server: str, tmp_path: Path) -> None:
    root = tmp_path / "coco"
    dc.prepare(root, _archives(server, only=["annotations"], instances=True), keep_archives=True, progress=False)
    assert (root / "annotations" / "instances_val2014.json").exists()
    assert (root / "downloads" / "annotations_trainval2014.zip").exists()
    assert not (root / "train2014").exists()
    assert [name for name, _ in _Handler.log] == ["annotations_trainval2014.zip"]


def test_extract_rejects_wrong_archive(tmp_path: Path) -> None:
    bad = tmp_path / "val2014.zip"
    bad.write_bytes(_zip({"something/else.jpg": b"x"}))
    archive = dc.select_archives(only=["val"])[0]
    with pytest.raises(DataError, match=r"val2014\.zip: has no 'val2014/'"):
        dc.extract(bad, tmp_path / "coco", archive)
    bad.write_bytes(b"not a zip")
    with pytest.raises(DataError, match="not a valid zip"):
        dc.extract(bad, tmp_path / "coco", archive)


def test_dry_run_lists_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "coco"
    (root / "downloads").mkdir(parents=True)
    (root / "downloads" / "val2014.zip.part").write_bytes(b"x" * 7)
    assert main(["--root", str(root), "--dry-run", "--mirror", "http://127.0.0.1:9/none"]) == 0
    out = capsys.readouterr().out
    assert "download http://127.0.0.1:9/none/train2014.zip" in out and "13.51 GB" in out
    assert "resuming at 7 bytes" in out
    assert "extract caption_datasets.zip" in out and "dataset_coco.json" in out
    assert sorted(p.name for p in root.rglob("*")) == ["downloads", "val2014.zip.part"]
    assert main(["--only", "nope"]) == 2


def test_the_command_knows_the_archive_keys() -> None:
    from captioner.commands import download as command

    assert command.COCO_KEYS == tuple(a.key for a in dc.ARCHIVES)
