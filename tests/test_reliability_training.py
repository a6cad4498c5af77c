"""Interrupted training and non-finite losses.

* ``kill -9`` of a real ``python -m captioner train`` process, in the middle of a step or while a
  checkpoint is being written, leaves a run folder whose latest checkpoint and training state
  load, and ``captioner train --resume`` then ends with weights bitwise equal to an uninterrupted
  run with the same seed (CPU).
* A non-finite loss stops training with one line naming the step, or the batch is skipped with
  ``train.skip_nonfinite``; the last good checkpoint is never replaced by non-finite weights.

Every run is sat_soft_tiny on the 60-image ``tiny_shapes`` set at batch 48 (5 steps per epoch).
"""

from __future__ import annotations

import csv
import hashlib
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from captioner.cli import main
from captioner.config import get_preset
from captioner.errors import CaptionerError

REPO = Path(__file__).resolve().parents[1]
EPOCHS = 3
STEPS_PER_EPOCH = 5  # 240 training captions / batch 48


def train_argv(data: Path, out: Path) -> list[str]:
    return ["train", "--preset", "sat_soft_tiny", "--data", str(data), "--out", str(out), "--epochs", str(EPOCHS),
            "--batch-size", "48", "--set", "train.val_max_images=8", "--set", "train.log_every=1", "--no-progress"]


def same_config(data: Path, **extra):
    """The Config that ``train_argv`` resolves to (for in-process runs)."""
    return get_preset("sat_soft_tiny", **{"data.root": str(data), "train.epochs": EPOCHS, "train.batch_size": 48,
                                          "train.val_max_images": 8, "train.log_every": 1, **extra})


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def step_losses(run: Path) -> list[tuple[str, str]]:
    with open(run / "metrics.csv", newline="") as f:
        return [(r["step"], r["loss"]) for r in csv.DictReader(f) if r["kind"] == "step"]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a)), load_file(str(b))
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"weights differ from the uninterrupted run: {different[:5]}"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def reference(tiny_shapes: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run (in-process, same config and thread count as the killed children)."""
    from captioner.training.loop import train

    out = tmp_path_factory.mktemp("reference") / "run"
    train(same_config(tiny_shapes), out, progress=False)
    return out


# ----------------------------------------------------------------------------- kill -9


# Entry point for children that must stop at a known moment. The training code is the real one,
# started through ``captioner.cli.main`` exactly as ``python -m captioner`` does; only a pause is
# added, after which the child touches ``PAUSE_MARKER`` and sleeps until the test kills it:
#   PAUSE_AT=fsync:<file>:<n>  inside the n-th atomic write of run-folder file <file>: its temporary
#                             file is written and fsync'ed but not yet renamed over <file>;
#   PAUSE_AT=step:<n>          right after the n-th optimizer step (weights updated, the step's
#                             bookkeeping not done yet), i.e. in the middle of a training step.
_PAUSING_ENTRY = """
import os, sys, time
kind, *spec = os.environ["PAUSE_AT"].split(":")
marker, seen = os.environ["PAUSE_MARKER"], [0]

def pause():
    open(marker, "w").close()
    time.sleep(600)

if kind == "fsync":
    target, nth = spec[0], int(spec[1])
    real_fsync = os.fsync

    def fsync(fd):
        try:
            name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            name = ""
        result = real_fsync(fd)
        if name.startswith("." + target + ".") and name.endswith(".tmp"):
            seen[0] += 1
            if seen[0] == nth:
                pause()
        return result

    os.fsync = fsync
else:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def after_step(optimizer, args, kwargs):
        seen[0] += 1
        if seen[0] == int(spec[0]):
            pause()

    register_optimizer_step_post_hook(after_step)

from captioner.cli import main
sys.exit(main(sys.argv[1:]))
"""


def start_child(argv: list[str], cwd: Path, pause: str | None = None, marker: Path | None = None
                ) -> subprocess.Popen:
    env = child_env()
    if pause is None:
        cmd = [sys.executable, "-m", "captioner", *argv]
    else:
        env.update(PAUSE_AT=pause, PAUSE_MARKER=str(marker))
        cmd = [sys.executable, "-c", _PAUSING_ENTRY, *argv]
    log = open(cwd / "child.log", "w")  # a file, not a pipe: a full pipe would block the child
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    log.close()
    proc.log_path = cwd / "child.log"  # type: ignore[attr-defined]
    return proc


def kill_when(procs: dict[str, tuple[subprocess.Popen, object]], timeout: float = 300.0) -> None:
    """Poll every child at once; ``kill -9`` each as soon as its condition holds.

    Children run concurrently (their start-up, mostly imports, dominates), and a child without a
    pause is killed within milliseconds of its trigger however many others are running.
    """
    deadline = time.monotonic() + timeout
    waiting = dict(procs)
    try:
        while waiting:
            for name, (proc, condition) in list(waiting.items()):
                if condition():
                    kill9(proc)
                    del waiting[name]
                elif proc.poll() is not None:
                    raise AssertionError(f"{name}: training exited ({proc.returncode}) before its kill point: "
                                         f"{proc.log_path.read_text()[-2000:]}")
            assert time.monotonic() < deadline, f"timed out waiting for {sorted(waiting)}"
            time.sleep(0.002)
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)


def kill9(proc: subprocess.Popen) -> None:
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def assert_resumable(run: Path) -> int:
    """The invariant after a kill: a loadable latest checkpoint and training state. Returns its epoch."""
    from captioner.checkpoint.store import load_checkpoint, load_train_state

    loaded = load_checkpoint(run / "latest.safetensors")
    state = load_train_state(run / "train_state.pt")
    assert state["progress"]["step"] >= STEPS_PER_EPOCH or state["progress"]["epoch"] >= 1
    return int(loaded.metadata["epoch"])


# A seeded "random" step of the last epoch, so that one kill also lands in a later epoch.
_LATE_STEP = random.Random(20240611).randrange((EPOCHS - 1) * STEPS_PER_EPOCH + 1, EPOCHS * STEPS_PER_EPOCH)

KILL_POINTS = {
    # The unmodified ``python -m captioner train``, killed as soon as its first checkpoint is complete
    # (train_state.pt is written last, atomically), wherever it then is: epoch 2's steps, validation...
    "plain_after_first_checkpoint": None,
    f"mid_step_{_LATE_STEP}": f"step:{_LATE_STEP}",
    "writing_latest_epoch2": "fsync:latest.safetensors:2",  # the old latest (epoch 1) is still in place
    "writing_train_state_epoch2": "fsync:train_state.pt:2",  # latest is epoch 2's, train_state epoch 1's
}


@pytest.fixture(scope="module")
def killed_runs(tiny_shapes: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, bool]]:
    """Every kill point's run folder after ``kill -9`` -> (folder, whether a write was in progress)."""
    root = tmp_path_factory.mktemp("killed")
    procs, in_write = {}, {}
    for point, pause in KILL_POINTS.items():
        folder = root / point
        folder.mkdir()
        out, marker = folder / "run", folder / "paused"
        proc = start_child(train_argv(tiny_shapes, out), folder, pause, marker)
        if pause is None:
            condition = (out / "train_state.pt").exists
        else:
            condition = marker.exists
            if pause.startswith("fsync:"):
                name = pause.split(":")[1]
                in_write[point] = lambda out=out, name=name: bool(list(out.glob(f".{name}.*.tmp")))
        procs[point] = (proc, condition)
    kill_when(procs)
    return {point: (root / point / "run", in_write[point]() if point in in_write else False) for point in KILL_POINTS}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to watch file writes")
@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_kill_9_then_resume_gives_the_uninterrupted_weights(point: str, killed_runs, reference: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    out, in_write = killed_runs[point]
    if KILL_POINTS[point] and KILL_POINTS[point].startswith("fsync:"):
        assert in_write, "the child was not killed inside the checkpoint write"

    epoch = assert_resumable(out)
    assert 1 <= epoch < EPOCHS

    code = main(["train", "--out", str(out), "--resume", "--no-progress"])
    capsys.readouterr()
    assert code == 0
    assert_same_weights(out / "latest.safetensors", reference / "latest.safetensors")
    assert step_losses(out) == step_losses(reference)
    assert len(step_losses(out)) == EPOCHS * STEPS_PER_EPOCH


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_before_the_first_checkpoint_leaves_a_clear_message(tiny_shapes: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """Killed while the feature cache is being built: nothing to resume yet, and --resume says so."""
    out = tmp_path / "run"
    proc = start_child(train_argv(tiny_shapes, out), tmp_path)
    kill_when({"before_first_checkpoint": (proc, (out / "vocab.json").exists)})
    assert not (out / "latest.safetensors").exists() and not (out / "train_state.pt").exists()
    code = main(["train", "--out", str(out), "--resume", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    [line] = err.splitlines()
    assert line.startswith("captioner train: error: ") and "nothing to resume" in line and "without --resume" in line


# ----------------------------------------------------------------------------- non-finite losses


@pytest.fixture(scope="module")
def one_epoch(tiny_shapes: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from captioner.training.loop import train

    out = tmp_path_factory.mktemp("one_epoch") / "run"
    train(same_config(tiny_shapes, **{"train.epochs": 1, "train.val_max_images": 2}), out, progress=False)
    return out


@pytest.fixture
def run_copy(one_epoch: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(one_epoch, out, ignore=shutil.ignore_patterns("tensorboard"))
    return out


CHECKPOINT_FILES = ("latest.safetensors", "best.safetensors", "train_state.pt")


def sabotage(monkeypatch: pytest.MonkeyPatch, how: str, at_call: int) -> None:
    """Wrap the optimizer step of ``captioner.training.step``: on its ``at_call``-th call (1-based, counted
    from the start of this session) either poison a decoder parameter with NaN after the step, or
    give one parameter a NaN gradient while the loss itself stays finite."""
    import captioner.training.step as train_module

    real = train_module.clip_and_step
    calls = {"n": 0}

    def clip_and_step(loss, optimizer, params, grad_clip, precision, **kwargs):
        calls["n"] += 1
        if calls["n"] != at_call:
            return real(loss, optimizer, params, grad_clip, precision, **kwargs)
        if how == "nan_gradient":
            hook = params[-1].register_hook(lambda g: torch.full_like(g, math.nan))
            try:
                return real(loss, optimizer, params, grad_clip, precision, **kwargs)
            finally:
                hook.remove()
        stepped = real(loss, optimizer, params, grad_clip, precision, **kwargs)
        with torch.no_grad():
            params[-1].fill_(math.nan)
        return stepped

    monkeypatch.setattr(train_module, "clip_and_step", clip_and_step)


def nan_loss_once(monkeypatch: pytest.MonkeyPatch, at_call: int) -> None:
    """One batch (the ``at_call``-th loss of this session) gets a NaN loss; the weights stay fine."""
    from captioner.training.objective import CaptionLoss

    real = CaptionLoss.forward
    calls = {"n": 0}

    def forward(self, output, targets):
        result = real(self, output, targets)
        if self.training:
            calls["n"] += 1
            if calls["n"] == at_call:
                result.total = result.total * math.nan
        return result

    monkeypatch.setattr(CaptionLoss, "forward", forward)


@pytest.mark.parametrize("how", ["poisoned_parameter", "nan_gradient"])
def test_nonfinite_loss_stops_naming_the_step_and_keeps_the_checkpoint(
        how: str, run_copy: Path, tiny_shapes: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from captioner.training.loop import train

    before = {name: digest(run_copy / name) for name in CHECKPOINT_FILES}
    sabotage(monkeypatch, how, at_call=2)  # epoch 2's second step (global step 7) breaks the weights
    cfg = same_config(tiny_shapes, **{"train.epochs": 2, "train.val_max_images": 2})
    with pytest.raises(CaptionerError) as info:
        train(cfg, run_copy, resume=True, progress=False)
    message = str(info.value)
    assert "\n" not in message and "non-finite loss" in message
    assert f"step {STEPS_PER_EPOCH + 3}" in message  # the first batch whose loss is NaN
    assert str(run_copy / "latest.safetensors") in message  # where the last good weights are
    assert {name: digest(run_copy / name) for name in CHECKPOINT_FILES} == before


def test_skip_nonfinite_skips_a_bad_batch_and_goes_on(run_copy: Path, tiny_shapes: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from captioner.training.loop import train

    nan_loss_once(monkeypatch, at_call=3)  # global step 8
    cfg = same_config(tiny_shapes, **{"train.epochs": 2, "train.val_max_images": 2, "train.skip_nonfinite": True})
    with caplog.at_level(logging.WARNING):
        result = train(cfg, run_copy, resume=True, progress=False)
    assert [h["epoch"] for h in result.history] == [1, 2] and result.history[-1]["partial"] == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(f"step {STEPS_PER_EPOCH + 3}" in w and "non-finite" in w for w in warnings), warnings
    losses = dict(step_losses(run_copy))
    assert losses[str(STEPS_PER_EPOCH + 3)] == "" and len(losses) == 2 * STEPS_PER_EPOCH
    weights = load_file(str(run_copy / "latest.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())


@pytest.mark.parametrize("how", ["poisoned_parameter", "nan_gradient"])
def test_skip_nonfinite_never_saves_nonfinite_weights(how: str, run_copy: Path, tiny_shapes: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the weights themselves are NaN every later batch is non-finite too: skipping batches
    cannot help. Training must then stop (naming the step) or at least never write the NaN weights
    over the last good checkpoint and training state."""
    from captioner.training.loop import train

    before = {name: digest(run_copy / name) for name in CHECKPOINT_FILES}
    sabotage(monkeypatch, how, at_call=2)
    cfg = same_config(tiny_shapes, **{"train.epochs": 2, "train.val_max_images": 2, "train.skip_nonfinite": True})
    try:
        train(cfg, run_copy, resume=True, progress=False)
    except CaptionerError as exc:
        assert "\n" not in str(exc) and "non-finite" in str(exc)
    for name in ("latest.safetensors", "best.safetensors"):
        weights = load_file(str(run_copy / name))
        bad = [k for k, t in weights.items() if t.is_floating_point() and not torch.isfinite(t).all()]
        assert not bad, f"{name} was overwritten with non-finite weights ({bad[:3]})"
    state = torch.load(run_copy / "train_state.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point()), \
        "train_state.pt was overwritten with non-finite weights"
    if digest(run_copy / "latest.safetensors") != before["latest.safetensors"]:
        assert digest(run_copy / "train_state.pt") != before["train_state.pt"]  # saved together, consistently
