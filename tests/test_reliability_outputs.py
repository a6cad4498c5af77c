"""What the commands write: never over a user's file, and never an empty caption as a result.

Every writer is run against a folder that holds a user's file of the name it would write: the file
is refused in one line (exit 1) and left as it was, unless ``--force``; captioner's own earlier
files (listed in the folder's ``.captioner-files.json``) are replaced without it where that is the
rule (overlays, a dataset's files). A model that writes no word for a photo is an error naming the
photo and the beam size, and ``attend`` draws nothing for it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from PIL import Image

import captioner
from captioner.cli import main
from captioner.errors import ConfigError, DataError, EmptyCaptionError
from captioner.files import MANIFEST, Outputs
from zips import zip_bytes as _zip

USER = b"the user's own file\n"


def _one_error(capsys: pytest.CaptureFixture[str], command: str, text: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("captioner: using")]
    assert len(lines) == 1 and lines[0].startswith(f"captioner {command}: error: ") and text in lines[0], err
    return lines[0]


@pytest.fixture()
def photo(tmp_path: Path) -> Path:
    path = tmp_path / "00001.png"
    Image.new("RGB", (48, 40), (120, 90, 40)).save(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, untrained_checkpoint) -> Path:
    return untrained_checkpoint(tmp_path_factory.mktemp("tiny"), "sat_soft_tiny")


@pytest.fixture(scope="module")
def mute(tmp_path_factory, untrained_checkpoint) -> Path:
    """A tiny checkpoint whose every caption is empty: ``<eos>`` is always the most probable word."""
    from captioner.checkpoint.store import save_checkpoint

    path = untrained_checkpoint(tmp_path_factory.mktemp("mute"), "sat_soft_tiny")
    model = captioner.load(path, device="cpu")
    with torch.no_grad():
        for module in model.model.decoder.modules():
            if isinstance(module, torch.nn.Linear) and module.out_features == len(model.vocab) \
                    and module.bias is not None:
                module.bias[model.vocab.eos_id] = 60.0
    save_checkpoint(path, model.model, model.vocab)
    return path


# --- the shared rule ---

def test_outputs_refuses_a_users_file_and_replaces_its_own(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "user.txt").write_bytes(USER)
    outputs = Outputs(out, option="--out")
    with pytest.raises(ConfigError, match=rf"^{out / 'user.txt'}: already exists, not written by captioner "
                                          r"\(and 1 more\); choose another --out or pass --force to replace it$"):
        outputs.check([out / "user.txt", out / "user.txt", out / "new.txt"])
    assert outputs.check([out / "new.txt"]) == []
    (out / "ours.txt").write_bytes(b"1")
    outputs.record([out / "ours.txt", out / "missing.txt"])
    assert set(Outputs(out).owned()) == {"ours.txt"}
    assert outputs.check([out / "ours.txt"]) == [out / "ours.txt"]  # its own file: replaced
    with pytest.raises(ConfigError, match="written by an earlier run; choose another --out or pass --force"):
        Outputs(out, replace_own=False).check([out / "ours.txt"])
    (out / "ours.txt").write_bytes(b"edited by the user")  # no longer the file captioner wrote
    with pytest.raises(ConfigError, match="ours.txt: already exists, not written by captioner"):
        outputs.check([out / "ours.txt"])
    assert Outputs(out, force=True).check([out / "ours.txt", out / "user.txt"]) == [out / "ours.txt", out / "user.txt"]
    (out / "dir").mkdir()
    with pytest.raises(ConfigError, match="dir: is a folder where a file is to be written"):
        Outputs(out, force=True).check([out / "dir"])
    (out / MANIFEST).write_text("{not json")  # a broken manifest owns nothing
    assert Outputs(out).owned() == {}
    assert sorted(os.listdir(out)) == [MANIFEST, "dir", "ours.txt", "user.txt"]  # no lock file left


# --- attend --out, caption --overlay ---

def test_attend_refuses_the_users_overlays_and_replaces_its_own(tmp_path, photo, tiny, capsys) -> None:
    out = tmp_path / "ovu"
    out.mkdir()
    (out / "attention.png").write_bytes(USER)
    (out / "attention.html").write_bytes(USER)
    argv = ["attend", str(photo), "-c", str(tiny), "--out", str(out), "--max-len", "3"]
    assert main(argv) == 1
    _one_error(capsys, "attend", f"{out / 'attention.png'}: already exists, not written by captioner (and 1 more); "
                                 "choose another --out or pass --force")
    assert sorted(os.listdir(out)) == ["attention.html", "attention.png"]
    assert (out / "attention.png").read_bytes() == USER
    assert main(argv + ["--force"]) == 0
    assert (out / "attention.png").read_bytes()[:4] == b"\x89PNG" and (out / MANIFEST).is_file()
    capsys.readouterr()
    assert main(argv) == 0  # its own files, run again: replaced without --force
    (out / "attention.json").write_bytes(USER)  # the user puts a file of their own in its place
    assert main(argv) == 1
    _one_error(capsys, "attend", "attention.json: already exists, not written by captioner;")
    assert (out / "attention.json").read_bytes() == USER


def test_caption_overlay_refuses_the_users_file_before_any_work(tmp_path, photo, tiny, capsys) -> None:
    out = tmp_path / "ovc"
    (out / "00001").mkdir(parents=True)
    (out / "00001" / "attention.json").write_bytes(USER)
    argv = ["caption", str(photo), "-c", str(tiny), "--overlay", str(out), "--max-len", "3"]
    assert main(argv) == 1
    _one_error(capsys, "caption", f"{out / '00001' / 'attention.json'}: already exists, not written by captioner; "
                                  "choose another --overlay or pass --force")
    assert os.listdir(out) == ["00001"] and os.listdir(out / "00001") == ["attention.json"]
    assert (out / "00001" / "attention.json").read_bytes() == USER
    assert main(argv + ["--force"]) == 0
    assert capsys.readouterr().out.startswith(f"{photo}\t")
    assert sorted(os.listdir(out / "00001")) == ["attention.gif", "attention.html", "attention.json", "attention.png"]
    assert set(Outputs(out).owned()) == {f"00001/attention.{k}" for k in ("gif", "html", "json", "png")}
    assert main(argv) == 0  # again: its own files


# --- download --root, --mirror ---

@pytest.fixture()
def text_mirror(tmp_path: Path) -> str:
    folder = tmp_path / "mirror"
    folder.mkdir()
    (folder / "Flickr8k_text.zip").write_bytes(_zip({"Flickr8k.token.txt": b"101_a.jpg#0\ta dog .\n",
                                                     "readme.txt": b"the archive's readme\n"}))
    return folder.as_uri()


def _download(root: Path, mirror: str, *extra: str) -> int:
    return main(["download", "flickr8k", "--root", str(root), "--only", "text", "--mirror", mirror, "--no-progress",
                 *extra])


def test_download_refuses_to_replace_the_users_captions(tmp_path, text_mirror, capsys) -> None:
    root = tmp_path / "dlr"
    (root / "Flickr8k_text").mkdir(parents=True)
    token = root / "Flickr8k_text" / "Flickr8k.token.txt"
    token.write_bytes(USER)
    assert _download(root, text_mirror) == 1  # known in advance: refused before the download
    _one_error(capsys, "download", f"{token}: already exists, not written by captioner; choose another --root or "
                                   "pass --force")
    assert token.read_bytes() == USER and sorted(os.listdir(root)) == ["Flickr8k_text"]
    assert _download(root, text_mirror, "--force") == 0
    assert token.read_bytes() == b"101_a.jpg#0\ta dog .\n"
    assert {"Flickr8k_text/Flickr8k.token.txt", "Flickr8k_text/.extracted", "Flickr8k.sha256"} <= set(
        Outputs(root).owned())


def test_a_users_file_seen_only_in_the_archive_keeps_the_zip_for_the_next_run(tmp_path, text_mirror,
                                                                                capsys) -> None:
    root = tmp_path / "dlr"
    (root / "Flickr8k_text").mkdir(parents=True)
    readme = root / "Flickr8k_text" / "readme.txt"
    readme.write_bytes(USER)
    assert _download(root, text_mirror) == 1
    _one_error(capsys, "download", f"{readme}: already exists, not written by captioner; choose another --root")
    assert readme.read_bytes() == USER and not (root / "Flickr8k_text" / "Flickr8k.token.txt").exists()
    assert os.listdir(root / "downloads") == ["Flickr8k_text.zip"]  # fetched once: --force uses it
    assert _download(root, text_mirror, "--force") == 0
    assert "use " in capsys.readouterr().out and readme.read_bytes() == b"the archive's readme\n"


@pytest.mark.parametrize("mirror", ["", "  ", "example.org/files", "ftp://example.org/x", "https://"])
def test_a_mirror_that_is_not_a_url_is_refused_and_leaves_nothing(tmp_path, capsys, mirror) -> None:
    root = tmp_path / "dl"
    assert _download(root, mirror) == 1
    _one_error(capsys, "download", f"--mirror {mirror!r}: not a mirror URL; give http(s)://HOST/PATH or "
                                   "file:///FOLDER")
    assert not root.exists()
    assert main(["download", "coco", "--root", str(root), "--mirror", mirror, "--dry-run"]) == 1
    assert not root.exists()


def test_a_failed_download_leaves_no_folder_behind(tmp_path, capsys) -> None:
    root = tmp_path / "a" / "dl"
    assert _download(root, (tmp_path / "no-such-mirror").as_uri()) == 1
    assert "download failed" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


# --- empty captions ---

def test_an_empty_caption_is_an_error_naming_the_photo_and_the_beam(mute, photo, tmp_path) -> None:
    model = captioner.load(mute, device="cpu")
    with pytest.raises(EmptyCaptionError, match=rf"^{photo}: the model wrote an empty caption \(no word before "
                                                r"<eos>\) at beam 10;"):
        model.caption(photo, beam=10)
    with pytest.raises(EmptyCaptionError, match=r"^image 0 of the input: .* at beam 3;"):
        model.caption([Image.open(photo), Image.open(photo)])
    assert model.caption(photo, allow_empty=True)[0].text == ""  # scoring a split counts it as a wrong answer
    with pytest.raises(ConfigError, match="allow_empty must be True or False"):
        model.caption(photo, allow_empty="yes")


def test_the_commands_fail_on_an_empty_caption_and_draw_nothing(mute, tiny, photo, tmp_path, capsys) -> None:
    other = tmp_path / "00002.png"
    Image.new("RGB", (30, 30), (0, 90, 200)).save(other)
    assert main(["caption", str(photo), str(other), "-c", str(mute), "--beam", "10"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"captioner caption: error: {p}: the model wrote an empty caption (no word before <eos>) at beam 10; a "
        "smaller beam, or a model trained longer, may say something" for p in (photo, other)]
    out_dir = tmp_path / "ov"
    assert main(["attend", str(photo), "-c", str(mute), "--out", str(out_dir)]) == 1
    _one_error(capsys, "attend", f"{photo}: the model wrote an empty caption (no word before <eos>) at beam 3")
    assert not out_dir.exists() or os.listdir(out_dir) == []
    assert main(["caption", str(photo), "-c", str(tiny), "--max-len", "2"]) == 0  # words: a caption


def test_the_n_best_drop_an_empty_hypothesis_and_refuse_an_empty_best(mute, tiny, photo) -> None:
    """caption_nbest, the server's call: a lower-ranked empty hypothesis is no caption (dropped); an empty best
    one is the error caption() gives for the same photo and beam."""
    model = captioner.load(tiny, device="cpu")
    with torch.no_grad():  # "red" most probable at every step, <eos> next: the bare "<eos>" ranks among the best
        for module in model.model.decoder.modules():
            if isinstance(module, torch.nn.Linear) and module.out_features == len(model.vocab) \
                    and module.bias is not None:
                module.bias.zero_()
                module.bias[model.vocab.eos_id] = 5.0
                module.bias[model.vocab.stoi["red"]] = 6.0
    longer = {"n_best": 4, "beam": 4, "max_len": 2, "length_penalty": 1.5}  # longer captions rank first
    kept = model.caption_nbest(photo, allow_empty=True, **longer)
    assert [c.text for c in kept][:3] == ["red red", "red", ""]
    assert [c.text for c in model.caption_nbest(photo, **longer)] == [c.text for c in kept if c.words]  # dropped
    with pytest.raises(EmptyCaptionError, match=rf"^{photo}: .* at beam 3;"):  # here the empty one is the best
        model.caption_nbest(photo, n_best=3, beam=3)
    with pytest.raises(EmptyCaptionError, match=rf"^{photo}: .* at beam 3;"):  # as caption() says
        model.caption(photo, beam=3)
    with pytest.raises(EmptyCaptionError, match=rf"^{photo}: the model wrote an empty caption \(no word before "
                                                r"<eos>\) at beam 4;"):
        captioner.load(mute, device="cpu").caption_nbest(photo, n_best=2, beam=4)


def test_the_server_answers_an_all_empty_n_best_with_json_400(mute, photo) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from captioner.share.server import ServedModel, create_app

    app = create_app([ServedModel("mute", captioner.load(mute, device="cpu"))])
    with TestClient(app, base_url="http://127.0.0.1:8000") as client:
        answer = client.post("/api/caption", files={"image": ("photo.png", photo.read_bytes(), "image/png")},
                             data={"beam": "3", "n_best": "2"})
    assert answer.status_code == 400
    assert "the model wrote an empty caption (no word before <eos>) at beam 3" in answer.json()["error"]


# --- Ctrl-C as a command exits ---

LATE_INTERRUPT = """
import atexit, os, signal, sys, time
from captioner.cli import main
def late():  # runs after main has returned, while the interpreter shuts down
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(2)
atexit.register(late)
sys.argv = ["captioner", *sys.argv[1:]]
sys.exit(main())
"""


def test_ctrl_c_while_a_command_exits_prints_one_line_and_no_traceback(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    def ctrl_c_as_a_terminal_gives_it() -> None:  # a background job's children inherit SIGINT ignored
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    out = tmp_path / "shapes"
    done = subprocess.run([sys.executable, "-c", LATE_INTERRUPT, "make-shapes", "--out", str(out), "--images", "3",
                           "--image-size", "32"], capture_output=True, text=True, timeout=120,
                          preexec_fn=ctrl_c_as_a_terminal_gives_it)
    assert done.returncode == 130 and "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
    assert done.stderr.splitlines()[-1] == ("captioner make-shapes: interrupted while exiting (the command had "
                                            "finished with exit code 0)")
    assert done.stdout.startswith("wrote 3 images (1 train, 1 val, 1 test)")  # its output was flushed first
    assert len(list((out / "images").iterdir())) == 3
    called = subprocess.run([sys.executable, "-c", "from captioner.cli import main; import signal; "
                             "main(['make-shapes', '--out', %r, '--images', '3', '--image-size', '32', '--force']); "
                             "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)" % str(out)],
                            capture_output=True, text=True, timeout=120, preexec_fn=ctrl_c_as_a_terminal_gives_it)
    assert called.stdout.splitlines()[-1] == "True"  # main(argv) from a program leaves its Ctrl-C alone


# --- caches: under the cache root or --out, never beside the working directory ---

def test_a_shared_feature_cache_lives_in_the_cache_root_and_leaves_no_lock(tiny_shapes, tmp_path, monkeypatch,
                                                                           capsys) -> None:
    from captioner.config import get_preset
    from captioner.training.data import feature_cache_dir

    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("CAPTIONER_CACHE", str(cache))
    monkeypatch.delenv("CAPTIONER_FEATURE_CACHE", raising=False)
    assert feature_cache_dir(get_preset("sat_soft_flickr8k"), work / "runs" / "x" / "features") == cache / "features"
    assert feature_cache_dir(get_preset("sat_soft_tiny"), Path("runs/x/features")) == Path("runs/x/features")
    argv = ["train", "--preset", "sat_soft_tiny", "--data", str(tiny_shapes), "--out", "runs/x", "--epochs", "1",
            "--set", "data.shared_feature_cache=true", "--set", "train.val_max_images=4", "--no-progress"]
    assert main(argv) == 0
    capsys.readouterr()
    assert sorted(p.name for p in work.iterdir()) == ["runs"] and sorted(os.listdir(work / "runs")) == ["x"]
    assert not (work / "runs" / "x" / "features").exists()
    cached = sorted(p.name for p in (cache / "features").iterdir())
    assert cached and all(name.endswith(".feats") for name in cached)  # the caches, and no 0-byte .lock file
    assert not [p for p in tmp_path.rglob("*.lock")]


# --- the other writers, each against a folder holding a user's file ---

def test_make_shapes_refuses_a_users_image_and_records_its_own(tmp_path, capsys) -> None:
    out = tmp_path / "shapes"
    (out / "images").mkdir(parents=True)
    (out / "images" / "00002.png").write_bytes(USER)
    argv = ["make-shapes", "--out", str(out), "--images", "3", "--image-size", "32"]
    assert main(argv) == 1
    _one_error(capsys, "make-shapes", f"{out / 'images' / '00002.png'}: already exists, not written by captioner")
    assert os.listdir(out / "images") == ["00002.png"] and sorted(os.listdir(out)) == ["images"]
    assert main(argv + ["--force"]) == 0
    assert len(Outputs(out).owned()) == 3 + 6  # the images and the six JSON files


def test_evaluate_refuses_a_users_file_of_its_name(tiny, tiny_shapes, tmp_path, capsys) -> None:
    out = tmp_path / "eval"
    out.mkdir()
    (out / "captions_val_results.json").write_bytes(USER)
    argv = ["evaluate", str(tiny), "--data", str(tiny_shapes), "--split", "val", "--max-images", "2", "--max-len",
            "3", "--out", str(out), "--no-progress", "--no-meteor", "--no-coco-caption"]
    assert main(argv) == 1
    _one_error(capsys, "evaluate", f"{out / 'captions_val_results.json'}: already exists, not written by captioner")
    assert os.listdir(out) == ["captions_val_results.json"]


def test_demo_refuses_a_users_report_before_any_work(tmp_path, capsys) -> None:
    out = tmp_path / "demo"
    out.mkdir()
    (out / "report.html").write_bytes(USER)
    assert main(["demo", "--data", str(tmp_path / "scenes"), "--out", str(out), "--decoders", "sat_soft"]) == 1
    _one_error(capsys, "demo", f"{out / 'report.html'}: already exists, not written by captioner; choose another "
                               "--out or pass --force")
    assert os.listdir(out) == ["report.html"] and not (tmp_path / "scenes").exists()


def test_train_refuses_a_folder_holding_a_users_run_file(tiny_shapes, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_bytes(USER)
    assert main(["train", "--preset", "sat_soft_tiny", "--data", str(tiny_shapes), "--out", str(out), "--epochs",
                 "1", "--no-progress"]) == 1
    _one_error(capsys, "train", f"{out} holds an earlier run (config.json)")
    assert os.listdir(out) == ["config.json"] and (out / "config.json").read_bytes() == USER
