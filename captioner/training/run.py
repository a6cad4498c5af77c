"""One training run: what it holds, where it writes, and what it saves to resume exactly.

``Run`` is made of small parts, each with one job: ``Learner`` (model, objective, optimizer,
schedule, precision), ``RunFolder`` (the folder and its metrics log), ``Clock`` (the time budget),
``Progress`` (counters and the best result, saved) and ``SessionState`` (what this process noticed,
never saved). docs/training.md explains exact resumption.

Shape legend: B batch, T caption steps, N regions, D feature width, S image side.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
import random
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tqdm import tqdm

from captioner.config import SELECT_METRICS, Config, EncoderConfig
from captioner.device import RANK_SEED_STRIDE, DistInfo
from captioner.errors import CaptionerError, CheckpointError, ImageLoadError
from captioner.files import atomic_file, check_regular, open_partial
from captioner.models.model import CaptionModel
from captioner.training.objective import LossResult, Objective, TrainModel, term_shares, weighted_terms
from captioner.training.optim import Precision, nonfinite_tensors

log = logging.getLogger(__name__)


COLUMNS = (
    "kind", "epoch", "step", "loss", "ce", "doubly_stochastic", "reinforce", "entropy", "baseline", "advantage_scale",
    "share_ce", "share_doubly_stochastic", "share_entropy",
    "grounding", "grounded_words", "grounding_in_box", "share_grounding",  # train.attention_supervision
    "concept_guide", "concept_guided_words", "share_concept_guide",  # train.concept_guide
    "concept_pointer", "concept_pointer_words", "share_concept_pointer",  # concepts.prior
    "word_distill", "word_distill_rows", "share_word_distill",  # train.word_distill
    "attention_kl",  # train.labels.attend_kd (the label stage)
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
    """Appends rows to ``<run>/metrics.csv`` (and TensorBoard when it imports).

    ``keep_until_step``: on resume, drop rows past the saved step; None starts a new file.
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
        with atomic_file(self.path, CaptionerError) as f:  # the rows kept, then appended to as training goes
            text = io.TextIOWrapper(f, encoding="utf-8", newline="")
            writer = csv.DictWriter(text, COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
            text.detach()
        self._file = io.TextIOWrapper(open_partial(self.path, True, CaptionerError), encoding="utf-8", newline="")
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
    """Where a run stands (``select_metric``, ``history``...); saved in ``train_state.pt`` and restored on resume."""

    epoch: int = 0  # current epoch, 0-based (== epochs when training has finished)
    batch_in_epoch: int = 0  # batches of ``epoch`` already trained (> 0 after a mid-epoch stop)
    step: int = 0  # batches trained in total (the x axis of every log)
    select_metric: str = "CIDEr-D"
    best_score: float = -1.0  # best ``select_metric`` so far (-1 before the first validation)
    best_bleu4: float = -1.0  # validation BLEU-4 (0-1 scale) of that best checkpoint
    best_epoch: int = 0  # 1-based epoch of ``best_score``
    bad_epochs: int = 0  # epochs since the last improvement (early stopping, plateau decay)
    seconds: float = 0.0  # training wall time of all sessions of this run
    skipped: int = 0  # batches skipped for a non-finite loss or gradient (``train.skip_nonfinite``)
    history: list[dict[str, Any]] = field(default_factory=list)
    epoch_meter: RunningMean = field(default_factory=RunningMean)  # loss means of the current epoch so far
    window_meter: RunningMean = field(default_factory=RunningMean)  # loss means since the last step row

    def state_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["history"] = [dict(h) for h in self.history]
        out["epoch_meter"] = self.epoch_meter.state_dict()
        out["window_meter"] = self.window_meter.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict`."""
        for f in fields(self):
            if f.name in ("epoch_meter", "window_meter"):
                getattr(self, f.name).load_state_dict(state[f.name])
            elif f.name == "history":
                self.history = [dict(h) for h in state["history"]]
            else:
                setattr(self, f.name, type(f.default)(state[f.name]))


STATE_FORMAT = "captioner-train-state"


class TrainForward(nn.Module):
    """The module DDP wraps: cached features (``on_features``) -> decoder, or images -> encoder -> decoder."""

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
    """What is trained and how; ``forward`` is the module or its DDP wrapper, ``graphed`` the CUDA-graph step or None."""

    model: CaptionModel  # the captioner (its ``state_dict`` is what checkpoints hold)
    module: TrainForward  # the :class:`TrainForward` over ``model``
    objective: Objective  # the training objective (:mod:`captioner.training.objective`)
    optimizer: torch.optim.Optimizer  # its param groups (decoder first) hold every trained parameter
    scheduler: torch.optim.lr_scheduler.LRScheduler  # the lr schedule, stepped once per optimizer step
    precision: Precision  # autocast dtype and gradient scaler
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
    """Wall time of a run."""

    start: float  # ``time.monotonic()`` when this ``train`` call began
    budget: float | None  # ``train.time_budget`` in seconds (None: no budget), counted from ``start``
    seconds_before: float = 0.0  # training seconds of earlier sessions of this run (resume)

    def session_seconds(self) -> float:
        """Seconds since this call began."""
        return time.monotonic() - self.start

    def time_up(self) -> bool:
        return self.budget is not None and self.session_seconds() >= self.budget

    def elapsed(self) -> float:
        """Training seconds of the whole run, earlier sessions included."""
        return self.seconds_before + self.session_seconds()


@dataclass
class StatsReading:
    """What ``DeviceStats.read`` returns."""

    means: dict[str, float]  # caption-weighted means of ``loss`` (the objective) and every loss term
    captions: float  # captions added since the last read
    bad_loss: tuple[int, float] | None  # ``(step, value)`` of the first non-finite loss, or None
    bad_grad_step: int | None  # the first step whose gradient norm was not finite, or None


class DeviceStats:
    """Caption-weighted sums of the loss terms on the device, read in one go."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.keys: list[str] | None = None
        self.sums: torch.Tensor | None = None
        self.captions = 0.0
        self.bad: torch.Tensor | None = None  # (3,) first bad-loss step, its value, first bad-grad step (-1: none)

    def add(self, result: LossResult, captions: int, step: int, grad_norm: torch.Tensor | float | None) -> None:
        """Add one step's terms (no host sync)."""
        terms = {"loss": result.objective, **result.terms}
        if self.keys is None:
            self.keys = sorted(terms)
        vec = torch.stack([terms[k].float() for k in self.keys]) * float(captions)
        self.sums = vec if self.sums is None else self.sums + vec
        self.captions += captions
        total = result.total.detach().float()
        if self.bad is None:
            self.bad = torch.tensor([-1.0, 0.0, -1.0], dtype=torch.float64, device=total.device)
        loss_bad = ~torch.isfinite(total) & (self.bad[0] < 0)
        grad_bad = (self.bad[2] < 0) & ~torch.isfinite(torch.as_tensor(grad_norm if grad_norm is not None else 0.0,
                                                                       device=total.device, dtype=torch.float32))
        self.bad = torch.stack([torch.where(loss_bad, float(step), self.bad[0]),
                                torch.where(loss_bad, total.double(), self.bad[1]),
                                torch.where(grad_bad, float(step), self.bad[2])])

    def read(self) -> StatsReading:
        """Means since the last read and the first non-finite steps (one host sync); then reset."""
        if self.sums is None or self.keys is None:
            self._reset()
            return StatsReading({}, 0.0, None, None)
        sums = self.sums.double().cpu().tolist()
        bad = self.bad.cpu().tolist() if self.bad is not None else [-1.0, 0.0, -1.0]
        n = self.captions
        means = {k: v / n for k, v in zip(self.keys, sums)} if n else {}
        reading = StatsReading(means, n, (int(bad[0]), bad[1]) if bad[0] >= 0 else None,
                               int(bad[2]) if bad[2] >= 0 else None)
        self._reset()
        return reading


@dataclass
class SessionState:
    """What this process noticed since it started; not saved (a resume starts afresh)."""

    last_lr: float | None = None  # decoder lr of the last optimizer step (logged)
    skipped_in_a_row: int = 0  # batches skipped for non-finite values since the last good one
    bad_grad_step: int | None = None  # first step with a non-finite gradient norm (without ``skip_nonfinite``)
    stats: DeviceStats = field(default_factory=DeviceStats)  # loss terms since the last read, on the device
    warned_regulariser: bool = False  # the "a regulariser outweighs the cross-entropy" line was printed


@dataclass
class Run:
    """One training run, as every piece of the loop sees it."""

    cfg: Config  # the full configuration (a resume keeps the run's ``select_metric``)
    info: DistInfo  # this process's rank, world size and device
    learner: Learner  # model, objective, optimizer, schedule, precision
    folder: RunFolder  # the run folder and its logger
    clock: Clock  # start time, time budget, earlier sessions
    progress: Progress  # counters and best-so-far (saved in ``train_state.pt``)
    session: SessionState = field(default_factory=SessionState)  # this process's unsaved bookkeeping
    show_progress: bool = True  # tqdm bars on (rank 0 only)


def open_run(cfg: Config, info: DistInfo, learner: Learner, run_dir: Path, start: float, show_progress: bool,
             saved: dict[str, Any] | None = None) -> Run:
    """The run that trains ``learner``: a new one, or the one ``saved`` (a ``train_state.pt``) resumes exactly."""
    t = cfg.train
    run = Run(cfg, info, learner, RunFolder(run_dir), Clock(start, t.time_budget),
              Progress(select_metric=t.select_metric), show_progress=show_progress)
    if saved is not None:
        restore_train_state(run, saved)
        run.clock.seconds_before = run.progress.seconds
    elif info.rank > 0:
        seed_everything(t.seed + RANK_SEED_STRIDE * info.rank)
    if info.is_main:
        run.folder.logger = MetricsLogger(run_dir, keep_until_step=run.progress.step if saved is not None else None)
    return run


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
    """Put a :func:`train_state` back into ``run``; ``CheckpointError`` for another model's or not a state."""
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
    metric = progress.get("select_metric")
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


# ----------------------------------------------------------------------------- bookkeeping of a step
MAX_SKIPPED_IN_A_ROW = 50  # train.skip_nonfinite: this many non-finite batches in a row stop the run
HUGE = 1e3  # a pretrained encoder's features stay well below this after pooling


def _encoder_name(enc: EncoderConfig) -> str:
    return enc.name if enc.pretrained else f"{enc.name} with random weights (model.encoder.pretrained=false)"


def first_loss_cause(inputs: torch.Tensor | None, encoder: EncoderConfig, autocast: torch.dtype | None) -> str:
    """The likely cause of a non-finite first loss, naming the largest input value and what to change."""
    fp16 = "; train.amp=fp16 overflows beyond 65504, try train.amp=bf16" if autocast == torch.float16 else ""
    if inputs is None or inputs.numel() == 0:
        return f"check the input data and the encoder {_encoder_name(encoder)}{fp16}"
    top = float(inputs.detach().abs().amax())
    if inputs.dim() != 3:  # images: the features are made inside the model
        if not math.isfinite(top):
            return f"the batch's input images hold {top} values"
        return (f"the input images are finite, so the encoder {_encoder_name(encoder)} may produce huge "
                f"activations, or the decoder's initialisation is at fault{fp16}")
    if not math.isfinite(top):
        return (f"the batch's input features hold {top} values: delete the feature cache (in "
                f"data.feature_cache_dir, $CAPTIONER_FEATURE_CACHE or the run's features/) so that it is rebuilt and checked")
    if top > HUGE:
        return (f"the batch's input features reach {top:.3g}, far beyond a pretrained encoder's: the encoder "
                f"{_encoder_name(encoder)} produces huge activations that overflow the decoder{fp16}")
    return (f"the batch's input features are finite (largest |value| {top:.3g}), so look at the decoder's "
            f"initialisation and the model config{fp16}")


def name_list(keys: list[str]) -> str:
    """``"a"``, or ``"a and 2 more"``: tensor names in a one-line error."""
    return keys[0] + (f" and {len(keys) - 1} more" if len(keys) > 1 else "")


def nonfinite_error(run: Run, value: float, epoch: int, step: int | None = None,
                    inputs: torch.Tensor | None = None) -> CaptionerError:
    """The one-line error for a non-finite loss ``value`` (at step 1 with its likely cause)."""
    step = run.progress.step if step is None else step
    last_good = run.folder.last_good()
    if step == 1:  # before any weight update: the inputs or the model as built, never the lr
        return CaptionerError(f"non-finite loss ({value}) at the first step (epoch {epoch + 1} step 1), before any "
                              f"weight update, so neither the learning rate nor skipping batches can help: "
                              f"{first_loss_cause(inputs, run.cfg.model.encoder, run.learner.precision.dtype)}; "
                              f"{last_good}")
    bad_grad_step = run.session.bad_grad_step
    note = "" if bad_grad_step is None else f"; the gradient norm was non-finite at step {bad_grad_step}"
    return CaptionerError(f"non-finite loss ({value}) at epoch {epoch + 1} step {step}; "
                          f"{last_good} (set train.skip_nonfinite=true to skip such batches{note})")


def skip_batch(run: Run, epoch: int, why: str, objective_state: dict[str, torch.Tensor] | None) -> None:
    """``train.skip_nonfinite``: count and report a skipped batch, and stop when skipping cannot help."""
    prog, session = run.progress, run.session
    prog.skipped += 1
    session.skipped_in_a_row += 1
    if objective_state is not None:
        run.learner.objective.load_state_dict(objective_state)  # e.g. a REINFORCE baseline updated from this batch
    if run.info.is_main:
        log.warning("skipping batch at step %d: %s", prog.step, why)
    bad = nonfinite_tensors(run.learner.model)
    if bad:
        raise CaptionerError(f"non-finite weights ({name_list(bad)}) at epoch {epoch + 1} step {prog.step}: "
                             f"skipping batches cannot help; {run.folder.last_good()}")
    if session.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
        raise CaptionerError(f"{session.skipped_in_a_row} batches in a row were non-finite (last at epoch "
                             f"{epoch + 1} step {prog.step}); stopping; {run.folder.last_good()}")


def add_means(run: Run, means: dict[str, float], captions: float) -> None:
    """Add a reading to the epoch and log-window meters; warn once when a regulariser outweighs the CE."""
    if not captions:
        return
    run.progress.epoch_meter.add(means, captions)
    run.progress.window_meter.add(means, captions)
    ce = means.get("ce", math.nan)
    heavy = {name: value for name, value in weighted_terms(means).items() if value > ce}
    if heavy and not run.session.warned_regulariser and run.info.is_main:
        run.session.warned_regulariser = True
        name, value = max(heavy.items(), key=lambda kv: kv[1])
        hint = {"doubly_stochastic": "lower train.alpha_c or use train.ds_form=excess",
                "entropy": "lower train.entropy_weight",
                "grounding": "lower train.attention_supervision"}.get(name, "lower its weight")
        log.warning("the weighted %s term (%.3g) outweighs the cross-entropy (%.3g) at step %d: it, not the "
                    "captions, now drives the attention (%s)", name.replace("_", " "), value, ce,
                    run.progress.step, hint)


def read_stats(run: Run, epoch: int, inputs: torch.Tensor | None = None) -> None:
    """Bring the device-side loss statistics to the meters; stop on a non-finite loss among them."""
    session = run.session
    reading = session.stats.read()
    if reading.bad_grad_step is not None and session.bad_grad_step is None:
        session.bad_grad_step = reading.bad_grad_step
        if run.info.is_main:
            log.warning("non-finite gradient norm at step %d (set train.skip_nonfinite=true to skip such batches)",
                        reading.bad_grad_step)
    if reading.bad_loss is not None:
        step, value = reading.bad_loss
        raise nonfinite_error(run, value, epoch, step, inputs if step == 1 else None)
    add_means(run, reading.means, reading.captions)


def skip_empty(run: Run, time_up: bool) -> tuple[bool, float]:
    """A batch of which no image could be read (``data.skip_missing``): nothing is trained."""
    if run.info.is_main:
        log.warning("skipping batch at step %d: none of its images could be read", run.progress.step)
    return time_up, 0.0


def image_error(run: Run, exc: ImageLoadError, where: str) -> ImageLoadError:
    """One line naming the unreadable file (a DataLoader worker wraps the message in its traceback)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    message = lines[-1] if lines else "unreadable image"
    if len(lines) > 1:  # "...ImageLoadError: <path>: <reason>", the last line of the worker's traceback
        message = re.sub(r"^[\w.]*(Error|Exception): ", "", message)
    return ImageLoadError(f"{message} (found {where}; pass --skip-missing to train without unreadable images; "
                          f"{run.folder.last_good()})")


class EpochLog:
    """The bookkeeping around one epoch's batches: progress bar, step counters, metric rows, loss statistics.

    Use as ``with EpochLog(run, loader, epoch) as batches: for batch in batches: ...``; an unreadable
    image becomes one line naming it.
    """

    def __init__(self, run: Run, loader: Any, epoch: int) -> None:
        self.run, self.epoch = run, epoch
        prog = run.progress
        self.bar = tqdm(loader, desc=f"epoch {epoch + 1}/{run.cfg.train.epochs}", unit="batch", leave=False,
                        initial=prog.batch_in_epoch, total=prog.batch_in_epoch + len(loader),
                        disable=True if not (run.show_progress and run.info.is_main) else None)
        self.remaining = len(loader)  # batches of the loader not yet taken
        self.window_start, self.window_captions = time.monotonic(), 0.0

    def __enter__(self) -> "EpochLog":
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: Any) -> None:
        self.bar.close()
        if kind is None:
            read_stats(self.run, self.epoch)

    def __iter__(self) -> Iterator[Any]:
        prog = self.run.progress
        try:
            for batch in self.bar:
                self.remaining -= 1
                prog.step += 1
                prog.batch_in_epoch += 1
                yield batch
        except ImageLoadError as exc:
            raise image_error(self.run, exc, f"in the training data at epoch {self.epoch + 1} "
                                             f"step {prog.step + 1}") from None

    def trained(self, captions: float) -> None:
        """A step trained ``captions`` captions; every ``train.log_every`` steps, write a step row."""
        run, prog = self.run, self.run.progress
        self.window_captions += captions
        if prog.step % run.cfg.train.log_every:
            return
        read_stats(run, self.epoch)
        speed = self.window_captions / max(time.monotonic() - self.window_start, 1e-9)
        means = prog.window_meter.means()
        if run.folder.logger is not None:
            run.folder.logger.write("step", {"epoch": self.epoch + 1, "step": prog.step, **means, **term_shares(means),
                                             "lr": run.session.last_lr, "captions_per_s": speed,
                                             "seconds": run.clock.elapsed()})
        loss = means.get("loss")
        self.bar.set_postfix(loss="-" if loss is None else f"{loss:.3f}", cap_s=f"{speed:.0f}", refresh=False)
        prog.window_meter = type(prog.window_meter)()
        self.window_start, self.window_captions = time.monotonic(), 0.0
