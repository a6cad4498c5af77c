"""The training loop: ``train(cfg, out_dir)`` builds a run and runs its epochs, each followed by
validation (real decoding, BLEU and CIDEr-D: ``validate``, ``score``) and a save.

A run folder holds ``config.json``, ``vocab.json``, ``best.safetensors``, ``latest.safetensors``,
``train_state.pt`` (to resume exactly), ``metrics.csv`` and ``features/``. docs/training.md explains
validation, resumption and multi-GPU runs.

Shape legend: B batch, T caption steps (with ``<bos>``/``<eos>``), N regions, D feature width.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from captioner import device as ddp
from captioner import inference
from captioner.checkpoint.store import (load_checkpoint, load_train_state, read_checkpoint_metadata, save_checkpoint,
                                        save_train_state)
from captioner.training.concepts import run_concepts
from captioner.config import Config, ModelConfig
from captioner.config.parse import MAX_CONFIG_BYTES
from captioner.data.images import attention_entropy
from captioner.decoding.search import DecodeOptions
from captioner.errors import CaptionerError, CheckpointError, ConfigError, ImageLoadError, one_line
from captioner.evaluation.metrics import bleu, cider_d
from captioner.features.dtype import model_input
from captioner.files import read_text, writable_folder
from captioner.models.model import CaptionModel, build_model, resolve_model
from captioner.models.registry import encoder_entry
from captioner.text import SPECIALS, Vocabulary
from captioner.training.data import (TrainData, load_caption_sets, load_or_build_vocab, prepare_data, train_loader,
                                     training_vocabulary, val_loader)
from captioner.training.distill import check_word_targets
from captioner.training.objective import Objective, build_cross_entropy, term_shares
from captioner.training.optim import (build_optimizer, build_schedule, decay_after_epoch, nonfinite_tensors,
                                      setup_precision)
from captioner.training.run import (Learner, Run, TrainForward, capture_rng, image_error, keep_select_metric, name_list,
                                    open_run, restore_rng, seed_everything, train_state)
from captioner.training.scst import build_self_critical
from captioner.training.step import GraphedStep, check_cuda_graph, train_one_epoch

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- the run folder


# Files the run folder writes atomically (``captioner.files.atomic_write``: ``.<name>.*.tmp``).
_ATOMIC_FILES = ("latest.safetensors", "best.safetensors", "train_state.pt", "config.json", "vocab.json")


# What a run writes: a folder holding any of these holds an earlier run.
RUN_FILES = ("train_state.pt", "latest.safetensors", "best.safetensors", "config.json", "vocab.json", "metrics.csv")


def config_diff(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested config dicts."""
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += config_diff(va, vb, f"{prefix}{key}.")
        elif (list(va) if isinstance(va, tuple) else va) != (list(vb) if isinstance(vb, tuple) else vb):
            out.append(f"{prefix}{key}")
    return out


# Settings a resumed run may change without breaking exact reproduction.
_RESUME_FREE = {"train.epochs", "train.time_budget", "train.patience", "train.device", "train.log_every",
                "data.num_workers", "train.skip_nonfinite", "data.feature_cache_dir", "data.in_memory_mb",
                "data.shared_feature_cache"}

def check_resume_config(cfg: Config, run_dir: Path) -> None:
    """Refuse a resume whose model config differs from the run's ``config.json``; warn on other changes."""
    path = run_dir / "config.json"
    if not path.exists():
        raise CheckpointError(f"{path}: missing; cannot resume this run")
    text = read_text(path, MAX_CONFIG_BYTES, CheckpointError, "config file")
    try:
        saved = Config.from_dict(json.loads(text))
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: unreadable ({one_line(str(exc))[:200]})") from None
    diff = config_diff(saved.to_dict(), cfg.to_dict())
    model_diff = [k for k in diff if k.startswith("model.")]
    if model_diff:
        raise ConfigError(f"--resume: the model config differs from {path} ({', '.join(model_diff[:4])}); "
                          "use another --out for a new model")
    other = [k for k in diff if k not in _RESUME_FREE]
    if other:
        log.warning("resuming with changed settings (%s): the run will not match an uninterrupted one",
                    ", ".join(other))


def remove_stale_temp_files(run_dir: Path) -> list[Path]:
    """Delete temporary files left in ``run_dir`` by a checkpoint write that was killed (resume only)."""
    removed = []
    for name in _ATOMIC_FILES:
        for tmp in run_dir.glob(f".{name}.*.tmp"):
            try:
                tmp.unlink()
            except OSError as exc:
                log.debug("cannot remove stale temporary file %s (%s)", tmp, exc)
                continue
            log.debug("removed %s, left by an interrupted checkpoint write", tmp)
            removed.append(tmp)
    return removed


def check_resume_vocab(vocab: Vocabulary, run_dir: Path) -> None:
    """Refuse a resume whose ``vocab.json`` is not the vocabulary ``latest.safetensors`` was trained with."""
    latest = run_dir / "latest.safetensors"
    if not latest.exists():
        return
    try:
        saved = Vocabulary.from_dict(read_checkpoint_metadata(latest)["vocab"])
    except (CaptionerError, KeyError, TypeError) as exc:
        log.debug("cannot compare vocabularies with %s (%s)", latest, exc)
        return
    if saved == vocab:
        return
    path = run_dir / "vocab.json"
    if len(saved) != len(vocab):
        raise CheckpointError(f"{path} has {len(vocab)} tokens but {latest} was trained with {len(saved)}; "
                              "put back the run's vocab.json or train into a new --out")
    index = next(i for i, (a, b) in enumerate(zip(vocab.itos, saved.itos)) if a != b)
    raise CheckpointError(f"{path} differs from the vocabulary {latest} was trained with (token {index} is "
                          f"{vocab.itos[index]!r}, was {saved.itos[index]!r}); put back the run's vocab.json "
                          "or train into a new --out")


def earlier_run_files(run_dir: Path) -> list[str]:
    """The files of :data:`RUN_FILES` that ``run_dir`` holds (none when it is not a folder)."""
    if not run_dir.is_dir():
        return []
    return [name for name in RUN_FILES if os.path.lexists(run_dir / name)]


def check_run_folder(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse a run folder this run must not write into (``ConfigError``); writes nothing.

    ``overwrite``: an earlier run there will be moved aside (:func:`move_aside`). Refused: both flags;
    a file in the way; a folder that cannot be written; an earlier run and neither flag.
    """
    if resume and overwrite:
        raise ConfigError("--resume continues the run in --out and --overwrite moves it aside to start over: "
                          "pass one of them")
    writable_folder(run_dir, ConfigError)
    found = earlier_run_files(run_dir)
    if found and not resume:
        if overwrite:
            writable_folder(run_dir.parent, ConfigError)  # the earlier run is renamed there
            return
        raise ConfigError(f"{run_dir} holds an earlier run ({', '.join(found[:3])}); pass --resume to continue it, "
                          f"--overwrite to move it to {run_dir.name}.old-<time> and start over, or another --out")


def move_aside(run_dir: Path) -> Path | None:
    """Rename a folder holding an earlier run to ``<name>.old-<YYYYmmdd-HHMMSS>``; return it, or None."""
    if not earlier_run_files(run_dir):
        return None
    base = f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}"
    target, n = run_dir.with_name(base), 1
    while os.path.lexists(target):
        n += 1
        target = run_dir.with_name(f"{base}-{n}")
    try:
        os.rename(run_dir, target)
    except OSError as exc:
        raise ConfigError(f"{run_dir}: cannot move the earlier run aside to {target} "
                          f"({exc.strerror or exc}); nothing was changed") from None
    log.warning("moved the earlier run in %s to %s (--overwrite); starting a new run", run_dir, target)
    return target


def make_run_folder(run_dir: Path) -> None:
    """Create the run folder (and its parents); one ConfigError line when that fails."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{run_dir}: cannot create the run folder ({exc.strerror or exc})") from None


@torch.inference_mode()
def validate(model: CaptionModel, loader: DataLoader, val_set: Any, vocab: Vocabulary, beam_size: int, max_len: int,
             device: torch.device, on_features: bool, options: Any = None) -> dict[str, Any]:
    """Decode captions for the loader's images; ``{"hypotheses", "references", "entropy_sum", "words"}``.

    ``loader`` yields (x, image_index), x region features (``on_features``) or images; ``options``: the
    config's ``decoding`` section, its ``beam_size`` and ``max_len`` replaced. Merge shards, then :func:`score`.
    """
    base = options if options is not None else DecodeOptions()
    options = dataclasses.replace(base, beam_size=beam_size, max_len=max_len, n_best=1)
    hyps: list[str] = []
    refs: list[list[str]] = []
    entropy_sum, words = 0.0, 0
    for batch in loader:
        if batch is None:  # no readable image in this batch (data.skip_missing)
            continue
        x, index = batch
        x = model_input(x, device)  # cached features: float16/bfloat16 -> float32 on the device
        if on_features:
            results = inference.caption_features(model, x, vocab, options)
        else:
            results = inference.caption_images(model, x, vocab, options)
        for res, i in zip(results, index.tolist()):
            hyps.append(res.text)
            refs.append(val_set.references(val_set.images[i].image_id))
            if res.attention.numel():
                entropy_sum += float(attention_entropy(res.attention.flatten(1).float()).sum())  # (L, N) -> (L,)
                words += res.attention.size(0)
    return {"hypotheses": hyps, "references": refs, "entropy_sum": entropy_sum, "words": words}


def score(shards: list[dict[str, Any]]) -> dict[str, float]:
    """Corpus BLEU-1..4 (0-1), CIDEr-D and mean attention entropy per generated word over merged shards."""
    hyps = [h for s in shards for h in s["hypotheses"]]
    refs = [r for s in shards for r in s["references"]]
    words = sum(s["words"] for s in shards)
    out = {k: float(v) for k, v in bleu(hyps, refs).items()}
    out["CIDEr-D"] = float(cider_d(hyps, refs))
    out["attention_entropy"] = sum(s["entropy_sum"] for s in shards) / words if words else float("nan")
    out["val_images"] = len(hyps)
    out["val_words"] = words / len(hyps) if hyps else 0.0  # mean caption length (0: only empty captions)
    return out


# Model settings a run may change from its --init checkpoint: training switches and test-time
# behaviour. Everything else (sizes, names, the encoder's input geometry and normalisation) must match.
INIT_FREE = frozenset({
    "model.encoder.fine_tune", "model.encoder.fine_tune_stages", "model.encoder.pretrained",
    "model.encoder.weights", "model.decoder.dropout", "model.decoder.hard_test_mode",
    "model.decoder.hard_soft_prob",
})


@dataclass
class InitWeights:
    """What a run takes from its ``--init`` checkpoint."""

    path: Path  # the checkpoint file
    state: dict[str, torch.Tensor]  # its model ``state_dict`` (CPU tensors)
    vocab: Vocabulary  # its vocabulary (the run must use it)
    config: ModelConfig  # its model config
    metadata: dict[str, Any]  # its training metadata (epoch, step, validation scores, ...)


def _show(value: Any) -> str:
    return repr(list(value) if isinstance(value, tuple) else value)


def check_init_config(path: str | Path, saved: ModelConfig, wanted: ModelConfig) -> None:
    """Refuse, in one line, a run whose model differs from the checkpoint's beyond :data:`INIT_FREE` (the
    encoder's preprocessing compared as the registry fills it in)."""
    a = {"model": dataclasses.asdict(resolve_model(saved))}
    b = {"model": dataclasses.asdict(resolve_model(wanted))}
    diff = [k for k in config_diff(a, b) if k not in INIT_FREE]
    if not diff:
        return
    diff.sort(key=lambda k: not k.endswith(".name"))  # a different encoder or decoder explains the rest
    key = diff[0]
    first = _lookup(a, key), _lookup(b, key)
    more = f" (and {len(diff) - 1} more: {', '.join(diff[1:4])})" if len(diff) > 1 else ""
    hint = (" (a decoder that reads concepts takes the concepts file it was trained with: --set train.concepts=FILE)"
            if "model.concepts.count" in diff and not wanted.concepts.count else "")
    raise ConfigError(f"--init {path}: {key} is {_show(first[0])} in the checkpoint but {_show(first[1])} in this "
                      f"run{more}; the architecture must match (only {', '.join(sorted(k[6:] for k in INIT_FREE))} "
                      f"may change){hint}")


def grown_vocabulary(saved: Vocabulary, train_set: Any, min_freq: int,
                     max_caption_len: int | None = None) -> tuple[Vocabulary, list[str]]:
    """The checkpoint's vocabulary with the training captions' words it lacks appended (those seen at
    least ``min_freq`` times), and the words added. Old words keep their ids, so their rows carry over."""
    found = training_vocabulary(train_set, min_freq, max_caption_len)
    added = [w for w in found.itos if w not in saved.stoi]
    if not added:
        return saved, []
    return Vocabulary(saved.itos[len(SPECIALS):] + added), added


def grown_state(state: dict[str, torch.Tensor], own: dict[str, torch.Tensor], old_size: int,
                new_size: int) -> dict[str, torch.Tensor]:
    """``state`` fitted to a model whose vocabulary grew: old rows from the checkpoint, new ones the model's own."""
    if new_size == old_size:
        return state
    out = dict(state)
    for key, value in state.items():
        mine = own.get(key)
        if mine is None or mine.shape == value.shape or mine.dim() != value.dim():
            continue
        dims = [d for d in range(value.dim()) if value.shape[d] != mine.shape[d]]
        if len(dims) == 1 and value.shape[dims[0]] == old_size and mine.shape[dims[0]] == new_size:
            grown = mine.detach().clone()
            grown.narrow(dims[0], 0, old_size).copy_(value)
            out[key] = grown
    return out


def check_init_vocab(path: str | Path, saved: Vocabulary, wanted: Vocabulary) -> None:
    """Refuse, in one line, a vocabulary other than the checkpoint's or the checkpoint's with words
    appended (:func:`grown_vocabulary`): its size, or the first differing token."""
    if saved == wanted or wanted.itos[:len(saved)] == saved.itos:
        return
    if len(saved) > len(wanted):
        raise ConfigError(f"--init {path}: the checkpoint's vocabulary has {len(saved)} tokens but this run's has "
                          f"{len(wanted)}; an --init run uses the checkpoint's vocabulary")
    index = next(i for i, (x, y) in enumerate(zip(saved.itos, wanted.itos)) if x != y)
    raise ConfigError(f"--init {path}: vocabulary token {index} is {saved.itos[index]!r} in the checkpoint but "
                      f"{wanted.itos[index]!r} in this run; an --init run uses the checkpoint's vocabulary")


def replay_warning(init: InitWeights, train: Any) -> str | None:
    """The warning for an ``--init`` run that would replay its checkpoint's batches and dropout masks, or None.

    With the same seed and batch size as the run that wrote the checkpoint, a second stage sees every
    caption again under the dropout mask it was trained with, so its loss reads low until the replay
    runs out. Self-critical training has no dropout, so only cross-entropy stages warn. The seed is
    read from the checkpoint's metadata or the ``config.json`` beside it; without either, None.
    """
    if train.objective != "xe":
        return None
    seed, batch_size = train.seed, train.batch_size
    seed_then, batch_then = init.metadata.get("train_seed"), init.metadata.get("train_batch_size")
    if seed_then is None:
        config_file = init.path.parent / "config.json"
        try:
            then = json.loads(read_text(config_file, MAX_CONFIG_BYTES)).get("train", {})
            seed_then, batch_then = then.get("seed"), then.get("batch_size")
        except (CaptionerError, ValueError, AttributeError, RecursionError):
            return None
    if seed_then != seed or batch_then != batch_size:
        return None
    return (f"--init {init.path}: this run has the train.seed ({seed}) and batch size ({batch_size}) of the run "
            "that wrote the checkpoint, so it replays that run's caption order and dropout masks: its training "
            "loss will read low until the replay ends. Set train.seed to another value (e.g. --set "
            f"train.seed={seed + 1}) for a fresh stream")


def load_init_checkpoint(path: str | Path, model_config: ModelConfig) -> InitWeights:
    """Read a checkpoint to start a run from and check that its architecture is the run's.

    Raises ``CheckpointError`` for an unreadable file, ``ConfigError`` for a model config differing
    beyond :data:`INIT_FREE` (naming the key).
    """
    init = read_init_checkpoint(path)
    check_init_config(init.path, init.config, model_config)
    return init


def read_init_checkpoint(path: str | Path) -> InitWeights:
    """Read a checkpoint to start a run from (what -c takes: a shipped model's name, a file, a run folder or a
    URL), leaving :func:`load_init_checkpoint`'s check to the caller."""
    try:
        path = inference.checkpoint_path(path)
    except CheckpointError as exc:
        raise CheckpointError(f"--init {exc}") from None
    if not os.path.lexists(path):
        raise CheckpointError(f"--init {path}: checkpoint not found")
    try:
        loaded = load_checkpoint(path)  # never downloads; refuses unsafe or broken files in one line
    except CheckpointError as exc:
        raise CheckpointError(f"--init {exc}") from None
    state = {k: v.detach() for k, v in loaded.model.state_dict().items()}
    return InitWeights(path, state, loaded.vocab, loaded.config, dict(loaded.metadata))


def apply_init(model: torch.nn.Module, init: InitWeights, vocab: Vocabulary) -> None:
    """Copy the checkpoint's weights into ``model``; ``ConfigError`` when ``vocab`` is not the checkpoint's."""
    check_init_vocab(init.path, init.vocab, vocab)
    own = model.state_dict()
    state = grown_state(init.state, own, len(init.vocab), len(vocab))
    wrong = [k for k in own if k not in state or own[k].shape != state[k].shape]
    extra = [k for k in init.state if k not in own]
    if wrong or extra:
        name = (wrong or extra)[0]
        raise CheckpointError(f"--init {init.path}: its weights do not fit this model ({len(wrong)} missing or "
                              f"reshaped, {len(extra)} unexpected, e.g. {name})")
    with torch.no_grad():
        model.load_state_dict(state, strict=True)
    log.info("initialised the model from %s (epoch %s, step %s)", init.path, init.metadata.get("epoch", "?"),
             init.metadata.get("step", "?"))


def _lookup(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _validate_all(run: Run, data: TrainData) -> dict[str, float]:
    """Sharded validation over ranks (rank r takes images r, r+K, ...), decoded as ``captioner evaluate`` does."""
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

    ``complete``: the epoch's last batch was trained. Raises ``CaptionerError`` for non-finite weights
    (nothing is saved), ``ImageLoadError`` for an unreadable validation image.
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


ObjectiveBuilder = Callable[[Config, Any, Vocabulary], Objective]


BUILDERS: dict[str, ObjectiveBuilder] = {"xe": build_cross_entropy, "scst": build_self_critical}  # keys: OBJECTIVES


def build_objective(cfg: Config, train_set: Any, vocab: Vocabulary, device: torch.device) -> Objective:
    """The objective ``cfg.train.objective`` names, over ``train_set``, its buffers on ``device``."""
    return BUILDERS[cfg.train.objective](cfg, train_set, vocab).to(device)


@dataclass
class TrainResult:
    """What ``train`` returns: ``history``, one dict per validation (the rows of ``metrics.csv``)."""

    best_checkpoint: Path  # ``best.safetensors`` (highest validation ``select_metric``)
    latest_checkpoint: Path  # ``latest.safetensors`` (weights after the last trained batch)
    best_bleu4: float  # validation BLEU-4 of the best checkpoint, 0-1 scale
    history: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0  # wall time of this call
    select_metric: str = "CIDEr-D"  # the metric the best checkpoint was selected on ("CIDEr-D" or "BLEU-4")
    best_score: float = 0.0  # its value for the best checkpoint
    best_epoch: int = 0  # 1-based epoch of the best checkpoint


def check_training_memory(cfg: Config, vocab_size: int, device: torch.device, world_size: int = 1,
                          captions: int | None = None) -> None:
    """Refuse, before the first write, a ``train.batch_size`` whose least memory passes what ``device`` has:
    the weights with their gradients and Adam's two moments (the model counted on the meta device), and
    one step's logits (with their softmax and gradient) and region features. A lower bound: what it
    refuses cannot run; a model of absurd widths is refused the same way. ``captions``: how many the
    training split has (no batch holds more)."""
    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(cfg.model, vocab_size, load_pretrained=False).parameters())
    enc = cfg.model.encoder
    regions, dim = enc.grid ** 2, encoder_entry(enc.name).feature_dim(enc)
    batch = math.ceil(min(cfg.train.batch_size, captions or cfg.train.batch_size) / max(1, world_size))
    words = cfg.data.max_caption_len + 1
    need = 4 * (4 * params + batch * (3 * words * vocab_size + regions * dim))
    ddp.check_memory(need, f"training with train.batch_size {cfg.train.batch_size} ({batch} per process), "
                           f"{params:,} parameters and {vocab_size} words",
                     "lower train.batch_size (--batch-size) or the model's widths", device)


def train(cfg: Config, out_dir: str | Path, resume: bool = False, progress: bool = True,
          overwrite: bool = False) -> TrainResult:
    """Train a captioner; all outputs go to the run folder ``out_dir`` (on every rank: a ``TrainResult``).

    ``resume``: continue ``out_dir/train_state.pt`` exactly; ``overwrite``: move an earlier run to
    ``<out_dir>.old-<time>`` (never deleted), which is otherwise refused. Raises ``CaptionerError`` for
    bad data, config or run folder, an ``--init`` checkpoint of another architecture or a non-finite
    loss; nothing is written before the checks.
    """
    start = time.monotonic()
    # the encoder's name checked and its weights' preprocessing written into the config the run saves
    cfg = dataclasses.replace(cfg, model=resolve_model(cfg.model))
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
            init = read_init_checkpoint(cfg.train.init)
            extension = run_concepts(cfg, init.vocab)  # it sizes the decoder the checkpoint must match
            cfg = extension.cfg
            check_init_config(init.path, init.config, cfg.model)
            replay = replay_warning(init, cfg.train)
            if replay and info.is_main:
                log.warning("%s", replay)
    train_set, val_set = load_caption_sets(cfg)
    check_word_targets(cfg)  # before the first write, as the data and the init checkpoint are
    if val_set.split != cfg.data.val_split:  # the data's own name for it (dev, val, validation): recorded
        cfg = cfg.override(**{"data.val_split": val_set.split})
    if init is not None:  # the checkpoint's words keep their rows; the data's new words are appended
        vocab, added = grown_vocabulary(init.vocab, train_set, cfg.data.min_freq, cfg.data.max_caption_len)
        if info.is_main:
            log.info("--init %s: %s", init.path, f"{len(added)} words of the training captions are new to the "
                     f"checkpoint's {len(init.vocab)}-token vocabulary and were added, with fresh rows: "
                     f"{', '.join(added[:8])}{' ...' if len(added) > 8 else ''}" if added
                     else "every word of the training captions is in the checkpoint's vocabulary")
    else:
        vocab = load_or_build_vocab(train_set, cfg.data.min_freq, run_dir, resume, cfg.data.max_caption_len)
        extension = run_concepts(cfg, vocab)  # checked before the first write
        cfg = extension.cfg
    if resume:
        check_resume_vocab(vocab, run_dir)
    check_training_memory(cfg, len(vocab), info.device, info.world_size, train_set.num_captions)
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
    extension.install(model.decoder, info.device)  # the extension's weights, from its files
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
    learner = Learner(model, forward, objective, optimizer, scheduler, precision)
    if t.cuda_graph:
        learner.graphed = GraphedStep(model.decoder, objective, vocab.pad_id, precision.dtype)
    run = open_run(cfg, info, learner, run_dir, start, progress, saved)
    del saved
    if info.distributed:
        run.learner.forward = nn.parallel.DistributedDataParallel(
            forward, device_ids=[info.device.index] if info.device.type == "cuda" else None,
            forward_sync_buffers=forward.encoder_trainable)  # BatchNorm stats of a fine-tuned encoder
    if info.is_main:
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
