"""Learning-rate schedules: one per parameter group, real peak lrs, decay, resume."""

from __future__ import annotations

import math

import pytest
import torch

from captioner.config import TrainConfig, get_preset
from captioner.errors import ConfigError
from captioner.training.optim import COSINE_FLOOR, GroupSchedule, build_scheduler, warmup_shape


def noam_factor(step: int, d_model: int, warmup_steps: int) -> float:
    """The reference: the unnormalised Vaswani et al. multiplier ``d**-0.5 * min(s**-0.5, s * w**-1.5)``.

    Equal to ``(d_model * warmup_steps) ** -0.5 * warmup_shape(step, warmup_steps)``.
    """
    step = max(step, 1)
    return d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def two_groups(decoder_lr: float = 1.0, encoder_lr: float = 1.0) -> torch.optim.Optimizer:
    """An optimizer shaped like ``build_optimizer``'s: a "decoder" and an "encoder" group."""
    return torch.optim.Adam([
        {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": decoder_lr, "name": "decoder"},
        {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": encoder_lr, "name": "encoder"},
    ])


def lrs_used(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[list[float]]:
    """The lr of every group at each of the next ``steps`` optimizer steps."""
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in scheduler.optimizer.param_groups])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def test_warmup_shape_reaches_one_at_warmup_and_is_normalised_noam() -> None:
    w = 10
    assert warmup_shape(1, w) == pytest.approx(1 / w)
    assert warmup_shape(w, w) == pytest.approx(1.0)
    assert warmup_shape(10 * w, w) == pytest.approx(10**-0.5)
    for s in (1, 3, w, 17, 400):  # the Noam curve divided by its peak (d * w)^-0.5
        assert warmup_shape(s, w) == pytest.approx(noam_factor(s, 512, w) * (512 * w) ** 0.5)


@pytest.mark.parametrize("encoder_schedule", ["constant", "warmup"])
def test_each_group_follows_its_own_schedule(encoder_schedule: str) -> None:
    """The decoder warms up to train.lr; the encoder keeps its own encoder_lr (or its own warm-up to it).

    Checked at optimizer steps s = 1 (the first step, "step 0" of the scheduler), s = w and s = 10 w.
    """
    from captioner.training.optim import build_schedule

    w, lr, enc_lr = 20, 4.4e-4, 1e-4
    cfg = TrainConfig(lr=lr, encoder_lr=enc_lr, schedule="warmup", warmup_steps=w, encoder_schedule=encoder_schedule)
    model = type("M", (), {"config": get_preset("transformer_tiny").model})()  # the schedule reads only config
    sched = build_schedule(two_groups(lr, enc_lr), model, cfg)
    lrs = lrs_used(sched, 10 * w)
    expected_enc = (lambda s: enc_lr * min(s / w, (w / s) ** 0.5)) if encoder_schedule == "warmup" else (lambda s: enc_lr)
    for s in (1, w, 10 * w):
        decoder, encoder = lrs[s - 1]
        assert decoder == pytest.approx(lr * min(s / w, (w / s) ** 0.5), rel=1e-9), s
        assert encoder == pytest.approx(expected_enc(s), rel=1e-9), s
    assert lrs[0][0] == pytest.approx(lr / w) and lrs[w - 1][0] == pytest.approx(lr)  # peak = train.lr, at w
    assert max(row[0] for row in lrs) == pytest.approx(lr)
    assert lrs[10 * w - 1][0] == pytest.approx(lr / math.sqrt(10))
    if encoder_schedule == "constant":  # the old bug: the warm-up lambda scaled the encoder down to ~1e-7
        assert {row[1] for row in lrs} == {enc_lr}


def test_constant_schedule_and_group_lookup_by_name() -> None:
    sched = build_scheduler(two_groups(), {"decoder": (3e-4, "constant"), "encoder": (1e-5, "constant")}, 10)
    assert lrs_used(sched, 3) == [[3e-4, 1e-5]] * 3
    with pytest.raises(ConfigError, match="'encoder'"):
        build_scheduler(two_groups(), {"decoder": (3e-4, "constant")}, 10)
    with pytest.raises(ConfigError, match="'triangle'"):
        GroupSchedule(two_groups(), [1e-4, 1e-4], ["warmup", "triangle"], 10)
    with pytest.raises(ConfigError, match="total number of steps"):
        GroupSchedule(two_groups(), [1e-4, 1e-4], ["cosine", "constant"], 10)
    with pytest.raises(ConfigError, match="warmup_steps"):
        GroupSchedule(two_groups(), [1e-4, 1e-4], ["warmup", "warmup"], 0)


def test_cosine_warms_up_then_anneals_to_the_floor_at_the_planned_last_step() -> None:
    peak, w, total = 1e-3, 10, 110
    sched = GroupSchedule(two_groups(), [peak, 1e-4], ["cosine", "constant"], w, total_steps=total)
    lrs = [row[0] for row in lrs_used(sched, total + 5)]
    assert lrs[0] == pytest.approx(peak / w) and lrs[w - 1] == pytest.approx(peak)  # linear warm-up to the peak
    assert lrs[w - 1 + (total - w) // 2] == pytest.approx(peak * (COSINE_FLOOR + (1 - COSINE_FLOOR) / 2))  # halfway
    assert lrs[total - 1] == pytest.approx(peak * COSINE_FLOOR)  # the floor at the last planned step ...
    assert lrs[-1] == pytest.approx(peak * COSINE_FLOOR)  # ... and after it (a resumed run with more epochs)
    assert all(a >= b for a, b in zip(lrs[w - 1:], lrs[w:]))  # never rises after the warm-up
    resumed = GroupSchedule(two_groups(), [peak, 1e-4], ["cosine", "constant"], w, total_steps=total)
    resumed.load_state_dict(sched.state_dict())
    assert resumed.total_steps == total


def test_transformer_preset_recipe() -> None:
    t = get_preset("transformer").train
    assert (t.batch_size, t.warmup_steps, t.betas, t.schedule) == (50, 10000, (0.9, 0.98), "warmup")
    assert t.lr == pytest.approx((512 * 10000) ** -0.5, rel=1e-2)  # 4.4e-4: the Noam peak at scale 1
    assert t.encoder_schedule == "constant"
    sat = get_preset("sat_soft").train
    assert (sat.lr, sat.schedule, sat.decay_patience, sat.decay_factor) == (4e-4, "constant", 3, 0.8)


def test_decay_multiplies_every_group_and_survives_resume() -> None:
    sched = GroupSchedule(two_groups(), [1e-3, 1e-4], ["warmup", "constant"], 10)
    lrs_used(sched, 15)
    before = [g["lr"] for g in sched.optimizer.param_groups]
    sched.decay(0.8)
    assert [g["lr"] for g in sched.optimizer.param_groups] == pytest.approx([0.8 * x for x in before])
    sched.decay(0.5)
    state = sched.state_dict()
    assert state["decay_factor"] == pytest.approx(0.4) and state["last_epoch"] == 15
    assert all(isinstance(v, (int, float, str, list)) for v in state.values())  # weights_only-safe

    resumed = GroupSchedule(two_groups(), [1e-3, 1e-4], ["warmup", "constant"], 10)
    resumed.load_state_dict(state)
    assert lrs_used(resumed, 5) == lrs_used(sched, 5)  # exactly
    with pytest.raises(ConfigError, match="decay factor"):
        sched.decay(0.0)


def test_resumes_the_lambdalr_state_of_older_runs() -> None:
    """train_state.pt files written before per-group schedules hold a LambdaLR state."""
    old_opt = two_groups(1.0, 1e-4)
    old = torch.optim.lr_scheduler.LambdaLR(old_opt, lambda i: noam_factor(i + 1, 512, 10))
    lrs_used(old, 7)
    sched = GroupSchedule(two_groups(), [(512 * 10) ** -0.5, 1e-4], ["warmup", "constant"], 10)  # its peak
    sched.load_state_dict(old.state_dict())
    assert sched.last_epoch == 7 and sched.decay_factor == 1.0
    decoder, encoder = lrs_used(sched, 1)[0]
    assert decoder == pytest.approx(noam_factor(8, 512, 10)) and encoder == 1e-4  # encoder no longer scaled
