"""A registry per component: one entry per encoder and per decoder family; the config accepts what is registered."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from captioner.config import Config, DecoderConfig, EncoderConfig, SATConfig, TransformerConfig, get_preset
from captioner.data.images import ImageTransform
from captioner.errors import ConfigError
from captioner.models import registry
from captioner.models.encoder import LITE_STAGES, build_encoder, tiny_trunk, trunk_map_size
from captioner.models.lstm import SATDecoder
from captioner.models.model import build_model
from captioner.models.transformer import TransformerCaptionDecoder, sinusoidal_positions


def test_the_registry_holds_each_encoder_once_with_its_weights_preprocessing() -> None:
    assert sorted(registry._ENCODERS) == sorted(["tiny", "resnet50", "resnet101", "efficientnet_lite0",
                                                 "efficientnet_lite1", "efficientnet_lite2"])
    assert {name: e.stride for name, e in registry._ENCODERS.items()} == {
        "tiny": 8, "resnet50": 32, "resnet101": 32, "efficientnet_lite0": 32, "efficientnet_lite1": 32,
        "efficientnet_lite2": 32}
    assert sorted(name for name, e in registry._ENCODERS.items() if e.dilatable) == [
        "efficientnet_lite0", "efficientnet_lite1", "efficientnet_lite2", "resnet101", "resnet50"]
    lite = {name: registry._ENCODERS[name].preprocessing for name in LITE_STAGES}
    assert {name: (p.image_size, p.interpolation) for name, p in lite.items()} == {
        "efficientnet_lite0": (224, "bicubic"), "efficientnet_lite1": (240, "bicubic"),
        "efficientnet_lite2": (260, "bicubic")}
    assert all(p.mean == (127 / 255,) * 3 and p.std == (128 / 255,) * 3 for p in lite.values())
    for name in ("tiny", "resnet50", "resnet101"):
        assert registry._ENCODERS[name].preprocessing == registry.Preprocessing(
            (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 224, "bilinear")
    assert {name: e.config for name, e in registry._DECODERS.items()} == {"sat": SATConfig,
                                                                         "transformer": TransformerConfig}
    with pytest.raises(ConfigError, match=r"encoder.name='vgg' is not a known encoder; registered: "):
        trunk_map_size("vgg", 224)


def test_a_bare_encoder_config_gets_its_weights_preprocessing_not_imagenets() -> None:
    bare = EncoderConfig(name="efficientnet_lite0")
    assert (bare.mean, bare.std, bare.image_size, bare.interpolation) == (None, None, None, None)
    lite = registry.resolve_encoder(bare)
    assert lite.mean == pytest.approx((127 / 255,) * 3) and lite.std == pytest.approx((128 / 255,) * 3)
    assert (lite.image_size, lite.interpolation) == (224, "bicubic")
    assert registry.resolve_encoder(EncoderConfig(name="efficientnet_lite2")).image_size == 260
    own = registry.resolve_encoder(EncoderConfig(name="efficientnet_lite0", image_size=448, mean=(0.5, 0.5, 0.5)))
    assert (own.image_size, own.mean, own.interpolation) == (448, (0.5, 0.5, 0.5), "bicubic")  # set values stay
    assert registry.resolve_encoder(lite) is lite
    model = build_model(get_preset("sat_soft_tiny").model, vocab_size=10)
    assert model.config.encoder.resolved and model.config.encoder.mean == (0.485, 0.456, 0.406)
    assert Config.from_dict(Config(model=model.config).to_dict()).model.encoder == model.config.encoder


def test_an_unknown_encoder_parses_and_is_refused_when_built() -> None:
    cfg = EncoderConfig(name="vgg")  # the config layer keeps no list of names: the registry checks them
    for build in (lambda: build_encoder(cfg), lambda: registry.resolve_encoder(cfg)):
        with pytest.raises(ConfigError, match=r"encoder.name='vgg' is not a known encoder; registered: efficientnet_lite0, .*tiny, .*timm/<model>$"):
            build()
    with pytest.raises(ConfigError, match=r"^encoder.image_size, encoder.interpolation, encoder.mean, encoder.std "
                                          r"not set: the vgg encoder's entry gives them"):
        ImageTransform(cfg)


@pytest.fixture
def clean_registries():
    encoders, decoders = dict(registry._ENCODERS), dict(registry._DECODERS)
    yield
    registry._ENCODERS.clear()
    registry._ENCODERS.update(encoders)
    registry._DECODERS.clear()
    registry._DECODERS.update(decoders)


def test_a_registered_encoder_is_one_entry_that_builds(clean_registries, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="encoder.name='tiny_wide' is not a known encoder"):
        build_encoder(EncoderConfig(name="tiny_wide"))
    registry.register_encoder("tiny_wide", trunk=tiny_trunk, stride=8, feature_dim=lambda cfg: 2 * cfg.width,
                              read_file=lambda path: {}, pretrained=lambda cfg: None,
                              preprocessing=registry.Preprocessing((0.5,) * 3, (0.25,) * 3, 32, "bicubic"))
    cfg = EncoderConfig(name="tiny_wide", grid=4, width=8)
    encoder = build_encoder(cfg)
    assert (encoder.out_dim, encoder.grid, trunk_map_size("tiny_wide", 32)) == (16, 4, 4)
    assert encoder(torch.randn(1, 3, 32, 32))[0].shape == (1, 16, 16)
    assert ImageTransform(registry.resolve_encoder(cfg)).std.flatten().tolist() == [0.25] * 3


@dataclass
class SATTwinConfig(SATConfig):
    """A new decoder family for the test: SAT's fields under another name."""

    name: str = "sat_twin"


def test_a_decoder_family_parses_by_its_class_and_builds_once_registered(clean_registries) -> None:
    with pytest.raises(ConfigError, match="decoder.name='sat_trio' is not one of sat, transformer, sat_twin"):
        DecoderConfig(name="sat_trio")
    cfg = get_preset("sat_soft_tiny").to_dict()
    cfg["model"]["decoder"]["name"] = "sat_twin"
    parsed = Config.from_dict(cfg)  # the config layer knows the family by its class, and keeps no list of names
    assert type(parsed.model.decoder) is SATTwinConfig and type(DecoderConfig(name="sat_twin")) is SATTwinConfig
    with pytest.raises(ConfigError, match="^decoder.name='sat_twin' is not registered; available: sat, transformer$"):
        build_model(parsed.model, 10)  # the name is checked when the model is built
    registry.register_decoder(SATTwinConfig)(SATDecoder)
    torch.manual_seed(0)
    twin = build_model(parsed.model, 10)
    torch.manual_seed(0)
    sat = build_model(get_preset("sat_soft_tiny").model, 10)
    assert all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(), sat.state_dict().values()))
    with pytest.raises(ConfigError, match="already SATTwinConfig's"):
        registry.register_decoder(type("Other", (SATTwinConfig,), {}))(SATDecoder)


def test_decoders_name_the_buffers_checkpoints_do_not_store() -> None:
    model = build_model(get_preset("transformer_tiny").model, 10)
    decoder = model.decoder
    assert isinstance(decoder, TransformerCaptionDecoder)
    recipes = decoder.derived_buffers()
    assert set(recipes) == {"positions"} and "decoder.positions" not in model.state_dict()
    assert torch.equal(recipes["positions"](torch.empty(decoder.positions.shape, device="meta")),
                       sinusoidal_positions(*decoder.positions.shape))
    assert build_model(get_preset("sat_soft_tiny").model, 10).decoder.derived_buffers() == {}
