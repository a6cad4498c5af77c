"""The optimiser: parameter groups, their learning-rate schedules and decays, mixed precision, and the
clipped optimizer step with its non-finite checks.

Every group has a peak learning rate and a shape (s = optimizer step, counted from 1)::

    constant   lr(s) = peak
    warmup     lr(s) = peak * min(s / w, sqrt(w / s))        w = train.warmup_steps
    cosine     lr(s) = peak * min(s / w, 1) * (f + (1 - f) * (1 + cos(pi * p)) / 2)
                       p = (s - w) / (S - w) clipped to [0, 1], S = the run's total steps, f = COSINE_FLOOR

``warmup`` is Vaswani et al. 2017's schedule normalised to reach ``peak`` at s = w; ``cosine`` is
Loshchilov & Hutter 2017 (one cycle). The decoder group uses ``train.lr``/``train.schedule``, the
fine-tuned encoder ``train.encoder_lr``/``train.encoder_schedule``. On top, the epoch-level decays
(``train.decay_*``) multiply every group by a factor saved with the schedule, so a resumed run
continues with the same rates. The state dict holds numbers and strings only.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from captioner.config import TrainConfig
from captioner.config.schema import SCHEDULES
from captioner.errors import ConfigError
from captioner.models.model import CaptionModel

log = logging.getLogger(__name__)


COSINE_FLOOR = 0.05  # the cosine shape ends at this fraction of the peak (as train.budget_decay's floor)


def warmup_shape(step: int, warmup_steps: int) -> float:
    """``min(s / w, sqrt(w / s))`` at optimizer step ``step`` (counted from 1): 1.0 at s = w."""
    step = max(step, 1)
    return min(step / warmup_steps, math.sqrt(warmup_steps / step))


def cosine_shape(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up to 1.0 at step w, then a half cosine down to ``COSINE_FLOOR`` at ``total_steps``."""
    step = max(step, 1)
    if step < warmup_steps:
        return step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return COSINE_FLOOR + (1.0 - COSINE_FLOOR) * 0.5 * (1.0 + math.cos(math.pi * progress))


def shape_factor(name: str, step: int, warmup_steps: int, total_steps: int | None = None) -> float:
    """The multiplier of a group's peak lr at step ``step`` for schedule ``name`` (``total_steps``: cosine only)."""
    if name == "constant":
        return 1.0
    if name == "warmup":
        return warmup_shape(step, warmup_steps)
    if name == "cosine":
        if total_steps is None or total_steps < 1:
            raise ConfigError("the cosine schedule needs the run's total number of steps")
        return cosine_shape(step, warmup_steps, total_steps)
    raise ConfigError(f"schedule={name!r} is not one of {', '.join(SCHEDULES)}")


class GroupSchedule(LRScheduler):
    """A peak lr and a shape per parameter group, times a shared decay factor.

    ``lr_g(s) = peaks[g] * shape_factor(shapes[g], s, warmup_steps) * decay_factor``.
    """

    def __init__(self, optimizer: Optimizer, peaks: Sequence[float], shapes: Sequence[str],
                 warmup_steps: int, total_steps: int | None = None) -> None:
        if len(peaks) != len(optimizer.param_groups) or len(shapes) != len(optimizer.param_groups):
            raise ConfigError(f"{len(optimizer.param_groups)} parameter groups but {len(peaks)} peaks and "
                              f"{len(shapes)} schedules")
        if warmup_steps < 1:
            raise ConfigError(f"warmup_steps must be >= 1, got {warmup_steps}")
        for name in shapes:
            shape_factor(name, 1, warmup_steps, total_steps)  # unknown names (or cosine without a length) fail here
        for peak in peaks:
            if not (isinstance(peak, (int, float)) and math.isfinite(peak) and peak > 0):
                raise ConfigError(f"a peak learning rate must be a number > 0, got {peak!r}")
        self.peaks = [float(p) for p in peaks]
        self.shapes = list(shapes)
        self.warmup_steps = int(warmup_steps)
        self.total_steps = None if total_steps is None else int(total_steps)
        self.decay_factor = 1.0
        super().__init__(optimizer)

    def lr_at(self, step: int) -> list[float]:
        """The lr of every group at optimizer step ``step`` (from 1), with the current decay."""
        return [peak * shape_factor(shape, step, self.warmup_steps, self.total_steps) * self.decay_factor
                for peak, shape in zip(self.peaks, self.shapes)]

    def get_lr(self) -> list[float]:  # LRScheduler: lrs for the next optimizer step
        return self.lr_at(self.last_epoch + 1)

    def _apply(self) -> None:
        values = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, values):
            group["lr"] = lr
        self._last_lr = values

    def decay(self, factor: float) -> None:
        """Multiply every group's lr by ``factor`` from the next optimizer step on."""
        if not (math.isfinite(factor) and factor > 0):
            raise ConfigError(f"a decay factor must be a number > 0, got {factor!r}")
        self.decay_factor *= float(factor)
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count, "decay_factor": self.decay_factor,
                "peaks": list(self.peaks), "shapes": list(self.shapes), "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps or 0, "_last_lr": list(self._last_lr)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the step count and decay (peaks and shapes come from this run's config)."""
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict.get("_step_count", self.last_epoch + 1))
        self.decay_factor = float(state_dict.get("decay_factor", 1.0))
        self._apply()


def build_scheduler(optimizer: Optimizer, schedules: dict[str, tuple[float, str]], warmup_steps: int,
                    total_steps: int | None = None) -> GroupSchedule:
    """A :class:`GroupSchedule` for an optimizer whose groups carry a ``"name"``, ``schedules[name] = (peak, shape)``."""
    peaks, shapes = [], []
    for group in optimizer.param_groups:
        name = group.get("name", "")
        if name not in schedules:
            raise ConfigError(f"no schedule for the parameter group {name!r} (known: {', '.join(schedules)})")
        peak, shape = schedules[name]
        peaks.append(peak)
        shapes.append(shape)
    return GroupSchedule(optimizer, peaks, shapes, warmup_steps, total_steps)


def build_optimizer(model: CaptionModel, cfg: TrainConfig, train_encoder: bool) -> torch.optim.Optimizer:
    """Adam/AdamW over the decoder (``cfg.lr``) and, with ``train_encoder``, the trainable encoder stages."""
    groups = [{"params": [p for p in model.decoder.parameters() if p.requires_grad], "lr": cfg.lr, "name": "decoder"}]
    if train_encoder:
        enc = [p for p in model.encoder.parameters() if p.requires_grad]
        if enc:
            groups.append({"params": enc, "lr": cfg.encoder_lr, "name": "encoder"})
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return cls(groups, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)


def build_schedule(optimizer: torch.optim.Optimizer, model: CaptionModel, cfg: TrainConfig,
                   total_steps: int | None = None) -> GroupSchedule:
    """One schedule per parameter group; ``total_steps`` (what ``cfg.epochs`` plans) is what ``cosine`` anneals over."""
    return build_scheduler(optimizer, {"decoder": (cfg.lr, cfg.schedule),
                                       "encoder": (cfg.encoder_lr, cfg.encoder_schedule)}, cfg.warmup_steps,
                           total_steps)


@dataclass
class Precision:
    """How one run takes its optimizer steps: mixed precision and whether to skip non-finite gradients."""

    dtype: torch.dtype | None  # autocast dtype, or None for full fp32
    device_type: str  # ``"cuda"`` or ``"cpu"``
    scaler: torch.amp.GradScaler | None  # a ``GradScaler`` (fp16 only), else None
    skip_nonfinite: bool = False

    def autocast(self) -> AbstractContextManager:
        """Context for forward passes: autocast when enabled, else a no-op."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    @property
    def name(self) -> str:
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]


def setup_precision(amp: str, device: torch.device, skip_nonfinite: bool = False) -> Precision:
    """Pick autocast for ``TrainConfig.amp``.

    ``auto``: bf16 on a GPU that supports it, else fp16 with a ``GradScaler``; on CPU ``auto`` and
    ``off`` run fp32, ``bf16`` runs CPU autocast, and ``fp16`` is refused.
    """
    if device.type == "cuda":
        if amp == "off":
            return Precision(None, "cuda", None, skip_nonfinite)
        if amp == "bf16" or (amp == "auto" and torch.cuda.is_bf16_supported()):
            return Precision(torch.bfloat16, "cuda", None, skip_nonfinite)
        return Precision(torch.float16, "cuda", torch.amp.GradScaler("cuda"), skip_nonfinite)
    if amp == "bf16":
        return Precision(torch.bfloat16, device.type, None, skip_nonfinite)
    if amp == "fp16":
        raise ConfigError(f"train.amp=fp16 needs a CUDA device (training on {device}); use bf16 or off")
    return Precision(None, device.type, None, skip_nonfinite)


@dataclass
class StepResult:
    """What :func:`clip_and_step` did; truthy when the optimizer stepped.

    ``grad_norm`` is None when not computed; ``skipped_nonfinite``: the step was skipped for a NaN/inf norm.
    """

    stepped: bool  # the optimizer took the step (the schedule should advance)
    grad_norm: float | torch.Tensor | None = None  # a tensor unless skip_nonfinite needed it on the host
    skipped_nonfinite: bool = False

    def __bool__(self) -> bool:
        return self.stepped

    @property
    def nonfinite(self) -> bool:
        """The gradient norm was computed and is NaN/inf."""
        return self.grad_norm is not None and not math.isfinite(float(self.grad_norm))


def _grad_norm(params: list[torch.nn.Parameter], grad_clip: float) -> torch.Tensor | float:
    """Clip to ``grad_clip`` (when > 0) and return the total norm before clipping (a device tensor: no sync)."""
    if grad_clip > 0:
        return torch.nn.utils.clip_grad_norm_(params, grad_clip)
    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else 0.0


def clip_and_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                  grad_clip: float, precision: Precision, backward: bool = True) -> StepResult:
    """Backward, optional clipping and an optimizer step (through the ``GradScaler`` for fp16).

    With ``precision.skip_nonfinite`` a step with a NaN/inf gradient norm is not taken (gradients
    cleared; the caller must not advance the schedule). ``backward=False``: the gradients are in place.
    """
    scaler = precision.scaler
    if scaler is None:
        if backward:
            loss.backward()
        norm = _grad_norm(params, grad_clip) if grad_clip > 0 or precision.skip_nonfinite else None
        if precision.skip_nonfinite and norm is not None:
            norm = float(norm)  # the decision below needs it now
        if precision.skip_nonfinite and norm is not None and not math.isfinite(norm):
            optimizer.zero_grad(set_to_none=True)
            return StepResult(False, norm, skipped_nonfinite=True)
        optimizer.step()
        return StepResult(True, norm)
    scaler.scale(loss).backward()
    norm = None
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return StepResult(scaler.get_scale() >= scale, norm)


def nonfinite_tensors(module: torch.nn.Module) -> list[str]:
    """Names of the floating-point parameters and buffers of ``module`` holding NaN/inf."""
    with torch.no_grad():
        return [name for name, t in module.state_dict().items()
                if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def decay_reasons(cfg: TrainConfig, progress: Any, epoch: int) -> list[str]:
    """Why the lr decays after complete epoch ``epoch``; one entry per x decay_factor.

    Plateau: each ``decay_patience`` more epochs without a better ``select_metric``; step: every
    ``decay_every`` epochs. ``progress``: the run's ``Progress``.
    """
    reasons = []
    bad = progress.bad_epochs
    if cfg.decay_patience and bad and bad % cfg.decay_patience == 0:
        reasons.append(f"plateau: {bad} epoch{'s' if bad > 1 else ''} without a better {progress.select_metric}")
    if cfg.decay_every and (epoch + 1) % cfg.decay_every == 0:
        n = cfg.decay_every
        reasons.append(f"step decay every {n} epoch{'s' if n > 1 else ''}")
    return reasons


def decay_after_epoch(cfg: TrainConfig, progress: Any, scheduler: GroupSchedule, epoch: int,
                      announce: bool = True) -> int:
    """Apply :func:`decay_reasons` to every group; return how many times ``decay_factor`` was applied."""
    reasons = decay_reasons(cfg, progress, epoch)
    for _ in reasons:
        scheduler.decay(cfg.decay_factor)
    if reasons and announce:
        lrs = ", ".join(f"{g.get('name', i)} {g['lr']:.3g}" for i, g in enumerate(scheduler.optimizer.param_groups))
        log.info("learning rate x%g after epoch %d (%s): %s", cfg.decay_factor ** len(reasons), epoch + 1,
                 "; ".join(reasons), lrs)
    return len(reasons)


BUDGET_DECAY_FLOOR = 0.05  # train.budget_decay: the lr factor reached when the time budget runs out


def budget_decay(optimizer: torch.optim.Optimizer, t: TrainConfig, seconds: float) -> None:
    """``train.budget_decay``: scale the lrs just set by ``1 - seconds / train.time_budget`` (floored)."""
    if not t.budget_decay or not t.time_budget:
        return
    factor = max(BUDGET_DECAY_FLOOR, 1.0 - seconds / t.time_budget)
    for group in optimizer.param_groups:
        group["lr"] *= factor
