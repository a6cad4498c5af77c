"""``captioner download flickr8k`` against small stand-in zips served on 127.0.0.1 (never a real host)."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
from range_server import RangeHandler, serve
from PIL import Image

from captioner.cli import main as captioner_main
from captioner.data.archives import flickr8k as df
from captioner.data.caption_set import check_images
from captioner.data.coco import load_caption_set
from captioner.errors import DataError
from zips import zip_bytes as _zip


def main(argv: list[str]) -> int:
    """``captioner download flickr8k ARGV``'s exit code."""
    return captioner_main(["download", "flickr8k", *argv])


NAMES = {"train": ["101_a.jpg", "102_b.jpg", "103_c.jpg"], "dev": ["201_d.jpg"], "test": ["301_e.jpg"]}


def _jpeg(shade: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (6, 4), (shade, 80, 160)).save(buf, "JPEG")
    return buf.getvalue()


def _archives() -> dict[str, bytes]:
    """Laid out as the mirror's zips are: a Flicker8k_Dataset/ folder, loose text files, __MACOSX junk."""
    names = [n for split in NAMES.values() for n in split]
    images = {f"Flicker8k_Dataset/{n}": _jpeg(30 * i) for i, n in enumerate(names)}
    images["__MACOSX/Flicker8k_Dataset/._101_a.jpg"] = b"\x00\x05\x16\x07 resource fork"
    token = "".join(f"{n}#{k}\tcaption {k} of {n} .\r\n" for n in names for k in range(5)) + "bad line\r\n"
    text = {"Flickr8k.token.txt": token.encode(), "readme.txt": b"Flickr8k\n",
            "__MACOSX/._Flickr8k.token.txt": b"junk"}
    text.update({f"Flickr_8k.{s}Images.txt": ("\r\n".join(v) + "\r\n").encode() for s, v in NAMES.items()})
    return {"Flickr8k_Dataset.zip": _zip(images), "Flickr8k_text.zip": _zip(text)}


FILES = _archives()
SHA = {name: hashlib.sha256(data).hexdigest() for name, data in FILES.items()}


_Handler: type[RangeHandler] = RangeHandler  # the running server's handler class (set by the fixture)


@pytest.fixture()
def mirror():
    global _Handler
    with serve(FILES, "Flickr8k") as (url, handler):
        _Handler = handler
        yield url


def test_download_unzips_into_the_layout_the_loader_reads(mirror: str, tmp_path: Path) -> None:
    root = tmp_path / "flickr8k"
    assert main(["--root", str(root), "--mirror", mirror, "--no-progress"]) == 0
    assert sorted(p.name for p in (root / "Flicker8k_Dataset").glob("*.jpg")) == sorted(
        n for v in NAMES.values() for n in v)  # no __MACOSX resource forks
    assert (root / "Flickr8k_text" / "readme.txt").exists() and not (root / "__MACOSX").exists()
    assert list((root / "downloads").iterdir()) == []
    assert (root / "Flickr8k.sha256").read_text() == "".join(
        f"{SHA[n]}  {n}\n" for n in ("Flickr8k_Dataset.zip", "Flickr8k_text.zip"))
    train = check_images(load_caption_set(root, "train"))
    assert (len(train), train.num_captions, train.name) == (3, 15, "flickr8k")
    assert len(load_caption_set(root, "dev")) == 1 and len(load_caption_set(root, "test")) == 1

    requests = len(_Handler.log)
    assert main(["--root", str(root), "--mirror", mirror, "--no-progress"]) == 0
    assert len(_Handler.log) == requests == 2  # the second run fetches nothing


def test_resume_after_a_partial_file_then_check(mirror: str, tmp_path: Path) -> None:
    root, name = tmp_path / "f8k", "Flickr8k_Dataset.zip"
    (root / "downloads").mkdir(parents=True)
    (root / "downloads" / f"{name}.part").write_bytes(FILES[name][:700])
    argv = ["--root", str(root), "--mirror", mirror, "--only", "images", "--sha256", f"images={SHA[name]}",
            "--no-progress", "--keep-archives"]
    assert main(argv) == 0
    assert _Handler.log == [(name, "bytes=700-")] and _Handler.sent == len(FILES[name]) - 700
    assert (root / "downloads" / name).read_bytes() == FILES[name]
    assert len(list((root / "Flicker8k_Dataset").glob("*.jpg"))) == 5
    assert not (root / "Flickr8k_text").exists()


def test_checksum_mismatch_is_one_line_and_exit_1(mirror: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "f8k"
    wrong = "0" * 64
    assert main(["--root", str(root), "--mirror", mirror, "--only", "text", "--sha256", f"text={wrong}",
                    "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err == (f"captioner download: error: Flickr8k_text.zip: SHA256 {SHA['Flickr8k_text.zip']} does not "
                   f"match {wrong}; the file was removed, run again\n")
    assert not root.exists()  # nothing is left: not the file, not the folders this run made
    assert main(["--sha256", "text=abc"]) == 1
    assert "expected KEY=HEX with KEY one of images, text" in capsys.readouterr().err


def test_dry_run_lists_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "f8k"
    (root / "downloads").mkdir(parents=True)
    (root / "downloads" / "Flickr8k_text.zip.part").write_bytes(b"x" * 9)
    assert main(["--root", str(root), "--dry-run", "--sha256", "text=" + "a" * 64]) == 0
    out = capsys.readouterr().out
    assert (f"download {df.BASE}/Flickr8k_Dataset.zip -> {root}/downloads/Flickr8k_Dataset.zip "
            "(SHA-256 recorded, not checked)") in out
    assert "(SHA-256 checked, resuming at 9 bytes)" in out
    assert f"extract Flickr8k_text.zip -> {root}/Flickr8k_text/" in out
    assert df.BASE == "https://github.com/jbrownlee/Datasets/releases/download/Flickr8k"
    assert sorted(p.name for p in root.rglob("*")) == ["Flickr8k_text.zip.part", "downloads"]


def test_the_wrong_zip_is_refused(tmp_path: Path) -> None:
    text = df.select_archives(only=["text"])[0]
    bad = tmp_path / "Flickr8k_text.zip"
    bad.write_bytes(_zip({"Flickr8k_text/readme.txt": b"no captions here"}))
    with pytest.raises(DataError, match=r"Flickr8k_text\.zip: has no Flickr8k\.token\.txt \(is it the right"):
        df.extract(bad, tmp_path / "out", text)
    bad.write_bytes(b"not a zip")
    with pytest.raises(DataError, match="not a valid zip"):
        df.extract(bad, tmp_path / "out", text)


def test_download_command_dry_run_names_each_extraction(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from captioner.commands import download as command

    root = tmp_path / "f8k"
    assert captioner_main(["download", "flickr8k", "--root", str(root), "--dry-run"]) == 0
    assert f"extract Flickr8k_text.zip -> {root}/Flickr8k_text/" in capsys.readouterr().out
    assert not root.exists()
    assert command.FLICKR8K_KEYS == tuple(a.key for a in df.ARCHIVES)


def test_download_help_lists_both_datasets(capsys: pytest.CaptureFixture[str]) -> None:
    assert captioner_main(["download", "--help"]) == 0
    out = capsys.readouterr().out
    assert "flickr8k" in out and "coco" in out
    assert captioner_main(["download"]) == 2



def test_a_users_zip_in_downloads_is_read_but_never_replaced_or_deleted(mirror: str, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The writer rule for --root/downloads/: a zip captioner did not write is used as it is (checked, extracted),
    and left in place whether it works or not; nothing is fetched over it."""
    name = "Flickr8k_text.zip"
    root = tmp_path / "f8k"
    (root / "downloads").mkdir(parents=True)
    users = root / "downloads" / name
    users.write_bytes(FILES[name])
    assert main(["--root", str(root), "--mirror", mirror, "--only", "text", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"use {users} (not downloaded by captioner: read, checked, never deleted)" in out
    assert f"delete {users}" not in out and _Handler.log == []  # nothing fetched
    assert users.read_bytes() == FILES[name] and (root / "Flickr8k_text" / "Flickr8k.token.txt").is_file()

    other = tmp_path / "other"
    (other / "downloads").mkdir(parents=True)
    broken = other / "downloads" / name
    broken.write_bytes(b"my own notes, not a zip")
    assert main(["--root", str(other), "--mirror", mirror, "--only", "text", "--no-progress"]) == 1
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == (f"captioner download: error: {broken}: not a valid zip archive (BadZipFile: File is not a zip "
                   f"file); {broken} is not a file captioner wrote, so it was left in place: replace or remove it")
    assert broken.read_bytes() == b"my own notes, not a zip"
    wrong = "0" * 64
    assert main(["--root", str(other), "--mirror", mirror, "--only", "text", "--sha256", f"text={wrong}",
                 "--no-progress"]) == 1
    err = capsys.readouterr().err.splitlines()[-1]
    assert f"does not match {wrong}; {broken} is not a file captioner wrote, so it was left in place" in err
    assert broken.read_bytes() == b"my own notes, not a zip" and _Handler.log == []


def test_a_zip_captioner_downloaded_and_kept_is_its_own(mirror: str, tmp_path: Path) -> None:
    """A kept archive is in the folder's manifest: a later run may use it, and delete it once extracted."""
    root, name = tmp_path / "f8k", "Flickr8k_text.zip"
    assert main(["--root", str(root), "--mirror", mirror, "--only", "text", "--no-progress", "--keep-archives"]) == 0
    kept = root / "downloads" / name
    assert kept.read_bytes() == FILES[name]
    import shutil

    shutil.rmtree(root / "Flickr8k_text")
    assert main(["--root", str(root), "--mirror", mirror, "--only", "text", "--no-progress"]) == 0
    assert not kept.exists() and (root / "Flickr8k_text" / "Flickr8k.token.txt").is_file()
    assert [n for n, _ in _Handler.log] == [name]  # fetched once
