"""``captioner download``'s extraction is bounded and fails in one line, leaving nothing half-written.

Small crafted zips (a bomb of zeros, a corrupt, an encrypted, an unsupported and a truncated one)
served on 127.0.0.1; the bounds are lowered where a real bound would need GiBs.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import zipfile
from pathlib import Path

import pytest
from range_server import serve

from captioner.cli import main as captioner_main
from captioner.data import archives
from captioner.data.archives import ArchiveBounds, open_zip, write_members
from captioner.errors import DataError

TOKEN = b"101_a.jpg#0\ta caption .\n"


def _zip(files: dict[str, bytes], method: int = zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=method) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _patch_central(data: bytes, offset: int, value: bytes) -> bytes:
    """``data`` with ``value`` written at ``offset`` of its first central directory entry."""
    at = data.index(b"PK\x01\x02") + offset
    return data[:at] + value + data[at + len(value):]


def _run(root: Path, mirror: str, *extra: str) -> int:
    return captioner_main(["download", "flickr8k", "--root", str(root), "--mirror", mirror, "--no-progress",
                           *extra])


def _left(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_zip_bomb_stops_at_the_ratio_and_leaves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bomb = _zip({"Flicker8k_Dataset/101_a.jpg": b"\xff\xd8 small", "Flicker8k_Dataset/bomb.jpg": bytes(16 << 20)})
    assert len(bomb) < 64 * 1024
    root = tmp_path / "f8k"
    with serve({"Flickr8k_Dataset.zip": bomb}, "m") as (mirror, _):
        assert _run(root, mirror, "--only", "images") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("captioner download: error: ")
    assert f"its members state {(16 << 20) + 8} bytes in all from" in err and "more than 200 times (a zip bomb?)" in err
    assert "Flickr8k_Dataset.zip was removed: run again to download it again" in err
    assert _left(root) == []  # no image, no .tmp, no zip, no recorded SHA-256


def test_member_and_total_bounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.zip"
    path.write_bytes(_zip({"a.bin": os.urandom(600), "b.bin": os.urandom(600)}, zipfile.ZIP_STORED))
    with open_zip(path) as zf:
        with pytest.raises(DataError, match=r"member 'a\.bin' states 600 bytes, over the limit of 500 bytes"):
            write_members(zf, path, tmp_path / "out", [("a.bin", "a.bin")], ArchiveBounds(member_bytes=500))
        with pytest.raises(DataError, match=r"its members state 1200 bytes in all, over the limit of 1000 bytes"):
            write_members(zf, path, tmp_path / "out", [("a.bin", "a.bin"), ("b.bin", "b.bin")],
                          ArchiveBounds(total_bytes=1000))
    assert _left(tmp_path / "out") == []  # a.bin, written first, is removed with the failure
    monkeypatch.setattr(archives, "BOUNDS", ArchiveBounds(member_bytes=500))
    with open_zip(path) as zf, pytest.raises(DataError, match="over the limit of 500 bytes"):
        write_members(zf, path, tmp_path / "out", [("a.bin", "a.bin")])


def test_a_bomb_spread_over_many_members_is_bounded_over_all_of_them(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    block = bytes(1 << 20)  # each member exactly at the per-member floor: only the whole archive's ratio sees it
    bomb = _zip({f"Flicker8k_Dataset/{i:04d}.jpg": block for i in range(300)})
    assert len(bomb) < 1 << 20
    root = tmp_path / "f8k"
    with serve({"Flickr8k_Dataset.zip": bomb}, "m") as (mirror, _):
        assert _run(root, mirror, "--only", "images") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"its members state {300 << 20} bytes in all from" in err
    assert "more than 200 times (a zip bomb?)" in err
    assert _left(root) == []  # nothing extracted, no recorded SHA-256


def test_members_that_understate_their_size_are_counted_as_they_are_written(tmp_path: Path) -> None:
    path = tmp_path / "a.zip"
    path.write_bytes(_zip({f"m{i}.bin": bytes(600 << 10) for i in range(4)}))
    bounds = ArchiveBounds(ratio=2.0, ratio_floor=1 << 20)
    with open_zip(path) as zf:
        for info in zf.infolist():  # as a crafted central directory would say: 1 byte each
            info.file_size = 1
        archives._check_stated(zf, path, zf.namelist(), bounds)  # the stated sizes pass
        budget = archives._Budget(path, bounds)
        with pytest.raises(DataError, match=r"up to member 'm1\.bin' it expands to \d+ bytes in all from \d+ "
                                            r"compressed bytes, more than 2 times"):
            for info in zf.infolist():
                zf.getinfo(info.filename).file_size = 600 << 10  # zipfile stops at the stated size otherwise
                archives._copy_member(zf, info, io.BytesIO(), tmp_path / "x", path, bounds, budget)


def test_a_full_disk_while_extracting_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    class Full(io.BytesIO):
        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    good = _zip({"Flickr8k.token.txt": TOKEN})
    root = tmp_path / "f8k"
    with serve({"Flickr8k_text.zip": good}, "m") as (mirror, _):
        real_file = archives.atomic_file

        @contextlib.contextmanager
        def full_disk(path, *args, **kwargs):  # a member's temporary file fills the disk
            with real_file(path, *args, **kwargs) as f:
                yield Full() if Path(path).name == "Flickr8k.token.txt" else f

        monkeypatch.setattr(archives, "atomic_file", full_disk)
        assert _run(root, mirror, "--only", "text") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Flickr8k.token.txt: cannot write while extracting" in err
    assert "(No space left on device)" in err and "free some space and run again" in err
    assert _left(root) == []


@pytest.mark.parametrize("damage, reason", [
    ("crc", r"BadZipFile: Bad CRC-32"),
    ("encrypted", r"it is encrypted: a password would be needed"),
    ("method", r"NotImplementedError: That compression method is not supported"),
])
def test_a_bad_member_is_one_line_and_leaves_no_tmp(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    damage: str, reason: str) -> None:
    good = _zip({"Flickr8k.token.txt": TOKEN * 50}, zipfile.ZIP_STORED)
    bad = {"crc": lambda d: d.replace(b"a caption", b"a cAption", 1),
           "encrypted": lambda d: _patch_central(d, 8, b"\x01\x00"),
           "method": lambda d: _patch_central(d, 10, b"\x63\x00")}[damage](good)
    root = tmp_path / "f8k"
    with serve({"Flickr8k_text.zip": bad}, "m") as (mirror, _):
        assert _run(root, mirror, "--only", "text") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "member 'Flickr8k.token.txt' cannot be extracted (" in err
    assert re.search(reason, err), err
    assert _left(root) == []  # no Flickr8k.token.txt.tmp


def test_a_truncated_zip_is_removed_not_recorded_and_fetched_again(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    good = _zip({"Flickr8k.token.txt": TOKEN, "readme.txt": b"r\n"})
    root = tmp_path / "f8k"
    with serve({"Flickr8k_text.zip": good[: len(good) // 2]}, "m") as (mirror, _):
        assert _run(root, mirror, "--only", "text") == 1
    err = capsys.readouterr().err
    assert "Flickr8k_text.zip: not a valid zip archive (BadZipFile" in err and "was removed: run again" in err
    assert _left(root) == []  # Flickr8k.sha256 does not record the bad zip
    with serve({"Flickr8k_text.zip": good}, "m") as (mirror, handler):
        assert _run(root, mirror, "--only", "text") == 0
        assert len(handler.log) == 1
    assert (root / "Flickr8k_text" / "Flickr8k.token.txt").read_bytes() == TOKEN
    assert (root / "Flickr8k.sha256").read_text().endswith("  Flickr8k_text.zip\n")
