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
HELP_SCRIPTS = ("benchmark.py", "flickr8k_results.py",
                "make_serve_screenshot.py", "experiments/grounding_ablation.py", "experiments/grounding_coco.py",
                "experiments/caption_stats.py", "experiments/gallery.py", "experiments/concept_maps_on_references.py",
                "experiments/reading_step_attention.py", "experiments/label_quality.py",
                "experiments/dev_captions.py", "experiments/everyday_levers.py", "experiments/verdict_bands.py",
                "experiments/label_stage_check.py", "experiments/everyday_probe.py", "experiments/person_signal.py",
                "calibrate_int8.py")
# modules the scripts import (not run on their own), and the one script checked by a dry run below
NOT_RUN = ("gpu_summary.py", "benchmarks/timing.py")


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


# Runs each script as __main__ with --help, one after another in one fresh process (their imports,
# torch's among them, paid once): one JSON line per script, its exit code and what it printed.
_HELP_RUNNER = """
import contextlib, io, json, runpy, sys
for script in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [script, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(script, run_name="__main__")
        code = "returned without exiting"
    except SystemExit as exc:
        code = exc.code or 0
    except BaseException as exc:  # noqa: BLE001 - reported for the script's own test
        code = repr(exc)[:300]
    print(json.dumps({"script": script, "code": code, "stdout": out.getvalue()[:200], "stderr": err.getvalue()[-2000:]}))
"""


@pytest.fixture(scope="module")
def script_help() -> dict[str, dict]:
    """Each of HELP_SCRIPTS run with ``--help`` (in one fresh process): {script: {code, stdout, stderr}}."""
    done = _run([sys.executable, "-c", _HELP_RUNNER, *(str(SCRIPTS / s) for s in HELP_SCRIPTS)])
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"script"')]
    return {str(Path(row["script"]).relative_to(SCRIPTS)): row for row in rows}


@pytest.mark.slow  # one fresh process runs every script's --help: about 8 s in all
@pytest.mark.parametrize("script", HELP_SCRIPTS)
def test_python_script_help(script: str, script_help: dict[str, dict]):
    row = script_help[script]
    assert row["code"] == 0, row["stderr"]
    assert row["stdout"].startswith("usage: ")


def test_gpu_summary_reads_an_empty_folder(tmp_path: Path):
    done = _run([sys.executable, str(SCRIPTS / "gpu_summary.py"), str(tmp_path)])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "missing" in done.stdout and (tmp_path / "summary.json").is_file()


@pytest.mark.slow  # a fresh process imports every benchmark: about 3 s
def test_benchmark_lists_every_benchmark_module():
    done = _run([sys.executable, str(SCRIPTS / "benchmark.py"), "--list"])
    assert done.returncode == 0, done.stderr[-2000:]
    names = set(done.stdout.split())
    assert {"sat_train", "train_loop", "beam", "serve"} <= names
    assert len(list((SCRIPTS / "benchmarks").glob("bench_*.py"))) <= len(names)


SHELL_SYNTAX_ONLY = ("gpu_env.sh", "test.sh")  # sourced by the GPU scripts | installs the package
USAGE_ERRORS = {"gpu_check.sh": "set OUT", "gpu_flickr8k.sh": "usage: ", "reproduce_flickr8k.sh": "usage: ",
                "experiments/real_photo_ablation.sh": "usage: ", "train_shipped_model.sh": "usage: ",
                "gpu_shipped_model.sh": "set OUT"}


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


STUB = """#!/usr/bin/env bash
# a stand-in for captioner: logs its call, and writes what the real command would leave behind
echo "$(basename "$0") $*" >> "$STUB_LOG"
out=""; prev=""
for arg in "$@"; do [ "$prev" = --out ] && out=$arg; prev=$arg; done
case "$1" in
    train) mkdir -p "$out"; touch "$out/best.safetensors" "$out/train_state.pt" ;;
    evaluate) mkdir -p "$out"; touch "$out/metrics_dev.json" "$out/metrics_train2017.json" ;;
    concepts) touch "$out" ;;
esac
"""


def _stubbed(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Stand-ins for captioner and python on a PATH folder: (that folder, the runs root, the calls log)."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ("captioner", "python"):
        (stubs / name).write_text(STUB)
        (stubs / name).chmod(0o755)
    return stubs, tmp_path / "runs", tmp_path / "calls.log"


def test_reproduce_flickr8k_resumes_where_it_stopped(tmp_path: Path):
    """RESUME=1 keeps the runs an earlier call scored, resumes a run with a training state and starts the
    rest afresh; without it every run starts afresh (--overwrite). The commands are stand-ins on PATH."""
    stubs, root, log = _stubbed(tmp_path)
    (root / "sat_soft" / "coco2017-mini").mkdir(parents=True)  # trained and scored by an earlier call
    for done in ("best.safetensors", "train_state.pt", "metrics_dev.json", "coco2017-mini/metrics_train2017.json"):
        (root / "sat_soft" / done).touch()
    (root / "sat_hard").mkdir()
    (root / "sat_hard" / "train_state.pt").touch()  # stopped during training
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "STUB_LOG": str(log),
           "ROOT": str(root), "RESUME": "1", "SCST": "1"}
    done = subprocess.run(["bash", str(SCRIPTS / "reproduce_flickr8k.sh"), "DATA", "COCO"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "== sat_soft: trained and scored already, kept" in done.stdout
    assert "== sat_hard: training (" in done.stdout and ", resumed)" in done.stdout
    calls = log.read_text().splitlines()
    trains = [c for c in calls if c.startswith("captioner train")]
    assert len(trains) == 3  # sat_hard, transformer, SCST: not sat_soft
    assert "--preset sat_hard_flickr8k" in trains[0] and "--resume" in trains[0]
    assert "--preset transformer_flickr8k" in trains[1] and "--overwrite" in trains[1]
    assert "--init" in trains[2] and "--overwrite" in trains[2]
    assert not any(f"--out {root}/sat_soft " in c for c in calls)
    assert sum(c.startswith("captioner evaluate") for c in calls) == 6  # dev and COCO boxes, three runs
    assert calls[-1] == f"python scripts/flickr8k_results.py {root}"
    # a second call finds everything scored and trains nothing
    log.unlink()
    again = subprocess.run(["bash", str(SCRIPTS / "reproduce_flickr8k.sh"), "DATA", "COCO"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stderr
    assert log.read_text().splitlines() == [f"python scripts/flickr8k_results.py {root}"]
    # without RESUME every run starts afresh
    log.unlink()
    fresh = subprocess.run(["bash", str(SCRIPTS / "reproduce_flickr8k.sh"), "DATA"], cwd=ROOT,
                           env={**env, "RESUME": "0", "SCST": "0"}, capture_output=True, text=True, timeout=60)
    assert fresh.returncode == 0, fresh.stderr
    trains = [c for c in log.read_text().splitlines() if c.startswith("captioner train")]
    assert len(trains) == 3 and all("--overwrite" in c for c in trains)


@pytest.mark.parametrize(("concepts_cider", "expected"), [(0.55, "sat_soft_concepts"), (0.45, "sat_soft")])
def test_reproduce_flickr8k_self_critical_stage_starts_from_the_better_sat(tmp_path: Path, concepts_cider: float,
                                                                           expected: str):
    """With CONCEPTS=1 and SCST=1 the self-critical stage starts from whichever SAT soft model has the higher dev
    CIDEr-D (coco-caption's), carrying the concept model's settings when it is that one."""
    stubs, root, log = _stubbed(tmp_path)
    scores = {"sat_soft": 0.50, "sat_hard": 0.47, "transformer": 0.49, "sat_soft_concepts": concepts_cider,
              "ensemble": 0.52}
    for run, cider in scores.items():
        (root / run / "coco2017-mini").mkdir(parents=True)
        (root / run / "best.safetensors").touch()
        (root / run / "coco2017-mini" / "metrics_train2017.json").touch()
        metrics = {"CIDEr-D": cider + 0.01, "coco/CIDEr-D": cider}  # coco-caption's is the one compared
        (root / run / "metrics_dev.json").write_text(json.dumps(metrics, indent=2))
    (root / "concepts.safetensors").touch()
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "STUB_LOG": str(log),
           "ROOT": str(root), "RESUME": "1", "SCST": "1", "CONCEPTS": "1", "ENSEMBLE": "1"}
    done = subprocess.run(["bash", str(SCRIPTS / "reproduce_flickr8k.sh"), "DATA", "COCO"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"== self-critical stage from {expected} (dev CIDEr-D {scores[expected]})" in done.stdout
    trains = [c for c in log.read_text().splitlines() if c.startswith("captioner train")]
    assert len(trains) == 1, trains  # everything else was scored already
    assert f"--init {root}/{expected}/best.safetensors" in trains[0]
    assert f"--out {root}/{expected}_scst " in trains[0]
    assert ("concepts.prior=true" in trains[0]) == (expected == "sat_soft_concepts")
    assert (f"train.concepts={root}/concepts.safetensors" in trains[0]) == (expected == "sat_soft_concepts")


def test_verdict_bands_fits_the_cuts_where_the_captions_stop_being_right(tmp_path: Path):
    def record(per_word: float, right: bool) -> dict:
        return {"per_word": per_word, "absent": [] if right else ["dog"], "cider": 1.0}

    # 4 in 5 right at -0.1 per word, half at -0.4, 1 in 10 at -1.0
    runs = {"a": [record(-0.1, i % 5 != 0) for i in range(50)] + [record(-0.4, i % 2 == 0) for i in range(50)]
            + [record(-1.0, i % 10 == 0) for i in range(50)]}
    (tmp_path / "records.json").write_text(json.dumps(runs))
    done = _run([sys.executable, str(SCRIPTS / "experiments/verdict_bands.py"), "--records", str(tmp_path / "records.json"),
                 "--high", "0.7", "--low", "0.2"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("fitted cuts: likely right >= -0.35, probably wrong < -0.40 "), done.stdout
    assert "| a | 80% right of 50 | 50% right of 50 | 10% right of 50 | 47% right of 150 |" in done.stdout
