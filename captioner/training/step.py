"""One training step: forward, loss, optimizer step, and what to do with non-finite values.

Shape legend: B batch, T caption steps (with ``<bos>``/``<eos>``), V vocabulary.

The loss comes from the run's objective (``objective.loss(model, batch)``,
:mod:`captioner.training.objective`), whichever it is. Two steps share the rest:

* :func:`step_deferred` (one process, no ``train.skip_nonfinite``) never waits for the device: its
  loss terms go to ``run.session.stats`` and are checked when read (:func:`read_stats`, every
  ``train.log_every`` steps, at the end of an epoch and when time is up);
* :func:`step_synchronised` (under torchrun, or with ``skip_nonfinite``, which must decide before
  the optimizer steps) reads the loss, summed over ranks, every step.

:func:`step_function` picks one for the run.

A non-finite loss stops the run with one line naming the step (:func:`nonfinite_error`);
``train.skip_nonfinite`` skips such batches instead (:func:`skip_batch`), and still stops when
the weights themselves become non-finite or after ``MAX_SKIPPED_IN_A_ROW`` skips in a row.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from captioner.config import TrainConfig
from captioner.errors import CaptionerError
from captioner.features.dtype import model_input
from captioner.losses import LossResult
from captioner.training import distributed as ddp
from captioner.training.diagnosis import first_loss_cause
from captioner.training.objective import Batch
from captioner.training.optim import clip_and_step, nonfinite_tensors
from captioner.training.run import Run
from captioner.training.step_stats import weighted_terms

log = logging.getLogger(__name__)

MAX_SKIPPED_IN_A_ROW = 50  # train.skip_nonfinite: this many non-finite batches in a row stop the run
BUDGET_DECAY_FLOOR = 0.05  # train.budget_decay: the lr factor reached when the time budget runs out


def name_list(keys: list[str]) -> str:
    """``"a"``, or ``"a and 2 more"``: tensor names in a one-line error."""
    return keys[0] + (f" and {len(keys) - 1} more" if len(keys) > 1 else "")


def nonfinite_error(run: Run, value: float, epoch: int, step: int | None = None,
                    inputs: torch.Tensor | None = None) -> CaptionerError:
    """The one-line error for a non-finite loss ``value`` at ``step`` (default: the current step).

    At step 1 (before any weight update) it names the likely cause from the batch ``inputs``.
    """
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


def budget_decay(optimizer: torch.optim.Optimizer, t: TrainConfig, seconds: float) -> None:
    """``train.budget_decay``: scale the lrs the schedule just set by ``1 - seconds / budget`` (floored).

    Args:
        optimizer: its param groups' ``lr`` are scaled in place.
        t: ``train.budget_decay`` and ``train.time_budget`` decide; nothing happens without both.
        seconds: time since this call of ``train`` began.
    """
    if not t.budget_decay or not t.time_budget:
        return
    factor = max(BUDGET_DECAY_FLOOR, 1.0 - seconds / t.time_budget)
    for group in optimizer.param_groups:
        group["lr"] *= factor


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


def _optimizer_step(run: Run, loss: torch.Tensor, params: list[nn.Parameter]) -> Any:  # -> StepResult
    """Clip and step, then advance the schedule (and the budget decay) when the optimizer stepped."""
    learner = run.learner
    step = clip_and_step(loss, learner.optimizer, params, run.cfg.train.grad_clip, learner.precision,
                         backward=learner.graphed is None)  # a captured step has run its backward
    if step:
        learner.scheduler.step()
        budget_decay(learner.optimizer, run.cfg.train, run.clock.session_seconds())
    return step


def _batch_on_device(run: Run, batch: Any) -> Batch:
    """The loader's ``(x, tokens, image_index)`` with ``x`` and ``tokens`` moved to the run's device.

    Cached features arrive in their stored float16/bfloat16 and become float32 here, on the device
    (``model_input``): the model, the captured step's static buffers and the loss see float32.
    """
    x, tokens, image_index = batch
    device = run.info.device
    return Batch(model_input(x, device), tokens.to(device, non_blocking=True), image_index)  # tokens (B, T)


def _loss(run: Run, batch: Batch) -> LossResult:
    """The objective's loss of ``batch`` under the run's precision, gradients cleared for the backward."""
    learner = run.learner
    if learner.graphed is not None:  # train.cuda_graph: forward, loss and backward replayed as one graph
        return learner.graphed(batch.x, batch.tokens, batch.image_index)
    with learner.precision.autocast():
        result = learner.objective.loss(learner.train_model(), batch)
    learner.optimizer.zero_grad(set_to_none=True)
    return result


def _skip_empty(run: Run, time_up: bool) -> tuple[bool, float]:
    """A batch of which no image could be read (``data.skip_missing``): nothing is trained."""
    if run.info.is_main:
        log.warning("skipping batch at step %d: none of its images could be read", run.progress.step)
    return time_up, 0.0


def step_deferred(run: Run, batch: Any, params: list[nn.Parameter], epoch: int) -> tuple[bool, float]:
    """One batch on one process without ``train.skip_nonfinite``: the step never waits for the device.

    The loss terms go to ``run.session.stats`` and are checked when read (:func:`read_stats`); the
    first step is read at once, so that a failure there is diagnosed from its own batch.

    Args:
        run: the run; its learner is stepped and its session updated (``run.progress.step``
            already counts this batch).
        batch: ``(x, tokens (B,T), image_index)`` from the train loader, where x is images
            (B,3,S,S) or cached features (B,N,D); None when ``data.skip_missing`` left it empty.
        params: every trained parameter (:meth:`Learner.params`).
        epoch: 0-based epoch (for messages).

    Returns:
        ``(time_up, captions)``: the time budget ran out, and the captions trained (0 when skipped).
    """
    if batch is None:
        return _skip_empty(run, run.clock.time_up())
    prog, learner, session = run.progress, run.learner, run.session
    batch = _batch_on_device(run, batch)
    result = _loss(run, batch)
    last_lr = learner.optimizer.param_groups[0]["lr"]
    step = _optimizer_step(run, result.total, params)
    session.stats.add(result, result.captions, prog.step, step.grad_norm if learner.precision.scaler is None else None)
    session.last_lr = last_lr
    if prog.step == 1:  # a first-step failure is diagnosed from its own batch
        read_stats(run, epoch, inputs=batch.x)
    return run.clock.time_up(), float(result.captions)


def step_synchronised(run: Run, batch: Any, params: list[nn.Parameter], epoch: int) -> tuple[bool, float]:
    """One batch under torchrun or with ``train.skip_nonfinite``: the loss is read before the update.

    One all-reduce carries every rank's loss statistics and its "time is up" vote; a non-finite
    loss stops the run, or with ``train.skip_nonfinite`` skips the batch (the objective's state
    put back as it was before the batch), as does a non-finite gradient norm.

    Args and returns: as :func:`step_deferred`; ``time_up`` and ``captions`` are agreed by all ranks.
    """
    cfg, info, prog, learner, session = run.cfg, run.info, run.progress, run.learner, run.session
    reduce_on = info.device if info.device.type == "cuda" else torch.device("cpu")
    if cfg.data.skip_missing and info.distributed:  # every rank skips a batch left empty on any rank
        flags = torch.tensor([float(batch is None), float(run.clock.time_up())], dtype=torch.float64,
                             device=reduce_on)
        flags = ddp.all_reduce_sum(flags, info).cpu()
        if flags[0] > 0:
            return _skip_empty(run, bool(flags[1] > 0))
    elif batch is None:
        return _skip_empty(run, not info.distributed and run.clock.time_up())
    batch = _batch_on_device(run, batch)
    objective_state = ({k: v.detach().clone() for k, v in learner.objective.state_dict().items()}
                       if cfg.train.skip_nonfinite else None)
    result = _loss(run, batch)
    n = float(result.captions)
    keys = sorted(result.terms)
    stats = torch.stack([result.total.detach().float() * n, result.total.new_tensor(n),
                         *(result.terms[k].float() * n for k in keys), result.objective.float() * n,
                         result.total.new_tensor(float(run.clock.time_up()))]).to(device=reduce_on,
                                                                                 dtype=torch.float64)
    stats = ddp.all_reduce_sum(stats, info).cpu()
    time_up = bool(stats[-1] > 0)
    loss = float(stats[0] / stats[1])
    if not math.isfinite(loss):
        if not cfg.train.skip_nonfinite:
            raise nonfinite_error(run, loss, epoch, inputs=batch.x)
        skip_batch(run, epoch, f"non-finite loss ({loss})", objective_state)
        return time_up, 0.0
    last_lr = learner.optimizer.param_groups[0]["lr"]  # the lr this step uses
    step = _optimizer_step(run, result.total, params)
    if getattr(step, "skipped_nonfinite", False):  # optimizer, its state and the schedule untouched
        skip_batch(run, epoch, f"non-finite gradient norm ({step.grad_norm})", objective_state)
        return time_up, 0.0
    if learner.precision.scaler is None and getattr(step, "nonfinite", False) and session.bad_grad_step is None:
        session.bad_grad_step = prog.step
        if info.is_main:
            log.warning("non-finite gradient norm (%s) at step %d (set train.skip_nonfinite=true to skip such "
                        "batches)", step.grad_norm, prog.step)
    session.last_lr = last_lr
    session.skipped_in_a_row = 0
    parts = {"loss": float(stats[-2] / stats[1]), **{k: float(stats[2 + i] / stats[1]) for i, k in enumerate(keys)}}
    add_means(run, parts, float(stats[1]))
    return time_up, float(stats[1])


def step_function(run: Run) -> Callable[[Run, Any, list[nn.Parameter], int], tuple[bool, float]]:
    """The step this run takes: :func:`step_synchronised` under torchrun or with ``train.skip_nonfinite``
    (which must decide before the optimizer steps), else :func:`step_deferred`."""
    return step_synchronised if run.info.distributed or run.cfg.train.skip_nonfinite else step_deferred
