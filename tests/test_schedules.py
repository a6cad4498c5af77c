"""Learning-rate schedules: known values of the warm-up schedule, dispatch, save/resume."""

from __future__ import annotations

import math

import pytest
import torch

from captioner.errors import ConfigError
from captioner.schedules import build_scheduler, constant_schedule, warmup_schedule


def optimizer(lr: float = 2.0) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def lrs_used(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[float]:
    """The lr each of the first ``steps`` optimizer steps runs with."""
    out = []
    for _ in range(steps):
        out.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def test_warmup_known_values() -> None:
    base, d, w = 2.0, 16, 10
    lrs = lrs_used(warmup_schedule(optimizer(base), d, w), 40)
    # first optimizer step uses s = 1: base * d^-0.5 * 1 * w^-1.5 (never 0)
    assert lrs[0] == pytest.approx(base * d**-0.5 * w**-1.5)
    peak = max(range(40), key=lambda i: lrs[i])
    assert peak + 1 == w  # the peak is at step s = warmup
    assert lrs[peak] == pytest.approx(base * d**-0.5 * w**-0.5)
    assert lrs[4] == pytest.approx(base * d**-0.5 * 5 * w**-1.5)  # linear warm-up
    assert lrs[39] == pytest.approx(base * d**-0.5 * 40**-0.5)  # inverse square-root decay
    assert all(a < b for a, b in zip(lrs[: w - 1], lrs[1:w]))
    assert all(a > b for a, b in zip(lrs[w - 1 : -1], lrs[w:]))
    assert all(math.isfinite(x) and x > 0 for x in lrs)


def test_transformer_preset_peak() -> None:
    # lr=1.0, d=512, warmup=4000 (the paper): peak ~ 7.0e-4
    lrs = lrs_used(warmup_schedule(optimizer(1.0), 512, 4000), 4001)
    assert lrs[3999] == pytest.approx(512**-0.5 * 4000**-0.5)
    assert lrs[3999] == max(lrs)


def test_warmup_resume_from_state_dict() -> None:
    sched = warmup_schedule(optimizer(), 16, 10)
    lrs_used(sched, 7)
    state = sched.state_dict()
    assert all(fn is None for fn in state["lr_lambdas"])  # plain functions: numbers only
    resumed = warmup_schedule(optimizer(), 16, 10)
    resumed.load_state_dict(state)
    resumed.optimizer.param_groups[0]["lr"] = resumed.get_last_lr()[0]
    assert lrs_used(resumed, 5) == pytest.approx(lrs_used(sched, 5))


def test_constant_and_dispatch() -> None:
    assert lrs_used(constant_schedule(optimizer(0.3)), 5) == pytest.approx([0.3] * 5)
    assert lrs_used(build_scheduler("constant", optimizer(0.3), 16, 10), 3) == pytest.approx([0.3] * 3)
    assert lrs_used(build_scheduler("warmup", optimizer(2.0), 16, 10), 2) == pytest.approx(
        lrs_used(warmup_schedule(optimizer(2.0), 16, 10), 2))
    with pytest.raises(ConfigError, match="'cosine'"):
        build_scheduler("cosine", optimizer(), 16, 10)
    with pytest.raises(ConfigError, match="warmup_steps"):
        warmup_schedule(optimizer(), 16, 0)
