"""The COCO recipe in training: selection on the test-time decoding and metric, plateau and step
decay, resuming runs saved before these existed, and two-stage training with ``--init``.

Tiny presets on the 60-image ``tiny_shapes`` set (48 training images x 5 captions, batch 16 -> 15
steps per epoch). Where the test is about what the loop does with validation scores, the scores
are scripted (``_validate_all`` patched), so the outcome does not hang on what a tiny model learns.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from captioner.config import Config, get_preset
from captioner.errors import ConfigError
from captioner.training.loop import train

STEPS = 15


def tiny_cfg(root: Path, preset: str = "sat_soft_tiny", **overrides) -> Config:
    base = {"data.root": str(root), "train.batch_size": 16, "train.val_max_images": 4, "train.log_every": 1,
            "train.epochs": 1}
    return get_preset(preset, **{**base, **overrides})


def rows(run: Path, kind: str) -> list[dict[str, str]]:
    with open(run / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r["kind"] == kind]


def step_lrs_by_epoch(run: Path) -> dict[int, list[float]]:
    """The distinct lrs logged on the step rows of each epoch."""
    out: dict[int, set[float]] = {}
    for r in rows(run, "step"):
        out.setdefault(int(r["epoch"]), set()).add(float(r["lr"]))
    return {epoch: sorted(lrs) for epoch, lrs in out.items()}


def script_validation(monkeypatch: pytest.MonkeyPatch, scores: list[tuple[float, float]], seen: list | None = None):
    """Validation returns (BLEU-4, CIDEr-D) from ``scores``, one pair per call."""
    import captioner.training.loop as train_mod

    calls = iter(scores)

    def fake(run, data):
        if seen is not None:
            seen.append((run.cfg.train.val_beam, run.cfg.train.val_max_len))
        bleu4, cider = next(calls)
        return {"BLEU-1": 0.5, "BLEU-2": 0.4, "BLEU-3": 0.3, "BLEU-4": bleu4, "CIDEr-D": cider,
                "attention_entropy": 1.0, "val_images": 4, "val_words": 3.0}

    monkeypatch.setattr(train_mod, "_validate_all", fake)


# BLEU-4 rises every epoch while CIDEr-D falls: the two metrics pick different checkpoints.
DIVERGING = [(0.10, 0.50), (0.20, 0.40), (0.30, 0.30), (0.40, 0.20)]


def test_best_checkpoint_early_stopping_and_plateau_decay_follow_cider(tiny_shapes: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    script_validation(monkeypatch, DIVERGING)
    lr = 1e-3
    cfg = tiny_cfg(tiny_shapes, **{"train.epochs": 4, "train.patience": 2, "train.decay_patience": 1,
                                   "train.lr": lr})
    result = train(cfg, tmp_path, progress=False)
    assert [h["epoch"] for h in result.history] == [1, 2, 3]  # early stopping: 2 epochs without a better CIDEr-D
    assert (result.select_metric, result.best_epoch, result.best_score) == ("CIDEr-D", 1, 0.5)
    assert result.best_bleu4 == 0.10  # the BLEU-4 of the checkpoint CIDEr-D chose
    meta = _metadata(tmp_path / "best.safetensors")
    assert meta["epoch"] == 1 and meta["select_metric"] == "CIDEr-D" and meta["val_cider_d"] == 0.5
    # plateau decay x0.8 after each epoch without improvement: after epoch 2, and after epoch 3
    lrs = step_lrs_by_epoch(tmp_path)
    assert (lrs[1], lrs[2], lrs[3]) == ([lr], [lr], pytest.approx([0.8 * lr], rel=1e-5))
    state = torch.load(tmp_path / "train_state.pt", weights_only=True)
    assert state["scheduler"]["decay_factor"] == pytest.approx(0.64)
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.64 * lr)
    epochs = rows(tmp_path, "epoch")
    assert [float(r["CIDEr-D"]) for r in epochs] == [0.5, 0.4, 0.3]
    assert [float(r["BLEU-4"]) for r in epochs] == [0.1, 0.2, 0.3]


def test_bleu4_selection_and_step_decay(tiny_shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script_validation(monkeypatch, DIVERGING)
    lr = 1e-3
    cfg = tiny_cfg(tiny_shapes, **{"train.epochs": 3, "train.patience": 2, "train.select_metric": "BLEU-4",
                                   "train.decay_every": 2, "train.decay_factor": 0.5, "train.lr": lr})
    result = train(cfg, tmp_path, progress=False)
    assert [h["epoch"] for h in result.history] == [1, 2, 3]
    assert (result.select_metric, result.best_epoch, result.best_score) == ("BLEU-4", 3, 0.3)
    assert _metadata(tmp_path / "best.safetensors")["epoch"] == 3
    lrs = step_lrs_by_epoch(tmp_path)
    assert (lrs[1], lrs[2], lrs[3]) == ([lr], [lr], pytest.approx([0.5 * lr], rel=1e-5))  # after epoch 2


def test_validation_decodes_like_evaluate_by_default(tiny_shapes: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Beam 3 and 20 words, the defaults of ``captioner evaluate`` (its parser and its Python API)."""
    import argparse
    import inspect

    from captioner.commands import evaluate as evaluate_cmd
    from captioner.commands.options import decoding_overrides
    from captioner.config import DecodeOptions
    from captioner.evaluation.evaluate import evaluate_checkpoint

    parser = argparse.ArgumentParser()
    evaluate_cmd.add_arguments(parser)
    assert decoding_overrides(parser.parse_args(["ckpt", "--data", "x"])) == {}  # nothing set: DecodeOptions()
    assert inspect.signature(evaluate_checkpoint).parameters["options"].default is None  # -> DecodeOptions()
    seen: list = []
    script_validation(monkeypatch, DIVERGING, seen)
    train(tiny_cfg(tiny_shapes), tmp_path, progress=False)
    assert seen == [(DecodeOptions().beam_size, DecodeOptions().max_len)] == [(3, 20)]


def test_real_validation_scores_cider_with_beam_search(tiny_shapes: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import captioner.training.loop as train_mod
    from captioner.evaluation.metrics import bleu, cider_d
    from captioner.training.loop import score

    captured = {}

    def spy(shards):
        captured["shards"] = shards
        return score(shards)

    monkeypatch.setattr(train_mod, "score", spy)
    result = train(tiny_cfg(tiny_shapes, **{"train.lr": 1e-2, "train.val_max_images": 8}), tmp_path, progress=False)
    [shard] = captured["shards"]
    row = result.history[0]
    assert row["CIDEr-D"] == pytest.approx(cider_d(shard["hypotheses"], shard["references"]))
    assert row["BLEU-4"] == pytest.approx(bleu(shard["hypotheses"], shard["references"])["BLEU-4"])
    assert not any("<unk>" in h.split() for h in shard["hypotheses"])


def _metadata(path: Path) -> dict:
    from captioner.checkpoint.store import read_checkpoint_metadata

    return read_checkpoint_metadata(path)["metadata"]


def test_progress_state_round_trips() -> None:
    from captioner.training.run import Progress

    prog = Progress(select_metric="BLEU-4", best_score=0.25, best_bleu4=0.25, best_epoch=3, skipped=2,
                    history=[{"epoch": 1, "BLEU-4": 0.25}])
    prog.epoch_meter.add({"loss": 2.0}, 4)
    again = Progress()
    again.load_state_dict(prog.state_dict())
    assert again.state_dict() == prog.state_dict() and again.epoch_meter.means() == {"loss": 2.0}
    assert again.history is not prog.history  # a copy, not the saved list


# ----------------------------------------------------------------------------- --init: two stages


@pytest.fixture(scope="module")
def stage1(tiny_shapes: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stage 1 of the SAT recipe in miniature: a frozen encoder, cached features."""
    out = tmp_path_factory.mktemp("stage1")
    train(tiny_cfg(tiny_shapes, **{"train.lr": 1e-2}), out, progress=False)
    assert (out / "features").is_dir()
    return out / "best.safetensors"


def _cli(argv: list[str]) -> int:
    from captioner.cli import main

    return main(["train", *argv])


def test_init_starts_a_fine_tuning_stage_from_the_checkpoint(stage1: Path, tiny_shapes: Path, tmp_path: Path) -> None:
    from captioner.models.model import build_model
    from captioner.text import Vocabulary

    out = tmp_path / "stage2"
    # a tiny lr: stage 2's weights stay those of stage 1 (a fresh model would differ everywhere); a data
    # setting that would build another vocabulary: the run must still use the checkpoint's
    code = _cli(["--preset", "sat_soft_tiny", "--data", str(tiny_shapes), "--out", str(out), "--init", str(stage1),
                 "--set", "encoder.fine_tune=true", "--set", "data.min_freq=1000", "--set", "train.lr=1e-9",
                 "--set", "train.encoder_lr=1e-9", "--set", "train.val_max_images=4", "--batch-size", "16",
                 "--epochs", "1", "--no-progress"])
    assert code == 0
    before, after = load_file(str(stage1)), load_file(str(out / "latest.safetensors"))
    assert before.keys() == after.keys()
    params = [k for k in before if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    for key in params:  # (the BatchNorm statistics of the fine-tuned stages move with the data)
        torch.testing.assert_close(after[key], before[key], atol=1e-5, rtol=0, msg=key)
    fresh = build_model(get_preset("sat_soft_tiny").model, len(before["decoder.out_word.bias"])).state_dict()
    assert not torch.allclose(fresh["decoder.out_word.weight"], before["decoder.out_word.weight"], atol=1e-3)
    assert not (out / "features").exists()  # fine-tuning runs on pixels
    saved_vocab = Vocabulary.from_dict(_checkpoint_vocab(stage1))
    assert Vocabulary.load(out / "vocab.json") == saved_vocab
    state = torch.load(out / "train_state.pt", weights_only=True)
    assert [g["name"] for g in state["optimizer"]["param_groups"]] == ["decoder", "encoder"]  # encoder trains now
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {STEPS}  # fresh optimizer
    assert state["progress"]["step"] == STEPS and state["progress"]["epoch"] == 1
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["init"] == str(stage1) and config["model"]["encoder"]["fine_tune"] is True

    # the stage-2 run resumes like any other (its weights come from train_state.pt)
    assert _cli(["--out", str(out), "--resume", "--epochs", "2", "--no-progress"]) == 0


def test_an_init_stage_with_the_first_stages_seed_is_warned_that_it_replays_its_batches(
        stage1: Path, tiny_shapes: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Same seed and batch size: the same caption order and dropout masks, which the model has fitted."""
    import logging
    import shutil

    from captioner.training.loop import load_init_checkpoint, replay_warning

    meta = _metadata(stage1)
    assert meta["train_seed"] == 0 and meta["train_batch_size"] == 16  # written with every checkpoint
    init = load_init_checkpoint(stage1, get_preset("sat_soft_tiny").model)
    same = tiny_cfg(tiny_shapes).train  # seed 0, batch 16, cross-entropy

    def train_cfg(**changes: object):  # noqa: ANN202
        return dataclasses.replace(same, **changes)

    warning = replay_warning(init, same)
    assert warning is not None and "train.seed=1" in warning and str(stage1) in warning
    assert replay_warning(init, train_cfg(seed=1)) is None
    assert replay_warning(init, train_cfg(batch_size=32)) is None  # other batches: no replay
    assert replay_warning(init, train_cfg(objective="scst")) is None  # SCST turns its dropout layers off
    # an older checkpoint without the fields: the run folder's config.json beside it says the seed
    old = dataclasses.replace(init, metadata={k: v for k, v in init.metadata.items() if not k.startswith("train_")})
    assert replay_warning(old, same) is not None
    lone = tmp_path / "lone" / "best.safetensors"
    lone.parent.mkdir()
    shutil.copy(stage1, lone)
    assert replay_warning(dataclasses.replace(old, path=lone), same) is None  # nothing says: no warning

    base = ["--preset", "sat_soft_tiny", "--data", str(tiny_shapes), "--init", str(stage1), "--set", "train.lr=1e-9",
            "--set", "train.val_max_images=4", "--batch-size", "16", "--epochs", "1", "--no-progress"]
    with caplog.at_level(logging.WARNING, logger="captioner"):
        assert _cli([*base, "--out", str(tmp_path / "same")]) == 0
    assert sum("replays that run's caption order" in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="captioner"):
        assert _cli([*base, "--out", str(tmp_path / "other"), "--set", "train.seed=1"]) == 0
    assert not any("replays" in r.getMessage() for r in caplog.records)


def _checkpoint_vocab(path: Path) -> dict:
    from captioner.checkpoint.store import read_checkpoint_metadata

    return read_checkpoint_metadata(path)["vocab"]


def test_init_refuses_another_architecture_in_one_line(stage1: Path, tiny_shapes: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    base = ["--preset", "sat_soft_tiny", "--data", str(tiny_shapes), "--out", str(tmp_path / "run"), "--no-progress"]
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a checkpoint")
    cases = [
        (["--init", str(stage1), "--set", "decoder.hidden_dim=48"],
         "model.decoder.hidden_dim is 32 in the checkpoint but 48 in this run"),
        (["--init", str(stage1), "--set", "encoder.grid=2"], "model.encoder.grid is 4 in the checkpoint but 2"),
        (["--init", str(tmp_path / "absent.safetensors")], "checkpoint not found"),
        (["--init", str(junk)], f"--init {junk}: "),
        (["--init", str(tmp_path)], f"--init {tmp_path}: a folder, and it holds no checkpoint"),
        (["--preset", "transformer_tiny", "--init", str(stage1)], "model.decoder.name is 'sat' in the checkpoint"),
        (["--init", str(stage1), "--resume"], "--init starts a new run"),
    ]
    for extra, message in cases:
        assert _cli(base + extra) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("captioner train: error: ") and message in err and "\n" not in err, err
    assert not (tmp_path / "run" / "train_state.pt").exists()


def test_init_takes_a_run_folder_as_c_does(stage1: Path, tiny_shapes: Path, tmp_path: Path) -> None:
    """--init runs/a: the help says a file, run folder or shipped model name; the folder's best checkpoint is read
    through the resolver -c uses (issue 54, item 8)."""
    from captioner.training.loop import read_init_checkpoint

    assert read_init_checkpoint(stage1.parent).path == stage1
    out = tmp_path / "from_folder"
    assert _cli(["--preset", "sat_soft_tiny", "--data", str(tiny_shapes), "--out", str(out), "--init", str(stage1.parent),
                 "--set", "train.lr=1e-9", "--set", "train.val_max_images=4", "--set", "train.seed=1",
                 "--batch-size", "16", "--epochs", "1", "--no-progress"]) == 0
    before, after = load_file(str(stage1)), load_file(str(out / "latest.safetensors"))
    torch.testing.assert_close(after["decoder.out_word.weight"], before["decoder.out_word.weight"], atol=1e-5, rtol=0)


def test_apply_init_refuses_another_vocabulary(stage1: Path) -> None:
    from captioner.models.model import build_model
    from captioner.text import Vocabulary
    from captioner.training.loop import apply_init, load_init_checkpoint

    cfg = get_preset("sat_soft_tiny").model
    init = load_init_checkpoint(stage1, cfg)
    model = build_model(cfg, len(init.vocab), load_pretrained=False)
    apply_init(model, init, init.vocab)
    for key, value in model.state_dict().items():
        assert torch.equal(value, init.state[key]), key
    words = init.vocab.itos[4:]
    with pytest.raises(ConfigError, match=rf"has {len(init.vocab)} tokens but this run's has {len(init.vocab) - 1}"):
        apply_init(model, init, Vocabulary(words[:-1]))
    swapped = Vocabulary([words[1], words[0], *words[2:]])
    with pytest.raises(ConfigError, match=rf"token 4 is {words[0]!r} in the checkpoint but {words[1]!r}"):
        apply_init(model, init, swapped)


def test_cosine_schedule_anneals_over_the_planned_epochs_with_length_buckets(
        tiny_shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Flickr8k presets' loop: batches of similar length, lr from the peak to the floor over train.epochs."""
    from captioner.training.optim import COSINE_FLOOR

    script_validation(monkeypatch, DIVERGING[:2])
    lr = 1e-3
    cfg = tiny_cfg(tiny_shapes, **{"train.epochs": 2, "train.schedule": "cosine", "train.warmup_steps": 1,
                                   "train.length_buckets": 4, "train.lr": lr, "train.patience": 0})
    result = train(cfg, tmp_path, progress=False)
    assert [h["epoch"] for h in result.history] == [1, 2]
    step_rows = rows(tmp_path, "step")
    assert len(step_rows) == 2 * STEPS  # every caption once per epoch, in the same number of batches
    lrs = [float(r["lr"]) for r in step_rows]
    assert lrs[0] == pytest.approx(lr) and lrs[-1] == pytest.approx(lr * COSINE_FLOOR, rel=1e-3)
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # never rises after the (one-step) warm-up


def test_the_flickr8k_presets_share_one_feature_cache_and_are_listed_in_train_help(
        capsys: pytest.CaptureFixture[str]) -> None:
    from captioner.cli import main

    configs = [get_preset(f"{d}_flickr8k") for d in ("sat_soft", "sat_hard", "transformer")]
    assert len({json.dumps(dataclasses.asdict(c.model.encoder)) for c in configs}) == 1  # one cache key ...
    # ... in one folder, the cache root's (never one beside the working directory)
    assert {(c.data.feature_cache_dir, c.data.shared_feature_cache) for c in configs} == {(None, True)}
    assert {c.model.decoder.attention_kind for c in configs} == {"soft", "hard", "cross"}
    assert main(["train", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(f"{d}_flickr8k" in help_text for d in ("sat_soft", "sat_hard", "transformer"))
