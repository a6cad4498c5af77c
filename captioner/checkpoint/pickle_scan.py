"""Which pickled globals made ``torch.load(weights_only=True)`` refuse a file, read from its opcodes.

When the weights-only unpickler refuses a file, the message names the classes or functions it
would have had to import, found without depending on the wording of torch's error (which changes
between releases): for a ``torch.save`` zip archive through torch's structured
``torch.serialization.get_unsafe_globals_in_checkpoint``; for a legacy ``torch.save`` stream or a
plain pickle by disassembling its pickles with :mod:`pickletools` (nothing is executed) and keeping
the globals torch does not allow. Neither reads more than :data:`MAX_SCAN_BYTES`.
"""

from __future__ import annotations

import io
import pickletools
import zipfile
from pathlib import Path

import torch

__all__ = ["blocked_globals", "refusal_reason"]

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
