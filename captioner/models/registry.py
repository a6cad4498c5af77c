"""Components by name: one entry per encoder and per decoder family, filled beside each component.

``register_encoder(name, trunk=..., stride=..., feature_dim=..., read_file=..., pretrained=...,
preprocessing=...)`` holds everything about one trunk, its weights' preprocessing included (as
timm's ``pretrained_cfg``); ``register_encoder_family`` a family such as ``timm/<model>``. Names are
checked when the model is built (:func:`resolve_encoder`). ``@register_decoder(ConfigClass)`` marks
a decoder class or builder taking ``feature_dim=D, vocab_size=V, grid=g, extension=None`` and the
config fields it reads by name. Components register when ``captioner.models.model`` imports them.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from captioner.config import PREPROCESSING_FIELDS, DecoderConfig, EncoderConfig
from captioner.config.decoders import family_name
from captioner.errors import ConfigError
from captioner.models.base import CaptionDecoder

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Download:
    """Pretrained weights fetched when the encoder is built (after its network, which they then fill)."""

    label: str  # names the weights in messages (``"resnet101 ResNet101_Weights.IMAGENET1K_V2"``)
    fetch: Callable[[], StateDict]  # downloads them: the trunk's state dict
    url: str = ""  # where they come from ("" when unknown)
    cached: Path | None = None  # the file they are kept in once downloaded (None when unknown)


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Preprocessing:
    """The pixels a trunk's weights were trained on: what :class:`captioner.data.images.ImageTransform` makes."""

    mean: tuple[float, float, float] = IMAGENET_MEAN  # per-channel mean of [0, 1] pixels, subtracted
    std: tuple[float, float, float] = IMAGENET_STD  # per-channel standard deviation, divided by
    image_size: int = 224  # the side of the square input
    interpolation: str = "bilinear"  # the resampling filter of the resize, ``"bilinear"`` or ``"bicubic"``


IMAGENET = Preprocessing()  # torchvision's ImageNet weights (and the random tiny CNN, which has none)


@dataclass(frozen=True)
class EncoderEntry:
    """Everything about one encoder trunk.

    Attributes:
        trunk: cfg -> (randomly initialised trunk (B,3,S,S) -> (B,D,h,w), its stages, bottom first).
        read_file: a local weights file -> the trunk's state dict.
        pretrained: cfg -> a local file, a :class:`Download` or None (random), checked before building.
        dilatable: the trunk can run its last stage dilated (``encoder.dilate``).
    """

    name: str  # ``encoder.name``
    trunk: Callable[[EncoderConfig], tuple[nn.Module, list[list[str]]]]
    stride: int  # the trunk's total downsampling: its map is ``ceil(S / stride)`` cells a side
    feature_dim: Callable[[EncoderConfig], int]  # cfg -> D, the trunk's output channels
    read_file: Callable[[Path], StateDict]
    pretrained: Callable[[EncoderConfig], Path | Download | None]
    dilatable: bool = False
    preprocessing: Preprocessing = IMAGENET  # the pixels its pretrained weights expect (:class:`Preprocessing`)


_ENCODERS: dict[str, EncoderEntry] = {}


def register_encoder(name: str, **entry: object) -> EncoderEntry:
    """Register an encoder under ``name`` (the fields of :class:`EncoderEntry`)."""
    registered = EncoderEntry(name=name, **entry)  # type: ignore[arg-type]
    _ENCODERS[name] = registered
    return registered


_FAMILIES: dict[str, Callable[[str], EncoderEntry]] = {}


def register_encoder_family(prefix: str, entry_for: Callable[[str], EncoderEntry]) -> None:
    """Register encoders named ``<prefix><model>`` (``timm/``): ``entry_for(model)`` makes each one's entry."""
    _FAMILIES[prefix] = entry_for


def encoder_entry(name: str) -> EncoderEntry:
    """The registered encoder ``name`` (or its family's); ConfigError listing the registered ones otherwise."""
    if name in _ENCODERS:
        return _ENCODERS[name]
    for prefix, entry_for in _FAMILIES.items():
        if name.startswith(prefix) and len(name) > len(prefix):
            return entry_for(name[len(prefix):])
    raise ConfigError(f"encoder.name={name!r} is not a known encoder; registered: "
                      f"{', '.join([*_ENCODERS, *(f'{p}<model>' for p in _FAMILIES)])}")


def resolve_encoder(cfg: EncoderConfig) -> EncoderConfig:
    """``cfg`` with its name checked (``ConfigError`` listing them) and unset preprocessing taken from its entry."""
    entry = encoder_entry(cfg.name)
    unset = {f: getattr(entry.preprocessing, f) for f in PREPROCESSING_FIELDS if getattr(cfg, f) is None}
    return dataclasses.replace(cfg, **unset) if unset else cfg


DecoderBuilder = Callable[..., CaptionDecoder]


@dataclass(frozen=True)
class DecoderEntry:
    """One decoder family: its config class (whose ``name`` default is the family's name) and builder."""

    config: type[DecoderConfig]
    build: DecoderBuilder


_DECODERS: dict[str, DecoderEntry] = {}


def register_decoder(config: type[DecoderConfig]) -> Callable[[DecoderBuilder], DecoderBuilder]:
    """Decorator: register a builder for the family of ``config`` (its config class), under that class's name."""

    def wrap(fn: DecoderBuilder) -> DecoderBuilder:
        if not (isinstance(config, type) and issubclass(config, DecoderConfig)) or config is DecoderConfig:
            raise ConfigError(f"{config!r} is not a DecoderConfig family")
        name = family_name(config)
        if _DECODERS.setdefault(name, DecoderEntry(config, fn)).config is not config:
            raise ConfigError(f"decoder.name={name!r} is already {_DECODERS[name].config.__name__}'s")
        return fn

    return wrap


def build_decoder(cfg: DecoderConfig, feature_dim: int, vocab_size: int, grid: int,
                  extension: nn.Module | None = None) -> CaptionDecoder:
    """The decoder ``cfg`` describes over ``feature_dim`` features on a ``grid`` x ``grid`` map, with ``extension``."""
    if cfg.name not in _DECODERS:
        raise ConfigError(f"decoder.name={cfg.name!r} is not registered; available: {', '.join(sorted(_DECODERS))}")
    build = _DECODERS[cfg.name].build
    params = inspect.signature(build).parameters
    options = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name in params}
    return build(feature_dim=feature_dim, vocab_size=vocab_size, grid=grid, extension=extension, **options)
