"""One epoch of training, then validation and the end-of-epoch save.

Validation decodes captions for real, the way ``captioner evaluate`` does by default (beam
``train.val_beam``, ``train.val_max_len`` words, no ``<unk>``), sharded over ranks and scored
identically everywhere. The end of an epoch updates the best score, early stopping and the plateau
decay (``train.select_metric``), writes the epoch row of ``metrics.csv`` and saves
``latest.safetensors`` (and ``best.safetensors``), then ``train_state.pt`` last; non-finite
weights are never saved.
"""

from __future__ import annotations

import logging
import math
import re
import time
from typing import Any

from tqdm import tqdm

from captioner.checkpoint.store import save_checkpoint, save_train_state
from captioner.errors import CaptionerError, ImageLoadError
from captioner.training import distributed as ddp
from captioner.training.data import TrainData, val_loader
from captioner.training.optim import nonfinite_tensors
from captioner.training.run import Run, train_state
from captioner.training.selection import decay_after_epoch
from captioner.training.state import capture_rng, restore_rng
from captioner.training.step import name_list, read_stats, step_function
from captioner.training.step_stats import term_shares
from captioner.training.validation import score, validate

log = logging.getLogger(__name__)


def image_error(run: Run, exc: ImageLoadError, where: str) -> ImageLoadError:
    """One line naming the unreadable file (a DataLoader worker wraps the message in its traceback)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    message = lines[-1] if lines else "unreadable image"
    if len(lines) > 1:  # "...ImageLoadError: <path>: <reason>", the last line of the worker's traceback
        message = re.sub(r"^[\w.]*(Error|Exception): ", "", message)
    return ImageLoadError(f"{message} (found {where}; pass --skip-missing to train without unreadable images; "
                          f"{run.folder.last_good()})")


def train_one_epoch(run: Run, loader: Any, epoch: int) -> tuple[bool, bool]:
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
    cfg, info, prog, learner = run.cfg, run.info, run.progress, run.learner
    params = learner.params()
    train_step = step_function(run)
    learner.forward.train()
    learner.objective.train()
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
            time_up, captions = train_step(run, batch, params, epoch)
            window_captions += captions
            if prog.step % cfg.train.log_every == 0:
                read_stats(run, epoch)
                speed = window_captions / max(time.monotonic() - window_start, 1e-9)
                means = prog.window_meter.means()
                if run.folder.logger is not None:
                    run.folder.logger.write("step", {"epoch": epoch + 1, "step": prog.step, **means,
                                                     **term_shares(means), "lr": run.session.last_lr,
                                                     "captions_per_s": speed, "seconds": run.clock.elapsed()})
                loss = means.get("loss")
                bar.set_postfix(loss="-" if loss is None else f"{loss:.3f}", cap_s=f"{speed:.0f}", refresh=False)
                prog.window_meter = type(prog.window_meter)()
                window_start, window_captions = time.monotonic(), 0.0
            if time_up:
                read_stats(run, epoch)
                return True, remaining == 0
    except ImageLoadError as exc:
        raise image_error(run, exc, f"in the training data at epoch {epoch + 1} step {prog.step + 1}") from None
    finally:
        bar.close()
    read_stats(run, epoch)
    return False, True


def _validate_all(run: Run, data: TrainData) -> dict[str, float]:
    """Sharded validation over ranks (rank r takes images r, r+K, ...), scored identically everywhere.

    Decodes like ``captioner evaluate``: beam ``train.val_beam``, ``train.val_max_len`` words, and the
    rest of the config's ``decoding`` section (length penalty 0 and no ``<unk>`` by default).
    """
    info, cfg = run.info, run.cfg
    dataset = data.val_dataset
    shard_indices = list(range(info.rank, len(dataset), info.world_size)) if info.distributed else None
    loader = val_loader(dataset, cfg, info, store=data.val_store, indices=shard_indices)
    shard = validate(run.learner.model, loader, data.val_set, data.vocab, cfg.train.val_beam, cfg.train.val_max_len,
                     info.device, data.on_features, options=cfg.decoding)
    return score(ddp.gather_objects(shard, info))


def _save(run: Run, data: TrainData, improved: bool, rngs: list[dict[str, Any]]) -> None:
    """latest (and best) checkpoint, then ``train_state.pt`` last; rank 0 only, each write atomic."""
    if not run.info.is_main:
        return
    prog, run_dir, model = run.progress, run.folder.path, run.learner.model
    last = prog.history[-1]
    meta = {"epoch": last["epoch"], "step": prog.step, "val_bleu4": last["BLEU-4"], "val_cider_d": last["CIDEr-D"],
            "select_metric": prog.select_metric, "val_split": run.cfg.data.val_split,
            # the random streams' identity: an --init run with the same ones replays them (initialize.replay_warning)
            "train_seed": run.cfg.train.seed, "train_batch_size": run.cfg.train.batch_size}
    save_checkpoint(run_dir / "latest.safetensors", model, data.vocab, metadata=meta)
    if improved:
        save_checkpoint(run_dir / "best.safetensors", model, data.vocab, metadata=meta)
    save_train_state(run_dir / "train_state.pt", train_state(run, rngs))


def end_of_epoch(run: Run, data: TrainData, epoch: int, complete: bool, captions_per_s: float) -> None:
    """Validate, update early stopping, log the epoch row and save (every rank calls this).

    Args:
        run: the run after ``train_one_epoch``.
        data: its validation set and vocabulary.
        epoch: 0-based epoch just trained.
        complete: its last batch was trained (False when the time budget cut it short).
        captions_per_s: training speed of the epoch, for the epoch row.

    Raises:
        CaptionerError: non-finite weights (nothing is saved).
        ImageLoadError: an unreadable validation image (one line naming it).
    """
    prog, info = run.progress, run.info
    bad = nonfinite_tensors(run.learner.model)
    if bad:  # never replace the last good checkpoint with NaN/inf weights
        raise CaptionerError(f"non-finite weights ({name_list(bad)}) at epoch {epoch + 1} step {prog.step}; not "
                             f"saving them; {run.folder.last_good()}")
    rng = capture_rng(info.device)
    try:
        metrics = _validate_all(run, data)
    except ImageLoadError as exc:
        raise image_error(run, exc, f"in the validation data after epoch {epoch + 1} step {prog.step}") from None
    restore_rng(rng, info.device)  # validation must not shift the training random stream
    row = {"epoch": epoch + 1, "step": prog.step, **prog.epoch_meter.means(), **term_shares(prog.epoch_meter.means()),
           "lr": run.session.last_lr, "captions_per_s": captions_per_s, **metrics,
           "partial": int(not complete), "seconds": run.clock.elapsed()}
    value = metrics[prog.select_metric]
    improved = value > prog.best_score
    if improved:
        prog.best_score, prog.best_bleu4, prog.best_epoch, prog.bad_epochs = value, metrics["BLEU-4"], epoch + 1, 0
    elif complete:
        prog.bad_epochs += 1
    if complete:
        decay_after_epoch(run.cfg.train, prog, run.learner.scheduler, epoch, announce=info.is_main)
        prog.epoch, prog.batch_in_epoch = epoch + 1, 0
        prog.epoch_meter = type(prog.epoch_meter)()
    prog.history.append(row)
    prog.seconds = run.clock.elapsed()
    if run.folder.logger is not None:
        run.folder.logger.write("epoch", row)
        log.info("epoch %d%s: loss %.4f, val %s %.4f (best %.4f, epoch %d), BLEU-4 %.4f, attention entropy %.3f, "
                 "%.0f s", epoch + 1, "" if complete else " (partial)", row.get("loss", math.nan), prog.select_metric,
                 value, prog.best_score, prog.best_epoch, metrics["BLEU-4"], metrics["attention_entropy"],
                 row["seconds"])
    _save(run, data, improved, ddp.gather_objects(rng, info))
