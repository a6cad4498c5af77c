"""Every script in ``scripts/`` still starts: ``--help`` (or a dry run) for the Python ones, a syntax
check and the usage error for the shell ones, discovery for the benchmark modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
HELP_SCRIPTS = ("benchmark.py", "download_coco.py", "download_flickr8k.py", "flickr8k_results.py",
                "make_serve_screenshot.py", "experiments/grounding_ablation.py", "experiments/grounding_coco.py",
                "experiments/caption_stats.py", "experiments/gallery.py")
# modules the scripts import (not run on their own), and the one script checked by a dry run below
NOT_RUN = ("download_common.py", "gpu_summary.py", "benchmarks/timing.py")


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            **env}
    return subprocess.run(args, cwd=ROOT, env=full, capture_output=True, text=True, timeout=120)


def test_every_script_is_checked_here():
    python = {str(p.relative_to(SCRIPTS)) for p in SCRIPTS.rglob("*.py")}
    benchmarks = {p for p in python if p.startswith("benchmarks/bench_")}
    assert python - benchmarks == set(HELP_SCRIPTS) | set(NOT_RUN)
    shell = {str(p.relative_to(SCRIPTS)) for p in SCRIPTS.rglob("*.sh")}
    assert shell == set(SHELL_SYNTAX_ONLY) | set(USAGE_ERRORS)


@pytest.mark.parametrize("script", HELP_SCRIPTS)
def test_python_script_help(script: str):
    done = _run([sys.executable, str(SCRIPTS / script), "--help"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: ")


def test_gpu_summary_reads_an_empty_folder(tmp_path: Path):
    done = _run([sys.executable, str(SCRIPTS / "gpu_summary.py"), str(tmp_path)])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "missing" in done.stdout and (tmp_path / "summary.json").is_file()


def test_benchmark_lists_every_benchmark_module():
    done = _run([sys.executable, str(SCRIPTS / "benchmark.py"), "--list"])
    assert done.returncode == 0, done.stderr[-2000:]
    names = set(done.stdout.split())
    assert {"sat_train", "train_loop", "beam", "serve"} <= names
    assert len(list((SCRIPTS / "benchmarks").glob("bench_*.py"))) <= len(names)


SHELL_SYNTAX_ONLY = ("gpu_env.sh", "test.sh")  # sourced by the GPU scripts | installs the package
USAGE_ERRORS = {"gpu_check.sh": "set OUT", "gpu_flickr8k.sh": "usage: ", "reproduce_flickr8k.sh": "usage: ",
                "experiments/real_photo_ablation.sh": "usage: "}


@pytest.mark.parametrize("script", sorted(set(SHELL_SYNTAX_ONLY) | set(USAGE_ERRORS)))
def test_shell_script_syntax(script: str):
    done = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("script", sorted(USAGE_ERRORS))
def test_shell_script_without_its_arguments_says_how_to_call_it(script: str):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run(["bash", str(SCRIPTS / script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode != 0
    assert USAGE_ERRORS[script] in done.stderr


def test_caption_stats_counts_repeats(tmp_path: Path):
    results = tmp_path / "results.json"
    results.write_text(json.dumps([{"image_id": 1, "caption": "a dog in a blue shirt and a blue shirt"},
                                   {"image_id": 2, "caption": "a baby baby in a bib"},
                                   {"image_id": 3, "caption": "a man rides a bike"}]))
    done = _run([sys.executable, str(SCRIPTS / "experiments/caption_stats.py"), str(results)])
    assert done.returncode == 0, done.stderr
    assert "3 captions" in done.stdout and "33.3% repeat a trigram" in done.stdout
    assert "66.7% repeat a content word" in done.stdout
    bad = _run([sys.executable, str(SCRIPTS / "experiments/caption_stats.py"), str(tmp_path / "none.json")])
    assert bad.returncode == 1 and "none.json" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow  # trains nothing but captions a dataset end to end (8 s)
def test_gallery_draws_photos_whose_caption_names_two_nouns(tmp_path: Path, tiny_shapes: Path, untrained_checkpoint):
    from PIL import Image

    tagged = untrained_checkpoint.point(
        untrained_checkpoint(tmp_path, "sat_soft_tiny", concepts=("circle", "square", "triangle")))
    out = tmp_path / "gallery"
    args = [sys.executable, str(SCRIPTS / "experiments/gallery.py"), str(tagged), str(tiny_shapes), "--split", "test",
            "--out", str(out), "--count", "2", "--images", "5", "--max-len", "8", "--no-repeat-words"]
    done = _run(args, OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "gallery.json").read_text())
    assert summary["nouns_from"] == "concept words of the model" and summary["photos_captioned"] == 5
    photos = summary["photos"]
    assert len(photos) == 2 and [p["score"] for p in photos] == sorted((p["score"] for p in photos), reverse=True)
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    for photo, line in zip(photos, lines):
        assert line.startswith(photo["file"] + ": ") and photo["caption"] in line
        nouns = [n["word"] for n in photo["nouns"]]
        assert len(set(nouns)) == len(nouns) >= 2 and set(nouns) <= {"circle", "square", "triangle"}
        assert all(n in photo["caption"].split() for n in nouns)
        for n in photo["nouns"]:
            assert all(0 <= v < 4 for v in n["peak"]) and 0 < n["peak_share"] <= 1
        assert len(photo["pairs"]) == len(nouns) * (len(nouns) - 1) // 2
        assert all(0 <= p["overlap"] <= 1 for p in photo["pairs"])
        with Image.open(out / photo["file"]) as picture:
            assert picture.format == "JPEG" and picture.width > picture.height
    # a model without concepts: the built-in nouns (none in this vocabulary), or the ones given
    plain = untrained_checkpoint.point(untrained_checkpoint(tmp_path, "sat_soft_tiny"))
    args[2], args[7] = str(plain), str(tmp_path / "none")
    done = _run(args, OMP_NUM_THREADS="1")
    assert done.returncode == 0 and "no caption of the 5 photos names two nouns" in done.stderr
    assert json.loads((tmp_path / "none" / "gallery.json").read_text())["photos"] == []
    args[7] = str(tmp_path / "given")
    done = _run([*args, "--nouns", "circle,triangle,red"], OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-2000:]
    given = json.loads((tmp_path / "given" / "gallery.json").read_text())
    assert given["nouns_from"] == "--nouns" and given["photos"]
    bad = _run([*args[:3], str(tmp_path / "nowhere"), *args[4:]], OMP_NUM_THREADS="1")
    assert bad.returncode == 1 and bad.stderr.startswith("gallery: error:") and "Traceback" not in bad.stderr
