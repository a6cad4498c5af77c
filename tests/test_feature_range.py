"""The feature cache never stores inf: huge features are kept as bfloat16, NaN/inf is refused,
old float16 caches still open, and a non-finite first loss names its likely cause.

The huge encoder is the tiny one with its output scaled, like a random-weight ResNet-101 whose
features reach 2.4e5 (float16 ends at 65504).
"""

from __future__ import annotations

import json
import logging
import math
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.config import get_preset
from captioner.data.coco import CaptionSet, ImageRecord
from captioner.data.dataset import image_loader
from captioner.data.images import ImageTransform
from captioner.errors import CaptionerError, DataError
from captioner.features.cache import MAGIC, FeatureCache, get_feature_cache
from captioner.features.dtype import FLOAT16_MAX
from captioner.models.encoder import build_encoder
from captioner.models.registry import resolve_encoder
from captioner.training.run import first_loss_cause

COUNT = 10


class Scaled(torch.nn.Module):
    """``encoder`` with its features multiplied by ``scale`` from the ``from_call``-th batch on, and
    ``poison`` (NaN, inf) written into image ``poison_image``'s features."""

    def __init__(self, encoder: torch.nn.Module, scale: float = 1.0, from_call: int = 1,
                 poison: float | None = None, poison_image: int = 0) -> None:
        super().__init__()
        self.encoder, self.scale, self.from_call = encoder, scale, from_call
        self.poison, self.poison_image = poison, poison_image
        self.calls = self.seen = 0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        self.calls += 1
        feats, grid = self.encoder(x)  # (b, N, D)
        feats = feats * (self.scale if self.calls >= self.from_call else 1.0)
        row = self.poison_image - self.seen
        if self.poison is not None and 0 <= row < len(x):
            feats = feats.clone()
            feats[row, 3, 5] = self.poison
        self.seen += len(x)
        return feats, grid


@pytest.fixture()
def setup(tmp_path: Path):
    torch.manual_seed(0)
    cfg = get_preset("sat_soft_tiny").model
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    records = []
    for i in range(COUNT):
        path = folder / f"img{i}.png"
        Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(path)
        records.append(ImageRecord(i + 1, path.name, path, 64, 48))
    cs = CaptionSet("toy", "train", records, {r.image_id: ["a caption"] for r in records}, folder)
    return cfg, build_encoder(cfg.encoder), cs, ImageTransform(resolve_encoder(cfg.encoder))


def _reference(encoder: torch.nn.Module, cs: CaptionSet, transform: ImageTransform) -> torch.Tensor:
    load = image_loader(cs, transform)
    encoder.eval()
    with torch.no_grad():
        return encoder(torch.stack([load(i) for i in range(len(cs))]))[0]  # (C, N, D)


@pytest.mark.parametrize("from_call", [1, 2], ids=["first_batch", "later_batch"])
def test_features_beyond_float16_round_trip_as_bfloat16(setup, tmp_path: Path, from_call: int,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """From the first batch, or from the second (the first batch's rows were already written as
    float16 and are converted in place)."""
    cfg, encoder, cs, transform = setup
    ref = _reference(encoder, cs, transform)
    scale = 2.4e5 / float(ref.abs().max())  # the largest feature becomes 2.4e5, like a random ResNet-101
    expected = ref * torch.where(torch.arange(COUNT) >= 4 * (from_call - 1), scale, 1.0)[:, None, None]
    assert float(expected.abs().max()) > FLOAT16_MAX  # float16 would store inf here
    path = tmp_path / "c.feats"
    with caplog.at_level(logging.WARNING, logger="captioner.features.cache"):
        built = FeatureCache.build(Scaled(encoder, scale, from_call), cs, transform, path, batch_size=4,
                                   progress=False, encoder_name="resnet101-like")
    first = float(expected[4 * (from_call - 1):4 * from_call].abs().max())  # the first batch beyond float16
    assert any(f"encoder resnet101-like produces features up to {first:.4g}, beyond float16's 65504; storing "
               f"bfloat16" in r.getMessage() for r in caplog.records)
    cache = FeatureCache.open(path)
    assert (cache.dtype, cache.header["version"]) == ("bfloat16", 2)  # version 1 readers refuse it
    assert path.stat().st_size < COUNT * 16 * encoder.out_dim * 2 + 4096  # 2 bytes a value, like float16
    got = torch.stack([cache[i] for i in range(COUNT)])  # (C, N, D) float32
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    # bfloat16 keeps 8 significant bits (relative error <= 2**-8); rows converted from float16 were
    # rounded twice (<= 2**-11 more)
    torch.testing.assert_close(got, expected, rtol=2 ** -8 + 2 ** -10, atol=1e-6)
    assert float(got.abs().max()) == pytest.approx(float(expected.abs().max()), rel=2 ** -8)
    assert cache.header["max_abs"] == pytest.approx(float(expected.abs().max()), rel=1e-6)
    clone = pickle.loads(pickle.dumps(cache.loader()))  # what a DataLoader worker gets
    assert torch.equal(clone(7), built[7]) and torch.equal(clone(0), got[0])


def test_features_within_float16_stay_float16(setup, tmp_path: Path) -> None:
    cfg, encoder, cs, transform = setup
    cache = FeatureCache.build(encoder, cs, transform, tmp_path / "c.feats", progress=False)
    assert (cache.dtype, cache.header["version"], cache.features.dtype) == ("float16", 1, np.float16)
    assert 0 < cache.header["max_abs"] < FLOAT16_MAX


def _write_old_cache(path: Path, rows: np.ndarray, **trailer) -> None:
    """A cache exactly as the captioner wrote it before the range check (float16, version 1)."""
    header = {"format": "captioner-features", "version": 1, "count": rows.shape[0], "num_regions": rows.shape[1],
              "dim": rows.shape[2], "grid": [2, 2], "dtype": "float16", "invalid": [], "key": "old",
              "invalid_names": [], **trailer}
    blob = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(rows.astype(np.float16).tobytes() + blob + struct.pack("<Q", len(blob)) + MAGIC)


def test_old_float16_cache_still_opens(tmp_path: Path) -> None:
    rows = np.random.default_rng(0).normal(size=(3, 4, 8)).astype(np.float32)
    _write_old_cache(tmp_path / "old.feats", rows)
    cache = FeatureCache.open(tmp_path / "old.feats", key="old")
    assert (cache.count, cache.num_regions, cache.dim, cache.dtype) == (3, 4, 8, "float16")
    torch.testing.assert_close(cache[2], torch.from_numpy(rows[2]), rtol=2 ** -10, atol=1e-4)


@pytest.mark.parametrize(("trailer", "message"), [
    ({"version": 3}, r"has format version 3, this captioner reads 1 and 2; rebuild it"),
    ({"dtype": "bfloat16"}, r"says dtype 'bfloat16' with format version 1, which stores float16; rebuild it"),
    ({"version": 2}, r"says dtype 'float16' with format version 2, which stores bfloat16"),
])
def test_inconsistent_dtype_or_version_refused(tmp_path: Path, trailer: dict, message: str) -> None:
    _write_old_cache(tmp_path / "x.feats", np.zeros((2, 4, 8), np.float32), **trailer)
    with pytest.raises(DataError, match=r"^feature cache .*x\.feats " + message):
        FeatureCache.open(tmp_path / "x.feats")


@pytest.mark.parametrize(("poison", "shown"), [(math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf")])
def test_nonfinite_encoder_output_refused_naming_encoder_and_image(setup, tmp_path: Path, poison: float,
                                                                   shown: str) -> None:
    """Through ``get_feature_cache``, as training calls it: the message names the configured encoder."""
    cfg, encoder, cs, transform = setup
    with pytest.raises(DataError) as info:
        get_feature_cache(cfg, Scaled(encoder, poison=poison, poison_image=6), cs, transform, tmp_path / "cache",
                          hash_weights=False, batch_size=4, progress=False)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"encoder tiny with random weights (model.encoder.pretrained=false) produced "
                              f"non-finite features ({shown}) for image {cs.images[6].path}; feature cache ")
    assert message.endswith(".feats was not written")
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_features_beyond_bfloat16_refused_naming_the_value(setup, tmp_path: Path) -> None:
    cfg, encoder, cs, transform = setup
    with pytest.raises(DataError) as info:
        FeatureCache.build(Scaled(encoder, poison=3.4e38, poison_image=2), cs, transform, tmp_path / "c.feats",
                           progress=False, encoder_name="big")
    assert str(info.value).startswith(f"encoder big produced a feature of 3.4e+38 for image {cs.images[2].path}, "
                                      f"beyond what feature cache ")
    assert not (tmp_path / "c.feats").exists() and not (tmp_path / "c.feats.partial").exists()


# ----------------------------------------------------------------------------- the first training step


def test_first_loss_cause_reads_the_batch() -> None:
    random = get_preset("sat_soft_tiny").model.encoder  # pretrained=false
    resnet = get_preset("sat_soft_tiny", **{"model.encoder.pretrained": True}).model.encoder
    huge = torch.full((2, 4, 8), 2.4e5)
    assert first_loss_cause(huge, random, None) == (
        "the batch's input features reach 2.4e+05, far beyond a pretrained encoder's: the encoder tiny with "
        "random weights (model.encoder.pretrained=false) produces huge activations that overflow the decoder")
    stored_inf = huge.clone()
    stored_inf[1, 2, 3] = math.inf
    assert first_loss_cause(stored_inf, resnet, None).startswith(
        "the batch's input features hold inf values: delete the feature cache")
    fine = first_loss_cause(torch.ones(2, 4, 8), resnet, torch.float16)
    assert fine.startswith("the batch's input features are finite (largest |value| 1), so look at the decoder's")
    assert fine.endswith("train.amp=fp16 overflows beyond 65504, try train.amp=bf16")
    images = first_loss_cause(torch.ones(2, 3, 8, 8), random, None)
    assert images.startswith("the input images are finite, so the encoder tiny with random weights")


def test_nonfinite_first_loss_names_the_cause_not_skipping(tiny_shapes: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose encoder produces features beyond float16's range: the cache keeps them (as
    bfloat16), and the NaN loss of step 1 is blamed on them, without suggesting to skip batches."""
    from captioner.models.encoder import Encoder
    from captioner.training.loop import train
    from captioner.training.objective import CaptionLoss

    encode, loss = Encoder.forward, CaptionLoss.forward

    def huge(self, images):
        feats, grid = encode(self, images)
        return feats * 1e6 + 1e5, grid  # every feature beyond float16's 65504

    def nan_loss(self, output, targets):  # what the decoder makes of such features, made certain
        result = loss(self, output, targets)
        result.total = result.total * math.nan
        return result

    monkeypatch.setattr(Encoder, "forward", huge)
    monkeypatch.setattr(CaptionLoss, "forward", nan_loss)
    cfg = get_preset("sat_soft_tiny", **{"data.root": str(tiny_shapes), "train.batch_size": 16, "train.epochs": 1,
                                         "train.val_max_images": 4})
    with pytest.raises(CaptionerError) as info:
        train(cfg, tmp_path, progress=False)
    message = str(info.value)
    assert "\n" not in message and "skip_nonfinite" not in message
    assert message.startswith("non-finite loss (nan) at the first step (epoch 1 step 1), before any weight update, "
                              "so neither the learning rate nor skipping batches can help: the batch's input "
                              "features reach ")
    assert "the encoder tiny with random weights (model.encoder.pretrained=false) produces huge activations" in message
    assert message.endswith("; no checkpoint was written yet")
    caches = list((tmp_path / "features").glob("*.feats"))
    assert caches and all(FeatureCache.open(p).dtype == "bfloat16" for p in caches)
