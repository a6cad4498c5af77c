"""scripts/flickr8k_results.py: the results table of the Flickr8k benchmark from its run folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from script_modules import load_script


@pytest.fixture(scope="module")
def results():
    return load_script("flickr8k_results.py")


def make_run(root: Path, name: str, coco: bool, seconds: float, correctness: float | None,
             interval: list[float] | None = None) -> Path:
    run = root / name
    run.mkdir(parents=True)
    report = {f"BLEU-{n}": 0.1 * n for n in range(1, 5)} | {"CIDEr-D": 0.5, "METEOR": 0.19, "ROUGE-L": 0.45,
                                                             "beam_size": 3,
                                                             "attention": {"attention_entropy": 3.36,
                                                                           "uniform_entropy": 3.89}}
    if coco:
        report |= {f"coco/BLEU-{n}": 0.2 * n / 2 + 0.01 for n in range(1, 5)} | {
            "coco/CIDEr-D": 0.526, "coco/METEOR": 0.196, "coco/ROUGE-L": 0.46}
    (run / "metrics_dev.json").write_text(json.dumps(report))
    (run / "metrics.csv").write_text("kind,epoch,seconds\nstep,1,10\nepoch,1,60\nstep,2,70\n"
                                     f"epoch,2,{seconds}\n")
    if correctness is not None:
        (run / "coco2017-mini").mkdir()
        (run / "coco2017-mini" / "metrics_train2017.json").write_text(
            json.dumps({"attention_correctness": {"ratio": correctness, "words_scored": 50,
                                                  **({"ratio_interval": interval} if interval else {})},
                        **({"reference_attention_correctness": {"ratio": 1.5, "ratio_interval": [1.4, 1.6]}}
                           if interval else {})}))
    return run


def test_rows_prefer_coco_caption_scores_and_read_time_and_attention(results, tmp_path: Path, capsys) -> None:
    make_run(tmp_path, "sat_soft", coco=True, seconds=2188.0, correctness=1.378)
    make_run(tmp_path, "transformer", coco=False, seconds=1500.0, correctness=None)
    (tmp_path / "features").mkdir()  # no metrics_dev.json: not a row
    assert results.main([str(tmp_path)]) == 0
    table = (tmp_path / "results.md").read_text()
    assert table == capsys.readouterr().out
    lines = table.splitlines()
    assert lines[0].startswith("| system |") and set(lines[1]) <= set("| -")
    assert sum("(test)" in line for line in lines) == len(results.PUBLISHED)
    soft = next(line for line in lines if "**sat_soft**" in line)
    assert "(dev, coco-caption)" in soft and "11.0 / 21.0 / 31.0 / 41.0" in soft  # the coco/ scores, x100
    assert "| 19.60 | 46.0 | 52.6 | 3.36 (3.89) | 1.38x (50 words) | 36 min |" in soft
    tf = next(line for line in lines if "**transformer**" in line)
    assert "(dev, built-in)" in tf and "10.0 / 20.0 / 30.0 / 40.0" in tf and "| 50.0 |" in tf and "| 25 min |" in tf


def test_a_ratio_with_its_interval_shows_both(results, tmp_path: Path, capsys) -> None:
    make_run(tmp_path, "sat_soft", coco=True, seconds=2188.0, correctness=1.378, interval=[1.214, 1.551])
    assert results.main([str(tmp_path)]) == 0
    soft = next(line for line in capsys.readouterr().out.splitlines() if "**sat_soft**" in line)
    assert "| 1.38x [1.21-1.55] (50 words); references 1.50x [1.40-1.60] |" in soft


def test_no_scored_run_is_an_error(results, tmp_path: Path) -> None:
    assert results.main([str(tmp_path)]) == 1  # a table of the papers alone is no result
    assert results.main([str(tmp_path / "missing")]) == 1


def test_rows_name_the_encoder_and_an_ensembles_members(results, tmp_path: Path) -> None:
    lite2 = make_run(tmp_path, "sat_soft_lite2", coco=True, seconds=2400.0, correctness=None)
    (lite2 / "config.json").write_text(json.dumps({"model": {"encoder": {"name": "efficientnet_lite2"}}}))
    plain = make_run(tmp_path, "transformer", coco=True, seconds=2400.0, correctness=None)
    ensemble = tmp_path / "ensemble"
    ensemble.mkdir()
    report = json.loads((lite2 / "metrics_dev.json").read_text())
    report["checkpoint"] = [str(lite2 / "best.safetensors"), str(plain)]
    (ensemble / "metrics_dev.json").write_text(json.dumps(report))
    assert results.main([str(tmp_path)]) == 0
    lines = (tmp_path / "results.md").read_text().splitlines()
    assert "| EfficientNet-Lite2 frozen, beam 3 |" in next(line for line in lines if "**sat_soft_lite2**" in line)
    assert "| EfficientNet-Lite0 frozen, beam 3 |" in next(line for line in lines if "**transformer**" in line)
    row = next(line for line in lines if "**ensemble**" in line)
    assert ("| ensemble of sat_soft_lite2 (EfficientNet-Lite2) + transformer (EfficientNet-Lite0), beam 3 |" in row
            and row.endswith("| - |"))  # no training of its own
