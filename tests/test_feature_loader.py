"""Cached features cross the DataLoader in their stored 2-byte dtype and reach the model as float32 (#25).

* ``FeatureCache.loader()`` rows, the DataLoader's batches (workers included) are float16 or
  bfloat16, as stored: half the bytes of float32 to move through workers, collate and pinned memory.
* ``model_input`` (the training step's ``on_device``, validation) widens them to float32 on
  the device, equal to ``cache[i]`` (the float32 decode of the stored rows).
* The in-memory path still gives the model the same values as the DataLoader path.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from captioner.config import get_preset
from captioner.data.coco import CaptionSet, ImageRecord
from captioner.data.dataset import CaptionEvalDataset, CaptionTrainDataset
from captioner.device import DistInfo
from captioner.features.cache import FeatureCache, cache_header, write_cache_file
from captioner.features.dtype import model_input
from captioner.text import Vocabulary
from captioner.training import loop as validation
from captioner.training.data import features_in_memory, train_loader, val_loader
from captioner.training.step import on_device

COUNT, N, D = 12, 4, 8
CPU = DistInfo(0, 1, 0, torch.device("cpu"))


def _write_cache(path: Path, dtype: str) -> torch.Tensor:
    """A cache file of random rows stored as ``dtype``; returns its rows decoded to float32 (C, N, D)."""
    values = torch.randn(COUNT, N, D, generator=torch.Generator().manual_seed(0)) * 3
    stored = values.to(torch.float16 if dtype == "float16" else torch.bfloat16)
    raw = stored.numpy() if dtype == "float16" else stored.view(torch.int16).numpy()
    write_cache_file(path, raw, cache_header(COUNT, N, D, (2, 2), dtype, float(values.abs().max()), key="",
                                             invalid_names=[]))
    return stored.float()


def _caption_set() -> CaptionSet:
    rng = random.Random(0)
    words = ["a", "red", "blue", "circle", "square", "on", "the", "left", "right"]
    images = [ImageRecord(i, f"{i}.jpg", Path(f"synthetic/{i}.jpg")) for i in range(COUNT)]
    captions = {i: [" ".join(rng.choices(words, k=rng.randint(3, 8))) for _ in range(2)] for i in range(COUNT)}
    return CaptionSet("synthetic", "train", images, captions, Path("synthetic"))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("workers", [0, 1])
def test_loader_batches_keep_the_stored_dtype_and_reach_the_model_as_the_float32_decode(
        tmp_path: Path, dtype: str, workers: int) -> None:
    decoded = _write_cache(tmp_path / "c.feats", dtype)
    cache = FeatureCache.open(tmp_path / "c.feats")
    stored = torch.float16 if dtype == "float16" else torch.bfloat16
    row = cache.loader()(3)
    assert row.dtype == stored and row.element_size() == 2 and torch.equal(row.float(), cache[3])
    assert cache[3].dtype == torch.float32 and torch.equal(cache[3], decoded[3])

    cs = _caption_set()
    vocab = Vocabulary.build(cs.all_captions(), min_freq=1)
    cfg = get_preset("sat_soft_tiny", **{"train.batch_size": 5, "data.num_workers": workers})
    dataset = CaptionTrainDataset(cs, vocab, cache.loader(), max_len=30)
    run = SimpleNamespace(info=CPU)  # what on_device reads
    seen = 0
    for x, tokens, image_index in train_loader(dataset, cfg, 0, CPU):
        assert x.dtype == stored and x.element_size() == 2  # 2 bytes a value through workers and collate
        batch = on_device(run, (x, tokens, image_index))  # where a batch enters the model
        assert batch.x.dtype == torch.float32
        assert torch.equal(batch.x, decoded[image_index])
        assert torch.equal(batch.x, torch.stack([cache[int(i)] for i in image_index]))
        seen += len(image_index)
    assert seen == len(dataset)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_memory_and_dataloader_paths_give_the_model_identical_batches(tmp_path: Path, dtype: str) -> None:
    _write_cache(tmp_path / "c.feats", dtype)
    cache = FeatureCache.open(tmp_path / "c.feats")
    store = features_in_memory(cache, limit_mb=16, what="train")
    assert store is not None
    cs = _caption_set()
    vocab = Vocabulary.build(cs.all_captions(), min_freq=1)
    cfg = get_preset("sat_soft_tiny", **{"train.batch_size": 5, "data.num_workers": 0})
    streamed = CaptionTrainDataset(cs, vocab, cache.loader(), max_len=30)
    held = CaptionTrainDataset(cs, vocab, store, max_len=30)
    for epoch, skip in ((0, 0), (1, 2)):
        a = list(train_loader(streamed, cfg, epoch, CPU, skip_batches=skip))
        b = list(train_loader(held, cfg, epoch, CPU, skip_batches=skip, store=store))
        assert len(a) == len(b) > 0
        for (xa, ta, ia), (xb, tb, ib) in zip(a, b):
            assert torch.equal(ia, ib) and torch.equal(ta, tb)
            xa, xb = model_input(xa, CPU.device), model_input(xb, CPU.device)
            assert xa.dtype == xb.dtype == torch.float32 and torch.equal(xa, xb)  # bit-identical
    # validation batches too
    eval_a = list(val_loader(CaptionEvalDataset(cs, cache.loader()), cfg, CPU))
    eval_b = list(val_loader(CaptionEvalDataset(cs, store), cfg, CPU, store=store))
    for (xa, ia), (xb, ib) in zip(eval_a, eval_b, strict=True):
        assert xa.element_size() == 2 and torch.equal(ia, ib)
        assert torch.equal(model_input(xa, CPU.device), model_input(xb, CPU.device))


def test_validation_decodes_float32_features(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    decoded = _write_cache(tmp_path / "c.feats", "bfloat16")
    cache = FeatureCache.open(tmp_path / "c.feats")
    cs = _caption_set()
    cfg = get_preset("sat_soft_tiny", **{"train.batch_size": 5, "data.num_workers": 0})
    got = []

    def caption_features(model, x, vocab, options):  # noqa: ANN001, ANN202
        got.append(x)
        return []

    monkeypatch.setattr(validation.inference, "caption_features", caption_features)
    loader = val_loader(CaptionEvalDataset(cs, cache.loader()), cfg, CPU)
    validation.validate(None, loader, cs, None, 1, 5, CPU.device, on_features=True)
    assert all(x.dtype == torch.float32 for x in got)
    assert torch.equal(torch.cat(got), decoded)


def test_model_input_moves_other_dtypes_untouched() -> None:
    pixels = torch.randn(2, 3, 4, 4)
    assert model_input(pixels, torch.device("cpu")) is pixels
    half = torch.randn(2, 3).half()
    assert torch.equal(model_input(half, torch.device("cpu")), half.float())
    assert np.dtype(np.float16).itemsize == 2
