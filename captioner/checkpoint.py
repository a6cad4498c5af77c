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
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file as _st_load_file
from safetensors.torch import save as _st_save

from captioner.config import ModelConfig, model_config_from_dict
from captioner.errors import CaptionerError, CheckpointError, ConfigError
from captioner.text import Vocabulary

logger = logging.getLogger(__name__)

FORMAT = "captioner"
FORMAT_VERSION = 1
TORCH_SUFFIXES = (".pt", ".pth", ".bin")


@dataclass
class LoadedCheckpoint:
    """A rebuilt model (eval mode) with everything that travelled with it."""

    model: torch.nn.Module
    vocab: Vocabulary
    config: ModelConfig
    metadata: dict[str, Any]


# ----------------------------------------------------------------------------- atomic writes


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
    """Write a file so that readers see either the old or the complete new content.

    ``write(f)`` fills a temporary file in the same folder; it is flushed and fsync'ed, renamed over
    ``path`` with ``os.replace`` and the folder is fsync'ed. On any failure the temporary file is
    removed and the previous ``path`` is left untouched.

    Raises:
        CheckpointError: the folder is missing or the file cannot be written.
    """
    path = Path(path)
    folder = path.parent
    if not folder.is_dir():
        raise CheckpointError(f"{path}: folder {folder} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot write ({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise CheckpointError(f"{path}: cannot write ({exc.strerror or exc})") from None
        raise
    _fsync_dir(folder)
    return path


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory; the rename is still atomic
        pass
    finally:
        os.close(fd)


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
    import captioner

    config = getattr(model, "config", None)
    vocab_size = getattr(model, "vocab_size", None)
    if not dataclasses.is_dataclass(config) or not isinstance(vocab_size, int):
        raise CheckpointError("save_checkpoint needs a Captioner (a model with .config and .vocab_size)")
    if len(vocab) != vocab_size:
        raise CheckpointError(f"vocabulary has {len(vocab)} tokens but the model was built for {vocab_size}")
    meta = dict(metadata or {})
    meta.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    meta.setdefault("torch_version", torch.__version__)
    meta.setdefault("captioner_version", captioner.__version__)
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
        model: a ``Captioner``.
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _unpickling_reason(exc: BaseException) -> str:
    """The informative part of torch's weights_only refusal, e.g. 'Unsupported global: GLOBAL io.open'."""
    for line in str(exc).splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].split(" was not an allowed")[0].strip()[:160]
    return _first_line(exc)[:160]


def _read(path: Path, want_tensors: bool) -> tuple[dict[str, str], dict[str, torch.Tensor] | None]:
    """Header strings (and tensors) from either file format; CheckpointError on anything wrong."""
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint not found")
    if not path.is_file():
        raise CheckpointError(f"{path}: not a file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(9)
    if not magic:
        raise CheckpointError(f"{path}: empty file, not a checkpoint")
    if magic[:2] == b"PK" or magic[:1] == b"\x80":  # torch.save zip archive or a legacy pickle
        return _read_torch(path, want_tensors)
    # safetensors: 8-byte little-endian header length, then a JSON header starting with "{"
    if size < 9:
        raise CheckpointError(f"{path}: truncated checkpoint or not a checkpoint (only {size} bytes)")
    header_len = int.from_bytes(magic[:8], "little")
    if magic[8:9] != b"{" or header_len > 100_000_000:
        raise CheckpointError(f"{path}: not a captioner checkpoint (neither safetensors nor torch.save data)")
    if 8 + header_len > size:
        raise CheckpointError(f"{path}: truncated checkpoint (header needs {8 + header_len} bytes, file has {size})")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = dict(f.metadata() or {})
    except SafetensorError as exc:
        reason = _first_line(exc)
        if "incomplete" in reason or "not fully covered" in reason:
            raise CheckpointError(f"{path}: truncated checkpoint (tensor data shorter than the header says)") from None
        raise CheckpointError(f"{path}: corrupt safetensors file ({reason})") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    _check_header(path, header)
    if not want_tensors:
        return header, None
    try:
        tensors = _st_load_file(str(path), device="cpu")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint ({_first_line(exc)})") from None
    return header, tensors


def _read_torch(path: Path, want_tensors: bool) -> tuple[dict[str, str], dict[str, torch.Tensor] | None]:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{path}: refused: the file holds pickled objects that weights_only loading "
                              f"does not allow, it may run code ({_unpickling_reason(exc)})") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint ({_first_line(exc)[:160]})") from None
    if not isinstance(payload, dict) or "format" not in payload:
        kind = "a bare state dict" if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"{path}: not a captioner checkpoint (no 'format' entry; looks like {kind})")
    state = payload.get("state_dict")
    header = {k: v for k, v in payload.items() if k != "state_dict"}
    if not all(isinstance(v, str) for v in header.values()):
        raise CheckpointError(f"{path}: not a captioner checkpoint (header entries must be strings)")
    _check_header(path, header)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: checkpoint has no 'state_dict' of tensors")
    return header, state if want_tensors else None


def _check_header(path: Path, header: Mapping[str, str]) -> None:
    if header.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a captioner checkpoint (format={header.get('format')!r})")
    version = header.get("format_version", "")
    if not version.isdigit() or int(version) > FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {version!r} is newer than this "
                              f"captioner reads ({FORMAT_VERSION}); upgrade captioner")
    missing = [k for k in ("config", "vocab", "vocab_size") if k not in header]
    if missing:
        raise CheckpointError(f"{path}: checkpoint header lacks {', '.join(missing)}")


def read_checkpoint_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Config, vocabulary and training metadata of a checkpoint, without building the model.

    Returns:
        ``{"config": dict, "vocab": dict, "vocab_size": int, "metadata": dict, "format_version": int}``.
    """
    path = Path(path)
    header, _ = _read(path, want_tensors=False)
    return _parse_header(path, header)


def _parse_header(path: Path, header: Mapping[str, str]) -> dict[str, Any]:
    try:
        out = {key: json.loads(header.get(key, "{}")) for key in ("config", "vocab", "metadata", "aliases")}
        out["vocab_size"] = int(header["vocab_size"])
    except ValueError as exc:
        raise CheckpointError(f"{path}: corrupt checkpoint header ({_first_line(exc)})") from None
    out["format_version"] = int(header["format_version"])
    return out


def _check_weights(path: Path, model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [k for k in expected if k in state and tuple(state[k].shape) != tuple(expected[k].shape)]
    problems = []
    for label, keys in (("missing keys", missing), ("unexpected keys", unexpected)):
        if keys:
            more = f" (+{len(keys) - 3} more)" if len(keys) > 3 else ""
            problems.append(f"{label} {', '.join(keys[:3])}{more}")
    for k in shapes[:3]:
        got, want = tuple(state[k].shape), tuple(expected[k].shape)
        problems.append(f"shape mismatch for {k}: checkpoint {got} vs model {want}")
    if problems:
        raise CheckpointError(f"{path}: weights do not match the model built from its config: {'; '.join(problems)}")


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu") -> LoadedCheckpoint:
    """Rebuild a model from a checkpoint (never downloads) and load its weights strictly.

    Args:
        path: a file written by :func:`save_checkpoint` (safetensors or torch format).
        device: where the model goes.

    Returns:
        ``LoadedCheckpoint(model in eval mode, vocab, config, metadata)``.

    Raises:
        CheckpointError: missing, truncated, foreign or unsafe file, or weights that do not match.
    """
    from captioner.models.captioner import build_model

    path = Path(path)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"bad device {device!r} ({_first_line(exc)})") from None
    header, state = _read(path, want_tensors=True)
    info = _parse_header(path, header)
    try:
        config = model_config_from_dict(info["config"])
        vocab = Vocabulary.from_dict(info["vocab"])
    except CaptionerError as exc:
        raise CheckpointError(f"{path}: bad config or vocabulary in checkpoint ({exc})") from None
    if len(vocab) != info["vocab_size"]:
        raise CheckpointError(f"{path}: vocab size mismatch: vocabulary has {len(vocab)} tokens, "
                              f"checkpoint says {info['vocab_size']}")
    state = dict(state or {})
    for alias, stored in info["aliases"].items():
        if stored not in state:
            raise CheckpointError(f"{path}: alias {alias} points to missing tensor {stored}")
        state[alias] = state[stored]
    model = build_model(config, vocab_size=info["vocab_size"], load_pretrained=False)
    _check_weights(path, model, state)
    model.load_state_dict(state, strict=True)
    model.to(device).eval()
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
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{path}: refused: the file holds pickled objects that weights_only loading "
                              f"does not allow ({_unpickling_reason(exc)})") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: truncated or corrupt training state ({_first_line(exc)[:160]})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a training state (expected a dict, got {type(state).__name__})")
    return state
