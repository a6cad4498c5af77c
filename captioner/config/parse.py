"""Nested mappings <-> config dataclasses, dotted ``key=value`` overrides and config files.

A field whose type hint is a dataclass is a section; a ``DecoderConfig`` field is parsed as the
family its ``name`` picks. Every value is checked against its field's type (:func:`check_value`)
before ``__post_init__`` sees it: ``bool`` takes only true/false; ``int`` whole numbers (``4e3``
yes, ``2.5`` and booleans no); ``float`` finite numbers; ``X | None`` also null; ``tuple[X, ...]``
a list of that length. Unknown keys and wrong types are one-line errors naming the key.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import reprlib
import types
import typing
from pathlib import Path
from typing import Any

from captioner.config.decoders import DEFAULT_DECODER, DecoderConfig, decoder_family, keys_help, switched_family
from captioner.errors import ConfigError
from captioner.files import MiB, read_text


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


_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxlevel = 50, 50, 4, 4, 2


def _show(value: Any) -> str:
    """A short quotation of ``value`` (at most 60 characters, built without expanding all of it)."""
    text = _SHORT.repr(value)
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
    """``value`` converted to the type ``hint`` of key ``key``, or a one-line ``ConfigError`` naming both."""
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


MAX_CONFIG_BYTES = 16 * MiB  # config files and a run's config.json (a few KB in practice)
FAMILY_KEY = "model.decoder.name"  # applied before the other overrides: it picks which keys exist


@functools.cache
def sections(cls: type) -> dict[str, type]:
    """The fields of dataclass ``cls`` that are themselves dataclasses: ``{field name: its class}``."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)
            if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name])}


def _where(prefix: str) -> str:
    return prefix.rstrip(".") or "config"


def _check_family_keys(family: type[DecoderConfig], data: dict[str, Any], prefix: str) -> None:
    """ConfigError for a decoder key the family lacks, naming its keys (and the family that has it)."""
    names = {f.name for f in dataclasses.fields(family)}
    unknown = sorted(k for k in data if k not in names)
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(prefix + k for k in unknown)} "
                          f"({keys_help(family, unknown[0])})")


def from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a nested mapping (missing keys take defaults), validating every field.

    ``prefix``: the dotted path of ``data`` (``"model."``) for messages. Raises ``ConfigError`` for an
    unknown key, a section that is not a mapping, a wrong type, or a value ``__post_init__`` refuses.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{_where(prefix)} must be a mapping, got {type(data).__name__}")
    if cls is DecoderConfig:
        cls = decoder_family(data.get("name", DEFAULT_DECODER))
        _check_family_keys(cls, data, prefix)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(prefix + k for k in unknown)}")
    subs = sections(cls)
    kwargs = {k: from_dict(subs[k], v, f"{prefix}{k}.") if k in subs else v for k, v in data.items()}
    kwargs = check_section(cls, kwargs, prefix, skip=set(subs))  # each value's type, named by its key
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"bad config for {_where(prefix)}: {exc}") from None


def family_first(items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Overrides with ``model.decoder.name`` first (stable): the family it picks decides the valid keys."""
    return sorted(items, key=lambda item: item[0] != FAMILY_KEY)


def set_dotted(cls: type, data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``key`` (``"train.lr"``) in the mapping ``data`` of ``cls``, in place; another decoder family resets its section."""
    parts = key.split(".")
    node, node_cls = data, cls
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict) or part not in sections(node_cls):
            raise ConfigError(f"unknown config key: {key}")
        node, node_cls = node[part], sections(node_cls)[part]
    last = parts[-1]
    if node_cls is DecoderConfig and last == "name":
        new = switched_family(node, value)
        node.clear()
        node.update(new)
        return
    if last not in node:
        extra = ""
        if node_cls is DecoderConfig and isinstance(node.get("name"), str):
            extra = f" ({keys_help(decoder_family(node['name']), last)})"
        raise ConfigError(f"unknown config key: {key}{extra}")
    node[last] = value


def deep_update(cls: type, base: dict[str, Any], new: dict[str, Any], prefix: str = "") -> None:
    """Merge the partial mapping ``new`` (a config file) into the full mapping ``base`` of ``cls``."""
    if cls is DecoderConfig and isinstance(new, dict):
        if "name" in new:
            switched = switched_family(base, new["name"])
            base.clear()
            base.update(switched)
        if isinstance(base.get("name"), str):
            _check_family_keys(decoder_family(base["name"]), new, prefix)
    subs = sections(cls)
    for key, value in new.items():
        if key not in base:
            raise ConfigError(f"unknown config key: {prefix}{key}")
        if key in subs and isinstance(base[key], dict) and isinstance(value, dict):
            deep_update(subs[key], base[key], value, f"{prefix}{key}.")
        else:
            base[key] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` from the command line, the value read as JSON when it parses (``train.lr=1e-3``)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if key.startswith(("encoder.", "decoder.", "concepts.")):
        key = "model." + key
    try:
        value = json.loads(raw)
    except ValueError:
        value = {"none": None, "null": None, "true": True, "false": False}.get(raw.lower(), raw)
    return key, value


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a bounded JSON or YAML config file into a nested dict (not yet validated)."""
    path = Path(path)
    text = read_text(path, MAX_CONFIG_BYTES, ConfigError, "config file")  # regular files only, bounded
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            data = _load_yaml(text, path)
        else:
            data = json.loads(text)
    except ConfigError:
        raise
    except Exception as exc:  # yaml and json raise different types
        raise ConfigError(f"{path}: invalid config file ({(str(exc).splitlines() or [type(exc).__name__])[0][:200]})") \
            from None
    _check_expanded(data, path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: config file must hold a mapping")
    return data


MAX_ALIASES = 100  # YAML aliases (*name) in one config file
MAX_VALUES = 100_000  # values in a config file once its aliases are expanded


def _load_yaml(text: str, path: Path) -> Any:
    """``yaml.safe_load`` that stops at the :data:`MAX_ALIASES` + 1st alias."""
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        aliases = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.events.AliasEvent):
                self.aliases += 1
                if self.aliases > MAX_ALIASES:
                    raise ConfigError(f"{path}: more than {MAX_ALIASES} YAML aliases (*name); write the values out")
            return super().compose_node(parent, index)

    return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 - a SafeLoader


def _check_expanded(data: Any, path: Path) -> None:
    """Refuse a config whose values, counted with every alias expanded, pass :data:`MAX_VALUES` (a few
    aliases that refer to each other can stand for billions), counting no further than that."""
    count, stack = 0, [data]
    while stack:
        item = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise ConfigError(f"{path}: expands to more than {MAX_VALUES} values (YAML aliases that refer to "
                              "each other?); write the values out")
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
