"""Decoder builders by ``DecoderConfig.name``: the two built-in families, and any you register.

A builder is ``fn(cfg, feature_dim=D, vocab_size=V, grid=g) -> CaptionDecoder``, where ``cfg`` is its
family's config (``SATConfig``, ``TransformerConfig``: ``captioner.config.decoders``; a new family
also needs its config class in ``DECODER_FAMILIES`` there).

The built-in families are imported here, at the top, so the decoders never import the registry
back (no import cycle); your own builders join with ``@register_decoder("name")``.
"""

from __future__ import annotations

from collections.abc import Callable

from captioner.config import DecoderConfig
from captioner.errors import ConfigError
from captioner.models.base import CaptionDecoder
from captioner.models.lstm import build_sat_decoder
from captioner.models.transformer import build_transformer_decoder

DecoderBuilder = Callable[..., CaptionDecoder]
_DECODERS: dict[str, DecoderBuilder] = {"sat": build_sat_decoder, "transformer": build_transformer_decoder}


def register_decoder(name: str) -> Callable[[DecoderBuilder], DecoderBuilder]:
    """Register a decoder builder under ``DecoderConfig.name``."""

    def wrap(fn: DecoderBuilder) -> DecoderBuilder:
        _DECODERS[name] = fn
        return fn

    return wrap


def list_decoders() -> list[str]:
    return sorted(_DECODERS)


def build_decoder(cfg: DecoderConfig, feature_dim: int, vocab_size: int, grid: int) -> CaptionDecoder:
    if cfg.name not in _DECODERS:
        raise ConfigError(f"decoder.name={cfg.name!r} is not registered; available: {', '.join(sorted(_DECODERS))}")
    return _DECODERS[cfg.name](cfg, feature_dim=feature_dim, vocab_size=vocab_size, grid=grid)
