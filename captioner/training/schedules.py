"""Learning-rate schedules: one per parameter group, stepped once per optimizer step.

Every group has a real peak learning rate and a shape (s = optimizer step, counted from 1)::

    constant   lr(s) = peak
    warmup     lr(s) = peak * min(s / w, sqrt(w / s))        w = train.warmup_steps
    cosine     lr(s) = peak * min(s / w, 1) * (f + (1 - f) * (1 + cos(pi * p)) / 2)
                       p = (s - w) / (S - w) clipped to [0, 1], S = the run's total steps, f = COSINE_FLOOR

``cosine`` (Loshchilov & Hutter 2017, one cycle, no restarts) anneals over the steps that
``train.epochs`` plans, so a run ends annealed after the same number of steps on any machine: the
recipes' alternative to ``train.budget_decay``, whose wall-clock annealing depends on the machine's
speed. Its warm-up is linear over w steps (w = 1: none).

``warmup`` is the Transformer schedule of Vaswani et al. 2017 (linear warm-up, then 1/sqrt(s)
decay) normalised so that it reaches ``peak`` at s = w: at s = 1 it is peak / w, at s = 10 w it
is peak / sqrt(10). The decoder group's peak is ``train.lr`` with ``train.schedule``; the
fine-tuned encoder group's peak is ``train.encoder_lr`` with ``train.encoder_schedule`` (constant
by default), so a warm-up never scales the encoder.

On top of the shapes, :meth:`GroupSchedule.decay` multiplies every group by a factor (the
epoch-level plateau and step decays of ``train.decay_*``); the accumulated factor is part of the
saved state, so a resumed run continues with the same learning rates.

Old configs: the Transformer presets used to set ``lr = 1.0`` with the unnormalised Noam formula
``lr * d_model**-0.5 * min(s**-0.5, s * w**-1.5)``, i.e. a peak of ``lr * (d_model * w)**-0.5``.
No Adam peak is 0.1 or more, so under ``warmup`` a ``train.lr >= LEGACY_NOAM_MIN_LR`` is read as
that old scale factor (with a warning giving the peak it means): such configs and runs keep the
decoder curve they had. Only the decoder group ever had that meaning.

The state dict holds numbers and strings only (safe with ``weights_only=True``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from captioner.config.schema import SCHEDULES
from captioner.errors import ConfigError

log = logging.getLogger(__name__)

COSINE_FLOOR = 0.05  # the cosine shape ends at this fraction of the peak (as train.budget_decay's floor)
LEGACY_NOAM_MIN_LR = 0.1  # under "warmup", train.lr >= this is the old Noam scale factor, not a peak


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
    """The multiplier of a group's peak lr at optimizer step ``step`` for schedule ``name``.

    ``total_steps`` (the steps the run plans) is needed by ``cosine`` only.
    """
    if name == "constant":
        return 1.0
    if name == "warmup":
        return warmup_shape(step, warmup_steps)
    if name == "cosine":
        if total_steps is None or total_steps < 1:
            raise ConfigError("the cosine schedule needs the run's total number of steps")
        return cosine_shape(step, warmup_steps, total_steps)
    raise ConfigError(f"schedule={name!r} is not one of {', '.join(SCHEDULES)}")


def decoder_peak_lr(lr: float, schedule: str, d_model: int, warmup_steps: int) -> float:
    """The decoder's peak lr: ``lr`` itself, or for an old Noam config its peak (see module docstring)."""
    if schedule == "warmup" and lr >= LEGACY_NOAM_MIN_LR:
        peak = lr * (d_model * warmup_steps) ** -0.5
        log.warning("train.lr=%g with schedule=warmup is read as the old Noam scale factor: peak lr %.3g at "
                    "step %d (%g * (%d * %d)^-0.5); train.lr is now the peak itself, so set train.lr=%.3g to say "
                    "this directly", lr, peak, warmup_steps, lr, d_model, warmup_steps, peak)
        return peak
    return lr


class GroupSchedule(LRScheduler):
    """A peak lr and a shape per parameter group, times a shared decay factor.

    ``lr_g(s) = peaks[g] * shape_factor(shapes[g], s, warmup_steps) * decay_factor``.

    Args:
        optimizer: its groups, in order, match ``peaks`` and ``shapes``.
        peaks: peak learning rate of each group.
        shapes: ``"constant"``, ``"warmup"`` or ``"cosine"`` for each group.
        warmup_steps: w of the ``warmup`` and ``cosine`` shapes.
        total_steps: the steps the run plans (``cosine`` anneals over them); None without ``cosine``.
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
        """Restore the step count and decay; peaks and shapes come from the config of this run.

        Also reads the ``LambdaLR`` state of older runs (no decay). The optimizer's lrs are set
        for the next step, so a resumed run continues exactly.
        """
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict.get("_step_count", self.last_epoch + 1))
        self.decay_factor = float(state_dict.get("decay_factor", 1.0))
        self._apply()


def build_scheduler(optimizer: Optimizer, schedules: dict[str, tuple[float, str]], warmup_steps: int,
                    total_steps: int | None = None) -> GroupSchedule:
    """A :class:`GroupSchedule` for an optimizer whose groups carry a ``"name"``.

    Args:
        optimizer: built by ``captioner.training.optim.build_optimizer`` (groups "decoder",
            "encoder").
        schedules: ``{group name: (peak lr, shape)}``.
        warmup_steps: w of the ``warmup`` and ``cosine`` shapes.
        total_steps: the steps the run plans (``cosine`` only).
    """
    peaks, shapes = [], []
    for group in optimizer.param_groups:
        name = group.get("name", "")
        if name not in schedules:
            raise ConfigError(f"no schedule for the parameter group {name!r} (known: {', '.join(schedules)})")
        peak, shape = schedules[name]
        peaks.append(peak)
        shapes.append(shape)
    return GroupSchedule(optimizer, peaks, shapes, warmup_steps, total_steps)
