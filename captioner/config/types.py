"""Per-key type checks of config values, derived from the dataclass field types.

:func:`captioner.config.parse.from_dict` runs :func:`check_value` on every value before a section's
``__post_init__`` sees it, so a value of the wrong type (``train.time_budget=abc``,
``train.batch_size=2.5``, ``decoder.hidden_dim=abc``) is refused in one line that names the key,
the value and the type wanted, before anything is written or computed, instead of failing later
inside a comparison or in the middle of training.

Rules: ``bool`` takes only true/false; ``int`` takes whole numbers (``4e3`` is 4000, ``2.5`` is
refused, and so are booleans); ``float`` takes finite numbers (ints become floats; NaN and
infinity are refused); ``str`` takes strings; ``X | None`` also takes null; ``tuple[X, ...]``
takes a list or tuple of that length.
"""

from __future__ import annotations

import functools
import math
import types
import typing
from typing import Any

from captioner.errors import ConfigError

_NAMES = {bool: "true or false", int: "a whole number", float: "a finite number", str: "a string"}


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """``{field name: resolved type hint}`` of a config dataclass."""
    return typing.get_type_hints(cls)


def wanted(hint: Any) -> str:
    """How a type hint reads in an error message: ``float | None`` -> ``"a finite number or null"``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [wanted(a) for a in args if a is not type(None)]
        return " or ".join(parts + (["null"] if type(None) in args else []))
    if origin is tuple:
        inner = {wanted(a) for a in args if a is not Ellipsis}
        return f"a list of {len(args)} values, each {' or '.join(sorted(inner))}"
    if hint is Any:
        return "any value"
    return _NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a whole number", float: "a number", str: "a string",
            list: "a list", tuple: "a list", dict: "a mapping"}.get(type(value), f"a {type(value).__name__}")


def _coerce(value: Any, hint: Any) -> tuple[bool, Any]:
    """(accepted, value converted to the field's type)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return True, None
        for arg in args:
            if arg is not type(None):
                ok, converted = _coerce(value, arg)
                if ok:
                    return True, converted
        return False, value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return False, value
        if len(args) == 2 and args[1] is Ellipsis:
            items = [_coerce(v, args[0]) for v in value]
        elif len(value) != len(args):
            return False, value
        else:
            items = [_coerce(v, a) for v, a in zip(value, args)]
        return all(ok for ok, _ in items), tuple(v for _, v in items)
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        if isinstance(value, bool):
            return False, value
        if isinstance(value, int):
            return True, value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return True, int(value)
        return False, value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False, value
        return math.isfinite(value), float(value)
    if hint is str:
        return isinstance(value, str), value
    if isinstance(hint, type):
        return isinstance(value, hint), value
    return True, value  # a hint this checker does not know: left to the dataclass


def check_value(key: str, value: Any, hint: Any) -> Any:
    """``value`` converted to the type ``hint`` of config key ``key``.

    Raises:
        ConfigError: one line naming the key, the value and the type wanted, e.g. ``train.time_budget:
            got 'abc' (a string), wanted a finite number or null``.
    """
    ok, converted = _coerce(value, hint)
    if ok:
        return converted
    extra = ""
    if isinstance(value, float) and not math.isfinite(value):
        extra = " (NaN and infinity are not accepted)"
    elif isinstance(value, str) and typing.get_origin(hint) is tuple:
        extra = " (write it as a JSON list, e.g. [0.9, 0.98])"
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and "a string" in wanted(hint):
        extra = f" (quote it to pass the text: {key}='\"{value}\"')"
    raise ConfigError(f"{key}: got {_show(value)} ({_kind(value)}), wanted {wanted(hint)}{extra}")


def check_section(cls: type, data: dict[str, Any], prefix: str, skip: set[str]) -> dict[str, Any]:
    """Every value of a section's mapping checked and converted (keys in ``skip``, sub-sections, untouched)."""
    hints = field_types(cls)
    return {k: v if k in skip or k not in hints else check_value(prefix + k, v, hints[k]) for k, v in data.items()}
