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
cross-entropy (:mod:`captioner.training.scst`): the objective is an object chosen once here
(:mod:`captioner.training.objectives`); everything else in the loop stays the same.

Under ``torchrun`` every rank runs this same code: the trained module is wrapped in
``DistributedDataParallel``, loss statistics are summed over ranks, validation is sharded and
gathered, and only rank 0 writes files, logs and progress bars.

Failures: a non-finite loss stops the run with one line naming the step (``train.skip_nonfinite``
skips such batches, and batches whose gradient norm is non-finite, instead; it still stops when
the weights themselves become non-finite or after ``MAX_SKIPPED_IN_A_ROW`` skips in a row), and
non-finite weights are never saved. An unreadable image stops it with one line naming the file,
unless ``data.skip_missing`` drops it from its batch. A resume removes the temporary files of an
interrupted checkpoint write and refuses a ``vocab.json`` other than the checkpoint's.

This module builds a run and runs its epochs; the pieces live beside it: what a run holds
(:mod:`captioner.training.run`), one training step and the non-finite checks
(:mod:`captioner.training.step`), one epoch, validation and the end-of-epoch save
(:mod:`captioner.training.epoch`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from captioner.checkpoint.store import load_train_state
from captioner.config import Config
from captioner.errors import CheckpointError
from captioner.models.captioner import build_model
from captioner.training import distributed as ddp
from captioner.training.cuda_graph import GraphedStep, check_cuda_graph
from captioner.training.detectors import install_concepts, read_concepts, with_concept_input
from captioner.training.data import TrainData, load_caption_sets, load_or_build_vocab, prepare_data, train_loader
from captioner.training.epoch import end_of_epoch, train_one_epoch
from captioner.training.initialize import apply_init, load_init_checkpoint, replay_warning
from captioner.training.logging_utils import MetricsLogger
from captioner.training.objectives import build_objective
from captioner.training.optim import build_optimizer, build_schedule, setup_precision
from captioner.training.run import Clock, Learner, Run, RunFolder, TrainForward, restore_train_state
from captioner.training.run_folder import check_run_folder, earlier_run_files, make_run_folder, move_aside
from captioner.training.selection import keep_select_metric
from captioner.training.state import (Progress, check_resume_config, check_resume_vocab, remove_stale_temp_files,
                                      seed_everything)

__all__ = ["TrainResult", "train"]

log = logging.getLogger(__name__)


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




def train(cfg: Config, out_dir: str | Path, resume: bool = False, progress: bool = True,
          overwrite: bool = False) -> TrainResult:
    """Train a captioner; all outputs go to the run folder ``out_dir``.

    Args:
        cfg: the full configuration (model, data, train).
        out_dir: run folder (created); see the module docstring for its files. A folder that holds
            an earlier run is refused unless ``resume`` or ``overwrite`` is given.
        resume: continue the run saved in ``out_dir/train_state.pt`` exactly where it stopped (its
            weights come from there; ``train.init`` only matters when a run starts).
        progress: show tqdm progress bars (rank 0, interactive terminals only).
        overwrite: start a new run in a folder that holds an earlier one: once the config, the data
            and the folder are checked, the earlier run is moved to ``<out_dir>.old-<time>``
            (never deleted).

    Returns:
        A ``TrainResult`` (on every rank under torchrun).

    Raises:
        CaptionerError: bad data, config or run folder (an earlier run without ``resume`` or
            ``overwrite``, a file, a folder that cannot be written), a ``train.init`` checkpoint whose
            architecture differs, or a non-finite loss. Nothing is written before these checks.
    """
    start = time.monotonic()
    check_run_folder(Path(out_dir), resume, overwrite)  # before anything is read, computed or written
    info = ddp.setup(cfg.train.device)
    try:
        return _train(cfg, Path(out_dir), resume, progress, info, start, overwrite)
    finally:
        ddp.cleanup(info)


def _train(cfg: Config, run_dir: Path, resume: bool, progress: bool, info: ddp.DistInfo, start: float,
           overwrite: bool) -> TrainResult:
    if cfg.train.cuda_graph:  # refused here, before anything is read or written, where it cannot run
        check_cuda_graph(cfg.train, cfg.model.decoder.name, bool(cfg.data.feature_cache and not
                                                                 cfg.model.encoder.fine_tune), info.device,
                         info.distributed)
    state_path = run_dir / "train_state.pt"
    saved = None
    init = None
    if resume:
        if not state_path.exists():
            again = "--overwrite instead of --resume" if earlier_run_files(run_dir) else "no --resume"
            raise CheckpointError(f"{run_dir}: nothing to resume (no train_state.pt); train without --resume "
                                  f"first (here: {again})")
        check_resume_config(cfg, run_dir)
        saved = load_train_state(state_path)
        cfg = keep_select_metric(cfg, saved, announce=info.is_main)
    else:
        if cfg.train.init:  # checked before any data is read: a wrong checkpoint fails in seconds
            init = load_init_checkpoint(cfg.train.init, cfg.model)
            replay = replay_warning(init, cfg.train)
            if replay and info.is_main:
                log.warning("%s", replay)
    train_set, val_set = load_caption_sets(cfg)
    if init is not None:
        vocab = init.vocab  # the output layer's rows are the checkpoint's words
    else:
        vocab = load_or_build_vocab(train_set, cfg.data.min_freq, run_dir, resume, cfg.data.max_caption_len)
    if resume:
        check_resume_vocab(vocab, run_dir)
    concepts = read_concepts(cfg, vocab)  # train.concepts: checked before the first write
    cfg = with_concept_input(cfg, concepts)
    if info.is_main:  # config, data and folder are checked: the first write to the run folder
        if resume:
            remove_stale_temp_files(run_dir)
        elif overwrite:
            move_aside(run_dir)
        make_run_folder(run_dir)
        cfg.save(run_dir / "config.json")
        vocab.save(run_dir / "vocab.json")

    seed_everything(cfg.train.seed)
    model = build_model(cfg.model, len(vocab), load_pretrained=init is None).to(info.device)
    install_concepts(model.decoder, concepts, vocab)
    if init is not None:  # before the feature cache: a frozen encoder's features come from these weights
        apply_init(model, init, vocab)
        init = None
    data = prepare_data(cfg, model, vocab, train_set, val_set, run_dir, info, progress)
    t = cfg.train
    objective = build_objective(cfg, data.train_set, vocab, info.device)  # SCST counts its reward's DFs here, once
    optimizer = build_optimizer(model, t, train_encoder=not data.on_features)
    scheduler = build_schedule(optimizer, model, t, total_steps=t.epochs * math.ceil(len(data.train_dataset) / t.batch_size))
    if t.compile and hasattr(model.decoder, "compile_recurrence"):
        model.decoder.compile_recurrence()
    forward = TrainForward(model, data.on_features)
    precision = setup_precision(t.amp, info.device, t.skip_nonfinite)
    run = Run(cfg, info, Learner(model, forward, objective, optimizer, scheduler, precision), RunFolder(run_dir),
              Clock(start, t.time_budget), Progress(select_metric=t.select_metric), show_progress=progress)
    if t.cuda_graph:
        run.learner.graphed = GraphedStep(model.decoder, objective, vocab.pad_id, precision.dtype)
    if saved is not None:
        restore_train_state(run, saved)
        run.clock.seconds_before = run.progress.seconds
        del saved
    elif info.rank > 0:
        seed_everything(t.seed + ddp.RANK_SEED_STRIDE * info.rank)  # own dropout / attention-sampling stream per rank
    if info.distributed:
        run.learner.forward = nn.parallel.DistributedDataParallel(
            forward, device_ids=[info.device.index] if info.device.type == "cuda" else None,
            forward_sync_buffers=forward.encoder_trainable)  # BatchNorm stats of a fine-tuned encoder
    if info.is_main:
        run.folder.logger = MetricsLogger(run_dir, keep_until_step=run.progress.step if resume else None)
        log.info("training %s/%s on %s (%s, %d process%s): %d captions of %d images, %s, vocabulary %d",
                 cfg.model.encoder.name, cfg.model.decoder.name, info.device, precision.name, info.world_size,
                 "es" if info.world_size > 1 else "", len(data.train_dataset), len(data.train_set),
                 "cached features" if data.on_features else "images", len(vocab))
    try:
        _loop(run, data)
    finally:
        if run.folder.logger is not None:
            run.folder.logger.close()
        if run.learner.graphed is not None and info.is_main:  # captures, replays, eager steps per shape
            log.info("train.cuda_graph: %s", run.learner.graphed.stats.as_dict())
    ddp.barrier(info)
    prog = run.progress
    return TrainResult(run_dir / "best.safetensors", run_dir / "latest.safetensors", max(prog.best_bleu4, 0.0),
                       list(prog.history), run.clock.session_seconds(), prog.select_metric,
                       max(prog.best_score, 0.0), prog.best_epoch)


def _loop(run: Run, data: TrainData) -> None:
    """Epochs until ``train.epochs``, early stopping (``train.patience``) or the time budget."""
    prog, t, info = run.progress, run.cfg.train, run.info
    patience = t.patience if t.patience > 0 else math.inf  # patience <= 0: no early stopping
    while prog.epoch < t.epochs and prog.bad_epochs < patience:
        epoch = prog.epoch
        loader = train_loader(data.train_dataset, run.cfg, epoch, info, skip_batches=prog.batch_in_epoch,
                              store=data.train_store)
        began, seen = time.monotonic(), prog.epoch_meter.count
        time_up, complete = train_one_epoch(run, loader, epoch)
        speed = (prog.epoch_meter.count - seen) / max(time.monotonic() - began, 1e-9)
        end_of_epoch(run, data, epoch, complete, speed)
        if time_up:
            if info.is_main:
                log.info("time budget of %.0f s reached at step %d; stopping", t.time_budget, prog.step)
            return
    if prog.skipped and info.is_main:
        log.warning("%d batch(es) of this run were skipped for non-finite values", prog.skipped)
    if prog.bad_epochs >= patience and info.is_main:
        log.info("early stopping: no better val %s for %d epochs (best %.4f at epoch %d)",
                 prog.select_metric, prog.bad_epochs, prog.best_score, prog.best_epoch)
