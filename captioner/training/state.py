"""Run state for exact resumption: loop progress and random-generator states.

``train_state.pt`` may hold only tensors, numbers, strings and containers of them, so the Python
and NumPy generator states (tuples with a NumPy array inside) are converted to lists and tensors
here, and converted back on restore.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from captioner.checkpoint.store import read_checkpoint_metadata
from captioner.config import Config
from captioner.config.parse import MAX_CONFIG_BYTES
from captioner.errors import CaptionerError, CheckpointError, ConfigError, one_line
from captioner.files import read_text
from captioner.text import Vocabulary
from captioner.training.logging_utils import RunningMean

log = logging.getLogger(__name__)


def capture_rng(device: torch.device | None = None) -> dict[str, Any]:
    """Snapshot the torch CPU, CUDA (``device``'s, when CUDA), Python and NumPy generators."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),  # uint8 tensor
        "python": [int(version), [int(x) for x in internal], gauss],
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Put back a snapshot from :func:`capture_rng` (the CUDA part only when both sides have CUDA)."""
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    npst = state["numpy"]
    keys = npst["keys"].numpy().astype(np.uint32)
    np.random.set_state((npst["kind"], keys, int(npst["pos"]), int(npst["has_gauss"]),
                         float(npst["cached_gaussian"])))
    if "cuda" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and every GPU), Python and NumPy."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


@dataclass
class Progress:
    """Where a run stands; saved in ``train_state.pt`` and restored on resume.

    Attributes:
        epoch: current epoch, 0-based (== epochs when training has finished).
        batch_in_epoch: batches of ``epoch`` already trained (> 0 after a mid-epoch stop).
        step: batches trained in total (the x axis of every log).
        select_metric: the validation metric this run selects on (``train.select_metric`` when the
            run started; a resume keeps it).
        best_score: best ``select_metric`` so far (-1 before the first validation).
        best_bleu4: validation BLEU-4 (0-1 scale) of that best checkpoint.
        best_epoch: 1-based epoch of ``best_score``.
        bad_epochs: epochs since the last improvement (early stopping, plateau decay).
        seconds: training wall time of all sessions of this run.
        skipped: batches skipped for a non-finite loss or gradient (``train.skip_nonfinite``).
        history: one dict per validation (the epoch rows of ``metrics.csv``).
        epoch_meter: loss means of the current epoch so far.
        window_meter: loss means since the last step row.
    """

    epoch: int = 0
    batch_in_epoch: int = 0
    step: int = 0
    select_metric: str = "CIDEr-D"
    best_score: float = -1.0
    best_bleu4: float = -1.0
    best_epoch: int = 0
    bad_epochs: int = 0
    seconds: float = 0.0
    skipped: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    epoch_meter: RunningMean = field(default_factory=RunningMean)
    window_meter: RunningMean = field(default_factory=RunningMean)

    def state_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["history"] = [dict(h) for h in self.history]
        out["epoch_meter"] = self.epoch_meter.state_dict()
        out["window_meter"] = self.window_meter.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved state, including those of older versions (see :func:`migrate_progress`)."""
        state = migrate_progress(state)
        for f in fields(self):
            if f.name in ("epoch_meter", "window_meter"):
                getattr(self, f.name).load_state_dict(state[f.name])
            elif f.name == "history":
                self.history = [dict(h) for h in state["history"]]
            else:
                setattr(self, f.name, type(f.default)(state[f.name]))


def migrate_progress(state: dict[str, Any]) -> dict[str, Any]:
    """A saved ``Progress`` state in the current layout (a copy; the input is left alone).

    States from before selection metrics selected on BLEU-4 alone: they have ``best_bleu4`` and no
    ``best_score``, so their ``select_metric`` is BLEU-4 and their best score is that BLEU-4. States
    from before ``skipped`` count no skipped batches.
    """
    state = dict(state)
    if "best_score" not in state:
        state["select_metric"] = "BLEU-4"
        state["best_score"] = state["best_bleu4"]
    state.setdefault("skipped", 0)
    return state


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
                "data.num_workers", "train.skip_nonfinite", "data.feature_cache_dir", "data.in_memory_mb"}


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


# Files the run folder writes atomically (``captioner.files.atomic_write``: ``.<name>.*.tmp``).
_ATOMIC_FILES = ("latest.safetensors", "best.safetensors", "train_state.pt", "config.json", "vocab.json")


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
    """Refuse a resume whose ``vocab.json`` is not the vocabulary ``latest.safetensors`` was trained with.

    The checkpoint header holds the vocabulary, so this needs no model. An unreadable checkpoint
    is left for loading ``train_state.pt`` to report.
    """
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
