"""The int8 encoder: the same layers as the float trunk, 8-bit arithmetic close to it, the shipped model's
calibration, and captions that agree with float32's on the example photos."""

from __future__ import annotations

import json

import pytest
import torch

import captioner
import captioner.pretrained as pretrained
from captioner.cli import main
from captioner.errors import CheckpointError, ConfigError
from captioner.models.encoder import EfficientNetLiteFeatures
from captioner.models.quantize import (INPUT, Calibration, Int8Lite, calibrate, int8_available, read_calibration,
                                       sites, write_calibration)

needs_int8 = pytest.mark.skipif(not int8_available(), reason="this PyTorch has no onednn quantized engine")


def _lite(dilate: bool = False, labels: bool = False) -> EfficientNetLiteFeatures:
    torch.manual_seed(0)
    trunk = EfficientNetLiteFeatures("efficientnet_lite0", dilate=dilate)
    if labels:
        trunk.add_labels()
    for module in trunk.modules():  # BatchNorm statistics that are not the identity
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.1, 0.1)
            module.running_var.uniform_(0.5, 2.0)
    return trunk.eval()


@pytest.mark.parametrize("size", [224, 200, 97])  # even sides all the way down; odd sides at 25 and 13; odd first
@pytest.mark.parametrize("dilate", [False, True])
def test_float_layers_equal_the_trunk(size, dilate):
    """BatchNorm folded and the stride-2 "SAME" convolutions run at stride 1 and subsampled: the same sums."""
    trunk = _lite(dilate, labels=True)
    images = torch.randn(2, 3, size, size)
    with torch.no_grad():
        want, got = trunk(images), Int8Lite(trunk)(images)
    assert got.shape == want.shape  # (2, 2560, ceil(size/32), ...) with the label top
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@needs_int8
def test_int8_is_close_to_float_and_keeps_the_state_dict():
    trunk = _lite()
    images = torch.rand(8, 3, 64, 64) * 2 - 1
    measured = calibrate(trunk, [images[:4], images[4:]])
    model = Int8Lite(trunk)
    assert set(measured.ranges) == {INPUT, *sites(model)}
    convolutions = {name: m for name, m in sites(model).items() if hasattr(m, "relu6")}
    assert all(measured.ranges[name][1] == 0 for name, m in convolutions.items() if m.relu6)  # ReLU6: unsigned from 0
    assert set(measured.means) == set(convolutions)
    torch.testing.assert_close(measured.means["stem"], images.mean(dim=(0, 2, 3)), rtol=0.05, atol=0.01)  # padded
    int8 = Int8Lite(trunk, measured)
    with torch.no_grad():
        want, got = trunk(images), int8(images)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert float((got - want).norm() / want.norm()) < 0.2
    assert float(torch.nn.functional.cosine_similarity(got.flatten(1), want.flatten(1)).min()) > 0.97
    assert all(not t.is_quantized for t in int8.state_dict().values())


@needs_int8
def test_encoder_runs_the_int8_copy_only_for_inference_on_a_cpu():
    trunk = _lite()
    images = torch.rand(2, 3, 64, 64) * 2 - 1
    from captioner.models.encoder import Encoder

    encoder = Encoder(trunk, 1280, 2, [["conv_stem"]]).eval()
    keys = set(encoder.state_dict())
    with torch.no_grad():
        float_features, _ = encoder(images)
        encoder.use_int8(Int8Lite(trunk, calibrate(trunk, [images])))  # (B, N, D) from 8-bit arithmetic
        int8_features, grid = encoder(images)
    assert set(encoder.state_dict()) == keys  # the copy is no part of a checkpoint
    assert int8_features.shape == float_features.shape and grid == (2, 2)
    assert not torch.equal(int8_features, float_features)  # the 8-bit path ran
    torch.testing.assert_close(encoder(images)[0], float_features)  # with gradients: the float trunk
    encoder.use_int8(None)
    with torch.no_grad():
        torch.testing.assert_close(encoder(images)[0], float_features)


def test_calibration_file_round_trip_and_bad_files(tmp_path):
    measured = Calibration({INPUT: (0.0078, 128), "stem": (0.0235, 0)}, {"stem": torch.tensor([0.25, -0.5, 1e-3])})
    path = tmp_path / "m.int8.json"
    write_calibration(path, measured, {"photos": 2})
    back = read_calibration(path)
    assert back.ranges == measured.ranges and torch.equal(back.means["stem"], measured.means["stem"])
    assert json.loads(path.read_text())["photos"] == 2
    for text, reason in (("{", "invalid JSON at line 1"), ("[]", "expected a JSON object"),
                         ('{"format": 9, "ranges": {}}', "format 9"),
                         ('{"format": 1, "ranges": {"stem": [-1, 0]}, "means": {}}', "of stem is out of bounds"),
                         ('{"format": 1, "ranges": {"stem": [0.1, 300]}, "means": {}}', "out of bounds"),
                         ('{"format": 1, "ranges": {}, "means": {"stem": [NaN]}}', "of stem is out of bounds"),
                         ('{"format": 1, "ranges": {}}', "KeyError")):
        path.write_text(text)
        with pytest.raises(CheckpointError, match=reason) as info:
            read_calibration(path)
        assert "\n" not in str(info.value) and str(path) in str(info.value)
    with pytest.raises(CheckpointError, match="none.json: int8 calibration file not found"):
        read_calibration(tmp_path / "none.json")


@needs_int8
def test_a_calibration_without_every_activation_is_refused():
    with pytest.raises(ConfigError, match=r"int8 calibration lacks \d+ of \d+ activations \(e.g. input\)"):
        Int8Lite(_lite(), Calibration({"stem": (0.02, 0)}, {}))


def test_precision_is_checked_and_int8_needs_a_calibration(untrained_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="precision must be one of float32, int8 .*got 'bfloat16'"):
        captioner.load("flickr8k", device="cpu", precision="bfloat16")
    path = untrained_checkpoint(tmp_path, "sat_soft_tiny")
    with pytest.raises(ConfigError, match=r"precision int8 needs the encoder's calibration \(.*\.int8\.json"):
        captioner.load(str(path), device="cpu", precision="int8")
    assert captioner.load(str(path), device="cpu").precision == "float32"  # the default: no calibration, float32


# ----------------------------------------------------------------------------- the shipped model
def _shipped():
    if not pretrained.MODELS["flickr8k"].int8:
        pytest.skip("the shipped model has no int8 calibration")
    return captioner.load("flickr8k", device="cpu", precision="float32")


@needs_int8
def test_int8_and_float32_agree_on_the_example_photos():
    model = _shipped()
    photos = pretrained.example_photos()
    want = model.caption(photos, attention=True, labels=3)
    with torch.no_grad():
        float_features, _ = model.encode(photos)
    model.use_int8(pretrained.int8_calibration("flickr8k"))
    assert model.precision == "int8" and "precision='int8'" in repr(model)
    got = model.caption(photos, attention=True, labels=3)
    with torch.no_grad():
        int8_features, _ = model.encode(photos)
    cosine = torch.nn.functional.cosine_similarity(int8_features, float_features, dim=-1)  # (B, N)
    assert float(cosine.mean()) > 0.97
    same = [a.text == b.text for a, b in zip(got, want)]
    assert sum(same) >= 3, [(a.text, b.text) for a, b in zip(got, want)]  # word for word
    for a, b, equal in zip(got, want, same):
        assert a.words[:4] == b.words[:4]  # one that differs, differs late ("... on a street" / "... in front of")
        assert a.labels[0][0] == b.labels[0][0]  # the label head's first word
        if equal:
            assert a.attention.shape == b.attention.shape
            assert float((a.attention - b.attention).abs().sum(dim=(1, 2)).max()) < 0.5  # within half each map's mass


@needs_int8
def test_cli_precision_int8(capsys, tmp_path):
    _shipped()
    photo = pretrained.example_photos()[0]
    assert main(["caption", str(photo), "--precision", "int8", "--json"]) == 0
    line = json.loads(capsys.readouterr().out.splitlines()[0])
    assert line["caption"]
    try:
        main(["caption", "--help"])
    except SystemExit:
        pass
    assert "int8: the encoder in 8-bit integers" in " ".join(capsys.readouterr().out.split())
