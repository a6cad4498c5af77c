"""What one training run holds, grouped by what changes together.

Shape legend: B batch, T caption steps, N regions, D feature width, S image side.

A :class:`Run` is made of small parts, each with one job:

* :class:`Learner`: what is trained and how (model, the module that runs it, objective, optimizer,
  schedule, precision); its state is saved in ``train_state.pt``.
* :class:`RunFolder`: where the run writes (the folder and its metrics logger).
* :class:`Clock`: when this call began, the time budget and the seconds of earlier sessions.
* :class:`~captioner.training.state.Progress`: the counters and the best result so far, saved.
* :class:`SessionState`: what this process noticed since it started (device-side loss sums, the
  last lr, non-finite bookkeeping); never saved.

The data (:class:`~captioner.training.data.TrainData`) is passed next to the run where needed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from captioner.config import Config
from captioner.errors import CheckpointError
from captioner.models.captioner import CaptionModel
from captioner.training.distributed import RANK_SEED_STRIDE, DistInfo
from captioner.training.logging_utils import MetricsLogger
from captioner.training.objective import Objective, TrainModel
from captioner.training.optim import Precision
from captioner.training.state import Progress, restore_rng, seed_everything
from captioner.training.step_stats import DeviceStats

log = logging.getLogger(__name__)

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
            (:class:`~captioner.training.cuda_graph.GraphedStep`), else None.
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
