"""The on-disk feature cache: exactness, round trip, memory mapping, partial files, stale keys, locks."""

from __future__ import annotations

import fcntl
import os
import pickle
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.config import get_preset
from captioner.data.coco import CaptionSet, ImageRecord
from captioner.data.dataset import image_loader
from captioner.data.images import ImageTransform
from captioner.errors import CaptionerError, DataError, ImageLoadError
from captioner.features.cache import FeatureCache, cache_key, cache_path, get_feature_cache
from captioner.models.encoder import build_encoder
from captioner.models.registry import resolve_encoder

COUNT = 10


def _caption_set(folder: Path, count: int = COUNT, seed: int = 0) -> CaptionSet:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    records = []
    for i in range(count):
        path = folder / f"img{i}.png"
        size = (48 + 8 * (i % 3), 64)  # mixed aspect ratios
        Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), dtype=np.uint8)).save(path)
        records.append(ImageRecord(i + 1, path.name, path, *size))
    captions = {r.image_id: [f"caption {r.image_id}"] for r in records}
    return CaptionSet("toy", "train", records, captions, folder)


@pytest.fixture()
def setup(tmp_path: Path):
    torch.manual_seed(0)
    cfg = get_preset("sat_soft_tiny").model
    encoder = build_encoder(cfg.encoder)
    encoder.train()  # build must switch to eval itself (BatchNorm running statistics)
    cs = _caption_set(tmp_path / "images")
    return cfg, encoder, cs, ImageTransform(resolve_encoder(cfg.encoder))


def _reference(encoder, cs, transform) -> torch.Tensor:
    load = image_loader(cs, transform)
    encoder.eval()
    with torch.no_grad():
        return encoder(torch.stack([load(i) for i in range(len(cs))]))[0]  # (C, N, D)


def test_cached_features_equal_encoder_output(setup, tmp_path: Path) -> None:
    cfg, encoder, cs, transform = setup
    cache = FeatureCache.build(encoder, cs, transform, tmp_path / "c.feats", batch_size=4, progress=False)
    assert encoder.training  # mode restored
    ref = _reference(encoder, cs, transform)
    assert (cache.count, cache.num_regions, cache.dim) == (COUNT, 16, encoder.out_dim) and cache.grid == (4, 4)
    got = torch.stack([cache[i] for i in range(COUNT)])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)  # fp16 storage
    assert not torch.equal(got[0], got[1])


def test_round_trip_memmap_and_copies(setup, tmp_path: Path) -> None:
    cfg, encoder, cs, transform = setup
    path = tmp_path / "c.feats"
    built = FeatureCache.build(encoder, cs, transform, path, batch_size=3, progress=False, key="k1")
    cache = FeatureCache.open(path, key="k1")
    load = cache.loader()
    for i in range(COUNT):
        assert torch.equal(load(i), built[i])
    assert isinstance(cache.features, np.memmap) and cache.features.mode == "r"
    assert path.stat().st_size > COUNT * 16 * encoder.out_dim * 2  # features + trailer on disk
    row = load(3)
    row += 100.0  # a copy: the map is untouched
    assert torch.equal(load(3), built[3])
    assert not any(isinstance(v, np.ndarray) and not isinstance(v, np.memmap) and v.size >= COUNT * 16
                   for v in vars(cache).values())  # nothing holds the features in RAM
    clone = pickle.loads(pickle.dumps(load))  # what a DataLoader worker receives
    assert len(pickle.dumps(load)) < 4096 and torch.equal(clone(5), built[5])
    with pytest.raises(IndexError):
        load(COUNT)


def test_partial_and_truncated_caches_are_detected(setup, tmp_path: Path) -> None:
    cfg, encoder, cs, transform = setup
    path = tmp_path / "c.feats"
    FeatureCache.build(encoder, cs, transform, path, progress=False)
    data = path.read_bytes()
    # a killed build leaves only <path>.partial: never opened as a cache
    path.unlink()
    path.with_name("c.feats.partial").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"c\.feats is incomplete .*c\.feats\.partial"):
        FeatureCache.open(path)
    # a truncated or foreign file at the final name
    path.write_bytes(data[:-5])
    with pytest.raises(DataError, match="truncated or not a captioner feature cache"):
        FeatureCache.open(path)
    path.write_bytes(data[:1000] + data[2000:])
    with pytest.raises(DataError, match="truncated"):
        FeatureCache.open(path)
    with pytest.raises(DataError, match="does not exist"):
        FeatureCache.open(tmp_path / "none.feats")


def test_failed_build_leaves_nothing(setup, tmp_path: Path) -> None:
    cfg, encoder, cs, transform = setup
    calls = []

    class Failing(torch.nn.Module):
        def forward(self, x):
            calls.append(len(x))
            if len(calls) == 2:
                raise RuntimeError("out of memory")
            return encoder(x)

    path = tmp_path / "c.feats"
    with pytest.raises(RuntimeError, match="out of memory"):
        FeatureCache.build(Failing(), cs, transform, path, batch_size=4, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != "" and p.is_file()) == []  # no lock file either


def test_stale_key_refused_and_rebuilt(setup, tmp_path: Path) -> None:
    cfg, encoder, cs, transform = setup
    key = cache_key(cfg, cs, encoder)
    path = cache_path(tmp_path / "cache", cs, key)
    FeatureCache.build(encoder, cs, transform, path, key="old", progress=False)
    with pytest.raises(DataError, match="is stale"):
        FeatureCache.open(path, key=key)
    cache = get_feature_cache(cfg, encoder, cs, transform, tmp_path / "cache", progress=False)
    assert cache.path == path and cache.key == key  # rebuilt in place
    mtime = path.stat().st_mtime_ns
    assert get_feature_cache(cfg, encoder, cs, transform, tmp_path / "cache", progress=False).key == key
    assert path.stat().st_mtime_ns == mtime  # reused, not rebuilt


def test_cache_key_covers_encoder_config_images_and_weights(setup, tmp_path: Path) -> None:
    cfg, encoder, cs, transform = setup
    key = cache_key(cfg, cs)
    assert key == cache_key(get_preset("sat_soft_tiny").model, cs)
    assert key == cache_key(get_preset("transformer_tiny").model, cs)  # the decoder does not count
    for override in ({"model.encoder.grid": 2}, {"model.encoder.mean": [0.5, 0.5, 0.5]},
                     {"model.encoder.interpolation": "bicubic"}, {"model.encoder.image_size": 32},
                     {"model.encoder.labels": True}):  # label channels after the regions
        assert cache_key(get_preset("sat_soft_tiny", **override).model, cs) != key
    assert cache_key(cfg, cs.subset(list(range(COUNT))[::-1])) != key  # image order
    assert cache_key(cfg, cs, encoder) != key
    other = build_encoder(cfg.encoder)
    assert cache_key(cfg, cs, other) != cache_key(cfg, cs, encoder)
    time.sleep(0.01)
    Image.new("RGB", (64, 64)).save(cs.images[0].path)  # a regenerated image
    assert cache_key(cfg, cs) != key


def test_cache_key_survives_a_moved_or_copied_dataset_but_not_other_pixels(setup, tmp_path: Path) -> None:
    cfg, _, cs, _ = setup
    key = cache_key(cfg, cs)
    copy = tmp_path / "elsewhere" / "images"
    copy.mkdir(parents=True)
    for rec in cs.images:  # a plain copy: new paths and new modification times, the same bytes
        shutil.copyfile(rec.path, copy / Path(rec.path).name)
        os.utime(copy / Path(rec.path).name, ns=(1, 1))
    moved = CaptionSet(cs.name, cs.split, [replace(r, path=copy / Path(r.path).name) for r in cs.images],
                       cs.captions, copy)
    assert cache_key(cfg, moved) == key
    os.utime(cs.images[0].path, ns=(2, 2))  # touched in place
    assert cache_key(cfg, cs) == key
    renamed = CaptionSet(cs.name, cs.split, [replace(cs.images[0], path=copy / "other.png"), *moved.images[1:]],
                         cs.captions, copy)
    shutil.copyfile(cs.images[0].path, copy / "other.png")
    assert cache_key(cfg, renamed) != key  # another file name is another image list
    pixels = np.asarray(Image.open(copy / Path(cs.images[0].path).name)).copy()
    pixels[0, 0] ^= 1
    Image.fromarray(pixels).save(copy / Path(cs.images[0].path).name)
    assert cache_key(cfg, moved) != key  # one pixel redrawn


def test_skip_bad_marks_invalid_rows(setup, tmp_path: Path) -> None:
    cfg, encoder, cs, transform = setup
    cs.images[0].path.write_bytes(b"not an image")  # first row: before the row shape is known
    cs.images[6].path.write_bytes(b"\x89PNG\r\n\x1a\n broken")
    with pytest.raises(ImageLoadError, match="img0.png") as info:  # one clean line, also from a worker
        FeatureCache.build(encoder, cs, transform, tmp_path / "a.feats", progress=False, num_workers=1)
    assert str(info.value).startswith(str(cs.images[0].path)) and "\n" not in str(info.value)
    assert not (tmp_path / "a.feats").exists()
    cache = FeatureCache.build(encoder, cs, transform, tmp_path / "b.feats", batch_size=4, skip_bad=True,
                               progress=False)
    assert cache.valid_indices() == [1, 2, 3, 4, 5, 7, 8, 9]
    assert cache.invalid_names == ["img0.png", "img6.png"]
    with pytest.raises(ImageLoadError, match="image #6 failed to load"):
        cache[6]
    good = cs.subset(cache.valid_indices())
    ref = _reference(encoder, good, transform)
    torch.testing.assert_close(torch.stack([cache[i] for i in cache.valid_indices()]), ref, rtol=2e-3, atol=2e-3)


def _hold_lock(path: Path) -> int:
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file description = another "process"
    os.write(fd, b"4242")
    return fd


def test_lock_held_by_another_writer(setup, tmp_path: Path) -> None:
    cfg, encoder, cs, transform = setup
    path = tmp_path / "c.feats"
    fd = _hold_lock(path)
    try:
        msg = r"feature cache .*c\.feats is being written by another process \(lock .*c\.feats\.lock, pid 4242\)"
        with pytest.raises(CaptionerError, match=msg):
            FeatureCache.build(encoder, cs, transform, path, progress=False)
        with pytest.raises(CaptionerError, match=msg):
            FeatureCache.open(path)
        start = time.monotonic()
        with pytest.raises(CaptionerError, match=msg):
            FeatureCache.open(path, lock_timeout=0.3)
        assert time.monotonic() - start >= 0.3
    finally:
        os.close(fd)
    assert not path.exists()


def test_open_waits_for_the_writer_to_finish(setup, tmp_path: Path) -> None:
    cfg, encoder, cs, transform = setup
    ready = FeatureCache.build(encoder, cs, transform, tmp_path / "done.feats", progress=False, key="k")
    row = ready[2]
    path = tmp_path / "c.feats"
    fd = _hold_lock(path)

    def finish() -> None:  # the "other process" completes its build, then releases the lock
        time.sleep(0.4)
        os.replace(ready.path, path)
        os.close(fd)

    thread = threading.Thread(target=finish)
    thread.start()
    cache = FeatureCache.open(path, key="k", lock_timeout=10)
    thread.join()
    assert cache.count == COUNT and torch.equal(cache[2], row)
    # a builder that waited for the lock reuses the finished cache instead of encoding again
    fd = _hold_lock(path)
    threading.Timer(0.2, os.close, args=(fd,)).start()
    mtime = path.stat().st_mtime_ns
    again = FeatureCache.build(encoder, cs, transform, path, key="k", lock_timeout=10, progress=False)
    assert again.key == "k" and path.stat().st_mtime_ns == mtime


def test_first_epoch_losses_equal_on_cached_and_image_paths(tiny_shapes: Path, tmp_path: Path) -> None:
    """Teacher-forced losses of the first epoch's batches: cached features vs pixels through the encoder.

    The same weights and the same batches (the epoch order is seeded); the first 4 batches keep it fast.
    """
    from captioner.models.model import build_model
    from captioner.training.data import load_caption_sets, load_or_build_vocab, prepare_data, train_loader
    from captioner.device import DistInfo
    from captioner.training.objective import CaptionLoss
    from captioner.training.run import TrainForward

    info = DistInfo(0, 1, 0, torch.device("cpu"))
    losses = {}
    for cached in (True, False):
        cfg = get_preset("sat_soft_tiny", **{"data.root": str(tiny_shapes), "data.feature_cache": cached})
        train_set, val_set = load_caption_sets(cfg)
        vocab = load_or_build_vocab(train_set, cfg.data.min_freq, tmp_path, resume=False)
        torch.manual_seed(0)
        model = build_model(cfg.model, len(vocab))
        data = prepare_data(cfg, model, vocab, train_set, val_set, tmp_path / f"run{cached}", info, progress=False)
        assert data.on_features is cached
        forward = TrainForward(model, data.on_features).train()
        criterion = CaptionLoss(alpha_c=cfg.train.alpha_c)
        batch_losses = []
        with torch.no_grad():
            for step, (x, tokens, _) in enumerate(train_loader(data.train_dataset, cfg, epoch=0, info=info)):
                if step == 4:
                    break
                assert x.shape[1:] == ((16, model.encoder.out_dim) if cached else (3, 64, 64))
                batch_losses.append(criterion(forward(x, tokens[:, :-1]), tokens[:, 1:]).total.item())
        losses[cached] = torch.tensor(batch_losses)
    assert len(losses[True]) == len(losses[False]) == 4
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-3, atol=1e-3)
    assert losses[True].std() > 0  # real, different batches
