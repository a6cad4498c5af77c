"""A registry per component: one entry per encoder and per decoder family; the config accepts what is registered."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from captioner.config import DECODER_FAMILIES, ENCODERS, Config, DecoderConfig, EncoderConfig, SATConfig, get_preset
from captioner.errors import ConfigError
from captioner.models import registry
from captioner.models.encoder import build_encoder, tiny_trunk, trunk_map_size
from captioner.models.lstm import build_sat_decoder
from captioner.models.model import build_model
from captioner.models.transformer import TransformerCaptionDecoder, sinusoidal_positions


def test_the_config_names_exactly_the_registered_components() -> None:
    assert sorted(registry._ENCODERS) == sorted(ENCODERS) == sorted(["tiny", "resnet50", "resnet101",
                                                                      "efficientnet_lite0", "efficientnet_lite1",
                                                                      "efficientnet_lite2"])
    assert {name: e.stride for name, e in registry._ENCODERS.items()} == {
        "tiny": 8, "resnet50": 32, "resnet101": 32, "efficientnet_lite0": 32, "efficientnet_lite1": 32,
        "efficientnet_lite2": 32}
    assert sorted(name for name, e in registry._ENCODERS.items() if e.dilatable) == [
        "efficientnet_lite0", "efficientnet_lite1", "efficientnet_lite2", "resnet101", "resnet50"]
    assert {name: e.config for name, e in registry._DECODERS.items()} == DECODER_FAMILIES
    with pytest.raises(ConfigError, match=r"encoder.name='vgg' is not a known encoder; registered: "):
        trunk_map_size("vgg", 224)


def test_every_built_in_encoder_name_validates_in_a_fresh_interpreter() -> None:
    """The config accepts the built-in encoders whether or not the model code was imported first."""
    code = ("import sys; from captioner.config import ENCODERS, EncoderConfig; "
            "[EncoderConfig(name=name) for name in ENCODERS]; "
            "print(ENCODERS, 'captioner.models.encoder' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert "'efficientnet_lite2'" in done.stdout and done.stdout.strip().endswith("False")


@pytest.fixture
def clean_registries():
    encoders, families, decoders = list(ENCODERS), dict(DECODER_FAMILIES), dict(registry._DECODERS)
    yield
    ENCODERS[:] = encoders
    for name in set(registry._ENCODERS) - set(encoders):
        del registry._ENCODERS[name]
    DECODER_FAMILIES.clear()
    DECODER_FAMILIES.update(families)
    registry._DECODERS.clear()
    registry._DECODERS.update(decoders)


def test_a_registered_encoder_is_one_entry_the_config_accepts(clean_registries, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="encoder.name='tiny_wide' is not one of"):
        EncoderConfig(name="tiny_wide")
    registry.register_encoder("tiny_wide", trunk=tiny_trunk, stride=8, feature_dim=lambda cfg: 2 * cfg.width,
                              read_file=lambda path: {}, pretrained=lambda cfg: None)
    cfg = EncoderConfig(name="tiny_wide", grid=4, width=8, image_size=32)
    encoder = build_encoder(cfg)
    assert (encoder.out_dim, encoder.grid, trunk_map_size("tiny_wide", 32)) == (16, 4, 4)
    assert encoder(torch.randn(1, 3, 32, 32))[0].shape == (1, 16, 16)


@dataclass
class SATTwinConfig(SATConfig):
    """A new decoder family for the test: SAT's fields under another name."""

    name: str = "sat_twin"


def test_a_decoder_registers_its_config_class_and_builder_once(clean_registries) -> None:
    with pytest.raises(ConfigError, match="decoder.name='sat_twin' is not one of sat, transformer"):
        DecoderConfig(name="sat_twin")
    registry.register_decoder(SATTwinConfig)(build_sat_decoder)
    cfg = get_preset("sat_soft_tiny").to_dict()
    cfg["model"]["decoder"]["name"] = "sat_twin"
    parsed = Config.from_dict(cfg)
    assert type(parsed.model.decoder) is SATTwinConfig
    torch.manual_seed(0)
    twin = build_model(parsed.model, 10)
    torch.manual_seed(0)
    sat = build_model(get_preset("sat_soft_tiny").model, 10)
    assert all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(), sat.state_dict().values()))
    with pytest.raises(ConfigError, match="already SATTwinConfig's"):
        registry.register_decoder(type("Other", (SATTwinConfig,), {}))(build_sat_decoder)


def test_decoders_name_the_buffers_checkpoints_do_not_store() -> None:
    model = build_model(get_preset("transformer_tiny").model, 10)
    decoder = model.decoder
    assert isinstance(decoder, TransformerCaptionDecoder)
    recipes = decoder.derived_buffers()
    assert set(recipes) == {"positions"} and "decoder.positions" not in model.state_dict()
    assert torch.equal(recipes["positions"](torch.empty(decoder.positions.shape, device="meta")),
                       sinusoidal_positions(*decoder.positions.shape))
    assert build_model(get_preset("sat_soft_tiny").model, 10).decoder.derived_buffers() == {}
