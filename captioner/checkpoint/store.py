"""Self-contained checkpoints: model config + vocabulary + weights in one file, written atomically.

Layout (format "captioner", version 1). The default is one ``.safetensors`` file: the tensors are the
model's ``state_dict`` (contiguous; a tensor shared under several names, e.g. tied embeddings, is
stored once and the other names are listed in ``aliases``) and the string->string header metadata is

    format          "captioner"
    format_version  "1"
    config          JSON of dataclasses.asdict(model.config)  (ModelConfig)
    vocab           JSON of Vocabulary.to_dict()
    vocab_size      decimal string
    aliases         JSON {alias name: stored name}
    metadata        JSON: training metadata (epoch, step, metrics, ...) plus created / torch_version /
                    captioner_version

A ``.pt`` / ``.pth`` path gets the same content through ``torch.save`` of plain containers (the
metadata fields as strings, the tensors under ``state_dict``); it is always read back with
``torch.load(weights_only=True)``, so a file that would run code when unpickled is refused. Nothing
else is needed to rebuild the model: the architecture comes from the config, never from pickled
modules, and encoder weights are never downloaded on load.

Files are recognised by content, not by name (:mod:`captioner.checkpoint.format`). Loading builds
the model on the meta device, checks every tensor name and shape against the file, and only then
allocates (uninitialised) storage and copies the weights in (:mod:`captioner.checkpoint.build`): a
header with absurd sizes is refused before anything big is allocated, and no time is spent on a
random initialisation. Every write is atomic (:func:`captioner.files.atomic_write`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as _st_save

from captioner.files import atomic_write
from captioner.checkpoint.build import as_checkpoint_error, build_model_from_state
from captioner.checkpoint.format import FORMAT, FORMAT_VERSION, first_line, parse_header, read_file, torch_load
from captioner.config import ModelConfig, model_config_from_dict
from captioner.errors import CheckpointError, ConfigError
from captioner.text import Vocabulary
from captioner.version import __version__

logger = logging.getLogger(__name__)

__all__ = ["FORMAT", "FORMAT_VERSION", "LoadedCheckpoint", "load_checkpoint", "load_train_state",
           "read_checkpoint_metadata", "save_checkpoint", "save_train_state"]

TORCH_SUFFIXES = (".pt", ".pth", ".bin")


@dataclass
class LoadedCheckpoint:
    """A rebuilt model (eval mode) with everything that travelled with it."""

    model: torch.nn.Module
    vocab: Vocabulary
    config: ModelConfig
    metadata: dict[str, Any]


# ----------------------------------------------------------------------------- saving


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _dedupe(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Contiguous CPU tensors that share no memory; a tensor under several names is kept once."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, t in state.items():
        t = t.detach().to("cpu")
        if t.numel() == 0:
            tensors[name] = t.contiguous()
            continue
        ptr = t.untyped_storage().data_ptr()
        key = (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key in seen:  # the same tensor under another name (tied weights)
            aliases[name] = seen[key]
            continue
        seen[key] = name
        whole = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        tensors[name] = t if whole and ptr not in storages else t.contiguous().clone()  # views: own copy
        storages.add(ptr)
    return tensors, aliases


def _header(model: torch.nn.Module, vocab: Vocabulary, metadata: Mapping[str, Any] | None,
            aliases: dict[str, str]) -> dict[str, str]:
    config = getattr(model, "config", None)
    vocab_size = getattr(model, "vocab_size", None)
    if not dataclasses.is_dataclass(config) or not isinstance(vocab_size, int):
        raise CheckpointError("save_checkpoint needs a CaptionModel (a model with .config and .vocab_size)")
    if len(vocab) != vocab_size:
        raise CheckpointError(f"vocabulary has {len(vocab)} tokens but the model was built for {vocab_size}")
    meta = dict(metadata or {})
    meta.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    meta.setdefault("torch_version", torch.__version__)
    meta.setdefault("captioner_version", __version__)
    try:
        meta_json = json.dumps(meta, default=_json_default)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint metadata is not JSON serialisable: {exc}") from None
    return {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "config": json.dumps(dataclasses.asdict(config)),
        "vocab": json.dumps(vocab.to_dict(), ensure_ascii=False),
        "vocab_size": str(vocab_size),
        "aliases": json.dumps(aliases),
        "metadata": meta_json,
    }


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module, vocab: Vocabulary,
                    metadata: Mapping[str, Any] | None = None, file_format: str | None = None) -> Path:
    """Write model config, vocabulary, weights and metadata to one file, atomically.

    Args:
        path: output file; ``.safetensors`` (default) or ``.pt``/``.pth``/``.bin`` (torch.save of
            tensors and strings only).
        model: a ``CaptionModel``.
        vocab: its vocabulary (``len(vocab) == model.vocab_size``).
        metadata: JSON-serialisable training metadata (epoch, step, metrics, ...).
        file_format: "safetensors" or "torch"; default from the suffix.

    Returns:
        The path written.
    """
    path = Path(path)
    fmt = file_format or ("torch" if path.suffix.lower() in TORCH_SUFFIXES else "safetensors")
    if fmt not in ("safetensors", "torch"):
        raise CheckpointError(f"unknown checkpoint file_format {fmt!r}: use safetensors or torch")
    tensors, aliases = _dedupe(model.state_dict())
    header = _header(model, vocab, metadata, aliases)
    if fmt == "safetensors":
        data = _st_save(tensors, metadata=header)
        atomic_write(path, lambda f: f.write(data))
    else:
        payload = {**header, "state_dict": tensors}
        atomic_write(path, lambda f: torch.save(payload, f))
    logger.info("saved checkpoint %s (%d tensors)", path, len(tensors))
    return path


# ----------------------------------------------------------------------------- loading


def read_checkpoint_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Config, vocabulary and training metadata of a checkpoint, without building the model.

    Returns:
        ``{"config": dict, "vocab": dict, "vocab_size": int, "metadata": dict, "aliases": dict,
        "format_version": int}``.
    """
    path = Path(path)
    header, _ = read_file(path, want_tensors=False)
    return parse_header(path, header)


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu") -> LoadedCheckpoint:
    """Rebuild a model from a checkpoint (never downloads) and load its weights strictly.

    Args:
        path: a file written by :func:`save_checkpoint` (safetensors or torch format).
        device: where the model goes.

    Returns:
        ``LoadedCheckpoint(model in eval mode, vocab, config, metadata)``.

    Raises:
        CheckpointError: missing, truncated, foreign or unsafe file, a config or vocabulary that is
            invalid or asks for absurd sizes, or weights that do not match.
    """
    path = Path(path)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"bad device {device!r} ({first_line(exc)})") from None
    header, state = read_file(path, want_tensors=True)
    info = parse_header(path, header)
    with as_checkpoint_error(path, "bad config or vocabulary in checkpoint"):
        config = model_config_from_dict(info["config"])
        vocab = Vocabulary.from_dict(info["vocab"])
    if len(vocab) != info["vocab_size"]:
        raise CheckpointError(f"{path}: vocab size mismatch: vocabulary has {len(vocab)} tokens, "
                              f"checkpoint says {info['vocab_size']}")
    state = dict(state or {})
    for alias, stored in info["aliases"].items():
        if stored not in state:
            raise CheckpointError(f"{path}: alias {alias[:120]} points to missing tensor {stored[:120]}")
        state[alias] = state[stored]
    model = build_model_from_state(path, config, info["vocab_size"], state, device)
    return LoadedCheckpoint(model=model, vocab=vocab, config=config, metadata=info["metadata"])


# ----------------------------------------------------------------------------- training state

_ALLOWED_LEAVES = (torch.Tensor, int, float, bool, str, type(None))


def _check_train_state(value: Any, where: str) -> None:
    if isinstance(value, _ALLOWED_LEAVES):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_train_state(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise CheckpointError(f"train state key {k!r} at {where or 'top level'} must be a str or int")
            _check_train_state(v, f"{where}.{k}" if where else str(k))
        return
    raise CheckpointError(f"train state value at {where or 'top level'} is a {type(value).__name__}; only "
                          "tensors, numbers, strings, None, lists and dicts are allowed")


def save_train_state(path: str | os.PathLike, state: Mapping[str, Any]) -> Path:
    """Atomically ``torch.save`` resumable training state (optimizer/scheduler dicts, RNG tensors,
    counters). Only tensors, numbers, strings, None, lists/tuples and dicts are accepted."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"train state must be a dict, got {type(state).__name__}")
    _check_train_state(dict(state), "")
    payload = dict(state)
    return atomic_write(path, lambda f: torch.save(payload, f))


def load_train_state(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a file written by :func:`save_train_state` with ``torch.load(weights_only=True)``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: training state not found")
    state = torch_load(path, device, "training state")
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a training state (expected a dict, got {type(state).__name__})")
    return state
