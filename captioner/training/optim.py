"""Optimizer (decoder + fine-tuned encoder parameter groups), LR schedule and mixed precision."""

from __future__ import annotations

import contextlib
import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from captioner.config import TrainConfig
from captioner.errors import ConfigError
from captioner.models.captioner import Captioner

log = logging.getLogger(__name__)


def build_optimizer(model: Captioner, cfg: TrainConfig, train_encoder: bool) -> torch.optim.Optimizer:
    """Adam/AdamW over the decoder (``cfg.lr``) and the trainable encoder stages (``cfg.encoder_lr``).

    Args:
        model: the captioner.
        cfg: training options (optimizer, lr, encoder_lr, weight_decay).
        train_encoder: add a parameter group for the encoder's trainable parameters.
    """
    groups = [{"params": [p for p in model.decoder.parameters() if p.requires_grad], "lr": cfg.lr, "name": "decoder"}]
    if train_encoder:
        enc = [p for p in model.encoder.parameters() if p.requires_grad]
        if enc:
            groups.append({"params": enc, "lr": cfg.encoder_lr, "name": "encoder"})
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return cls(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)


def schedule_width(model: Captioner) -> int:
    """The ``d_model`` the warm-up schedule scales by: Transformer width, else the LSTM width."""
    dec = model.config.decoder
    return dec.d_model if dec.name == "transformer" else dec.hidden_dim


@dataclass
class Precision:
    """Mixed-precision settings for one run.

    Attributes:
        dtype: autocast dtype, or None for full fp32.
        device_type: ``"cuda"`` or ``"cpu"``.
        scaler: a ``GradScaler`` (fp16 only), else None.
    """

    dtype: torch.dtype | None
    device_type: str
    scaler: torch.amp.GradScaler | None

    def autocast(self) -> AbstractContextManager:
        """Context for forward passes: autocast when enabled, else a no-op."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    @property
    def name(self) -> str:
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]


def setup_precision(amp: str, device: torch.device) -> Precision:
    """Pick autocast for ``TrainConfig.amp``.

    ``auto`` means bf16 on a GPU that supports it, else fp16 with a ``GradScaler``; on CPU ``auto``
    and ``off`` run fp32, ``bf16`` runs CPU autocast, and ``fp16`` is refused.
    """
    if device.type == "cuda":
        if amp == "off":
            return Precision(None, "cuda", None)
        if amp == "bf16" or (amp == "auto" and torch.cuda.is_bf16_supported()):
            return Precision(torch.bfloat16, "cuda", None)
        return Precision(torch.float16, "cuda", torch.amp.GradScaler("cuda"))
    if amp == "bf16":
        return Precision(torch.bfloat16, device.type, None)
    if amp == "fp16":
        raise ConfigError(f"train.amp=fp16 needs a CUDA device (training on {device}); use bf16 or off")
    return Precision(None, device.type, None)


def clip_and_step(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    grad_clip: float,
    precision: Precision,
) -> bool:
    """Backward, optional clipping and an optimizer step (through the ``GradScaler`` for fp16).

    Returns:
        True when the optimizer stepped (a ``GradScaler`` skips steps with inf/nan gradients).
    """
    scaler = precision.scaler
    if scaler is None:
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer.step()
        return True
    scaler.scale(loss).backward()
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return scaler.get_scale() >= scale
