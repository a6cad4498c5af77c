"""Optimizer (decoder + fine-tuned encoder parameter groups), their LR schedules and mixed precision."""

from __future__ import annotations

import contextlib
import logging
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from captioner.config import TrainConfig
from captioner.errors import ConfigError
from captioner.models.captioner import CaptionModel
from captioner.training.schedules import GroupSchedule, build_scheduler, decoder_peak_lr

log = logging.getLogger(__name__)


def build_optimizer(model: CaptionModel, cfg: TrainConfig, train_encoder: bool) -> torch.optim.Optimizer:
    """Adam/AdamW over the decoder (``cfg.lr``) and the trainable encoder stages (``cfg.encoder_lr``).

    The group lrs are those peaks; :func:`build_schedule` then sets each group's lr per step.

    Args:
        model: the captioner.
        cfg: training options (optimizer, lr, encoder_lr, betas, weight_decay).
        train_encoder: add a parameter group for the encoder's trainable parameters.
    """
    groups = [{"params": [p for p in model.decoder.parameters() if p.requires_grad], "lr": cfg.lr, "name": "decoder"}]
    if train_encoder:
        enc = [p for p in model.encoder.parameters() if p.requires_grad]
        if enc:
            groups.append({"params": enc, "lr": cfg.encoder_lr, "name": "encoder"})
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return cls(groups, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)


def schedule_width(model: CaptionModel) -> int:
    """The ``d_model`` of an old Noam-scale ``train.lr``: the decoder family's width (d_model, LSTM hidden_dim)."""
    return model.config.decoder.width


def build_schedule(optimizer: torch.optim.Optimizer, model: CaptionModel, cfg: TrainConfig,
                   total_steps: int | None = None) -> GroupSchedule:
    """One schedule per parameter group (see :mod:`captioner.training.schedules`).

    The decoder group peaks at ``cfg.lr`` with ``cfg.schedule``; the fine-tuned encoder group at
    ``cfg.encoder_lr`` with ``cfg.encoder_schedule``. A legacy Noam-scale ``cfg.lr`` (>= 0.1 under
    ``warmup``) is turned into its peak, with a warning. ``total_steps`` (the steps ``cfg.epochs``
    plans) is what the ``cosine`` shape anneals over.
    """
    peak = decoder_peak_lr(cfg.lr, cfg.schedule, schedule_width(model), cfg.warmup_steps)
    return build_scheduler(optimizer, {"decoder": (peak, cfg.schedule),
                                       "encoder": (cfg.encoder_lr, cfg.encoder_schedule)}, cfg.warmup_steps,
                           total_steps)


@dataclass
class Precision:
    """How one run takes its optimizer steps: mixed precision and non-finite gradients.

    Attributes:
        dtype: autocast dtype, or None for full fp32.
        device_type: ``"cuda"`` or ``"cpu"``.
        scaler: a ``GradScaler`` (fp16 only), else None.
        skip_nonfinite: without a scaler, skip (do not take) an optimizer step whose gradient norm
            is NaN/inf (``train.skip_nonfinite``); a scaler already skips such steps itself.
    """

    dtype: torch.dtype | None
    device_type: str
    scaler: torch.amp.GradScaler | None
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

    ``auto`` means bf16 on a GPU that supports it, else fp16 with a ``GradScaler``; on CPU ``auto``
    and ``off`` run fp32, ``bf16`` runs CPU autocast, and ``fp16`` is refused. ``skip_nonfinite``
    is ``train.skip_nonfinite`` (see :class:`Precision`).
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

    Attributes:
        stepped: the optimizer took the step (the schedule should advance).
        grad_norm: total gradient norm before clipping, or None when it was not computed (no
            clipping and no ``skip_nonfinite``).
        skipped_nonfinite: the gradient norm was NaN/inf and ``precision.skip_nonfinite`` skipped
            the step (gradients cleared, optimizer and its state untouched).
    """

    stepped: bool
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


def clip_and_step(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    grad_clip: float,
    precision: Precision,
    backward: bool = True,
) -> StepResult:
    """Backward, optional clipping and an optimizer step (through the ``GradScaler`` for fp16).

    With ``precision.skip_nonfinite`` (and no scaler) a step whose gradient norm is NaN/inf is not
    taken: the gradients are cleared and neither the parameters nor the optimizer state change,
    so the caller must not advance the schedule either. Without it such a step is taken as is
    (the next loss is then non-finite and stops training there).

    ``backward=False``: the gradients are already in place (``train.cuda_graph`` replayed the backward).

    Returns:
        A :class:`StepResult`, falsy when the optimizer did not step (a ``GradScaler`` also skips
        steps with inf/nan gradients, lowering its scale).
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
