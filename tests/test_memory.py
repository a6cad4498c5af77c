"""In-memory training data and device-side loss statistics: the fast path must not change a run.

* ``MemoryBatches`` cut exactly the batches ``DataLoader`` + ``collate_captions`` give (features and
  pixels, every epoch, after a mid-epoch skip), so a run trains to bit-identical weights either way.
* The loop reads its loss statistics at ``log_every`` only, yet still names the first non-finite step.
* One warning line when a weighted regulariser outweighs the cross-entropy.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from captioner.config import get_preset
from captioner.data.coco import load_caption_set
from captioner.data.dataset import CaptionTrainDataset, collate_captions, image_loader
from captioner.data.images import ImageTransform
from captioner.device import DistInfo
from captioner.models.registry import resolve_encoder
from captioner.text import Vocabulary
from captioner.training.data import MemoryStore, padded_tokens, pixels_in_memory, train_loader, val_loader
from captioner.training.loop import train
from captioner.training.objective import LossResult, term_shares
from captioner.training.run import DeviceStats


def _dataset(root: Path, store_or_loader, vocab: Vocabulary) -> CaptionTrainDataset:
    return CaptionTrainDataset(load_caption_set(root, "train"), vocab, store_or_loader, max_len=30)


def test_memory_batches_equal_the_dataloader_batches_on_pixels(tiny_shapes: Path) -> None:
    cfg = get_preset("sat_soft_tiny", **{"data.root": str(tiny_shapes), "train.batch_size": 7})
    cs = load_caption_set(tiny_shapes, "train")
    vocab = Vocabulary.build(cs.all_captions())
    transform = ImageTransform(resolve_encoder(cfg.model.encoder))
    store = pixels_in_memory(cs, transform, limit_mb=64, what="train")
    assert store is not None and store.rows.dtype == torch.uint8
    streamed = _dataset(tiny_shapes, image_loader(cs, transform), vocab)
    held = _dataset(tiny_shapes, store, vocab)
    info = DistInfo(0, 1, 0, torch.device("cpu"))
    for epoch, skip in ((0, 0), (1, 0), (1, 3)):
        a = list(train_loader(streamed, cfg, epoch, info, skip_batches=skip))
        b = list(train_loader(held, cfg, epoch, info, skip_batches=skip, store=store))
        assert len(a) == len(b) == len(train_loader(held, cfg, epoch, info, skip_batches=skip, store=store))
        for (xa, ta, ia), (xb, tb, ib) in zip(a, b):
            assert torch.equal(ia, ib) and torch.equal(ta, tb)
            assert torch.equal(xa, xb)  # bit-identical normalised pixels
    # validation batches: a rank's shard of rows, in order, as the per-image loader gives them
    eval_a = list(val_loader(torch.utils.data.TensorDataset(torch.zeros(1)), cfg, info, store=store, indices=[3, 1]))
    assert torch.equal(eval_a[0][1], torch.tensor([3, 1]))
    assert torch.equal(eval_a[0][0][0], image_loader(cs, transform)(3))


def test_memory_store_of_features_returns_float32_rows_and_padded_tokens_match_collate() -> None:
    rows = torch.randn(5, 4, 3).half()
    store = MemoryStore(rows)
    got = store.gather(torch.tensor([4, 0, 4]))
    assert got.dtype == torch.float32 and torch.equal(got, rows[[4, 0, 4]].float())
    assert torch.equal(store(2), rows[2].float())

    class Fake:
        tokens = torch.tensor([1, 5, 2, 1, 6, 7, 8, 2, 1, 2]).numpy()
        offsets = torch.tensor([0, 3, 8, 10]).numpy()

    padded, lengths = padded_tokens(Fake())
    assert lengths.tolist() == [3, 5, 2]
    items = [(torch.zeros(1), torch.tensor(Fake.tokens[s:e]).long(), i)
             for i, (s, e) in enumerate(zip(Fake.offsets[:-1], Fake.offsets[1:]))]
    _, collated, _ = collate_captions(items)
    assert torch.equal(padded, collated)


def test_pixels_that_do_not_fit_or_cannot_be_read_stay_on_disk(tiny_shapes: Path, tmp_path: Path) -> None:
    import shutil

    cfg = get_preset("sat_soft_tiny")
    transform = ImageTransform(resolve_encoder(cfg.model.encoder))
    cs = load_caption_set(tiny_shapes, "train")
    assert pixels_in_memory(cs, transform, limit_mb=0.01, what="train") is None  # over the limit
    assert pixels_in_memory(cs, transform, limit_mb=0, what="train") is None  # disabled
    root = tmp_path / "shapes"
    shutil.copytree(tiny_shapes, root)
    broken = load_caption_set(root, "train")
    Path(broken.images[2].path).write_bytes(b"not a png")
    assert pixels_in_memory(broken, transform, limit_mb=64, what="train") is None  # the streaming path reports it


@pytest.mark.parametrize("preset", ["sat_soft_tiny", "transformer_tiny"])
def test_a_run_in_memory_equals_a_run_from_disk(preset: str, tiny_shapes: Path, tmp_path: Path) -> None:
    base = {"data.root": str(tiny_shapes), "train.batch_size": 16, "train.val_max_images": 4, "train.epochs": 1,
            "train.log_every": 4}
    results = {}
    for name, limit in (("disk", 0.0), ("memory", 64.0)):
        results[name] = train(get_preset(preset, **base, **{"data.in_memory_mb": limit}), tmp_path / name,
                              progress=False)
    a, b = (load_file(str(results[n].latest_checkpoint)) for n in ("disk", "memory"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [list(csv.DictReader(open(tmp_path / n / "metrics.csv"))) for n in ("disk", "memory")]
    assert [r["loss"] for r in rows[0]] == [r["loss"] for r in rows[1]]


def test_device_stats_keep_means_and_the_first_nonfinite_step() -> None:
    stats = DeviceStats()

    def result(ce: float, total: float) -> LossResult:
        t = torch.tensor
        return LossResult(total=t(total), objective=t(ce + 0.5), terms={"ce": t(ce), "weighted_doubly_stochastic": t(0.5)})

    stats.add(result(1.0, 1.5), 10, step=1, grad_norm=torch.tensor(2.0))
    stats.add(result(2.0, 2.5), 30, step=2, grad_norm=torch.tensor(float("inf")))
    reading = stats.read()
    assert reading.captions == 40
    assert reading.means["ce"] == pytest.approx((10 * 1 + 30 * 2) / 40)
    assert reading.means["loss"] == pytest.approx(reading.means["ce"] + 0.5)
    assert reading.bad_loss is None and reading.bad_grad_step == 2
    stats.add(result(1.0, float("nan")), 8, step=3, grad_norm=None)
    stats.add(result(1.0, float("inf")), 8, step=4, grad_norm=None)
    reading = stats.read()
    assert reading.bad_loss is not None and reading.bad_loss[0] == 3  # the first bad step, not the last
    assert stats.read().captions == 0  # reading resets


def test_term_shares_sum_to_one() -> None:
    shares = term_shares({"ce": 1.0, "weighted_doubly_stochastic": 3.0, "reinforce": -7.0})
    assert shares == {"share_ce": pytest.approx(0.25), "share_doubly_stochastic": pytest.approx(0.75)}
    assert term_shares({"loss": 1.0}) == {}


def test_training_warns_once_when_the_penalty_outweighs_the_cross_entropy(
        tiny_shapes: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    over = {"data.root": str(tiny_shapes), "train.batch_size": 16, "train.val_max_images": 4, "train.epochs": 1,
            "train.log_every": 3}
    with caplog.at_level(logging.WARNING, logger="captioner.training.step"):
        train(get_preset("sat_soft_tiny", **over, **{"train.alpha_c": 5.0, "train.ds_form": "sum"}), tmp_path / "sum",
              progress=False)
    heavy = [r.getMessage() for r in caplog.records if "outweighs the cross-entropy" in r.getMessage()]
    assert len(heavy) == 1 and "doubly stochastic" in heavy[0] and "alpha_c" in heavy[0]
    rows = [r for r in csv.DictReader(open(tmp_path / "sum" / "metrics.csv")) if r["kind"] == "step"]
    assert float(rows[0]["share_doubly_stochastic"]) > 0.5
    assert float(rows[0]["share_ce"]) + float(rows[0]["share_doubly_stochastic"]) == pytest.approx(1.0, abs=1e-4)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="captioner.training.step"):
        train(get_preset("sat_soft_tiny", **over, **{"train.alpha_c": 1.0}), tmp_path / "excess", progress=False)
    assert not [r for r in caplog.records if "outweighs" in r.getMessage()]


def test_budget_decay_scales_the_scheduled_lr_linearly_to_a_floor() -> None:
    from captioner.training.optim import BUDGET_DECAY_FLOOR, budget_decay

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adam([param], lr=1e-3)
    cfg = get_preset("sat_soft_tiny", **{"train.time_budget": 100.0, "train.budget_decay": True})
    for elapsed, factor in ((50.0, 0.5), (90.0, 0.1), (500.0, BUDGET_DECAY_FLOOR)):
        optimizer.param_groups[0]["lr"] = 1e-3  # what the schedule set for this step
        budget_decay(optimizer, cfg.train, elapsed)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * factor, rel=1e-3)
    cfg.train.budget_decay = False
    optimizer.param_groups[0]["lr"] = 1e-3
    budget_decay(optimizer, cfg.train, 50.0)
    assert optimizer.param_groups[0]["lr"] == 1e-3
