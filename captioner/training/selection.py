"""Model selection and learning-rate decay between epochs: which validation metric decides, when to decay.

``train.select_metric`` (CIDEr-D by default, or BLEU-4) decides ``best.safetensors``, early stopping
(``train.patience``) and the plateau decay (``train.decay_patience``). A run keeps the metric it
started with: resuming with another one would compare scores of different metrics, and
``best.safetensors`` was chosen on the first. States saved before the metric was configurable
selected on BLEU-4.
"""

from __future__ import annotations

import logging
from typing import Any

from captioner.config import SELECT_METRICS, Config, TrainConfig
from captioner.training.schedules import GroupSchedule
from captioner.training.state import Progress

log = logging.getLogger(__name__)


def saved_select_metric(saved: dict[str, Any]) -> str | None:
    """The selection metric of a saved ``train_state.pt`` (None when it cannot be told)."""
    progress = saved.get("progress")
    if not isinstance(progress, dict):
        return None
    metric = progress.get("select_metric") if "best_score" in progress else "BLEU-4"
    return metric if metric in SELECT_METRICS else None


def decay_reasons(cfg: TrainConfig, progress: Progress, epoch: int) -> list[str]:
    """Why the learning rate decays after complete epoch ``epoch`` (0-based); one entry per x decay_factor.

    Plateau: each time ``decay_patience`` more epochs pass without a better ``select_metric``
    (after 3, 6, ... bad epochs for a patience of 3). Step: after every ``decay_every`` epochs.
    """
    reasons = []
    bad = progress.bad_epochs
    if cfg.decay_patience and bad and bad % cfg.decay_patience == 0:
        reasons.append(f"plateau: {bad} epoch{'s' if bad > 1 else ''} without a better {progress.select_metric}")
    if cfg.decay_every and (epoch + 1) % cfg.decay_every == 0:
        n = cfg.decay_every
        reasons.append(f"step decay every {n} epoch{'s' if n > 1 else ''}")
    return reasons


def decay_after_epoch(cfg: TrainConfig, progress: Progress, scheduler: GroupSchedule, epoch: int,
                      announce: bool = True) -> int:
    """Apply :func:`decay_reasons` to every parameter group after complete epoch ``epoch``.

    The accumulated factor is saved with the schedule, so a resumed run keeps the decayed lrs.

    Returns:
        How many times ``decay_factor`` was applied (0, 1 or 2).
    """
    reasons = decay_reasons(cfg, progress, epoch)
    for _ in reasons:
        scheduler.decay(cfg.decay_factor)
    if reasons and announce:
        lrs = ", ".join(f"{g.get('name', i)} {g['lr']:.3g}" for i, g in enumerate(scheduler.optimizer.param_groups))
        log.info("learning rate x%g after epoch %d (%s): %s", cfg.decay_factor ** len(reasons), epoch + 1,
                 "; ".join(reasons), lrs)
    return len(reasons)


def keep_select_metric(cfg: Config, saved: dict[str, Any], announce: bool = True) -> Config:
    """``cfg`` with the selection metric of the saved run it resumes (a warning when that differs)."""
    metric = saved_select_metric(saved)
    if metric is None or metric == cfg.train.select_metric:
        return cfg
    if announce:
        log.warning("this run selects its best checkpoint on %s (since it started); a resume keeps that, not "
                    "train.select_metric=%s (train into a new --out to select on it)", metric, cfg.train.select_metric)
    return cfg.override(**{"train.select_metric": metric})
