"""A miniature demo: tiny presets on the 60-image scenes, a few seconds per decoder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from captioner.cli import main
from captioner.config import get_preset
from captioner.demo import pipeline as demo
from captioner.demo.pipeline import DEMO_DECODERS, DemoOptions, ensure_scenes, parse_budgets, run_demo
from captioner.demo.report import COLUMNS, COMPOSITIONAL, format_table
from captioner.errors import ConfigError, DataError

TINY = {name: f"{name}_tiny" for name in DEMO_DECODERS}
# A fixed amount of training (epochs, not seconds) so the result does not depend on machine speed;
# 4 epochs are enough for the tiny Transformer to name shapes, the tiny SAT models may not yet.
FAST = {"train.epochs": 4, "train.val_max_images": 8, "train.batch_size": 16}


@pytest.fixture(scope="module")
def mini_report(tiny_shapes: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("demo")
    options = DemoOptions(data=tiny_shapes, out=out, budgets=parse_budgets(120), encoder_budget=4, presets=dict(TINY),
                          overrides=dict(FAST), overlays=1, beam_size=2, progress=False, jobs=2)
    return run_demo(options)


@pytest.mark.slow
def test_report_has_a_row_per_decoder_with_every_column(mini_report: dict) -> None:
    rows = mini_report["table"]
    assert [r["decoder"] for r in rows] == list(DEMO_DECODERS)
    for row in rows:
        assert {key for key, _, _ in COLUMNS} <= set(row)
        assert 0.0 <= row["BLEU-4"] <= 1.0 and row["CIDEr-D"] >= 0.0
        if row["uniform_baseline"] is not None:  # some generated word named an object: boxes were scored
            assert 0.0 < row["uniform_baseline"] < 1.0 and row["attention_correctness"] is not None
        assert 0.0 <= row["objects_correct"] <= 1.0
        assert row["uniform_entropy"] == pytest.approx(2.7725887, abs=1e-5)  # log 16 regions (4 x 4 grid)
        assert row["parameters"] > row["decoder_parameters"] > 0
        assert row["train_seconds"] > 0


@pytest.mark.slow
def test_one_pretrained_frozen_encoder_and_one_feature_cache_serve_every_decoder(mini_report: dict) -> None:
    encoder = mini_report["encoder"]
    assert encoder["steps"] > 0 and Path(encoder["weights"]).is_file()
    for name in DEMO_DECODERS:
        enc = mini_report["runs"][name]["config"]["model"]["encoder"]
        assert (enc["weights"], enc["pretrained"], enc["fine_tune"]) == (encoder["weights"], True, False)
        assert mini_report["runs"][name]["budget"] == 120
    caches = sorted(p.name.split("_")[-2] for p in (Path(mini_report["paths"]["json"]).parent / "features").glob("*.feats"))
    assert caches == ["train", "val"]  # built once, before the worker processes, and shared
    assert all(r["steps"] > 0 and r["steps_per_s"] > 0 for r in mini_report["table"])


@pytest.mark.slow
def test_attention_correctness_was_scored_for_a_decoder_that_names_objects(mini_report: dict) -> None:
    rows = {r["decoder"]: r for r in mini_report["table"]}
    row = rows["transformer"]
    assert row["uniform_baseline"] is not None and 0.0 < row["uniform_baseline"] < 1.0
    assert 0.0 <= row["attention_correctness"] <= 1.0 and row["ratio"] == pytest.approx(
        row["attention_correctness"] / row["uniform_baseline"], rel=1e-6)


@pytest.mark.slow
def test_report_files_are_written_and_self_contained(mini_report: dict) -> None:
    html_path, json_path = Path(mini_report["paths"]["html"]), Path(mini_report["paths"]["json"])
    saved = json.loads(json_path.read_text())
    assert [r["decoder"] for r in saved["table"]] == list(DEMO_DECODERS)
    assert saved["table"][0]["BLEU-4"] == pytest.approx(mini_report["table"][0]["BLEU-4"])
    page = html_path.read_text()
    assert page.count("<tr>") == 1 + len(DEMO_DECODERS)
    assert page.count("data:image/png;base64,") == 1 + len(DEMO_DECODERS)  # curves + one overlay per decoder
    assert "http://" not in page and "https://" not in page
    for name in DEMO_DECODERS:
        (shown,) = saved["runs"][name]["overlays"]
        assert Path(shown["html"]).is_file() and Path(shown["png"]).is_file()
        assert f'href="{name}/overlays/test_{shown["image_id"]}.html"' in page
        assert (html_path.parent / name / "metrics_test.json").is_file()


@pytest.mark.slow
def test_format_table_lines_up_columns(mini_report: dict) -> None:
    lines = format_table(mini_report["table"]).splitlines()
    assert len(lines) == 2 + len(DEMO_DECODERS)
    assert lines[0].split()[:3] == ["decoder", "B-1", "B-2"]
    assert {len(line) for line in lines} == {len(lines[0])}
    assert format_table([{"decoder": "x"}]).splitlines()[-1].split()[1:] == ["-"] * (len(COLUMNS) - 1 - len(COMPOSITIONAL))


def test_scenes_are_generated_once(tmp_path: Path) -> None:
    options = DemoOptions(data=tmp_path / "scenes", images=30, image_size=64)
    first = ensure_scenes(options)
    assert first["generated"] and (tmp_path / "scenes" / "instances_test.json").is_file()
    again = ensure_scenes(options)
    assert not again["generated"] and again["images"] == 30


def test_bad_options_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="choose from"):
        DemoOptions.from_args(data="d", images=None, seed=0, budget=None, decoders="sat_soft,lstm", out="o")
    with pytest.raises(ConfigError, match="budget"):
        DemoOptions(budgets={"sat_soft": 0})
    with pytest.raises(ConfigError, match="budget"):
        DemoOptions(budgets={"lstm": 10})
    with pytest.raises(ConfigError, match="decoder=seconds"):
        parse_budgets("sat_soft=fast")
    assert parse_budgets("sat_soft=150, transformer=60") == {"sat_soft": 150.0, "transformer": 60.0}
    assert parse_budgets("90") == {name: 90.0 for name in DEMO_DECODERS}
    (tmp_path / "notes.txt").write_text("not scenes")
    with pytest.raises(DataError, match="not a synthetic-scenes folder"):
        ensure_scenes(DemoOptions(data=tmp_path))


def test_quick_defaults_and_presets_exist() -> None:
    quick = DemoOptions.from_args(data="d", images=None, seed=1, budget=None, decoders="transformer", out="o",
                                  quick=True)
    assert (quick.images, quick.budgets["transformer"], quick.encoder_budget, quick.decoders) == (
        400, 15.0, 10.0, ("transformer",))
    for name in DEMO_DECODERS:
        cfg = get_preset(demo.DEMO_PRESETS[name])
        assert cfg.model.decoder.name == ("transformer" if name == "transformer" else "sat")


@pytest.mark.slow
def test_cli_demo_runs_end_to_end(tiny_shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(demo, "DEMO_PRESETS", {"sat_soft": "sat_soft_tiny"})
    out = tmp_path / "run"
    code = main(["demo", "--data", str(tiny_shapes), "--out", str(out), "--decoders", "sat_soft", "--budget", "3",
                 "--encoder-budget", "2", "--overlays", "0", "--beam", "1"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "B-4" in printed and "SAT soft" not in printed and "sat_soft" in printed
    assert (out / "report.html").is_file()
    assert main(["demo", "--decoders", "nope", "--out", str(out)]) == 1
    assert "captioner demo: error: --decoders nope" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_demo_with_scst_adds_a_self_critical_row_per_decoder(tiny_shapes: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(demo, "DEMO_PRESETS", {"sat_soft": "sat_soft_tiny"})
    out = tmp_path / "run"
    code = main(["demo", "--data", str(tiny_shapes), "--out", str(out), "--decoders", "sat_soft", "--budget", "3",
                 "--encoder-budget", "2", "--overlays", "0", "--beam", "1", "--scst", "--scst-budget", "2"])
    assert code == 0
    table = capsys.readouterr().out
    assert [line.split()[0] for line in table.splitlines() if line.startswith("sat_soft")] == ["sat_soft",
                                                                                              "sat_soft+scst"]
    report = json.loads((out / "report.json").read_text())
    assert [r["decoder"] for r in report["table"]] == ["sat_soft", "sat_soft+scst"]
    stage2 = report["runs"]["sat_soft+scst"]
    assert stage2["config"]["train"]["objective"] == "scst" and stage2["budget"] == 2.0
    assert stage2["config"]["train"]["init"] == str(out / "sat_soft" / "best.safetensors")
    assert stage2["config"]["train"]["lr"] == pytest.approx(report["runs"]["sat_soft"]["config"]["train"]["lr"]
                                                            * demo.SCST_LR_SCALE)
    assert (out / "sat_soft+scst" / "best.safetensors").is_file() and report["table"][1]["steps"] > 0
    assert (out / "report.html").read_text().count("<tr>") == 3


def test_scst_demo_options() -> None:
    options = DemoOptions(budgets={"sat_soft": 100.0}, scst=True)
    assert options.scst_budgets["sat_soft"] == pytest.approx(100.0 * demo.SCST_BUDGET_SHARE)
    assert DemoOptions().scst_budgets == {}  # the default demo has no SCST stage
    with pytest.raises(ConfigError, match="--scst-budget needs --scst"):
        DemoOptions.from_args(data="d", images=None, seed=0, budget=None, decoders="sat_soft", out="o",
                              scst_budget="10")
    with pytest.raises(ConfigError, match="--scst-budget 'soon'"):
        DemoOptions.from_args(data="d", images=None, seed=0, budget=None, decoders="sat_soft", out="o", scst=True,
                              scst_budget="soon")


def test_scst_stage_config_starts_from_the_decoders_best_checkpoint_with_the_mixed_objective(tmp_path: Path) -> None:
    from captioner.config import get_preset
    from captioner.demo.pipeline import SCST_LR_SCALE, SCST_XE_WEIGHT, scst_config

    options = DemoOptions(out=tmp_path, scst=True, budgets={"sat_soft": 100.0, "sat_hard": 100.0, "transformer": 50.0})
    cfg = get_preset("sat_soft_tiny")
    stage = scst_config("sat_soft", cfg, options)
    assert stage.train.objective == "scst" and stage.train.init == str(tmp_path / "sat_soft" / "best.safetensors")
    assert stage.train.time_budget == pytest.approx(100.0)  # the decoder's own budget by default
    assert stage.train.lr == pytest.approx(cfg.train.lr * SCST_LR_SCALE)
    assert stage.train.scst.xe_weight == SCST_XE_WEIGHT == 0.25
    assert cfg.train.objective == "xe"  # the cross-entropy stage's config is left as it was


def test_attention_supervision_is_on_by_default_and_can_be_turned_off(tmp_path: Path) -> None:
    import argparse

    from captioner.commands import demo as command

    on, off = DemoOptions(), DemoOptions(attention_supervision=False)
    for name in DEMO_DECODERS:
        assert demo.demo_config(name, on).train.attention_supervision == demo.ATTENTION_SUPERVISION[name] > 0
        assert demo.demo_config(name, off).train.attention_supervision == 0.0
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--no-attention-supervision", "--unseen-pairs", "4"])
    assert args.no_attention_supervision and args.unseen_pairs == 4 and args.data is None
    with pytest.raises(ConfigError, match="--unseen-pairs must be a whole number from 0 to 18"):
        DemoOptions(unseen_pairs=19)


def test_scenes_with_other_unseen_pairs_are_refused(tmp_path: Path) -> None:
    plain = DemoOptions(data=tmp_path / "scenes", images=30, image_size=32)
    assert ensure_scenes(plain)["unseen_pairs"] == 0
    with pytest.raises(DataError, match="its scenes hold 0 unseen colour-shape pairs, not 4; pass another --data"):
        ensure_scenes(DemoOptions(data=tmp_path / "scenes", unseen_pairs=4))
    split = ensure_scenes(DemoOptions(data=tmp_path / "split", images=30, image_size=32, unseen_pairs=4))
    assert split["generated"] and split["unseen_pairs"] == 4
    assert ensure_scenes(DemoOptions(data=tmp_path / "split", unseen_pairs=4))["unseen_pairs"] == 4


def test_the_table_shows_seen_and_unseen_columns_only_for_a_compositional_split() -> None:
    plain = format_table([{"decoder": "sat_soft", "attention_supervision": 1.0, "objects_correct": 0.9}])
    assert "att. sup." in plain and "unseen ok" not in plain
    split = format_table([{"decoder": "sat_soft", "objects_correct_unseen": 0.5, "unseen_pairs_named": 0.25}])
    assert "seen ok" in split and "unseen ok" in split and "25.0%" in split


def test_encoder_learns_from_boxes_and_recoloured_images_unless_told_not_to(tmp_path: Path, monkeypatch) -> None:
    import argparse

    from captioner.commands import demo as command
    from captioner.demo.report import _encoder_note
    from captioner.training.detectors import PretrainResult

    calls = []

    def fake(cfg, out, seconds=None, progress=True, boxes=False, recolour=0.0, **_):  # noqa: ANN001, ANN003
        calls.append((boxes, recolour))
        return PretrainResult(Path(out), 10, 1.0, 0.5, 1.0, grounded_images=7 if boxes else 0)

    monkeypatch.setattr(demo, "pretrain_word_detectors", fake)
    on = demo.pretrain_encoder(DemoOptions(out=tmp_path))
    off = demo.pretrain_encoder(DemoOptions(out=tmp_path, encoder_boxes=False))
    assert calls == [(True, demo.ENCODER_RECOLOUR), (False, 0.0)] and 0 < demo.ENCODER_RECOLOUR < 1
    assert "region by region" in _encoder_note(on) and "recoloured" in _encoder_note(on)
    assert "region by region" not in _encoder_note(off) and "recoloured" not in _encoder_note(off)
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert parser.parse_args(["--encoder-from-captions"]).encoder_from_captions
    assert not parser.parse_args([]).encoder_from_captions
