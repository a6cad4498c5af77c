"""The training loop and ``captioner train``: run folder, exact resume, time budget, NaN handling.

All runs use the tiny presets on the 60-image ``tiny_shapes`` set (48 training images x 5
captions, batch 16 -> 15 steps per epoch) with validation capped at 4 images.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from captioner.config import Config, get_preset
from captioner.errors import CaptionerError, CheckpointError, ConfigError
from captioner.models.registry import resolve_encoder
from captioner.training.loop import train

STEPS_PER_EPOCH = 15


def tiny_cfg(preset: str, root: Path, **overrides) -> Config:
    base = {"data.root": str(root), "train.batch_size": 16, "train.val_max_images": 4, "train.log_every": 1,
            "train.epochs": 1}
    return get_preset(preset, **{**base, **overrides})


def step_losses(run: Path) -> list[tuple[str, str]]:
    with open(run / "metrics.csv", newline="") as f:
        return [(r["step"], r["loss"]) for r in csv.DictReader(f) if r["kind"] == "step"]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"weights differ: {different[:5]}"


def cli(argv: list[str]) -> int:
    """``captioner train ARGV``, in process."""
    from captioner.cli import main

    return main(["train", *argv])


@pytest.fixture(scope="module")
def uninterrupted(tiny_shapes: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two-epoch reference runs, made once, for the resume tests."""
    runs = {}
    for preset in ("sat_soft_tiny", "sat_hard_tiny"):
        out = tmp_path_factory.mktemp(preset)
        train(tiny_cfg(preset, tiny_shapes, **{"train.epochs": 2}), out, progress=False)
        runs[preset] = out
    return runs


def test_run_folder_has_every_artifact_and_checkpoint_loads(tiny_shapes: Path, tmp_path: Path) -> None:
    from captioner.checkpoint.store import load_checkpoint, load_train_state
    from captioner.text import Vocabulary

    # lr high enough to emit words in 1 epoch; greedy, because after one epoch a beam prefers the empty caption
    cfg = tiny_cfg("sat_soft_tiny", tiny_shapes, **{"train.lr": 1e-2, "train.val_beam": 1})
    result = train(cfg, tmp_path, progress=False)

    for name in ("config.json", "vocab.json", "best.safetensors", "latest.safetensors", "train_state.pt",
                 "metrics.csv"):
        assert (tmp_path / name).is_file(), name
    saved = Config.from_dict(json.loads((tmp_path / "config.json").read_text()))
    # the run saves its encoder's preprocessing, filled from the registry where the preset left it unset
    assert cfg.model.encoder.mean is None and saved.model.encoder == resolve_encoder(cfg.model.encoder)
    assert saved.model.encoder.mean == (0.485, 0.456, 0.406) and saved.model.encoder.interpolation == "bilinear"
    assert dataclasses.replace(saved, model=cfg.model) == cfg
    vocab = Vocabulary.load(tmp_path / "vocab.json")
    assert {"a", "circle", "red"} <= set(vocab.itos)

    loaded = load_checkpoint(result.best_checkpoint)
    assert loaded.vocab == vocab and loaded.config == saved.model
    assert loaded.metadata["epoch"] == 1 and loaded.metadata["step"] == STEPS_PER_EPOCH
    assert loaded.metadata["select_metric"] == "CIDEr-D" and loaded.metadata["val_cider_d"] >= 0.0
    assert_same_weights(result.best_checkpoint, result.latest_checkpoint)  # one epoch: best is latest

    [row] = result.history
    assert row["epoch"] == 1 and row["partial"] == 0 and row["val_images"] == 4
    assert all(0.0 <= row[f"BLEU-{n}"] <= 1.0 for n in range(1, 5))
    assert row["val_words"] > 0 and 0.0 <= row["attention_entropy"] <= math.log(16) + 1e-4  # 4x4 grid
    assert math.isfinite(row["loss"]) and row["doubly_stochastic"] > 0  # SAT penalty is on
    assert result.best_bleu4 == row["BLEU-4"]
    assert result.select_metric == "CIDEr-D" and result.best_score == row["CIDEr-D"] and result.best_epoch == 1

    rows = list(csv.DictReader(open(tmp_path / "metrics.csv", newline="")))
    assert [r["kind"] for r in rows] == ["step"] * STEPS_PER_EPOCH + ["epoch"]
    assert rows[-1]["BLEU-4"] != "" and rows[0]["BLEU-4"] == ""
    assert float(rows[-1]["CIDEr-D"]) == pytest.approx(row["CIDEr-D"], rel=1e-5)

    state = load_train_state(tmp_path / "train_state.pt")
    assert state["progress"]["epoch"] == 1 and state["progress"]["step"] == STEPS_PER_EPOCH
    latest = weights(result.latest_checkpoint)
    assert latest and all(torch.equal(state["model"][k], v) for k, v in latest.items())  # same weights


@pytest.mark.parametrize("preset", ["sat_soft_tiny", "sat_hard_tiny"])
def test_resume_after_epoch_reproduces_uninterrupted_run(preset: str, tiny_shapes: Path, tmp_path: Path,
                                                         uninterrupted: dict[str, Path]) -> None:
    train(tiny_cfg(preset, tiny_shapes, **{"train.epochs": 1}), tmp_path, progress=False)
    result = train(tiny_cfg(preset, tiny_shapes, **{"train.epochs": 2}), tmp_path, resume=True, progress=False)

    reference = uninterrupted[preset]
    assert len(step_losses(tmp_path)) == 2 * STEPS_PER_EPOCH
    assert step_losses(tmp_path) == step_losses(reference)
    assert_same_weights(tmp_path / "latest.safetensors", reference / "latest.safetensors")
    assert [h["epoch"] for h in result.history] == [1, 2]


def test_time_budget_stops_mid_epoch_saves_and_resumes_exactly(tiny_shapes: Path, tmp_path: Path,
                                                               uninterrupted: dict[str, Path]) -> None:
    """Hard attention samples regions, so this also checks the RNG state saved mid-epoch."""
    preset = "sat_hard_tiny"
    stopped = train(tiny_cfg(preset, tiny_shapes, **{"train.epochs": 2, "train.time_budget": 1e-9}), tmp_path,
                    progress=False)
    [row] = stopped.history
    assert row["step"] == 1 and row["partial"] == 1  # one batch, then validation and checkpoints
    assert stopped.latest_checkpoint.is_file() and stopped.best_checkpoint.is_file()

    train(tiny_cfg(preset, tiny_shapes, **{"train.epochs": 2}), tmp_path, resume=True, progress=False)
    assert step_losses(tmp_path) == step_losses(uninterrupted[preset])
    assert_same_weights(tmp_path / "latest.safetensors", uninterrupted[preset] / "latest.safetensors")


def test_mid_epoch_resume_reading_whole_batches_from_the_feature_cache_is_exact(
        tiny_shapes: Path, tmp_path: Path, uninterrupted: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """With the cache too large for ``data.in_memory_mb`` the loader gathers whole batches from the memory
    map; stopped after one batch and resumed, the run still equals the uninterrupted in-memory one."""
    from captioner.data.dataset import CaptionBatchDataset

    gathered = []
    original = CaptionBatchDataset.__getitem__
    monkeypatch.setattr(CaptionBatchDataset, "__getitem__", lambda self, items: gathered.append(items) or
                        original(self, items))
    preset, streamed = "sat_hard_tiny", {"train.epochs": 2, "data.in_memory_mb": 0}
    stopped = train(tiny_cfg(preset, tiny_shapes, **streamed, **{"train.time_budget": 1e-9}), tmp_path,
                    progress=False)
    assert [row["step"] for row in stopped.history] == [1] and len(gathered) == 1
    train(tiny_cfg(preset, tiny_shapes, **streamed), tmp_path, resume=True, progress=False)
    assert len(gathered) == 2 * STEPS_PER_EPOCH  # every batch came through the batch-level path
    assert step_losses(tmp_path) == step_losses(uninterrupted[preset])
    assert_same_weights(tmp_path / "latest.safetensors", uninterrupted[preset] / "latest.safetensors")


def _nan_at(monkeypatch: pytest.MonkeyPatch, calls: set[int]) -> None:
    """Make CaptionLoss return NaN on the given (1-based) calls."""
    from captioner.training.objective import CaptionLoss

    original = CaptionLoss.forward
    count = {"n": 0}

    def forward(self, output, targets):
        result = original(self, output, targets)
        count["n"] += 1
        if count["n"] in calls:
            result.total = result.total * float("nan")
        return result

    monkeypatch.setattr(CaptionLoss, "forward", forward)


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tiny_shapes: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    train(tiny_cfg("sat_soft_tiny", tiny_shapes), tmp_path, progress=False)
    before = {n: (tmp_path / n).read_bytes() for n in ("latest.safetensors", "best.safetensors", "train_state.pt")}

    _nan_at(monkeypatch, {3})
    cfg = tiny_cfg("sat_soft_tiny", tiny_shapes, **{"train.epochs": 2})
    with pytest.raises(CaptionerError) as info:
        train(cfg, tmp_path, resume=True, progress=False)
    step = STEPS_PER_EPOCH + 3
    assert str(info.value).startswith(f"non-finite loss (nan) at epoch 2 step {step}; last good checkpoint: "
                                      f"{tmp_path / 'latest.safetensors'}")
    assert "\n" not in str(info.value)
    assert {n: (tmp_path / n).read_bytes() for n in before} == before


def test_skip_nonfinite_skips_the_batch(tiny_shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _nan_at(monkeypatch, {2})
    cfg = tiny_cfg("sat_soft_tiny", tiny_shapes, **{"train.skip_nonfinite": True})
    result = train(cfg, tmp_path, progress=False)
    losses = step_losses(tmp_path)
    assert losses[1] == ("2", "")  # the skipped step has no loss
    assert all(math.isfinite(float(loss)) for _, loss in losses[:1] + losses[2:])
    assert all(torch.isfinite(w).all() for w in weights(result.latest_checkpoint).values())
    state = torch.load(tmp_path / "train_state.pt", weights_only=True)
    assert state["progress"]["skipped"] == 1 and state["progress"]["step"] == STEPS_PER_EPOCH
    # the skipped batch took no optimizer step and did not advance the schedule (exact resume)
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {STEPS_PER_EPOCH - 1}
    assert state["scheduler"]["last_epoch"] == STEPS_PER_EPOCH - 1


def test_unreadable_image_mid_epoch_stops_in_one_line_keeping_the_checkpoint(
        tiny_shapes: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """On pixels a truncated image is only found when its batch is loaded (here in a DataLoader
    worker, which wraps the error in its traceback). The resume also removes the temporary file of
    an interrupted checkpoint write."""
    import shutil

    root, out = tmp_path / "shapes", tmp_path / "run"
    shutil.copytree(tiny_shapes, root)
    assert cli(["--preset", "sat_soft_tiny", "--data", str(root), "--out", str(out), "--epochs", "1",
                "--batch-size", "16", "--set", "train.val_max_images=4", "--set", "data.feature_cache=false",
                "--no-progress"]) == 0
    capsys.readouterr()
    before = {n: (out / n).read_bytes() for n in ("latest.safetensors", "best.safetensors", "train_state.pt")}
    stale = out / ".latest.safetensors.k1ll3d.tmp"
    stale.write_bytes(b"half a checkpoint")
    name = json.loads((root / "captions_train.json").read_text())["images"][0]["file_name"]
    image = root / "images" / name
    image.write_bytes(image.read_bytes()[:-200])  # truncated pixel data: the header still reads

    code = cli(["--out", str(out), "--resume", "--epochs", "2", "--set", "data.num_workers=1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    [line] = err.splitlines()
    assert line.startswith(f"captioner train: error: {image}: ") and "--skip-missing" in line, line
    assert f"last good checkpoint: {out / 'latest.safetensors'}" in line
    assert {n: (out / n).read_bytes() for n in before} == before
    assert not stale.exists()


@pytest.mark.slow  # two CLI training runs on pixels: about 5 s
def test_cli_trains_on_images_with_overrides_then_resumes(tiny_shapes: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    """Transformer end to end on pixels (no feature cache), warm-up schedule, YAML config + --set.

    ``--lr`` is the peak of the warm-up (it used to be the Noam scale factor; tests/test_schedules.py
    covers how such old values are still read)."""

    out = tmp_path / "run"
    config = tmp_path / "cfg.yaml"
    config.write_text("train:\n  val_max_images: 4\n  log_every: 5\n  schedule: warmup\n  warmup_steps: 10\n"
                      "data:\n  feature_cache: false\n")
    code = cli(["--preset", "transformer_tiny", "--config", str(config), "--data", str(tiny_shapes),
                "--out", str(out), "--epochs", "1", "--batch-size", "16", "--lr", "0.02",
                "--set", "decoder.num_layers=1", "--no-progress"])
    assert code == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("best val BLEU-4 ") and str(out / "best.safetensors") in summary
    saved = json.loads((out / "config.json").read_text())
    assert saved["model"]["decoder"]["num_layers"] == 1 and saved["train"]["lr"] == 0.02
    assert saved["train"]["schedule"] == "warmup" and saved["data"]["feature_cache"] is False
    assert not (out / "features").exists()
    logged = {int(r["step"]): float(r["lr"]) for r in csv.DictReader(open(out / "metrics.csv")) if r["kind"] == "step"}
    assert logged == pytest.approx({s: 0.02 * min(s / 10, (10 / s) ** 0.5) for s in (5, 10, 15)}, rel=1e-5)

    # --resume needs only the run folder: config.json is the base, --epochs extends the run.
    assert cli(["--out", str(out), "--resume", "--epochs", "2", "--no-progress"]) == 0
    state = torch.load(out / "train_state.pt", weights_only=True)
    assert state["progress"]["epoch"] == 2 and len(state["progress"]["history"]) == 2


def test_resume_refuses_another_model_and_an_empty_folder(tiny_shapes: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="nothing to resume"):
        train(tiny_cfg("sat_soft_tiny", tiny_shapes), tmp_path, resume=True, progress=False)
    train(tiny_cfg("sat_soft_tiny", tiny_shapes, **{"train.val_max_images": 1}), tmp_path, progress=False)
    other = tiny_cfg("sat_soft_tiny", tiny_shapes, **{"model.decoder.hidden_dim": 48, "train.epochs": 2})
    with pytest.raises(ConfigError, match=r"model config differs .*model\.decoder\.hidden_dim"):
        train(other, tmp_path, resume=True, progress=False)


def test_cli_reports_user_errors_in_one_line(tiny_shapes: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli(["--help"]) == 0
    assert "torchrun --nproc_per_node" in capsys.readouterr().out  # examples in the help
    base = ["--preset", "sat_soft_tiny", "--out", str(tmp_path / "run"), "--no-progress"]
    cases = [
        (["--data", str(tiny_shapes), "--set", "train.lrr=1"], "unknown config key: train.lrr"),
        (["--data", str(tmp_path / "nowhere")], "dataset path does not exist"),
        (["--data", str(tiny_shapes), "--resume"], "nothing to resume"),
        (["--data", str(tiny_shapes), "--device", "gpu"], "train.device='gpu' is not a device"),
    ]
    for extra, message in cases:
        assert cli(base + extra) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("captioner train: error: ") and message in err and "\n" not in err, err


def test_training_validates_on_the_split_the_data_has(tiny_shapes: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A Flickr8k setting (data.val_split=dev) on a COCO folder with train/val/test validates on its 'val',
    says so in one line and records it; a folder with no validation split names the option (issue 54, item 9)."""
    import logging
    import shutil

    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="captioner"):
        assert cli(["--preset", "sat_soft_tiny", "--data", str(tiny_shapes), "--out", str(out), "--epochs", "1",
                    "--no-progress", "--set", "data.val_split=dev", "--set", "train.val_max_images=4",
                    "--set", "train.time_budget=3"]) == 0
    said = [r.getMessage() for r in caplog.records if "validating on" in r.getMessage()]
    assert said == [f"{tiny_shapes} has no 'dev' split: validating on its 'val' split "
                    "(--set data.val_split=NAME picks another)"]
    assert json.loads((out / "config.json").read_text())["data"]["val_split"] == "val"
    bare = tmp_path / "no_val"
    bare.mkdir()
    for name in ("captions_train.json", "captions_test.json"):
        shutil.copy(tiny_shapes / name, bare / name)
    (bare / "images").symlink_to(tiny_shapes / "images")
    capsys.readouterr()
    assert cli(["--preset", "sat_soft_tiny", "--data", str(bare), "--out", str(tmp_path / "r2"), "--no-progress",
                "--set", "data.val_split=dev"]) == 1
    err = capsys.readouterr().err
    assert err == (f"captioner train: error: {bare}: unknown split 'dev'; available: test, train; name the "
                   "validation split with --set data.val_split=NAME\n")
    assert not (tmp_path / "r2").exists()


def test_fine_tuning_trains_the_encoder_with_its_own_lr(tiny_shapes: Path, tmp_path: Path) -> None:
    from captioner.models.model import build_model
    from captioner.text import Vocabulary
    from captioner.training.run import seed_everything

    cfg = tiny_cfg("sat_soft_tiny", tiny_shapes, **{"model.encoder.fine_tune": True, "train.encoder_lr": 1e-3,
                                                    "train.val_max_images": 1})
    result = train(cfg, tmp_path, progress=False)
    assert not (tmp_path / "features").exists()  # trains on pixels, no feature cache
    groups = torch.load(tmp_path / "train_state.pt", weights_only=True)["optimizer"]["param_groups"]
    assert [(g["name"], g["lr"]) for g in groups] == [("decoder", cfg.train.lr), ("encoder", 1e-3)]

    seed_everything(cfg.train.seed)  # the run's initial weights
    initial = build_model(cfg.model, len(Vocabulary.load(tmp_path / "vocab.json"))).state_dict()
    trained = weights(result.latest_checkpoint)
    encoder_changed = [k for k in trained if k.startswith("encoder.") and k.endswith("weight")
                       and not torch.equal(trained[k], initial[k])]
    assert encoder_changed


def test_validation_decodes_with_the_configs_decoding_section(tiny_shapes: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import captioner.inference as inference

    seen = []
    real = inference.caption_features

    def spy(model, x, vocab, options):  # noqa: ANN001
        seen.append(options)
        return real(model, x, vocab, options)

    monkeypatch.setattr(inference, "caption_features", spy)
    cfg = tiny_cfg("sat_soft_tiny", tiny_shapes, **{"decoding.length_penalty": 0.7, "decoding.beam_size": 5,
                                                     "train.val_beam": 2, "train.val_max_len": 7})
    train(cfg, tmp_path / "run", progress=False)
    assert seen, "validation never decoded"
    # the section's length penalty; beam and length from train.val_beam / val_max_len
    assert {(o.length_penalty, o.beam_size, o.max_len, o.n_best) for o in seen} == {(0.7, 2, 7, 1)}


def test_cli_trains_with_a_timm_encoder_offline(tiny_shapes: Path, tmp_path: Path) -> None:
    """``encoder.name=timm/<model>``: random weights with encoder.pretrained=false (the tiny presets'), no network."""
    pytest.importorskip("timm")
    from captioner.checkpoint.store import load_checkpoint

    assert cli(["--preset", "sat_soft_tiny", "--data", str(tiny_shapes), "--out", str(tmp_path),
                "--set", "encoder.name=timm/resnet18", "--set", "encoder.grid=2", "--set", "train.epochs=1"]) == 0
    loaded = load_checkpoint(tmp_path / "best.safetensors")
    assert loaded.config.encoder.name == "timm/resnet18" and loaded.model.encoder.out_dim == 512
    features, grid = loaded.model.encode(torch.randn(1, 3, 64, 64))
    assert features.shape == (1, 4, 512) and tuple(grid) == (2, 2)  # 64 px / 32: a 2 x 2 map


def test_a_log_gets_no_progress_bars_and_one_line_per_epoch(tiny_shapes: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Output that is not a terminal (``captioner train > log``) gets no tqdm frames, only the epoch lines."""
    with caplog.at_level("INFO", logger="captioner"):
        assert cli(["--preset", "sat_soft_tiny", "--data", str(tiny_shapes), "--out", str(tmp_path),
                    "--set", "train.epochs=2"]) == 0
    out, err = capsys.readouterr()
    assert "\r" not in out + err and "img/s" not in out + err and "batch/s" not in out + err
    epochs = [r.getMessage().split(":")[0] for r in caplog.records if r.getMessage().startswith("epoch ")]
    assert epochs == ["epoch 1", "epoch 2"]
