"""One write path: every file the package writes is a temporary file renamed into place.

A symbolic link where a file is to be written is replaced, never followed; a file with other hard
links is never written into; a command interrupted between two files leaves only complete files,
each recorded in its folder's manifest, so the same command runs again. ``captioner download``
holds a lock on its ``--root``. The source is searched for any other way of writing a file.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest
from PIL import Image

from captioner import files
from captioner.cli import main
from captioner.errors import CaptionerError, DataError
from captioner.files import MANIFEST, Outputs, atomic_write, open_partial

PACKAGE = Path(__file__).resolve().parents[1] / "captioner"
PRECIOUS = b"the user's precious file\n"

# Ways of writing a file other than captioner.files' (each line of the package is searched).
BARE_WRITES = [
    (re.compile(r"\.write_(text|bytes)\("), "Path.write_text / write_bytes"),
    (re.compile(r"\bopen\([^)]*[\"'][rbt]*[wax+][rbt+]*[\"']"), "open(..., 'w' / 'a' / 'x')"),
    (re.compile(r"(?<!torch)\.(save|savefig)\((?!\s*(f|buf)\b)"), "save(path) of an image or figure"),
    (re.compile(r"\b(torch\.save|save_file)\((?!\s*[a-z_]+, f\))"), "torch.save / safetensors save_file to a path"),
    (re.compile(r"\bos\.open\([^)]*O_(WRONLY|RDWR|CREAT)"), "os.open for writing"),
    (re.compile(r"\bshutil\.(copy|copy2|copyfile|move)\("), "shutil copy or move"),
]
# Lines that write otherwise, and why that is right there.
ALLOWED = {
    ("cli.py", "os.open(os.devnull, os.O_WRONLY)"): "stdout pointed at /dev/null after a closed pipe",
    ("features/cache.py", "lock.write_text(str(os.getpid()))"): "the pid inside the lock file its holder holds",
    ("features/cache.py", 'lock.write_text("")'): "the same lock file, emptied before it is released",
    ("training/loop.py", 'cfg.save(run_dir / "config.json")'): "Config.save is atomic_write",
    ("training/loop.py", 'vocab.save(run_dir / "vocab.json")'): "Vocabulary.save is atomic_write",
}


def bare_writes() -> list[str]:
    """``file:line: text (kind)`` of every write in the package outside captioner/files.py and :data:`ALLOWED`."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "files.py":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            code = line.split("#", 1)[0] if not line.lstrip().startswith(("'", '"')) else ""
            for pattern, kind in BARE_WRITES:
                if pattern.search(code) and not any(rel == f and snippet in code for f, snippet in ALLOWED):
                    found.append(f"{rel}:{number}: {line.strip()} ({kind})")
    return found


def test_nothing_in_the_package_writes_a_file_outside_the_one_write_path() -> None:
    assert bare_writes() == []


def test_the_search_finds_each_kind_of_bare_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = ['Path(p).write_text("x")', 'open(p, "w")', "open(p, mode='ab')", "image.save(out / 'a.png')",
             "fig.savefig(path)", "torch.save(state, path)", "os.open(p, os.O_WRONLY | os.O_CREAT)",
             "shutil.copy(a, b)"]
    fine = ["image.save(f, format='PNG')", "fig.savefig(buf, format='png')", "open(p, 'rb')",
            "torch.save(payload, f)", "os.open(path, flags)  # read-only flags"]
    (tmp_path / "mod.py").write_text("\n".join(lines + fine) + "\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path)
    assert [hit.split(": ", 1)[1].rsplit(" (", 1)[0] for hit in bare_writes()] == lines


# --- the rule itself ---

def test_a_symlink_in_the_way_is_replaced_never_followed(tmp_path: Path) -> None:
    precious = tmp_path / "precious.txt"
    precious.write_bytes(PRECIOUS)
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.png").symlink_to(precious)
    atomic_write(out / "a.png", lambda f: f.write(b"new"))
    assert precious.read_bytes() == PRECIOUS
    assert not (out / "a.png").is_symlink() and (out / "a.png").read_bytes() == b"new"


def test_a_hard_linked_file_keeps_its_content(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(b"first")
    os.link(tmp_path / "a.png", tmp_path / "backup.png")
    atomic_write(tmp_path / "a.png", lambda f: f.write(b"second"))
    assert (tmp_path / "backup.png").read_bytes() == b"first" and (tmp_path / "a.png").read_bytes() == b"second"


def test_a_partial_file_is_never_a_link_or_another_files_inode(tmp_path: Path) -> None:
    precious = tmp_path / "precious.txt"
    precious.write_bytes(PRECIOUS)
    (tmp_path / "x.part").symlink_to(precious)
    with pytest.raises(DataError, match=r"x\.part: is a symbolic link; captioner does not write through it"):
        open_partial(tmp_path / "x.part", True, DataError)
    os.link(precious, tmp_path / "y.part")
    with pytest.raises(DataError, match=r"y\.part: has other hard links; captioner does not write into it"):
        open_partial(tmp_path / "y.part", True, DataError)
    with open_partial(tmp_path / "x.part", False, DataError) as f:  # starting over: the link goes, not the file
        f.write(b"new")
    assert precious.read_bytes() == PRECIOUS and (tmp_path / "x.part").read_bytes() == b"new"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_bytes(b"old")

    def fail(f) -> None:  # noqa: ANN001
        f.write(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "a.json", fail)
    assert os.listdir(tmp_path) == ["a.json"] and (tmp_path / "a.json").read_bytes() == b"old"


def test_outputs_write_records_each_file_as_it_lands(tmp_path: Path) -> None:
    outputs = Outputs(tmp_path)
    outputs.write(tmp_path / "one.txt", lambda f: f.write(b"1"))
    assert set(outputs.owned()) == {"one.txt"}
    outputs.write(tmp_path / "two.txt", lambda f: f.write(b"2"))
    assert set(outputs.owned()) == {"one.txt", "two.txt"}
    assert outputs.check([tmp_path / "one.txt", tmp_path / "two.txt"])  # its own: replaced without --force


def test_ctrl_c_between_rename_and_record_is_held_until_both_are_done(tmp_path: Path) -> None:
    """A SIGINT that arrives inside the rename-and-record step is acted on only once the file is recorded."""
    import signal

    outputs = Outputs(tmp_path)

    def interrupted_record(paths, **kwargs) -> None:  # noqa: ANN001, ANN003
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of the step
        Outputs.record(outputs, paths, **kwargs)

    object.__setattr__(outputs, "record", interrupted_record)
    with pytest.raises(KeyboardInterrupt):
        outputs.write(tmp_path / "a.png", lambda f: f.write(b"png"))
    assert set(Outputs(tmp_path).owned()) == {"a.png"}


# --- the commands ---

@pytest.fixture(scope="module")
def tiny(tmp_path_factory, untrained_checkpoint) -> Path:
    return untrained_checkpoint(tmp_path_factory.mktemp("tiny"), "sat_soft_tiny")


@pytest.fixture()
def photo(tmp_path: Path) -> Path:
    path = tmp_path / "photo.png"
    Image.new("RGB", (48, 40), (120, 90, 40)).save(path)
    return path


def test_attend_force_replaces_a_link_and_leaves_its_target(tmp_path, photo, tiny, capsys) -> None:
    precious = tmp_path / "precious.txt"
    precious.write_bytes(PRECIOUS)
    out = tmp_path / "ud2"
    out.mkdir()
    (out / "attention.png").symlink_to("../precious.txt")
    argv = ["attend", str(photo), "-c", str(tiny), "--out", str(out), "--max-len", "3"]
    assert main(argv) == 1  # a link is not captioner's file
    assert "attention.png: already exists, not written by captioner" in capsys.readouterr().err
    assert main(argv + ["--force"]) == 0
    assert precious.read_bytes() == PRECIOUS
    assert not (out / "attention.png").is_symlink() and (out / "attention.png").read_bytes()[:4] == b"\x89PNG"


def test_a_second_attend_leaves_a_hard_link_to_the_first_alone(tmp_path, photo, tiny) -> None:
    out = tmp_path / "out"
    argv = ["attend", str(photo), "-c", str(tiny), "--out", str(out), "--max-len", "3"]
    assert main(argv) == 0
    os.link(out / "attention.png", tmp_path / "backup.png")
    before = (tmp_path / "backup.png").read_bytes()
    Image.new("RGB", (48, 40), (10, 200, 40)).save(photo)  # another photo: other overlays
    assert main(argv) == 0  # captioner's own files: replaced without --force
    assert (tmp_path / "backup.png").read_bytes() == before
    assert (out / "attention.png").read_bytes() != before


def test_ctrl_c_during_the_overlay_writes_then_the_same_command_runs_again(tmp_path, photo, tiny, capsys,
                                                                           monkeypatch) -> None:
    out = tmp_path / "out"
    argv = ["attend", str(photo), "-c", str(tiny), "--out", str(out), "--max-len", "3"]
    real, calls = files.atomic_write, []

    def interrupted(path, write, *args, **kwargs):  # noqa: ANN001, ANN202
        if Path(path).name != MANIFEST:
            calls.append(path)
            if len(calls) == 3:  # in the middle of the third file
                def half(f) -> None:  # noqa: ANN001
                    f.write(b"\x89PNG half")
                    raise KeyboardInterrupt
                return real(path, half, *args, **kwargs)
        return real(path, write, *args, **kwargs)

    monkeypatch.setattr(files, "atomic_write", interrupted)
    assert main(argv) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "captioner attend: interrupted"
    left = sorted(os.listdir(out))
    assert left == sorted([MANIFEST, "attention.gif", "attention.png"])  # two whole files, no temporary
    assert set(Outputs(out).owned()) == {"attention.gif", "attention.png"}
    monkeypatch.setattr(files, "atomic_write", real)
    assert main(argv) == 0  # captioner's own files: the same command completes them
    assert {"attention.json", "attention.html"} <= set(os.listdir(out))


# --- captioner download: one writer per --root ---

def test_two_downloads_into_one_root_take_turns(tmp_path: Path, capsys) -> None:
    from captioner.data.archives import LOCK
    from captioner.files import hold_lock

    root = tmp_path / "f8k"
    root.mkdir()
    with hold_lock(root / LOCK):  # another download is writing here
        code = main(["download", "flickr8k", "--root", str(root), "--only", "text", "--mirror", "http://127.0.0.1:9",
                     "--no-progress"])
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"captioner download: error: {root}: another captioner download is writing into this folder "
                   f"(it holds {root / LOCK}); wait for it to finish, then run again")
    assert os.listdir(root) == [LOCK]  # the holder's lock, nothing else: the refused run wrote nothing


def test_the_lock_is_released_and_removed_after_a_download(tmp_path: Path, capsys) -> None:
    from captioner.data.archives import LOCK

    root = tmp_path / "f8k"
    code = main(["download", "flickr8k", "--root", str(root), "--only", "text", "--mirror", "http://127.0.0.1:9",
                 "--no-progress"])
    assert code == 1 and "download failed" in capsys.readouterr().err
    assert not root.exists()  # the failed run created the folder: it is gone, lock and all
    assert not (tmp_path / LOCK).exists()


def test_the_recorded_sha256_is_that_of_the_zip_written(tmp_path: Path) -> None:
    """Two downloads started together: one writes, the other is refused; the record matches the zip."""
    import hashlib
    import zipfile
    from io import BytesIO

    from range_server import serve

    from captioner.data.archives import flickr8k

    buf = BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("Flickr8k.token.txt", "1000268201_693b08cb0e.jpg#0\tA child in a pink dress .\n" * 2000)
    data = buf.getvalue()
    root = tmp_path / "f8k"
    results: list[object] = []
    with serve({"Flickr8k_text.zip": data}, "m") as (mirror, _):
        archives = flickr8k.select_archives(["text"], mirror, {})

        def run() -> None:
            try:
                results.append(flickr8k.prepare(root, archives, progress=False, keep_archives=True))
            except CaptionerError as exc:
                results.append(exc)

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    refused = [r for r in results if isinstance(r, CaptionerError)]
    assert all("another captioner download is writing into this folder" in str(r) for r in refused)
    assert len(refused) <= 1
    digest = hashlib.sha256(data).hexdigest()
    assert (root / "Flickr8k.sha256").read_text() == f"{digest}  Flickr8k_text.zip\n"
    assert hashlib.sha256((root / "downloads" / "Flickr8k_text.zip").read_bytes()).hexdigest() == digest


# --- Ctrl-C: one line and 130, nothing from other libraries ---

AFTER_EXIT_FUNCTIONS = """
import atexit, logging, os, signal, sys
def late():  # registered first, so it would run last: inside the interpreter's own shutdown
    os.write(2, b"LATE\\n")
    os.kill(os.getpid(), signal.SIGINT)
atexit.register(late)
import torch._subclasses.fake_tensor  # its exit function logs the FakeTensor cache stats at INFO
logging.getLogger("torch").setLevel(logging.NOTSET)  # as after a Ctrl-C while torch's logging was set up
from captioner.cli import main
sys.argv = ["captioner", *sys.argv[1:]]
sys.exit(main())
"""


def test_a_command_ends_with_its_code_before_the_interpreters_shutdown_and_without_torchs_lines(tmp_path) -> None:
    import signal
    import subprocess
    import sys

    def ctrl_c_as_a_terminal_gives_it() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    done = subprocess.run([sys.executable, "-c", AFTER_EXIT_FUNCTIONS, "make-shapes", "--out", str(tmp_path / "s"),
                           "--images", "3", "--image-size", "32"], capture_output=True, text=True, timeout=120,
                          preexec_fn=ctrl_c_as_a_terminal_gives_it)
    assert done.returncode == 0, done  # not -2: the process ended before the shutdown where Ctrl-C kills it
    assert "LATE" not in done.stderr and "FakeTensor" not in done.stderr and "cache_hits" not in done.stderr
    assert done.stdout.startswith("wrote 3 images")


def test_a_linked_folder_below_the_output_folder_that_leads_out_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "00001").symlink_to(elsewhere)
    with pytest.raises(CaptionerError, match=rf"^{out / '00001'}: leads outside {out} \({elsewhere}, through a "
                                             r"symbolic link\); remove the link or choose another --overlay$"):
        Outputs(out, force=True, option="--overlay").check([out / "00001" / "attention.png"])
    (out / "inside").mkdir()
    (out / "link").symlink_to(out / "inside")  # a link that stays inside is fine
    assert Outputs(out).check([out / "link" / "attention.png"]) == []
    assert os.listdir(elsewhere) == []
