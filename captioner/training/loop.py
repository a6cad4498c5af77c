"""The training loop: ``train(cfg, out_dir)`` with ``train_one_epoch`` and ``validate`` pieces.

Shape legend: B batch, T caption steps (with ``<bos>``/``<eos>``), N regions, D feature width.

A run folder holds ``config.json``, ``vocab.json``, ``best.safetensors`` (best validation
``train.select_metric``), ``latest.safetensors``, ``train_state.pt`` (everything needed to resume
exactly), ``metrics.csv``, ``features/`` (cached encoder features, frozen encoder only) and
``tensorboard/`` (if installed). Validation decodes captions for real, the way ``captioner
evaluate`` does by default (beam ``train.val_beam`` = 3, ``train.val_max_len`` = 20 words, no
``<unk>``), and scores corpus BLEU-1..4 and CIDEr-D against all references; the best checkpoint,
early stopping and the plateau decay follow ``train.select_metric`` (CIDEr-D by default). A run
keeps the metric it started with when resumed.

``train.init`` (``--init``) starts a new run from a checkpoint's weights and vocabulary with a fresh
optimizer (:mod:`captioner.training.initialize`), e.g. the fine-tuning stage of the SAT recipe.
``train.objective = "scst"`` trains such a stage with self-critical sequence training instead of
cross-entropy (:mod:`captioner.training.scst`); everything else in the loop stays the same.

Under ``torchrun`` every rank runs this same code: the trained module is wrapped in
``DistributedDataParallel``, loss statistics are summed over ranks, validation is sharded and
gathered, and only rank 0 writes files, logs and progress bars.

Failures: a non-finite loss stops the run with one line naming the step (``train.skip_nonfinite``
skips such batches, and batches whose gradient norm is non-finite, instead; it still stops when
the weights themselves become non-finite or after ``MAX_SKIPPED_IN_A_ROW`` skips in a row), and
non-finite weights are never saved. An unreadable image stops it with one line naming the file,
unless ``data.skip_missing`` drops it from its batch. A resume removes the temporary files of an
interrupted checkpoint write and refuses a ``vocab.json`` other than the checkpoint's.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from captioner.config import Config
from captioner.errors import CaptionerError, CheckpointError, ImageLoadError
from captioner.models.captioner import Captioner
from captioner.training import distributed as ddp
from captioner.training.data import (TrainData, load_caption_sets, load_or_build_vocab, prepare_data, train_loader,
                                     val_loader)
from captioner.training.diagnosis import first_loss_cause
from captioner.training.logging_utils import MetricsLogger
from captioner.training.optim import (Precision, build_optimizer, build_schedule, clip_and_step, nonfinite_tensors,
                                      setup_precision)
from captioner.training.selection import decay_after_epoch, keep_select_metric
from captioner.training.step_stats import DeviceStats, term_shares, weighted_terms
from captioner.training.state import (Progress, capture_rng, check_resume_config, check_resume_vocab,
                                      remove_stale_temp_files, restore_rng, seed_everything)
from captioner.training.validation import score, validate

log = logging.getLogger(__name__)

STATE_FORMAT = "captioner-train-state"
MAX_SKIPPED_IN_A_ROW = 50  # train.skip_nonfinite: this many non-finite batches in a row stop the run


@dataclass
class TrainResult:
    """What ``train`` returns.

    Attributes:
        best_checkpoint: ``best.safetensors`` (highest validation ``select_metric``).
        latest_checkpoint: ``latest.safetensors`` (weights after the last trained batch).
        best_bleu4: validation BLEU-4 of the best checkpoint, 0-1 scale.
        history: one dict per validation (epoch rows of ``metrics.csv``).
        seconds: wall time of this call.
        select_metric: the metric the best checkpoint was selected on ("CIDEr-D" or "BLEU-4").
        best_score: its value for the best checkpoint.
        best_epoch: 1-based epoch of the best checkpoint.
    """

    best_checkpoint: Path
    latest_checkpoint: Path
    best_bleu4: float
    history: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    select_metric: str = "CIDEr-D"
    best_score: float = 0.0
    best_epoch: int = 0


class TrainForward(nn.Module):
    """The module DDP wraps: cached features -> decoder, or images -> encoder -> decoder.

    Args:
        model: the captioner.
        on_features: inputs are region features (B,N,D) rather than images (B,3,S,S).
    """

    def __init__(self, model: Captioner, on_features: bool) -> None:
        super().__init__()
        self.model = model
        self.on_features = on_features
        self.encoder_trainable = any(p.requires_grad for p in model.encoder.parameters())

    def forward(self, x: torch.Tensor, tokens: torch.Tensor):  # -> DecoderOutput
        if not self.on_features:
            with torch.set_grad_enabled(self.encoder_trainable and torch.is_grad_enabled()):
                x, _ = self.model.encoder(x)  # (B, N, D)
        return self.model.decoder(x, tokens)


@dataclass
class _Run:
    """Objects shared by the pieces of one training run."""

    cfg: Config
    info: ddp.DistInfo
    model: Captioner
    forward: nn.Module  # TrainForward, possibly DDP-wrapped
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    progress: Progress
    run_dir: Path
    logger: MetricsLogger | None
    start: float  # time.monotonic() when this call began
    seconds_before: float  # training seconds of earlier sessions
    show_progress: bool
    last_lr: float | None = None  # decoder lr of the last optimizer step
    skipped_in_a_row: int = 0  # batches skipped for non-finite values since the last good one
    bad_grad_step: int | None = None  # first step with a non-finite gradient norm (without skip_nonfinite)
    stats: DeviceStats = field(default_factory=DeviceStats)  # loss terms since the last read, on the device
    warned_regulariser: bool = False  # the "a regulariser outweighs the cross-entropy" line was printed

    def time_up(self) -> bool:
        budget = self.cfg.train.time_budget
        return budget is not None and time.monotonic() - self.start >= budget

    def elapsed(self) -> float:
        return self.seconds_before + time.monotonic() - self.start


def _last_good(run: _Run) -> str:
    latest = run.run_dir / "latest.safetensors"
    return f"last good checkpoint: {latest}" if latest.exists() else "no checkpoint was written yet"


def _nonfinite_error(run: _Run, value: float, epoch: int, step: int | None = None,
                     inputs: torch.Tensor | None = None) -> CaptionerError:
    step = run.progress.step if step is None else step
    if step == 1:  # before any weight update: the inputs or the model as built, never the lr
        return CaptionerError(f"non-finite loss ({value}) at the first step (epoch {epoch + 1} step 1), before any "
                              f"weight update, so neither the learning rate nor skipping batches can help: "
                              f"{first_loss_cause(inputs, run.cfg.model.encoder, run.precision.dtype)}; "
                              f"{_last_good(run)}")
    note = "" if run.bad_grad_step is None else f"; the gradient norm was non-finite at step {run.bad_grad_step}"
    return CaptionerError(f"non-finite loss ({value}) at epoch {epoch + 1} step {step}; "
                          f"{_last_good(run)} (set train.skip_nonfinite=true to skip such batches{note})")


def _names(keys: list[str]) -> str:
    return keys[0] + (f" and {len(keys) - 1} more" if len(keys) > 1 else "")


def _image_error(run: _Run, exc: ImageLoadError, where: str) -> ImageLoadError:
    """One line naming the unreadable file (a DataLoader worker wraps the message in its traceback)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    message = lines[-1] if lines else "unreadable image"
    if len(lines) > 1:  # "...ImageLoadError: <path>: <reason>", the last line of the worker's traceback
        message = re.sub(r"^[\w.]*(Error|Exception): ", "", message)
    return ImageLoadError(f"{message} (found {where}; pass --skip-missing to train without unreadable images; "
                          f"{_last_good(run)})")


def _skip_batch(run: _Run, epoch: int, why: str, criterion_state: dict[str, torch.Tensor] | None) -> None:
    """``train.skip_nonfinite``: count and report a skipped batch, and stop when skipping cannot help."""
    prog = run.progress
    prog.skipped += 1
    run.skipped_in_a_row += 1
    if criterion_state is not None:
        run.criterion.load_state_dict(criterion_state)  # e.g. a REINFORCE baseline updated from this batch
    if run.info.is_main:
        log.warning("skipping batch at step %d: %s", prog.step, why)
    bad = nonfinite_tensors(run.model)
    if bad:
        raise CaptionerError(f"non-finite weights ({_names(bad)}) at epoch {epoch + 1} step {prog.step}: skipping "
                             f"batches cannot help; {_last_good(run)}")
    if run.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
        raise CaptionerError(f"{run.skipped_in_a_row} batches in a row were non-finite (last at epoch {epoch + 1} "
                             f"step {prog.step}); stopping; {_last_good(run)}")


def _train_step(run: _Run, batch: Any, params: list[nn.Parameter], epoch: int) -> tuple[bool, float]:
    """One batch (``prog.step`` already counts it).

    Without torchrun and ``train.skip_nonfinite`` the step never waits for the device: its loss
    terms go to ``run.stats`` and are checked when read (:func:`_read_stats`). Under torchrun (the
    ranks vote on the time budget) or with ``skip_nonfinite`` (which must decide before the
    optimizer steps) the loss is read at every step.

    Returns:
        ``(time_up, captions)``: the time-budget vote (agreed by all ranks) and the number of
        captions trained (all ranks; 0 when the batch was skipped).
    """
    cfg, info, prog = run.cfg, run.info, run.progress
    per_step = info.distributed or cfg.train.skip_nonfinite
    reduce_on = info.device if info.device.type == "cuda" else torch.device("cpu")
    if cfg.data.skip_missing and info.distributed:  # every rank skips a batch left empty on any rank
        flags = torch.tensor([float(batch is None), float(run.time_up())], dtype=torch.float64, device=reduce_on)
        flags = ddp.all_reduce_sum(flags, info).cpu()
        empty, time_up = bool(flags[0] > 0), bool(flags[1] > 0)
    else:
        empty, time_up = batch is None, False
    if empty:
        if info.is_main:
            log.warning("skipping batch at step %d: none of its images could be read", prog.step)
        return time_up or (not info.distributed and run.time_up()), 0.0
    x, tokens, _ = batch
    x = x.to(info.device, non_blocking=True)
    tokens = tokens.to(info.device, non_blocking=True)  # (B, T)
    criterion_state = ({k: v.detach().clone() for k, v in run.criterion.state_dict().items()}
                       if cfg.train.skip_nonfinite else None)
    with run.precision.autocast():
        if cfg.train.objective == "scst":  # sampled captions, rewarded (captioner/training/scst.py)
            result, n = run.criterion.batch_loss(run.forward, run.model.decoder, _scst_encoder(run), x, batch[2])
            n = float(n)
        else:
            out = run.forward(x, tokens[:, :-1])  # logits (B, T-1, V)
            result = run.criterion(out, tokens[:, 1:])
            n = float(tokens.size(0))
    run.optimizer.zero_grad(set_to_none=True)
    if not per_step:
        last_lr = run.optimizer.param_groups[0]["lr"]
        step = clip_and_step(result.total, run.optimizer, params, cfg.train.grad_clip, run.precision)
        if step:
            run.scheduler.step()
            _budget_decay(run)
        run.stats.add(result, int(n), prog.step, step.grad_norm if run.precision.scaler is None else None)
        run.last_lr = last_lr
        if prog.step == 1:  # a first-step failure is diagnosed from its own batch
            _read_stats(run, epoch, inputs=x)
        return run.time_up(), n
    # One all-reduce carries the loss statistics and the "time is up" vote of every rank.
    keys = sorted(result.terms)
    stats = torch.stack([result.total.detach().float() * n, result.total.new_tensor(n),
                         *(result.terms[k].float() * n for k in keys), result.objective.float() * n,
                         result.total.new_tensor(float(run.time_up()))]).to(device=reduce_on, dtype=torch.float64)
    stats = ddp.all_reduce_sum(stats, info).cpu()
    time_up = bool(stats[-1] > 0)
    loss = float(stats[0] / stats[1])
    if not math.isfinite(loss):
        if not cfg.train.skip_nonfinite:
            raise _nonfinite_error(run, loss, epoch, inputs=x)
        _skip_batch(run, epoch, f"non-finite loss ({loss})", criterion_state)
        return time_up, 0.0
    last_lr = run.optimizer.param_groups[0]["lr"]  # the lr this step uses
    step = clip_and_step(result.total, run.optimizer, params, cfg.train.grad_clip, run.precision)
    if getattr(step, "skipped_nonfinite", False):  # optimizer, its state and the schedule untouched
        _skip_batch(run, epoch, f"non-finite gradient norm ({step.grad_norm})", criterion_state)
        return time_up, 0.0
    if step:
        run.scheduler.step()
        _budget_decay(run)
    if run.precision.scaler is None and getattr(step, "nonfinite", False) and run.bad_grad_step is None:
        run.bad_grad_step = prog.step
        if info.is_main:
            log.warning("non-finite gradient norm (%s) at step %d (set train.skip_nonfinite=true to skip such "
                        "batches)", step.grad_norm, prog.step)
    run.last_lr = last_lr
    run.skipped_in_a_row = 0
    parts = {"loss": float(stats[-2] / stats[1]), **{k: float(stats[2 + i] / stats[1]) for i, k in enumerate(keys)}}
    _add_means(run, parts, float(stats[1]))
    return time_up, float(stats[1])


def _scst_encoder(run: _Run):  # -> Callable | None
    """images -> features for SCST sampling, or None when the batches already hold cached features."""
    if getattr(run.forward, "module", run.forward).on_features:
        return None
    return lambda images: run.model.encoder(images)[0]  # (B, N, D)


BUDGET_DECAY_FLOOR = 0.05  # train.budget_decay: the lr factor reached when the time budget runs out


def _budget_decay(run: _Run) -> None:
    """``train.budget_decay``: scale the lrs the schedule just set by ``1 - elapsed / budget`` (floored)."""
    t = run.cfg.train
    if not t.budget_decay or not t.time_budget:
        return
    factor = max(BUDGET_DECAY_FLOOR, 1.0 - (time.monotonic() - run.start) / t.time_budget)
    for group in run.optimizer.param_groups:
        group["lr"] *= factor


def _add_means(run: _Run, means: dict[str, float], captions: float) -> None:
    """Add a reading to the epoch and log-window meters; warn once when a regulariser outweighs the CE."""
    if not captions:
        return
    run.progress.epoch_meter.add(means, captions)
    run.progress.window_meter.add(means, captions)
    ce = means.get("ce", math.nan)
    heavy = {name: value for name, value in weighted_terms(means).items() if value > ce}
    if heavy and not run.warned_regulariser and run.info.is_main:
        run.warned_regulariser = True
        name, value = max(heavy.items(), key=lambda kv: kv[1])
        hint = {"doubly_stochastic": "lower train.alpha_c or use train.ds_form=excess",
                "entropy": "lower train.entropy_weight"}.get(name, "lower its weight")
        log.warning("the weighted %s term (%.3g) outweighs the cross-entropy (%.3g) at step %d: it, not the "
                    "captions, now drives the attention (%s)", name.replace("_", " "), value, ce,
                    run.progress.step, hint)


def _read_stats(run: _Run, epoch: int, inputs: torch.Tensor | None = None) -> None:
    """Bring the device-side loss statistics to the meters; stop on a non-finite loss among them."""
    reading = run.stats.read()
    if reading.bad_grad_step is not None and run.bad_grad_step is None:
        run.bad_grad_step = reading.bad_grad_step
        if run.info.is_main:
            log.warning("non-finite gradient norm at step %d (set train.skip_nonfinite=true to skip such batches)",
                        reading.bad_grad_step)
    if reading.bad_loss is not None:
        step, value = reading.bad_loss
        raise _nonfinite_error(run, value, epoch, step, inputs if step == 1 else None)
    _add_means(run, reading.means, reading.captions)


def train_one_epoch(run: _Run, loader: Any, epoch: int) -> tuple[bool, bool]:
    """Train over ``loader`` (the rest of epoch ``epoch``), logging every ``train.log_every`` steps.

    A batch that is skipped (non-finite with ``train.skip_nonfinite``, or without a readable
    image with ``data.skip_missing``) still counts as a step of the epoch, so a resumed run
    starts at the same batch.

    Returns:
        ``(time_up, complete)``: whether the time budget ran out (agreed by all ranks) and whether
        the epoch's last batch was trained.

    Raises:
        ImageLoadError: an unreadable image without ``data.skip_missing`` (one line naming it).
    """
    cfg, info, prog = run.cfg, run.info, run.progress
    params = [p for g in run.optimizer.param_groups for p in g["params"]]
    run.forward.train()
    run.criterion.train()
    bar = tqdm(loader, desc=f"epoch {epoch + 1}/{cfg.train.epochs}", unit="batch", leave=False,
               initial=prog.batch_in_epoch, total=prog.batch_in_epoch + len(loader),
               disable=True if not (run.show_progress and info.is_main) else None)
    window_start = time.monotonic()
    window_captions = 0.0
    remaining = len(loader)
    try:
        for batch in bar:
            remaining -= 1
            prog.step += 1
            prog.batch_in_epoch += 1
            time_up, captions = _train_step(run, batch, params, epoch)
            window_captions += captions
            if prog.step % cfg.train.log_every == 0:
                _read_stats(run, epoch)
                speed = window_captions / max(time.monotonic() - window_start, 1e-9)
                means = prog.window_meter.means()
                if run.logger is not None:
                    run.logger.write("step", {"epoch": epoch + 1, "step": prog.step, **means, **term_shares(means),
                                              "lr": run.last_lr, "captions_per_s": speed, "seconds": run.elapsed()})
                loss = means.get("loss")
                bar.set_postfix(loss="-" if loss is None else f"{loss:.3f}", cap_s=f"{speed:.0f}", refresh=False)
                prog.window_meter = type(prog.window_meter)()
                window_start, window_captions = time.monotonic(), 0.0
            if time_up:
                _read_stats(run, epoch)
                return True, remaining == 0
    except ImageLoadError as exc:
        raise _image_error(run, exc, f"in the training data at epoch {epoch + 1} step {prog.step + 1}") from None
    finally:
        bar.close()
    _read_stats(run, epoch)
    return False, True


def _validate_all(run: _Run, data: TrainData) -> dict[str, float]:
    """Sharded validation over ranks (rank r takes images r, r+K, ...), scored identically everywhere.

    Decodes like ``captioner evaluate``: beam ``train.val_beam``, ``train.val_max_len`` words, no ``<unk>``.
    """
    info, cfg = run.info, run.cfg
    dataset = data.val_dataset
    shard_indices = list(range(info.rank, len(dataset), info.world_size)) if info.distributed else None
    loader = val_loader(dataset, cfg, info, store=data.val_store, indices=shard_indices)
    shard = validate(run.model, loader, data.val_set, data.vocab, cfg.train.val_beam, cfg.train.val_max_len,
                     info.device, data.on_features)
    return score(ddp.gather_objects(shard, info))


# ----------------------------------------------------------------------------- the run


def _train_state(run: _Run, rngs: list[dict[str, Any]]) -> dict[str, Any]:
    scaler = run.precision.scaler
    return {
        "format": STATE_FORMAT,
        "version": 1,
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "criterion": run.criterion.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else {},
        "progress": run.progress.state_dict(),
        "rng": rngs,  # one snapshot per rank
        "world_size": run.info.world_size,
    }


def _load_train_state(run: _Run, state: dict[str, Any]) -> None:
    path = run.run_dir / "train_state.pt"
    if state.get("format") != STATE_FORMAT:
        raise CheckpointError(f"{path}: not a captioner training state")
    try:
        run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        run.scheduler.load_state_dict(state["scheduler"])
        run.criterion.load_state_dict(state["criterion"])
        if run.precision.scaler is not None and state["scaler"]:
            run.precision.scaler.load_state_dict(state["scaler"])
        run.progress.load_state_dict(state["progress"])
    except (KeyError, RuntimeError, ValueError) as exc:
        # load_state_dict: "Error(s) in loading state_dict for X:" then one line per problem
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = next((line for line in lines if line.startswith("size mismatch")), lines[-1] if lines else repr(exc))
        raise CheckpointError(f"{path}: does not match this model ({detail[:300]})") from None
    rngs = state.get("rng", [])
    if run.info.rank < len(rngs):
        restore_rng(rngs[run.info.rank], run.info.device)
    else:
        seed_everything(run.cfg.train.seed + 1_000_003 * run.info.rank + run.progress.step)
    if state.get("world_size", 1) != run.info.world_size and run.progress.batch_in_epoch and run.info.is_main:
        log.warning("resuming mid-epoch with %d processes (saved with %d): the batch order differs",
                    run.info.world_size, state["world_size"])


def _save(run: _Run, data: TrainData, improved: bool, rngs: list[dict[str, Any]]) -> None:
    """latest (and best) checkpoint, then ``train_state.pt`` last; rank 0 only, each write atomic."""
    if not run.info.is_main:
        return
    from captioner.checkpoint.store import save_checkpoint, save_train_state

    prog = run.progress
    last = prog.history[-1]
    meta = {"epoch": last["epoch"], "step": prog.step, "val_bleu4": last["BLEU-4"], "val_cider_d": last["CIDEr-D"],
            "select_metric": prog.select_metric, "val_split": run.cfg.data.val_split}
    save_checkpoint(run.run_dir / "latest.safetensors", run.model, data.vocab, metadata=meta)
    if improved:
        save_checkpoint(run.run_dir / "best.safetensors", run.model, data.vocab, metadata=meta)
    save_train_state(run.run_dir / "train_state.pt", _train_state(run, rngs))


def _end_of_epoch(run: _Run, data: TrainData, epoch: int, complete: bool, captions_per_s: float) -> None:
    """Validate, update early stopping, log the epoch row and save (every rank calls this)."""
    prog, info = run.progress, run.info
    bad = nonfinite_tensors(run.model)
    if bad:  # never replace the last good checkpoint with NaN/inf weights
        raise CaptionerError(f"non-finite weights ({_names(bad)}) at epoch {epoch + 1} step {prog.step}; not saving "
                             f"them; {_last_good(run)}")
    rng = capture_rng(info.device)
    try:
        metrics = _validate_all(run, data)
    except ImageLoadError as exc:
        raise _image_error(run, exc, f"in the validation data after epoch {epoch + 1} step {prog.step}") from None
    restore_rng(rng, info.device)  # validation must not shift the training random stream
    row = {"epoch": epoch + 1, "step": prog.step, **prog.epoch_meter.means(), **term_shares(prog.epoch_meter.means()),
           "lr": run.last_lr, "captions_per_s": captions_per_s, **metrics,
           "partial": int(not complete), "seconds": run.elapsed()}
    value = metrics[prog.select_metric]
    improved = value > prog.best_score
    if improved:
        prog.best_score, prog.best_bleu4, prog.best_epoch, prog.bad_epochs = value, metrics["BLEU-4"], epoch + 1, 0
    elif complete:
        prog.bad_epochs += 1
    if complete:
        decay_after_epoch(run.cfg.train, prog, run.scheduler, epoch, announce=info.is_main)
        prog.epoch, prog.batch_in_epoch = epoch + 1, 0
        prog.epoch_meter = type(prog.epoch_meter)()
    prog.history.append(row)
    prog.seconds = run.elapsed()
    if run.logger is not None:
        run.logger.write("epoch", row)
        log.info("epoch %d%s: loss %.4f, val %s %.4f (best %.4f, epoch %d), BLEU-4 %.4f, attention entropy %.3f, "
                 "%.0f s", epoch + 1, "" if complete else " (partial)", row.get("loss", math.nan), prog.select_metric,
                 value, prog.best_score, prog.best_epoch, metrics["BLEU-4"], metrics["attention_entropy"],
                 row["seconds"])
    _save(run, data, improved, ddp.gather_objects(rng, info))


def train(cfg: Config, out_dir: str | Path, resume: bool = False, progress: bool = True) -> TrainResult:
    """Train a captioner; all outputs go to the run folder ``out_dir``.

    Args:
        cfg: the full configuration (model, data, train).
        out_dir: run folder (created); see the module docstring for its files.
        resume: continue the run saved in ``out_dir/train_state.pt`` exactly where it stopped (its
            weights come from there; ``train.init`` only matters when a run starts).
        progress: show tqdm progress bars (rank 0, interactive terminals only).

    Returns:
        A ``TrainResult`` (on every rank under torchrun).

    Raises:
        CaptionerError: bad data, config or run folder, a ``train.init`` checkpoint whose
            architecture differs, or a non-finite loss.
    """
    start = time.monotonic()
    info = ddp.setup(cfg.train.device)
    try:
        return _train(cfg, Path(out_dir), resume, progress, info, start)
    finally:
        ddp.cleanup(info)


def _train(cfg: Config, run_dir: Path, resume: bool, progress: bool, info: ddp.DistInfo, start: float) -> TrainResult:
    from captioner.losses import CaptionLoss
    from captioner.models.captioner import build_model
    from captioner.training.initialize import apply_init, load_init_checkpoint

    state_path = run_dir / "train_state.pt"
    saved = None
    init = None
    if resume:
        if not state_path.exists():
            raise CheckpointError(f"{run_dir}: nothing to resume (no train_state.pt); train without --resume first")
        check_resume_config(cfg, run_dir)
        if info.is_main:
            remove_stale_temp_files(run_dir)
        from captioner.checkpoint.store import load_train_state

        saved = load_train_state(state_path)
        cfg = keep_select_metric(cfg, saved, announce=info.is_main)
    else:
        if info.is_main and state_path.exists():
            log.warning("%s holds an earlier run; starting over (pass --resume to continue it)", run_dir)
        if cfg.train.init:  # checked before any data is read: a wrong checkpoint fails in seconds
            init = load_init_checkpoint(cfg.train.init, cfg.model)
    train_set, val_set = load_caption_sets(cfg)
    if init is not None:
        vocab = init.vocab  # the output layer's rows are the checkpoint's words
    else:
        vocab = load_or_build_vocab(train_set, cfg.data.min_freq, run_dir, resume)
    if resume:
        check_resume_vocab(vocab, run_dir)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.save(run_dir / "config.json")
        vocab.save(run_dir / "vocab.json")

    seed_everything(cfg.train.seed)
    model = build_model(cfg.model, len(vocab), load_pretrained=init is None).to(info.device)
    if init is not None:  # before the feature cache: a frozen encoder's features come from these weights
        apply_init(model, init, vocab)
        init = None
    data = prepare_data(cfg, model, vocab, train_set, val_set, run_dir, info, progress)
    t = cfg.train
    criterion: nn.Module
    if t.objective == "scst":  # self-critical: rewards from the training references (DFs counted once, here)
        from captioner.training.scst import build_scst_loss

        criterion = build_scst_loss(cfg, data.train_set, vocab)
    else:
        criterion = CaptionLoss.from_config(t, cfg.model.decoder.name, vocab.pad_id).to(info.device)
    optimizer = build_optimizer(model, t, train_encoder=not data.on_features)
    scheduler = build_schedule(optimizer, model, t)
    if t.compile and hasattr(model.decoder, "compile_recurrence"):
        model.decoder.compile_recurrence()
    forward: nn.Module = TrainForward(model, data.on_features)
    precision = setup_precision(t.amp, info.device, t.skip_nonfinite)
    run = _Run(cfg, info, model, forward, criterion, optimizer, scheduler, precision,
               Progress(select_metric=t.select_metric), run_dir, None, start, 0.0, progress)
    if saved is not None:
        _load_train_state(run, saved)
        run.seconds_before = run.progress.seconds
        del saved
    elif info.rank > 0:
        seed_everything(t.seed + 1_000_003 * info.rank)  # own dropout / attention-sampling stream per rank
    if info.distributed:
        run.forward = nn.parallel.DistributedDataParallel(
            forward, device_ids=[info.device.index] if info.device.type == "cuda" else None,
            forward_sync_buffers=forward.encoder_trainable)  # BatchNorm stats of a fine-tuned encoder
    if info.is_main:
        run.logger = MetricsLogger(run_dir, keep_until_step=run.progress.step if resume else None)
        log.info("training %s/%s on %s (%s, %d process%s): %d captions of %d images, %s, vocabulary %d",
                 cfg.model.encoder.name, cfg.model.decoder.name, info.device, run.precision.name, info.world_size,
                 "es" if info.world_size > 1 else "", len(data.train_dataset), len(data.train_set),
                 "cached features" if data.on_features else "images", len(vocab))
    try:
        _loop(run, data)
    finally:
        if run.logger is not None:
            run.logger.close()
    ddp.barrier(info)
    prog = run.progress
    return TrainResult(run_dir / "best.safetensors", run_dir / "latest.safetensors", max(prog.best_bleu4, 0.0),
                       list(prog.history), time.monotonic() - start, prog.select_metric, max(prog.best_score, 0.0),
                       prog.best_epoch)


def _loop(run: _Run, data: TrainData) -> None:
    prog, t = run.progress, run.cfg.train
    patience = t.patience if t.patience > 0 else math.inf  # patience <= 0: no early stopping
    while prog.epoch < t.epochs and prog.bad_epochs < patience:
        epoch = prog.epoch
        loader = train_loader(data.train_dataset, run.cfg, epoch, run.info, skip_batches=prog.batch_in_epoch,
                              store=data.train_store)
        began, seen = time.monotonic(), prog.epoch_meter.count
        time_up, complete = train_one_epoch(run, loader, epoch)
        speed = (prog.epoch_meter.count - seen) / max(time.monotonic() - began, 1e-9)
        _end_of_epoch(run, data, epoch, complete, speed)
        if time_up:
            if run.info.is_main:
                log.info("time budget of %.0f s reached at step %d; stopping", t.time_budget, prog.step)
            return
    if prog.skipped and run.info.is_main:
        log.warning("%d batch(es) of this run were skipped for non-finite values", prog.skipped)
    if prog.bad_epochs >= patience and run.info.is_main:
        log.info("early stopping: no better val %s for %d epochs (best %.4f at epoch %d)",
                 prog.select_metric, prog.bad_epochs, prog.best_score, prog.best_epoch)
