"""``captioner export``: checkpoint, SHA-256, Hub model card and overlay; then the round trip a user makes:
a model trained here, exported, put on a (local) web server, loaded by URL with its hash, captions
exactly as the local file does.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from captioner.cli import main
from captioner.errors import CheckpointError, DataError
from range_server import serve

METRICS = {"BLEU-1": 0.63, "BLEU-4": 0.2077, "METEOR": 0.196, "ROUGE-L": 0.46, "CIDEr-D": 0.526,
           "scale": "BLEU, METEOR and ROUGE-L on 0-1 scale; CIDEr-D on coco-caption's x10 scale",
           "data": "../shared/data/flickr8k", "split": "dev", "beam_size": 3, "num_images": 1000}


def front_matter(readme: str) -> dict:
    assert readme.startswith("---\n")
    return yaml.safe_load(readme.split("---\n", 2)[1])


@pytest.fixture()
def run_dir(tmp_path: Path, untrained_checkpoint) -> Path:
    run = tmp_path / "f8k_sat"
    run.mkdir()
    untrained_checkpoint(run, "sat_soft_tiny").rename(run / "best.safetensors")
    (run / "metrics_dev.json").write_text(json.dumps(METRICS))
    (run / "config.json").write_text(json.dumps({"data": {"root": "/data/flickr8k"}}))
    return run


def test_export_writes_a_hub_ready_folder(run_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out), "--repo-id", "me/f8k-sat"]) == 0
    data = (out / "model.safetensors").read_bytes()
    assert data == (run_dir / "best.safetensors").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    assert (out / "model.safetensors.sha256").read_text() == f"{digest}  model.safetensors\n"
    assert f"SHA-256 {digest}" in capsys.readouterr().out
    assert json.loads((out / "metrics_dev.json").read_text()) == METRICS

    readme = (out / "README.md").read_text()
    meta = front_matter(readme)
    assert meta["pipeline_tag"] == "image-to-text" and meta["library_name"] == "captioner"
    assert meta["datasets"] == ["flickr8k"] and meta["license"] == "other"
    assert set(meta["metrics"]) == {"bleu", "cider", "meteor", "rouge"}
    [result] = meta["model-index"][0]["results"]
    assert result["dataset"] == {"name": "Flickr8k", "type": "flickr8k", "split": "dev"}
    assert {m["name"]: m["value"] for m in result["metrics"]}["BLEU-4"] == 0.2077
    assert "| dev | 1000 | 3 | 0.6300 | 0.2077 | 0.1960 | 0.4600 | 0.5260 |" in readme
    assert "research use only" in readme  # the data's licence, in words
    assert 'captioner.load("hf://me/f8k-sat")' in readme and f"#sha256={digest}" in readme
    assert "![" in readme and "(overlay.png)" in readme
    overlay = Image.open(out / "overlay.png")
    assert overlay.width > 256 and overlay.height > 100


def test_export_keeps_existing_files_and_reads_what_it_is_given(run_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "export"
    out.mkdir()
    (out / "README.md").write_text("my own notes")
    assert main(["export", str(run_dir), "--out", str(out)]) == 1
    assert (f"{out / 'README.md'}: already exists, not written by captioner; choose another --out or pass --force"
            in capsys.readouterr().err)
    assert (out / "README.md").read_text() == "my own notes"

    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((50, 80, 3), 90, np.uint8)).save(photo)
    (run_dir / "metrics_dev.json").unlink()
    assert main(["export", str(run_dir / "best.safetensors"), "--out", str(out), "--force", "--image", str(photo),
                 "--dataset", "shapes"]) == 0
    readme = (out / "README.md").read_text()
    meta = front_matter(readme)
    assert meta["license"] == "mit" and meta["datasets"] == ["shapes"] and "model-index" not in meta
    assert "Not evaluated yet" in readme and "YOUR-NAME/f8k_sat" in readme

    (run_dir / "metrics_test.json").write_text("{broken")
    with pytest.raises(DataError, match="metrics_test.json: invalid JSON at line 1"):
        from captioner.share.model_card import metrics_rows

        metrics_rows(run_dir)
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 1
    assert "no checkpoint to export" in capsys.readouterr().err


@pytest.mark.slow
def test_trained_exported_served_by_url_captions_like_the_local_file(tiny_shapes: Path, tmp_path: Path,
                                                                      monkeypatch) -> None:
    import captioner
    from captioner.config import get_preset
    from captioner.training.loop import train

    monkeypatch.setenv("CAPTIONER_CACHE", str(tmp_path / "cache"))
    cfg = get_preset("sat_soft_tiny", **{"data.root": str(tiny_shapes), "train.batch_size": 16, "train.epochs": 1,
                                         "train.val_max_images": 4, "train.lr": 1e-2, "train.val_beam": 1})
    run = tmp_path / "run"
    train(cfg, run, progress=False)
    assert main(["export", str(run), "--out", str(tmp_path / "export")]) == 0
    files = {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()}
    digest = files["model.safetensors.sha256"].decode().split()[0]
    images = sorted((tiny_shapes / "images").rglob("*.png"))[:6] or sorted(tiny_shapes.rglob("*.png"))[:6]
    local = captioner.load(run / "best.safetensors", device="cpu")
    with serve(files, "models/tiny") as (base, _):
        remote = captioner.load(f"{base}/model.safetensors#sha256={digest}", device="cpu", progress=False)
    both = [m.caption(images, attention=True, allow_empty=True) for m in (local, remote)]  # beam 3: often empty
    for a, b in zip(*both):
        assert a.text == b.text and torch.equal(a.attention, b.attention)
    assert any(c.text for c in local.caption(images, beam=1))  # a trained model writes words (greedy: after one
    # epoch a beam still prefers the empty caption)


@pytest.mark.parametrize("key, value, message", [
    ("BLEU-4", "high", 'BLEU-4 must be a number, got "high"'),
    ("CIDEr-D", float("nan"), "CIDEr-D must be a number, got NaN"),
    ("num_images", 2.5, "num_images must be a whole number, got 2.5"),
    ("split", "<script>x</script>", 'split must be a short plain text, got "<script>x</script>"'),
])
def test_a_bad_metrics_file_is_one_line_and_writes_nothing(run_dir: Path, tmp_path: Path, capsys,
                                                          key: str, value: object, message: str) -> None:
    (run_dir / "metrics_dev.json").write_text(json.dumps({**METRICS, key: value}))
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"metrics_dev.json: {message}; fix or remove the file" in err
    assert not out.exists() or list(out.iterdir()) == []
    (run_dir / "metrics_dev.json").write_text(json.dumps(METRICS))
    assert main(["export", str(run_dir), "--out", str(out)]) == 0  # nothing half-written refuses the next run


def test_a_failure_midway_removes_what_the_export_wrote(run_dir: Path, tmp_path: Path, monkeypatch) -> None:
    from captioner.share import model_card

    def broken(*args: object, **kwargs: object) -> str:
        raise DataError("the card could not be rendered")

    monkeypatch.setattr(model_card, "render_card", broken)
    out = tmp_path / "export"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="could not be rendered"):
        model_card.export_run(run_dir, out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_a_full_disk_leaves_no_empty_folder(run_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    import errno

    from captioner.share import model_card

    def full(src: Path, dest: Path) -> None:
        raise CheckpointError(f"{dest}: cannot write ({os.strerror(errno.ENOSPC)})")

    monkeypatch.setattr(model_card, "_copy_into", full)
    out = tmp_path / "new" / "export"
    assert main(["export", str(run_dir), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.safetensors: cannot write (No space left on device)" in err
    assert not (tmp_path / "new").exists()  # neither export/ nor the new/ made for it


def test_two_metrics_files_for_one_split_are_refused(run_dir: Path, tmp_path: Path, capsys) -> None:
    (run_dir / "metrics_dev2.json").write_text(json.dumps(METRICS))  # also says "split": "dev"
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "metrics_dev.json and metrics_dev2.json both hold split 'dev'; keep one of them" in err
    assert not out.exists()


def test_repo_ids_are_checked_and_the_default_is_made_safe(tmp_path: Path, run_dir: Path, capsys) -> None:
    from captioner.share.model_card import check_repo_id, default_repo_id

    for bad in ("../..", "me/..", "a/b/c", "me/-x", "me/a--b", "<b>/x", "me"):
        assert main(["export", str(run_dir), "--out", str(tmp_path / "o"), "--repo-id", bad]) == 1
        assert "--repo-id must look like ORG/NAME" in capsys.readouterr().err
        with pytest.raises(DataError):
            check_repo_id(bad)
    assert check_repo_id("me/f8k-sat.v2") == "me/f8k-sat.v2"
    hostile = tmp_path / "<img src=x onerror=alert(1)>"
    hostile.mkdir()
    assert default_repo_id(hostile) == "YOUR-NAME/img-src-x-onerror-alert-1"
    assert default_repo_id(tmp_path / "...") == "YOUR-NAME/captioner-model"


def test_exported_files_follow_the_umask(run_dir: Path, tmp_path: Path) -> None:
    import os

    from captioner.share.model_card import export_run

    old = os.umask(0o022)
    try:
        paths = export_run(run_dir, tmp_path / "export")
    finally:
        os.umask(old)
    assert {oct(p.stat().st_mode & 0o777) for p in paths.values()} == {"0o644"}
