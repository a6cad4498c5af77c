"""Training over a feature cache fetches whole batches: the same batches as the row-by-row loader.

``train_loader`` over a dataset whose ``load`` is ``FeatureCache.loader()`` reads each batch's rows
from the memory map in one gather (``CaptionBatchDataset``), into shared memory inside a worker.
Against the row-by-row path (the same cache read through ``FeatureCache.stored``, one row per item,
then ``collate_captions``) every batch must be identical: x's bytes and dtype, padded tokens,
image indices, order and structure; with workers or without, float16 and bfloat16 caches, length
buckets, a mid-epoch skip, and invalid rows left out by ``Remap``.
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from captioner.config import get_preset
from captioner.data.coco import CaptionSet, ImageRecord
from captioner.data.dataset import CaptionBatchDataset, CaptionTrainDataset
from captioner.device import DistInfo
from captioner.errors import ImageLoadError
from captioner.features.cache import FeatureCache, cache_header, write_cache_file
from captioner.text import Vocabulary
from captioner.training.data import Remap, train_loader

COUNT, N, D = 14, 4, 8
CPU = DistInfo(0, 1, 0, torch.device("cpu"))


def _write_cache(path: Path, dtype: str, invalid: tuple[int, ...] = ()) -> FeatureCache:
    """A cache of random rows stored as ``dtype`` (``invalid`` rows zero and marked failed)."""
    values = torch.randn(COUNT, N, D, generator=torch.Generator().manual_seed(1)) * 3
    values[list(invalid)] = 0.0
    stored = values.to(torch.float16 if dtype == "float16" else torch.bfloat16)
    raw = stored.numpy() if dtype == "float16" else stored.view(torch.int16).numpy()
    write_cache_file(path, raw, cache_header(COUNT, N, D, (2, 2), dtype, float(values.abs().max()), invalid, key="",
                                             invalid_names=[f"{i}.jpg" for i in invalid]))
    return FeatureCache.open(path)


def _caption_set() -> CaptionSet:
    """Captions of 1 to 9 words, so that batches pad to different widths."""
    rng = random.Random(0)
    words = ["a", "red", "blue", "circle", "square", "on", "the", "left", "right"]
    images = [ImageRecord(i, f"{i}.jpg", Path(f"synthetic/{i}.jpg")) for i in range(COUNT)]
    captions = {i: [" ".join(rng.choices(words, k=rng.randint(1, 9))) for _ in range(3)] for i in range(COUNT)}
    return CaptionSet("synthetic", "train", images, captions, Path("synthetic"))


def _batches(dataset: CaptionTrainDataset, cfg, epoch: int, skip: int, batched: bool) -> list:  # noqa: ANN001
    loader = train_loader(dataset, cfg, epoch, CPU, skip_batches=skip)
    assert isinstance(loader.dataset, CaptionBatchDataset) == batched  # the path under test is the one taken
    batches = list(loader)
    assert len(batches) == len(loader)
    return batches


def _assert_same(got: list, expected: list) -> None:
    assert len(got) == len(expected) > 0
    for (x, tokens, index), (x_ref, tokens_ref, index_ref) in zip(got, expected):
        assert x.dtype == x_ref.dtype and x.shape == x_ref.shape and x.is_contiguous()
        assert x.view(torch.int16).numpy().tobytes() == x_ref.view(torch.int16).numpy().tobytes()
        assert tokens.dtype == tokens_ref.dtype == torch.long and torch.equal(tokens, tokens_ref)
        assert index.dtype == index_ref.dtype == torch.long and torch.equal(index, index_ref)
    assert [type(b) for b in got] == [type(b) for b in expected]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("epoch,buckets,skip", [(0, 0, 0), (1, 2, 2)], ids=["plain", "buckets_and_skip"])
def test_batch_loader_gives_the_row_loaders_batches(tmp_path: Path, dtype: str, workers: int, epoch: int,
                                                    buckets: int, skip: int) -> None:
    cache = _write_cache(tmp_path / "c.feats", dtype)
    cs = _caption_set()
    vocab = Vocabulary.build(cs.all_captions(), min_freq=1)
    cfg = get_preset("sat_soft_tiny", **{"train.batch_size": 5, "data.num_workers": workers,
                                         "train.length_buckets": buckets})
    by_row = CaptionTrainDataset(cs, vocab, cache.stored, max_len=30)  # one row per item, then collate
    by_batch = CaptionTrainDataset(cs, vocab, cache.loader(), max_len=30)
    expected = _batches(by_row, cfg, epoch, skip, batched=False)
    got = _batches(by_batch, cfg, epoch, skip, batched=True)
    _assert_same(got, expected)
    assert sum(len(b[2]) for b in got) == len(by_batch) - skip * 5
    assert {b[1].shape[1] for b in got} != {max(by_batch.lengths)}  # batches pad to their own width


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_batch_loader_over_a_cache_with_invalid_rows(tmp_path: Path, workers: int, dtype: str) -> None:
    """Training without the images that failed to load (``Remap``) reads whole batches too."""
    cache = _write_cache(tmp_path / "c.feats", dtype, invalid=(2, 7, 13))
    valid = cache.valid_indices()
    cs = _caption_set().subset(valid)
    vocab = Vocabulary.build(cs.all_captions(), min_freq=1)
    cfg = get_preset("sat_soft_tiny", **{"train.batch_size": 4, "data.num_workers": workers})
    by_row = CaptionTrainDataset(cs, vocab, Remap(cache.stored, valid), max_len=30)
    by_batch = CaptionTrainDataset(cs, vocab, Remap(cache.loader(), valid), max_len=30)
    for epoch, skip in ((0, 0), (1, 3)):
        expected = _batches(by_row, cfg, epoch, skip, batched=False)
        got = _batches(by_batch, cfg, epoch, skip, batched=True)
        _assert_same(got, expected)
        for x, _, index in got:  # every row is the cache's own row of that image, never an invalid one
            assert torch.equal(x.float(), torch.stack([cache[valid[int(i)]] for i in index]))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_stack_equals_stacked_rows_and_refuses_what_a_row_read_refuses(tmp_path: Path, dtype: str) -> None:
    cache = _write_cache(tmp_path / "c.feats", dtype, invalid=(5,))
    load = pickle.loads(pickle.dumps(cache.loader()))  # what a DataLoader worker receives
    rows = [9, 0, 9, 13, 4]  # any order, repeats allowed
    batch = load.stack(rows)
    assert batch.dtype == load(0).dtype and batch.shape == (5, N, D)
    assert torch.equal(batch.view(torch.int16), torch.stack([load(i) for i in rows]).view(torch.int16))
    batch += 1  # a copy: the map is untouched
    assert torch.equal(load.stack([9]).float(), cache[9][None])
    with pytest.raises(ImageLoadError, match="image #5"):
        load.stack([1, 5])
    with pytest.raises(IndexError):
        load.stack([1, COUNT])
    with pytest.raises(IndexError):
        load.stack([-1])


class _Gathered(Dataset):
    """Reports, from inside a DataLoader worker, whether a gathered batch is already in shared memory."""

    def __init__(self, load) -> None:  # noqa: ANN001
        self.load = load

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> tuple[bool, torch.Tensor]:
        x = self.load.stack([i, i + 1])
        return x.is_shared(), x


def test_a_worker_gathers_straight_into_shared_memory(tmp_path: Path) -> None:
    """The batch is written once in the worker and crosses to the main process without another copy."""
    cache = _write_cache(tmp_path / "c.feats", "bfloat16")
    loader = DataLoader(_Gathered(cache.loader()), batch_size=None, num_workers=1)
    for i, (shared, x) in enumerate(loader):
        assert shared
        assert torch.equal(x.float(), torch.stack([cache[i], cache[i + 1]]))
    shared, _ = _Gathered(cache.loader())[0]
    assert not shared  # no worker: an ordinary tensor
