"""One training run: what it holds, where it writes, and what it saves to resume exactly.

``Run`` is made of small parts, each with one job: ``Learner`` (model, objective, optimizer,
schedule, precision), ``RunFolder`` (the folder and its metrics log), ``Clock`` (the time budget),
``Progress`` (counters and the best result, saved) and ``SessionState`` (what this process noticed,
never saved). docs/training.md explains exact resumption.

Shape legend: B batch, T caption steps, N regions, D feature width, S image side.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from captioner.checkpoint.store import read_checkpoint_metadata
from captioner.config import SELECT_METRICS, Config
from captioner.config.parse import MAX_CONFIG_BYTES
from captioner.errors import CaptionerError, CheckpointError, ConfigError, one_line
from captioner.files import check_regular, read_text, writable_folder
from captioner.models.model import CaptionModel
from captioner.text import Vocabulary
from captioner.training.distributed import RANK_SEED_STRIDE, DistInfo
from captioner.training.objective import DeviceStats, Objective, TrainModel
from captioner.training.optim import Precision

log = logging.getLogger(__name__)


COLUMNS = (
    "kind", "epoch", "step", "loss", "ce", "doubly_stochastic", "reinforce", "entropy", "baseline", "advantage_scale",
    "share_ce", "share_doubly_stochastic", "share_entropy",
    "grounding", "grounded_words", "grounding_in_box", "share_grounding",  # train.attention_supervision
    "concept_guide", "concept_guided_words", "share_concept_guide",  # train.concept_guide
    "concept_pointer", "concept_pointer_words", "share_concept_pointer",  # decoder.concept_prior
    "word_distill", "word_distill_rows", "share_word_distill",  # train.word_distill
    "scst_reward", "scst_baseline_reward", "scst_better", "scst_greedy_reward", "scst_better_than_greedy", "scst_xe",
    "lr", "captions_per_s", "BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "CIDEr-D", "attention_entropy",
    "val_images", "val_words", "partial", "seconds",
)


class RunningMean:
    """Caption-weighted running means of named loss parts."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.count = 0.0

    def add(self, parts: Mapping[str, float], count: float) -> None:
        for key, value in parts.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value) * count
        self.count += count

    def means(self) -> dict[str, float]:
        return {k: v / self.count for k, v in self.sums.items()} if self.count else {}

    def state_dict(self) -> dict[str, Any]:
        return {"sums": dict(self.sums), "count": self.count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sums = {k: float(v) for k, v in state["sums"].items()}
        self.count = float(state["count"])


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


class MetricsLogger:
    """Appends rows to ``<run>/metrics.csv`` and mirrors numbers to TensorBoard when available.

    Args:
        run_dir: the run folder.
        keep_until_step: when resuming, drop existing rows whose ``step`` is larger (they belong
            to work the saved state does not include); None starts a new file.
        tensorboard: write ``<run>/tensorboard`` event files if ``torch.utils.tensorboard`` imports.
    """

    def __init__(self, run_dir: str | os.PathLike, keep_until_step: int | None = None,
                 tensorboard: bool = True) -> None:
        self.path = Path(run_dir) / "metrics.csv"
        if os.path.lexists(self.path):  # opening a named pipe here would block
            check_regular(self.path, None, CaptionerError, "metrics file")
        rows: list[dict[str, str]] = []
        if keep_until_step is not None and self.path.exists():
            with open(self.path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if r.get("step") and int(r["step"]) <= keep_until_step]
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        self._file = open(self.path, "a", newline="")
        self._writer = csv.DictWriter(self._file, COLUMNS, extrasaction="ignore")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except Exception as exc:  # optional dependency: any import/setup failure just disables it
                log.debug("TensorBoard logging disabled (%s)", exc)

    def write(self, kind: str, row: Mapping[str, Any]) -> None:
        """Write one ``kind`` ("step" or "epoch") row; numbers also go to TensorBoard."""
        self._writer.writerow({k: _cell(v) for k, v in {"kind": kind, **row}.items()})
        self._file.flush()
        if self._tb is not None:
            step = int(row.get("step", 0))
            for key, value in row.items():
                if key not in ("epoch", "step", "partial") and isinstance(value, (int, float)) and value is not None:
                    self._tb.add_scalar(f"{kind}/{key}", float(value), step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def capture_rng(device: torch.device | None = None) -> dict[str, Any]:
    """Snapshot the torch CPU, CUDA (``device``'s, when CUDA), Python and NumPy generators."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),  # uint8 tensor
        "python": [int(version), [int(x) for x in internal], gauss],
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Put back a snapshot from :func:`capture_rng` (the CUDA part only when both sides have CUDA)."""
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    npst = state["numpy"]
    keys = npst["keys"].numpy().astype(np.uint32)
    np.random.set_state((npst["kind"], keys, int(npst["pos"]), int(npst["has_gauss"]),
                         float(npst["cached_gaussian"])))
    if "cuda" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and every GPU), Python and NumPy."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


@dataclass
class Progress:
    """Where a run stands; saved in ``train_state.pt`` and restored on resume.

    Attributes:
        epoch: current epoch, 0-based (== epochs when training has finished).
        batch_in_epoch: batches of ``epoch`` already trained (> 0 after a mid-epoch stop).
        step: batches trained in total (the x axis of every log).
        select_metric: the validation metric this run selects on (``train.select_metric`` when the
            run started; a resume keeps it).
        best_score: best ``select_metric`` so far (-1 before the first validation).
        best_bleu4: validation BLEU-4 (0-1 scale) of that best checkpoint.
        best_epoch: 1-based epoch of ``best_score``.
        bad_epochs: epochs since the last improvement (early stopping, plateau decay).
        seconds: training wall time of all sessions of this run.
        skipped: batches skipped for a non-finite loss or gradient (``train.skip_nonfinite``).
        history: one dict per validation (the epoch rows of ``metrics.csv``).
        epoch_meter: loss means of the current epoch so far.
        window_meter: loss means since the last step row.
    """

    epoch: int = 0
    batch_in_epoch: int = 0
    step: int = 0
    select_metric: str = "CIDEr-D"
    best_score: float = -1.0
    best_bleu4: float = -1.0
    best_epoch: int = 0
    bad_epochs: int = 0
    seconds: float = 0.0
    skipped: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    epoch_meter: RunningMean = field(default_factory=RunningMean)
    window_meter: RunningMean = field(default_factory=RunningMean)

    def state_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["history"] = [dict(h) for h in self.history]
        out["epoch_meter"] = self.epoch_meter.state_dict()
        out["window_meter"] = self.window_meter.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved state, including those of older versions (see :func:`migrate_progress`)."""
        state = migrate_progress(state)
        for f in fields(self):
            if f.name in ("epoch_meter", "window_meter"):
                getattr(self, f.name).load_state_dict(state[f.name])
            elif f.name == "history":
                self.history = [dict(h) for h in state["history"]]
            else:
                setattr(self, f.name, type(f.default)(state[f.name]))


def migrate_progress(state: dict[str, Any]) -> dict[str, Any]:
    """A saved ``Progress`` state in the current layout (a copy; the input is left alone).

    States from before selection metrics selected on BLEU-4 alone: they have ``best_bleu4`` and no
    ``best_score``, so their ``select_metric`` is BLEU-4 and their best score is that BLEU-4. States
    from before ``skipped`` count no skipped batches.
    """
    state = dict(state)
    if "best_score" not in state:
        state["select_metric"] = "BLEU-4"
        state["best_score"] = state["best_bleu4"]
    state.setdefault("skipped", 0)
    return state


def config_diff(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested config dicts."""
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += config_diff(va, vb, f"{prefix}{key}.")
        elif (list(va) if isinstance(va, tuple) else va) != (list(vb) if isinstance(vb, tuple) else vb):
            out.append(f"{prefix}{key}")
    return out


# Settings a resumed run may change without breaking exact reproduction.
_RESUME_FREE = {"train.epochs", "train.time_budget", "train.patience", "train.device", "train.log_every",
                "data.num_workers", "train.skip_nonfinite", "data.feature_cache_dir", "data.in_memory_mb",
                "data.shared_feature_cache"}


def check_resume_config(cfg: Config, run_dir: Path) -> None:
    """Refuse a resume whose model config differs from the run's ``config.json``; warn on other changes."""
    path = run_dir / "config.json"
    if not path.exists():
        raise CheckpointError(f"{path}: missing; cannot resume this run")
    text = read_text(path, MAX_CONFIG_BYTES, CheckpointError, "config file")
    try:
        saved = Config.from_dict(json.loads(text))
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: unreadable ({one_line(str(exc))[:200]})") from None
    diff = config_diff(saved.to_dict(), cfg.to_dict())
    model_diff = [k for k in diff if k.startswith("model.")]
    if model_diff:
        raise ConfigError(f"--resume: the model config differs from {path} ({', '.join(model_diff[:4])}); "
                          "use another --out for a new model")
    other = [k for k in diff if k not in _RESUME_FREE]
    if other:
        log.warning("resuming with changed settings (%s): the run will not match an uninterrupted one",
                    ", ".join(other))


# Files the run folder writes atomically (``captioner.files.atomic_write``: ``.<name>.*.tmp``).
_ATOMIC_FILES = ("latest.safetensors", "best.safetensors", "train_state.pt", "config.json", "vocab.json")


def remove_stale_temp_files(run_dir: Path) -> list[Path]:
    """Delete temporary files left in ``run_dir`` by a checkpoint write that was killed (resume only)."""
    removed = []
    for name in _ATOMIC_FILES:
        for tmp in run_dir.glob(f".{name}.*.tmp"):
            try:
                tmp.unlink()
            except OSError as exc:
                log.debug("cannot remove stale temporary file %s (%s)", tmp, exc)
                continue
            log.debug("removed %s, left by an interrupted checkpoint write", tmp)
            removed.append(tmp)
    return removed


def check_resume_vocab(vocab: Vocabulary, run_dir: Path) -> None:
    """Refuse a resume whose ``vocab.json`` is not the vocabulary ``latest.safetensors`` was trained with.

    The checkpoint header holds the vocabulary, so this needs no model. An unreadable checkpoint
    is left for loading ``train_state.pt`` to report.
    """
    latest = run_dir / "latest.safetensors"
    if not latest.exists():
        return
    try:
        saved = Vocabulary.from_dict(read_checkpoint_metadata(latest)["vocab"])
    except (CaptionerError, KeyError, TypeError) as exc:
        log.debug("cannot compare vocabularies with %s (%s)", latest, exc)
        return
    if saved == vocab:
        return
    path = run_dir / "vocab.json"
    if len(saved) != len(vocab):
        raise CheckpointError(f"{path} has {len(vocab)} tokens but {latest} was trained with {len(saved)}; "
                              "put back the run's vocab.json or train into a new --out")
    index = next(i for i, (a, b) in enumerate(zip(vocab.itos, saved.itos)) if a != b)
    raise CheckpointError(f"{path} differs from the vocabulary {latest} was trained with (token {index} is "
                          f"{vocab.itos[index]!r}, was {saved.itos[index]!r}); put back the run's vocab.json "
                          "or train into a new --out")


# What a run writes: a folder holding any of these holds an earlier run.
RUN_FILES = ("train_state.pt", "latest.safetensors", "best.safetensors", "config.json", "vocab.json", "metrics.csv")


def earlier_run_files(run_dir: Path) -> list[str]:
    """The files of :data:`RUN_FILES` that ``run_dir`` holds (none when it is not a folder)."""
    if not run_dir.is_dir():
        return []
    return [name for name in RUN_FILES if os.path.lexists(run_dir / name)]


def check_run_folder(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse a run folder this run must not write into; writes nothing.

    Args:
        run_dir: the run folder (``--out``).
        resume: the run continues the one in ``run_dir``.
        overwrite: the run starts over; an earlier run there is moved aside (:func:`move_aside`).

    Raises:
        ConfigError: both ``resume`` and ``overwrite``; ``run_dir`` (or a parent) is a file; the
            folder cannot be written; or it holds an earlier run and neither flag is given.
    """
    if resume and overwrite:
        raise ConfigError("--resume continues the run in --out and --overwrite moves it aside to start over: "
                          "pass one of them")
    writable_folder(run_dir, ConfigError)
    found = earlier_run_files(run_dir)
    if found and not resume:
        if overwrite:
            writable_folder(run_dir.parent, ConfigError)  # the earlier run is renamed there
            return
        raise ConfigError(f"{run_dir} holds an earlier run ({', '.join(found[:3])}); pass --resume to continue it, "
                          f"--overwrite to move it to {run_dir.name}.old-<time> and start over, or another --out")


def move_aside(run_dir: Path) -> Path | None:
    """Rename a folder holding an earlier run to ``<name>.old-<YYYYmmdd-HHMMSS>`` (``-2``... if taken).

    Returns:
        The new name, or None when ``run_dir`` holds no earlier run (nothing is moved).

    Raises:
        ConfigError: the rename failed (the earlier run is then where it was).
    """
    if not earlier_run_files(run_dir):
        return None
    base = f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}"
    target, n = run_dir.with_name(base), 1
    while os.path.lexists(target):
        n += 1
        target = run_dir.with_name(f"{base}-{n}")
    try:
        os.rename(run_dir, target)
    except OSError as exc:
        raise ConfigError(f"{run_dir}: cannot move the earlier run aside to {target} "
                          f"({exc.strerror or exc}); nothing was changed") from None
    log.warning("moved the earlier run in %s to %s (--overwrite); starting a new run", run_dir, target)
    return target


def make_run_folder(run_dir: Path) -> None:
    """Create the run folder (and its parents); one ConfigError line when that fails."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{run_dir}: cannot create the run folder ({exc.strerror or exc})") from None


STATE_FORMAT = "captioner-train-state"


class TrainForward(nn.Module):
    """The module DDP wraps: cached features -> decoder, or images -> encoder -> decoder.

    Args:
        model: the captioner.
        on_features: inputs are region features (B,N,D) rather than images (B,3,S,S).
    """

    def __init__(self, model: CaptionModel, on_features: bool) -> None:
        super().__init__()
        self.model = model
        self.on_features = on_features
        self.encoder_trainable = any(p.requires_grad for p in model.encoder.parameters())

    def forward(self, x: torch.Tensor, tokens: torch.Tensor):  # -> DecoderOutput
        if not self.on_features:
            with torch.set_grad_enabled(self.encoder_trainable and torch.is_grad_enabled()):
                x, _ = self.model.encoder(x)  # (B, N, D)
        return self.model.decoder(x, tokens)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """images (B,3,S,S) -> region features (B,N,D) through the bare encoder (not DDP-wrapped)."""
        return self.model.encoder(images)[0]


@dataclass
class Learner:
    """What is trained and how.

    Attributes:
        model: the captioner (its ``state_dict`` is what checkpoints hold).
        module: the :class:`TrainForward` over ``model``.
        objective: the training objective (:mod:`captioner.training.objective`).
        optimizer: its param groups (decoder first) hold every trained parameter.
        scheduler: the lr schedule, stepped once per optimizer step.
        precision: autocast dtype and gradient scaler.
        forward: the module that runs ``module`` with gradients: ``module`` itself, or its
            ``DistributedDataParallel`` wrapper under torchrun (set by the loop).
        graphed: ``train.cuda_graph``: the captured forward + loss + backward
            (:class:`~captioner.training.step.GraphedStep`), else None.
    """

    model: CaptionModel
    module: TrainForward
    objective: Objective
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    forward: nn.Module | None = None
    graphed: Any = None

    def __post_init__(self) -> None:
        if self.forward is None:
            self.forward = self.module

    def params(self) -> list[nn.Parameter]:
        """Every parameter the optimizer steps, in param-group order."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def train_model(self) -> TrainModel:
        """What the objective trains through: ``forward``, the bare decoder and, on images, the bare encoder."""
        return TrainModel(self.forward, self.model.decoder, None if self.module.on_features else self.module.features)


@dataclass
class RunFolder:
    """Where the run writes: ``path`` (see :mod:`captioner.training.loop`) and, on rank 0, its logger."""

    path: Path
    logger: MetricsLogger | None = None

    def last_good(self) -> str:
        """The clause every failure message ends with: where the last good weights are."""
        latest = self.path / "latest.safetensors"
        return f"last good checkpoint: {latest}" if latest.exists() else "no checkpoint was written yet"


@dataclass
class Clock:
    """Wall time of a run.

    Attributes:
        start: ``time.monotonic()`` when this ``train`` call began.
        budget: ``train.time_budget`` in seconds (None: no budget), counted from ``start``.
        seconds_before: training seconds of earlier sessions of this run (resume).
    """

    start: float
    budget: float | None
    seconds_before: float = 0.0

    def session_seconds(self) -> float:
        """Seconds since this call began."""
        return time.monotonic() - self.start

    def time_up(self) -> bool:
        return self.budget is not None and self.session_seconds() >= self.budget

    def elapsed(self) -> float:
        """Training seconds of the whole run, earlier sessions included."""
        return self.seconds_before + self.session_seconds()


@dataclass
class SessionState:
    """What this process noticed since it started; not saved (a resume starts afresh).

    Attributes:
        last_lr: decoder lr of the last optimizer step (logged).
        skipped_in_a_row: batches skipped for non-finite values since the last good one.
        bad_grad_step: first step with a non-finite gradient norm (without ``skip_nonfinite``).
        stats: loss terms since the last read, on the device.
        warned_regulariser: the "a regulariser outweighs the cross-entropy" line was printed.
    """

    last_lr: float | None = None
    skipped_in_a_row: int = 0
    bad_grad_step: int | None = None
    stats: DeviceStats = field(default_factory=DeviceStats)
    warned_regulariser: bool = False


@dataclass
class Run:
    """One training run, as every piece of the loop sees it.

    Attributes:
        cfg: the full configuration (a resume keeps the run's ``select_metric``).
        info: this process's rank, world size and device.
        learner: model, objective, optimizer, schedule, precision.
        folder: the run folder and its logger.
        clock: start time, time budget, earlier sessions.
        progress: counters and best-so-far (saved in ``train_state.pt``).
        session: this process's unsaved bookkeeping.
        show_progress: tqdm bars on (rank 0 only).
    """

    cfg: Config
    info: DistInfo
    learner: Learner
    folder: RunFolder
    clock: Clock
    progress: Progress
    session: SessionState = field(default_factory=SessionState)
    show_progress: bool = True


def train_state(run: Run, rngs: list[dict[str, Any]]) -> dict[str, Any]:
    """Everything ``train_state.pt`` holds to resume exactly; ``rngs`` is one snapshot per rank."""
    learner = run.learner
    scaler = learner.precision.scaler
    return {
        "format": STATE_FORMAT,
        "version": 1,
        "model": learner.model.state_dict(),
        "optimizer": learner.optimizer.state_dict(),
        "scheduler": learner.scheduler.state_dict(),
        "criterion": learner.objective.state_dict(),  # (the key it had when it held a criterion)
        "scaler": scaler.state_dict() if scaler is not None else {},
        "progress": run.progress.state_dict(),
        "rng": rngs,  # one snapshot per rank
        "world_size": run.info.world_size,
    }


def restore_train_state(run: Run, state: dict[str, Any]) -> None:
    """Put a :func:`train_state` back into ``run`` (weights, optimizer, schedule, loss, progress, RNG).

    Raises:
        CheckpointError: not a training state, or one saved for another model (one line).
    """
    learner, info = run.learner, run.info
    path = run.folder.path / "train_state.pt"
    if state.get("format") != STATE_FORMAT:
        raise CheckpointError(f"{path}: not a captioner training state")
    try:
        learner.model.load_state_dict(state["model"])
        learner.optimizer.load_state_dict(state["optimizer"])
        learner.scheduler.load_state_dict(state["scheduler"])
        learner.objective.load_state_dict(state["criterion"])
        if learner.precision.scaler is not None and state["scaler"]:
            learner.precision.scaler.load_state_dict(state["scaler"])
        run.progress.load_state_dict(state["progress"])
    except (KeyError, RuntimeError, ValueError) as exc:
        # load_state_dict: "Error(s) in loading state_dict for X:" then one line per problem
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = next((line for line in lines if line.startswith("size mismatch")), lines[-1] if lines else repr(exc))
        raise CheckpointError(f"{path}: does not match this model ({detail[:300]})") from None
    rngs = state.get("rng", [])
    if info.rank < len(rngs):
        restore_rng(rngs[info.rank], info.device)
    else:
        seed_everything(run.cfg.train.seed + RANK_SEED_STRIDE * info.rank + run.progress.step)
    if state.get("world_size", 1) != info.world_size and run.progress.batch_in_epoch and info.is_main:
        log.warning("resuming mid-epoch with %d processes (saved with %d): the batch order differs",
                    info.world_size, state["world_size"])


def saved_select_metric(saved: dict[str, Any]) -> str | None:
    """The selection metric of a saved ``train_state.pt`` (None when it cannot be told)."""
    progress = saved.get("progress")
    if not isinstance(progress, dict):
        return None
    metric = progress.get("select_metric") if "best_score" in progress else "BLEU-4"
    return metric if metric in SELECT_METRICS else None


def keep_select_metric(cfg: Config, saved: dict[str, Any], announce: bool = True) -> Config:
    """``cfg`` with the selection metric of the saved run it resumes (a warning when that differs)."""
    metric = saved_select_metric(saved)
    if metric is None or metric == cfg.train.select_metric:
        return cfg
    if announce:
        log.warning("this run selects its best checkpoint on %s (since it started); a resume keeps that, not "
                    "train.select_metric=%s (train into a new --out to select on it)", metric, cfg.train.select_metric)
    return cfg.override(**{"train.select_metric": metric})
