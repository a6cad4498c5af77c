"""Learning-rate schedules, stepped once per optimizer step.

``warmup`` is the Transformer schedule of Vaswani et al. 2017::

    lr(s) = base_lr * d_model**-0.5 * min(s**-0.5, s * warmup**-1.5),   s = 1, 2, ...

It rises linearly for ``warmup`` steps, peaks at s = warmup with base_lr * (d_model * warmup)**-0.5,
then decays as s**-0.5. ``base_lr`` is the optimizer's lr (1.0 in the Transformer presets).
``s`` counts from 1: the first optimizer step already uses s = 1, so the lr is never 0 or inf.

Both schedules are ``LambdaLR`` objects with plain-function lambdas, so their ``state_dict`` holds
only numbers (safe to save and load with ``weights_only=True``).
"""

from __future__ import annotations

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from captioner.errors import ConfigError

SCHEDULES = ("constant", "warmup")


def warmup_factor(step: int, d_model: int, warmup_steps: int) -> float:
    """Multiplier of the base lr at optimizer step ``step`` (counted from 1)."""
    step = max(step, 1)
    return d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def warmup_schedule(optimizer: Optimizer, d_model: int, warmup_steps: int) -> LambdaLR:
    """Inverse-square-root schedule with linear warm-up (see module docstring).

    Args:
        optimizer: its lr is base_lr.
        d_model: model width d.
        warmup_steps: steps of linear warm-up (the peak is at this step).

    Returns:
        A ``LambdaLR``; call ``scheduler.step()`` after every ``optimizer.step()``.
    """
    if d_model < 1:
        raise ConfigError(f"d_model must be >= 1, got {d_model}")
    if warmup_steps < 1:
        raise ConfigError(f"warmup_steps must be >= 1, got {warmup_steps}")

    def factor(index: int) -> float:
        # LambdaLR calls this with 0 at construction (the lr of the first optimizer step), 1 after
        # the first scheduler.step(), ...: optimizer step s = index + 1.
        return warmup_factor(index + 1, d_model, warmup_steps)

    return LambdaLR(optimizer, factor)


def constant_schedule(optimizer: Optimizer) -> LambdaLR:
    """Keep the optimizer's lr unchanged (a ``LambdaLR`` so every schedule saves the same way)."""

    def factor(index: int) -> float:
        return 1.0

    return LambdaLR(optimizer, factor)


def build_scheduler(name: str, optimizer: Optimizer, d_model: int, warmup_steps: int) -> LambdaLR:
    """The schedule named by ``TrainConfig.schedule``: ``"constant"`` or ``"warmup"``."""
    if name == "constant":
        return constant_schedule(optimizer)
    if name == "warmup":
        return warmup_schedule(optimizer, d_model, warmup_steps)
    raise ConfigError(f"schedule={name!r} is not one of {', '.join(SCHEDULES)}")
