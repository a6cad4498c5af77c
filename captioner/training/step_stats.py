"""Loss statistics kept on the device between log lines, so a training step never waits for the host.

Every step adds its caption-weighted loss terms to one device tensor and records, still on the
device, the first step whose loss or gradient norm was not finite. ``read()`` (at ``log_every``,
at the end of an epoch and when the time budget runs out) is the one host synchronisation: it
returns the means since the last read and the first non-finite step, which the loop turns into
the same one-line error as a per-step check would (the weights of a failed window are never
saved: the epoch-end save refuses non-finite weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from captioner.losses import LossResult


@dataclass
class StatsReading:
    """What ``DeviceStats.read`` returns.

    Attributes:
        means: caption-weighted means of ``loss`` (the objective) and every loss term.
        captions: captions added since the last read.
        bad_loss: ``(step, value)`` of the first non-finite loss, or None.
        bad_grad_step: the first step whose gradient norm was not finite, or None.
    """

    means: dict[str, float]
    captions: float
    bad_loss: tuple[int, float] | None
    bad_grad_step: int | None


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


def weighted_terms(means: dict[str, float]) -> dict[str, float]:
    """The regularisers as they enter the objective: ``{name: |weighted_<name>|}``."""
    return {k[len("weighted_"):]: abs(v) for k, v in means.items() if k.startswith("weighted_")}


def term_shares(means: dict[str, float]) -> dict[str, float]:
    """Each term's share of the positive loss mass: ``ce`` and every ``weighted_<name>`` regulariser.

    Returns ``{"share_ce": ..., "share_<name>": ...}`` (empty without a finite ``ce``).
    """
    ce = means.get("ce")
    if ce is None or not math.isfinite(ce):
        return {}
    weighted = weighted_terms(means)
    whole = ce + sum(weighted.values())
    if whole <= 0:
        return {}
    return {"share_ce": ce / whole, **{f"share_{k}": v / whole for k, v in weighted.items()}}
