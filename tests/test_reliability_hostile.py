"""Issue 26, a second hostile pass: one test (or more) per case, each pinning the one-line answer.

1 an earlier run in --out; 2 /dev/zero and huge files; 3 named pipes, broken links, loops, sockets;
4 --beam x --max-len memory; 5 --out a file; 6 a folder that cannot be written (simulated as
test_unreadable_file_simulated does, plus the real chattr +i when root can); 7 and 10 wrong-typed
config values; 8 a closed stdout; 9 API tensors and images; 11 refused pickles; 12 output names
from '...png'; 13 JSON and plain output of odd names, usage errors, the vocabulary of long captions.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from captioner.cli import main
from captioner.errors import CheckpointError, ConfigError, DataError, ImageInputError, ImageLoadError

REPO = Path(__file__).resolve().parents[1]
RUN_FILES = {"config.json": b"{}", "vocab.json": b"{}", "best.safetensors": b"B" * 64,
             "latest.safetensors": b"L" * 64, "train_state.pt": b"S" * 64, "metrics.csv": b"kind,step\n"}


def tree(root: Path) -> dict[str, str]:
    """``{relative path: sha1}`` of every regular file under ``root`` (links and pipes by their kind)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink() or not path.is_file():
            out[rel] = "link" if path.is_symlink() else ("dir" if path.is_dir() else "special")
        else:
            out[rel] = hashlib.sha1(path.read_bytes()).hexdigest()
    return out


def one_error(capsys: pytest.CaptureFixture, argv: list[str], code: int = 1) -> str:
    """Run the CLI; assert exit ``code`` and exactly one stderr line; return that line."""
    got = main(argv)
    err = capsys.readouterr().err
    assert got == code, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def fake_run(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name, data in RUN_FILES.items():
        (folder / name).write_bytes(data)
    return folder


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory, untrained_checkpoint) -> Path:
    return untrained_checkpoint(tmp_path_factory.mktemp("ckpt"), "sat_soft_tiny")


@pytest.fixture()
def photo(tmp_path: Path) -> Path:
    path = tmp_path / "photo.png"
    Image.new("RGB", (24, 16), (200, 30, 30)).save(path)
    return path


# ----------------------------------------------------------------------------- 1, 5, 6: the run folder


def test_1_train_refuses_a_folder_holding_an_earlier_run(tiny_shapes: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    run = fake_run(tmp_path / "run")
    before = tree(tmp_path)
    line = one_error(capsys, ["train", "--preset", "sat_soft_tiny", "--data", str(tiny_shapes), "--out", str(run)])
    assert line.startswith(f"captioner train: error: {run} holds an earlier run (train_state.pt, ")
    assert "pass --resume to continue it, --overwrite to move it to run.old-<time>" in line
    # a run that then fails (bad config, bad data, with --overwrite too) leaves the earlier run whole
    one_error(capsys, ["train", "--preset", "sat_soft_tiny", "--data", str(tiny_shapes), "--out", str(run),
                       "--overwrite", "--set", "train.batch_size=2.5"])
    one_error(capsys, ["train", "--preset", "sat_soft_tiny", "--data", str(tmp_path / "nowhere"), "--out", str(run),
                       "--overwrite"])
    one_error(capsys, ["train", "--out", str(run), "--resume", "--overwrite"])
    assert tree(tmp_path) == before


def test_1_overwrite_moves_the_earlier_run_aside_never_deletes(tmp_path: Path) -> None:
    from captioner.training.loop import check_run_folder, move_aside

    run = fake_run(tmp_path / "run")
    check_run_folder(run, resume=False, overwrite=True)  # allowed, and nothing changed yet
    assert tree(run) == {name: hashlib.sha1(data).hexdigest() for name, data in RUN_FILES.items()}
    first = move_aside(run)
    fake_run(run)
    second = move_aside(run)
    assert first and second and first != second and not run.exists()
    for old in (first, second):
        assert old.name.startswith("run.old-") and sorted(p.name for p in old.iterdir()) == sorted(RUN_FILES)
    assert move_aside(tmp_path / "empty") is None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_1_train_with_overwrite_starts_a_new_run_beside_the_old_one(tiny_shapes: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    run = fake_run(tmp_path / "run")
    before = tree(run)
    code = main(["train", "--preset", "sat_soft_tiny", "--data", str(tiny_shapes), "--out", str(run), "--overwrite",
                 "--epochs", "1", "--set", "train.val_max_images=4", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    [old] = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert tree(old) == before
    assert (run / "train_state.pt").is_file() and (run / "best.safetensors").is_file()


@pytest.mark.parametrize("kind", ["file", "under_a_file"])
def test_5_out_that_is_a_file_or_under_one(tiny_shapes: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                           kind: str) -> None:
    notes = tmp_path / "existing_file.txt"
    notes.write_text("keep me")
    out = notes if kind == "file" else notes / "sub"
    line = one_error(capsys, ["train", "--preset", "sat_soft_tiny", "--data", str(tiny_shapes), "--out", str(out)])
    assert line.startswith(f"captioner train: error: {notes}: is a file, not a folder")
    assert notes.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["existing_file.txt"]


def _immutable(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Simulate ``chattr +i folder`` for any user: creating a file in it fails with EPERM."""
    real_mkstemp, real_open = tempfile.mkstemp, os.open

    def mkstemp(*args, dir=None, **kwargs):  # noqa: A002 - tempfile's own name
        if dir is not None and Path(dir).resolve() == folder.resolve():
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_mkstemp(*args, dir=dir, **kwargs)

    def os_open(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and Path(path).resolve().parent == folder.resolve():
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(os, "open", os_open)


def test_6_a_folder_that_cannot_be_written_simulated(tiny_shapes: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture) -> None:
    from captioner.config import get_preset

    run = fake_run(tmp_path / "run")
    get_preset("sat_soft_tiny", **{"data.root": str(tiny_shapes)}).save(run / "config.json")
    before = tree(tmp_path)
    _immutable(monkeypatch, run)
    expected = f"captioner train: error: {run}: cannot write in this folder (Operation not permitted)"
    assert one_error(capsys, ["train", "--preset", "sat_soft_tiny", "--data", str(tiny_shapes), "--out", str(run),
                              "--overwrite"]) == expected
    assert one_error(capsys, ["train", "--out", str(run), "--resume", "--no-progress"]) == expected
    assert tree(tmp_path) == before


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("chattr"), reason="chattr +i needs root")
def test_6_a_folder_that_cannot_be_written_real_chattr(tiny_shapes: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    run = fake_run(tmp_path / "run")
    if subprocess.run(["chattr", "+i", str(run)], capture_output=True).returncode:
        pytest.skip("this filesystem has no immutable attribute")
    try:
        before = tree(tmp_path)
        line = one_error(capsys, ["train", "--preset", "sat_soft_tiny", "--data", str(tiny_shapes),
                                  "--out", str(run), "--overwrite"])
        assert line == f"captioner train: error: {run}: cannot write in this folder (Operation not permitted)"
        assert tree(tmp_path) == before
    finally:
        subprocess.run(["chattr", "-i", str(run)], check=True)


# ----------------------------------------------------------------------------- 7, 10: config values


@pytest.mark.parametrize("setting, message", [
    ("train.time_budget=abc", "train.time_budget: got 'abc' (a string), wanted a finite number or null"),
    ("train.lr=abc", "train.lr: got 'abc' (a string), wanted a finite number"),
    ("train.lr=nan", "train.lr: got 'nan' (a string), wanted a finite number"),
    ("train.lr=NaN", "train.lr: got nan (a number), wanted a finite number (NaN and infinity are not accepted)"),
    ("train.epochs=abc", "train.epochs: got 'abc' (a string), wanted a whole number"),
    ("decoder.hidden_dim=abc", "model.decoder.hidden_dim: got 'abc' (a string), wanted a whole number"),
    ("train.batch_size=2.5", "train.batch_size: got 2.5 (a number), wanted a whole number"),
    ("train.time_budget=-5", "train.time_budget must be a number of seconds > 0 or null, got -5.0"),
    ("data.skip_missing=1", "data.skip_missing: got 1 (a whole number), wanted true or false"),
    ("train.betas=0.9", "train.betas: got 0.9 (a number), wanted a list of 2 values, each a finite number"),
])
def test_7_10_wrong_config_values_name_the_key_before_anything_is_written(
        tiny_shapes: Path, tmp_path: Path, capsys: pytest.CaptureFixture, setting: str, message: str) -> None:
    out = tmp_path / "run"
    line = one_error(capsys, ["train", "--preset", "sat_soft_tiny", "--data", str(tiny_shapes), "--out", str(out),
                              "--set", setting])
    assert line == f"captioner train: error: {message}"
    assert not out.exists()


def test_10_config_types_accept_what_they_should() -> None:
    from captioner.config import get_preset

    cfg = get_preset("sat_soft_tiny", **{"train.epochs": 4e1, "train.time_budget": 600, "train.val_max_images": None,
                                         "train.betas": [0.9, 0.98]})
    assert (cfg.train.epochs, cfg.train.time_budget, cfg.train.betas) == (40, 600.0, (0.9, 0.98))
    assert isinstance(cfg.train.epochs, int) and isinstance(cfg.train.time_budget, float)
    with pytest.raises(ConfigError, match=r"^train.epochs: got True \(a boolean\), wanted a whole number$"):
        get_preset("sat_soft_tiny", **{"train.epochs": True})


# ----------------------------------------------------------------------------- 2, 3: what is read


def test_2_dev_zero_and_huge_files_are_refused_without_reading(tmp_path: Path, ckpt: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    from captioner.data.images import load_image

    assert one_error(capsys, ["caption", "/dev/zero", "-c", str(ckpt)]) == \
        "captioner caption: error: /dev/zero: is a character device, not a regular file"
    huge = tmp_path / "huge.jpg"
    with open(huge, "wb") as f:
        f.truncate(600 << 20)  # sparse: 600 MiB by its size, nothing on disk
    assert one_error(capsys, ["caption", str(huge), "-c", str(ckpt)]) == \
        f"captioner caption: error: {huge}: image file too large (600.0 MiB, limit 512.0 MiB)"
    small = tmp_path / "small.png"
    Image.new("RGB", (40, 40)).save(small)
    with pytest.raises(ImageLoadError, match=r"image file too large \(.* bytes, limit 10 bytes\)$"):
        load_image(small, max_bytes=10)


@pytest.mark.timeout(60)
def test_3_a_named_pipe_is_refused_without_blocking(tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    pipe = tmp_path / "pipe.jpg"
    os.mkfifo(pipe)
    assert one_error(capsys, ["caption", str(pipe), "-c", str(ckpt)]) == \
        f"captioner caption: error: {pipe}: is a named pipe, not a regular file"


@pytest.mark.timeout(60)
def test_3_a_folder_reports_what_it_skipped_and_why(tmp_path: Path, ckpt: Path, photo: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "photos"
    folder.mkdir()
    shutil.copy(photo, folder / "good.png")
    os.mkfifo(folder / "fifo.jpg")
    (folder / "broken.jpg").symlink_to(folder / "nowhere.jpg")
    (folder / "loop.png").symlink_to(folder / "loop.png")
    (folder / "dir.jpg").mkdir()
    (folder / "notes.txt").write_text("not an image name: not considered")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(folder / "sock.png"))
    try:
        code = main(["caption", str(folder), "-c", str(ckpt), "--beam", "1", "--max-len", "3"])
    finally:
        server.close()
    out, err = capsys.readouterr()
    assert code == 1 and "Traceback" not in err
    assert [line.split("\t")[0] for line in out.splitlines()] == [str(folder / "good.png")]
    prefix = f"captioner caption: error: {folder}"
    assert err.splitlines() == [f"{prefix}/broken.jpg: skipped: broken symbolic link",
                                f"{prefix}/dir.jpg: skipped: a directory, not an image file",
                                f"{prefix}/fifo.jpg: skipped: a named pipe, not a regular file",
                                f"{prefix}/loop.png: skipped: symbolic link loop",
                                f"{prefix}/sock.png: skipped: a socket, not a regular file"]


def test_3_config_annotation_and_checkpoint_pipes_are_refused(tmp_path: Path) -> None:
    from captioner.checkpoint.store import load_checkpoint
    from captioner.config import load_config_file
    from captioner.data.coco import load_caption_set

    for name in ("cfg.yaml", "captions_train.json", "model.safetensors"):
        os.mkfifo(tmp_path / name)
    with pytest.raises(ConfigError, match="cfg.yaml: is a named pipe, not a regular file$"):
        load_config_file(tmp_path / "cfg.yaml")
    with pytest.raises(CheckpointError, match="model.safetensors: is a named pipe, not a regular file$"):
        load_checkpoint(tmp_path / "model.safetensors")
    with pytest.raises(DataError, match="captions_train.json: is a named pipe, not a regular file$"):
        load_caption_set(tmp_path / "captions_train.json", "train")


@pytest.mark.timeout(60)
def test_3_every_input_opened_for_reading_refuses_pipes_and_devices(tmp_path: Path) -> None:
    """open_regular is the one way an input file is opened: the weights-only loader, the checkpoint
    sniffer, hashes, a Flickr8k token file and a feature cache's sampled images all refuse a pipe
    and /dev/zero from their kind instead of blocking or reading forever (issue 54, item 6)."""
    from captioner.checkpoint.store import torch_load
    from captioner.data.coco import load_flickr8k
    from captioner.features.cache import _sample_digest
    from captioner.files import file_sha256, open_regular

    pipe = tmp_path / "pipe.pt"
    os.mkfifo(pipe)
    zero = tmp_path / "zero.pt"
    zero.symlink_to("/dev/zero")
    for path, kind in ((pipe, "named pipe"), (zero, "character device")):
        with pytest.raises(CheckpointError, match=f"^{path}: is a {kind}, not a regular file$"):
            torch_load(path, "cpu", "training state")
        with pytest.raises(DataError, match=f"^{path}: is a {kind}, not a regular file$"):
            open_regular(path, None, DataError)
        with pytest.raises(CheckpointError, match=f"is a {kind}"):
            file_sha256(path, CheckpointError)
        assert _sample_digest(path) == b"missing\n"
    root = tmp_path / "flickr8k"
    (root / "Flickr8k_text").mkdir(parents=True)
    (root / "Flickr8k_Dataset").mkdir()
    os.mkfifo(root / "Flickr8k_text" / "Flickr8k.token.txt")
    (root / "Flickr8k_text" / "Flickr_8k.trainImages.txt").write_text("a.jpg\n")
    with pytest.raises(DataError, match="Flickr8k.token.txt: is a named pipe, not a regular file$"):
        load_flickr8k(root, "train")
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"abc")
    with open_regular(plain, 10) as f:
        assert f.read() == b"abc"
    assert file_sha256(plain) == hashlib.sha256(b"abc").hexdigest()


# ----------------------------------------------------------------------------- 4: search memory


class _EndsSoon(torch.nn.Module):
    """A decoder over 6 words whose <eos> (id 2) takes half the mass: every search ends in a few words."""

    vocab_size = 6

    def init_state(self, features: torch.Tensor):
        from captioner.models.base import State

        return State({}, {"t": 0})

    def step(self, prev: torch.Tensor, state):
        from captioner.models.base import State

        p = torch.tensor([0.0, 0.0, 0.5, 0.3, 0.15, 0.05]).expand(prev.size(0), 6)
        return p.log(), State(state.static, {"t": state.dynamic["t"] + 1}), torch.full((prev.size(0), 4), 0.25)

    def state_bytes_per_word(self) -> int:
        return 0


@pytest.mark.timeout(60)
def test_4_search_memory_grows_with_the_words_generated_not_max_len(monkeypatch: pytest.MonkeyPatch) -> None:
    from captioner.decoding import search as budget
    from captioner.decoding.search import SearchRules, DecodeOptions, decode

    features = torch.zeros(2, 4, 3)
    want = decode(_EndsSoon(), features, SearchRules(1, 2), DecodeOptions(beam_size=3, max_len=20))
    monkeypatch.setattr(budget, "MEMORY_LIMIT", 1 << 60)  # allow the request; only the words generated count
    for beam in (1, 3):
        began = time.monotonic()
        got = decode(_EndsSoon(), features, SearchRules(1, 2), DecodeOptions(beam_size=beam, max_len=10**9))
        assert time.monotonic() - began < 5.0  # a (rows, max_len, N) history would be 10**10 floats
        if beam == 3:
            assert [[(h.tokens, h.score) for h in per] for per in got] == \
                [[(h.tokens, h.score) for h in per] for per in want]


def test_4_an_impossible_search_is_one_line_naming_the_options(ckpt: Path, photo: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    import captioner

    line = one_error(capsys, ["caption", str(photo), "-c", str(ckpt), "--beam", "1000", "--max-len", "100000"])
    assert line.startswith("captioner caption: error: beam size 1000 with max_len 100000 (--beam, --max-len) could "
                           "need ") and line.endswith("(limit 2.0 GiB): lower --beam or --max-len")
    with pytest.raises(ConfigError, match="^beam size 1000 with max_len 100000"):
        captioner.load(ckpt, device="cpu").caption(photo, beam=1000, max_len=100000)
    model = captioner.load(ckpt, device="cpu")  # each alone is fine (this untrained model's best at beam 1000
    assert len(model.caption(photo, beam=1000, max_len=3, allow_empty=True)) == 1  # is the empty caption)


def test_4_a_batch_over_the_limit_is_searched_in_chunks_with_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    from captioner.decoding import search as budget
    from captioner.decoding.search import DecodeOptions, SearchRules, decode

    features = torch.randn(5, 4, 3)
    options = DecodeOptions(beam_size=3, max_len=6, n_best=2)
    whole = decode(_EndsSoon(), features, SearchRules(1, 2), options)
    one = budget.search_bytes(3, 6, 4, 6)
    monkeypatch.setattr(budget, "MEMORY_LIMIT", 2 * one)
    assert [(s.start, s.stop) for s in budget.image_chunks(_EndsSoon(), features, options)] == [(0, 2), (2, 4), (4, 5)]
    chunked = decode(_EndsSoon(), features, SearchRules(1, 2), options)
    assert [[(h.tokens, h.score, h.attention.tolist()) for h in per] for per in chunked] == \
        [[(h.tokens, h.score, h.attention.tolist()) for h in per] for per in whole]


# ----------------------------------------------------------------------------- 8: a closed stdout


class _ClosedPipe:
    def write(self, text: str) -> int:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")


def test_8_a_closed_stdout_ends_quietly_with_141(ckpt: Path, photo: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    code = main(["caption", str(photo), "-c", str(ckpt), "--beam", "1", "--max-len", "3"])
    monkeypatch.undo()
    assert code == 141
    assert capsys.readouterr().err == ""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_8_caption_piped_into_head_has_no_traceback(tmp_path: Path, ckpt: Path, photo: Path) -> None:
    for i in range(6):
        shutil.copy(photo, tmp_path / f"p{i}.png")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    script = (f"{sys.executable} -m captioner caption {tmp_path} -c {ckpt} --beam 1 --max-len 3 --batch-size 1 "
              "| head -1; echo \"exit=${PIPESTATUS[0]}\"")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=280)
    assert proc.stdout.splitlines()[0].startswith(str(tmp_path / "p0.png"))
    assert proc.stdout.splitlines()[-1] == "exit=141" and proc.stderr == ""


# ----------------------------------------------------------------------------- 9: the Python API


@pytest.fixture(scope="module")
def model(ckpt: Path):
    import captioner

    return captioner.load(ckpt, device="cpu")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64, torch.bool, torch.complex64])
def test_9_tensors_that_are_not_floats_are_refused(model, dtype: torch.dtype) -> None:
    side = model.transform.size
    name = str(dtype).replace("torch.", "")
    article = "an" if name[0] in "aeiou" else "a"
    with pytest.raises(ImageInputError, match=rf"^image 1: {article} {name} tensor is not an already-transformed "):
        model.caption(torch.zeros(3, side, side, dtype=dtype), beam=1, max_len=3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.bfloat16])
def test_9_other_float_tensors_are_converted(model, dtype: torch.dtype) -> None:
    x = torch.randn(3, model.transform.size, model.transform.size)
    want = model.caption(x, beam=1, max_len=3)[0]
    got = model.caption(x.to(dtype), beam=1, max_len=3)[0]
    assert len(got.words) == 3 and (dtype is not torch.float64 or got.text == want.text)


@pytest.mark.parametrize("value, problem", [(float("nan"), "NaN"), (float("inf"), "infinite")])
def test_9_nan_and_inf_tensors_are_refused(model, value: float, problem: str) -> None:
    side = model.transform.size
    batch = torch.zeros(2, 3, side, side)
    batch[1, 0, 0, 0] = value
    with pytest.raises(ImageInputError, match=rf"^image 2: the image tensor holds {problem} values$"):
        model.caption(batch, beam=1, max_len=3)


def test_9_empty_and_oversized_images_and_odd_inputs(model, photo: Path) -> None:
    with pytest.raises(ImageInputError, match=r"^image 2: empty image \(0x0 pixels\)$") as info:
        model.caption([Image.open(photo), Image.new("RGB", (0, 0))])
    assert isinstance(info.value, ValueError)  # what PIL raised before, so old except clauses still catch it
    with pytest.raises(ImageInputError, match=r"^image 1: image too large \(9000x9000 pixels"):
        model.caption(Image.new("L", (9000, 9000)))
    with pytest.raises(ImageInputError, match=r"^image 1: an image tensor must be already transformed to"):
        model.caption(torch.zeros(3, 5, 7))
    with pytest.raises(ImageInputError, match=r"^image 1: cannot caption a dict; give a path"):
        model.caption({"not": "an image"})
    with pytest.raises(ConfigError, match=r"^attention must be True or False, got 'yes'$"):
        model.caption(photo, attention="yes")
    with pytest.raises(ConfigError, match=r"^options must be a DecodeOptions, got int$"):
        model.caption(photo, options=3)


# ----------------------------------------------------------------------------- 11: refused pickles


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo PWNED > /dev/null",))


@pytest.mark.parametrize("kind", ["zip", "legacy", "pickle4", "pickle2"])
def test_11_a_refused_pickle_names_its_global_whatever_torch_says(tmp_path: Path, kind: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from captioner.checkpoint.store import load_checkpoint

    path = tmp_path / "evil.pt"
    if kind == "zip":
        torch.save({"a": _Evil(), "t": torch.zeros(2)}, path)
    elif kind == "legacy":
        torch.save({"a": _Evil(), "t": torch.zeros(2)}, path, _use_new_zipfile_serialization=False)
    else:
        path.write_bytes(pickle.dumps({"a": _Evil()}, protocol=int(kind[-1])))
    real_load = torch.load

    def reworded(*args, **kwargs):  # torch's wording changes between releases; the answer must not
        try:
            return real_load(*args, **kwargs)
        except pickle.UnpicklingError:
            raise pickle.UnpicklingError("Weights only load failed. " + "Some new explanation. " * 20) from None

    monkeypatch.setattr(torch, "load", reworded)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert str(info.value) == (f"{path}: refused: the file holds pickled objects that weights_only loading does not "
                               f"allow, it may run code (blocked global: {os.system.__module__}.system)")


# ----------------------------------------------------------------------------- 12: output names


def test_12_overlays_of_a_dots_only_stem_stay_inside_the_folder(tmp_path: Path, ckpt: Path, photo: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "photos"
    folder.mkdir()
    shutil.copy(photo, folder / "...png")
    shutil.copy(photo, folder / "a.png")
    out = tmp_path / "out"
    code = main(["caption", str(folder), "-c", str(ckpt), "--beam", "1", "--max-len", "2", "--overlay",
                 str(out / "sub"), "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["sub"]
    assert sorted(p.name for p in (out / "sub").iterdir()) == [".captioner-files.json", "a", "image"]  # + manifest
    assert [Path(r["overlay"]).parent for r in rows] == [out / "sub"] * 2


@pytest.mark.parametrize("stem", ["../x", "..", "a/b", ""])
def test_12_attend_refuses_a_stem_that_leaves_out(tmp_path: Path, ckpt: Path, photo: Path,
                                                 capsys: pytest.CaptureFixture, stem: str) -> None:
    line = one_error(capsys, ["attend", str(photo), "-c", str(ckpt), "--out", str(tmp_path / "o"), "--stem", stem])
    assert line.startswith(f"captioner attend: error: --stem {stem!r} must be a plain file name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["photo.png"]


def test_12_safe_name() -> None:
    from captioner.files import safe_name

    assert [safe_name(s) for s in ("..", ".", "", "a/b", "x\ny", "...", "ok.v2")] == \
        ["image", "image", "image", "a_b", "x_y", "image", "ok.v2"]


# ----------------------------------------------------------------------------- 13: output and usage


def test_13_json_lines_are_valid_utf8_and_plain_lines_unambiguous(tmp_path: Path, ckpt: Path, photo: Path,
                                                                  capsysbinary: pytest.CaptureFixture) -> None:
    folder = tmp_path / "odd"
    folder.mkdir()
    names = [b"bad\xffname.png", b"tab\there.png", b"new\nline.png", b'"quoted.png', b"plain.png"]
    for name in names:
        shutil.copy(photo, os.path.join(os.fsencode(folder), name))
    assert main(["caption", str(folder), "-c", str(ckpt), "--beam", "1", "--max-len", "2", "--json"]) == 0
    raw = capsysbinary.readouterr().out
    rows = [json.loads(line) for line in raw.decode("utf-8").splitlines()]  # strict UTF-8, one row per line
    assert sorted(os.fsencode(Path(r["path"]).name) for r in rows) == sorted(names)

    assert main(["caption", str(folder), "-c", str(ckpt), "--beam", "1", "--max-len", "2"]) == 0
    lines = capsysbinary.readouterr().out.decode("utf-8").splitlines()
    assert len(lines) == len(names)
    paths = []
    for line in lines:
        if line.startswith('"'):
            path, end = json.JSONDecoder().raw_decode(line)
            assert line[end] == "\t"
        else:
            path = line.split("\t")[0]
        paths.append(os.fsencode(Path(path).name))
    assert sorted(paths) == sorted(names)


def test_13_usage_errors_are_one_line_exit_2(capsys: pytest.CaptureFixture) -> None:
    assert one_error(capsys, ["caption", "--beam", "abc", "x.png", "-c", "m"], code=2) == \
        "captioner caption: error: argument --beam: expected a whole number, got 'abc' (see 'captioner caption --help')"
    assert one_error(capsys, ["train", "--nope"], code=2).startswith("captioner: error: unrecognized arguments")
    assert one_error(capsys, ["frobnicate"], code=2).startswith("captioner: error: argument COMMAND: invalid choice")


def test_13_a_very_long_caption_does_not_grow_the_vocabulary() -> None:
    from captioner.text import Vocabulary

    long = "a red circle " + " ".join(f"w{i}" for i in range(10_000))
    assert len(Vocabulary.build(["a blue square", long], max_len=30)) == 4 + 5 + 27
    assert len(Vocabulary.build(["a blue square", long])) == 4 + 5 + 10_000


def test_worker_counts_are_bounded_so_a_typo_cannot_fork_thousands_of_processes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from captioner.config import get_preset
    from captioner.config.schema import MAX_WORKERS
    from captioner.errors import ConfigError

    assert get_preset("sat_soft_tiny", **{"data.num_workers": MAX_WORKERS}).data.num_workers == MAX_WORKERS
    with pytest.raises(ConfigError, match=rf"data.num_workers must be between 0 and {MAX_WORKERS}, got 100000"):
        get_preset("sat_soft_tiny", **{"data.num_workers": 100000})
    from captioner.cli import main

    assert main(["evaluate", str(tmp_path / "none.safetensors"), "--data", str(tmp_path), "--workers", "100000"]) == 2
    assert f"argument --workers: must be between 0 and {MAX_WORKERS}, got 100000" in capsys.readouterr().err
