"""Scale check: a COCO-sized feature cache read through the real training loader, with the captured SAT step.

Shape legend: C images, N regions, D feature width, B batch.

Writes a synthetic cache of C images (default 20,000, the paper's 14 x 14 x 2048 regions in float16:
15.3 GiB) in the feature-cache format (``captioner.features.cache``), five random captions of 9-20
words per image over a vocabulary of about 10,000 words, and trains the paper-sized SAT soft decoder
(``sat_soft`` preset, batch 32) on it for up to ``SCALE_SECONDS`` through ``train_loader`` (a
``DataLoader`` over the memory-mapped cache reading whole batches in one gather, ``SCALE_WORKERS``
workers, pinned memory; ``loader_dataset`` names the path): the path a COCO cache too large for
``data.in_memory_mb`` takes. On CUDA the step is the captured one
(``train.cuda_graph``; eager with ``SCALE_EAGER=1``), on a CPU the same wrapper runs eagerly.

``loader_scale`` (CPU is enough) times the loader alone, no model: items/s through ``train_loader``
(``LOADER_WORKERS`` workers, default 2) over a synthetic cache of ``LOADER_IMAGES`` images (default
2,000 x 196 x 2048 float16, 1.5 GiB, in ``SCALE_DIR`` or /tmp, deleted afterwards), for rows decoded
to float32 in the worker (``float32_in_worker``, the older loader), for rows kept in
their stored float16 read one by one and stacked by the collate (``stored_dtype``, which
``model_input`` widens on the device), and for whole batches gathered from the map in one copy into
shared memory (``batch_gather``, what ``train_loader`` does over ``FeatureCache.loader()``), in turn
``LOADER_ROUNDS`` times, ``LOADER_SECONDS`` each, in the same process; the median of each is kept.
``batch_speedup`` is ``batch_gather`` over ``stored_dtype``. No pinned copy on a CPU run (it costs
both paths the same).

    python scripts/benchmark.py --only loader_scale --json

Reported (coco_scale): the time blocked waiting for the loader against the whole (``loader_wait_fraction``, also
after the first 20 steps, when captures are done), captions/s, the epoch time it projects, the same
steps' batches replayed from device memory without the loader (``model_captions_per_s``,
``efficiency`` = loop / model), peak GPU memory, and how long writing the cache took. Caveat: a
freshly written cache sits in the page cache, so this measures the loader, not the disk.

    SCALE_IMAGES=20000 python scripts/benchmark.py --only coco_scale --json
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from captioner.config import get_preset
from captioner.data.caption_set import CaptionSet, ImageRecord
from captioner.data.dataset import CaptionTrainDataset
from captioner.device import DistInfo
from captioner.features.cache import FeatureCache, cache_header, write_cache_file
from captioner.features.dtype import model_input
from captioner.models.lstm import SATDecoder
from captioner.training.data import train_loader, training_vocabulary
from captioner.training.objective import CaptionLoss
from captioner.training.step import GraphedStep

WARM_STEPS = 20  # steps left out of the steady-state figures (captures happen here)


def write_cache(path: Path, count: int, grid: int, dim: int, seed: int = 0) -> float:
    """A float16 cache of ``count`` rows (a block of random rows repeated); returns its size in GiB."""
    regions = grid * grid
    rows = max(1, min(count, (64 << 20) // (regions * dim * 2)))
    block = np.maximum(np.random.default_rng(seed).standard_normal((rows, regions, dim), dtype=np.float32), 0)
    block = block.astype(np.float16)
    blocks = (block[:min(rows, count - start)] for start in range(0, count, rows))
    write_cache_file(path, blocks, cache_header(count, regions, dim, (grid, grid), "float16", float(block.max()),
                                                key=""))
    return path.stat().st_size / 2**30


def caption_set(count: int, words: int, seed: int = 0) -> CaptionSet:
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(words)]
    images = [ImageRecord(i, f"{i}.jpg", Path(f"synthetic/{i}.jpg")) for i in range(count)]
    captions = {i: [" ".join(rng.choices(vocab, k=rng.randint(9, 20))) for _ in range(5)] for i in range(count)}
    return CaptionSet("synthetic-coco", "train", images, captions, Path("synthetic"))


def coco_scale(quick: bool = False) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    count = int(os.environ.get("SCALE_IMAGES", 300 if quick else 20_000))
    seconds = float(os.environ.get("SCALE_SECONDS", 5 if quick else 40))
    workers = int(os.environ.get("SCALE_WORKERS", 2 if quick else 8))
    grid, dim, words, width = (4, 32, 500, 32) if quick else (14, 2048, 10_000, 512)
    warm = 5 if quick else WARM_STEPS  # steps left out of the steady-state figures
    out: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "images": count,
                 "workers": workers}
    with tempfile.TemporaryDirectory(prefix="coco_scale_", dir=os.environ.get("SCALE_DIR")) as tmp:
        t0 = time.perf_counter()
        out["cache_gib"] = round(write_cache(Path(tmp) / "train.feats", count, grid, dim), 2)
        out["cache_write_s"] = round(time.perf_counter() - t0, 1)
        cache = FeatureCache.open(Path(tmp) / "train.feats")
        t0 = time.perf_counter()
        cs = caption_set(count, words)
        cfg = get_preset("sat_soft", **{"data.num_workers": workers, "train.device": device.type})
        vocab = training_vocabulary(cs, cfg.data.min_freq, cfg.data.max_caption_len)
        dataset = CaptionTrainDataset(cs, vocab, cache.loader(), cfg.data.max_caption_len)
        out["dataset_build_s"] = round(time.perf_counter() - t0, 1)
        out["epoch_captions"] = len(dataset)
        torch.manual_seed(0)
        decoder = SATDecoder(len(vocab), dim, embed_dim=width, hidden_dim=width, attention_dim=width).to(device)
        loss = CaptionLoss.from_config(cfg.train, cfg.model.decoder, vocab.pad_id).to(device)
        capture = device.type == "cuda" and os.environ.get("SCALE_EAGER") != "1"
        step = GraphedStep(decoder, loss, vocab.pad_id, capture=capture)
        optimizer = torch.optim.Adam(decoder.parameters(), lr=cfg.train.lr, fused=device.type == "cuda")
        params = list(decoder.parameters())

        def train(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
            total = step(x, tokens).total
            torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip, foreach=True)
            optimizer.step()
            return total

        kept: list = []
        # The training loader as it is (whole batches from the map), then, on the same cache and model, the
        # row-by-row loader it replaced: the two side by side in one run (SCALE_COMPARE=0 skips the second).
        out.update(_through_loader(dataset, cfg, device, train, seconds, warm, kept))
        out["mode"] = "cuda_graph" if capture else "eager"
        if os.environ.get("SCALE_COMPARE", "1") == "1":
            rows = CaptionTrainDataset(cs, vocab, _RowByRow(cache), cfg.data.max_caption_len)
            out["row_by_row"] = _through_loader(rows, cfg, device, train, seconds, warm, [])
        speed = out.get("steady_captions_per_s", out["captions_per_s"])
        out["projected_epoch_s"] = round(len(dataset) / speed, 1)
        _sync(device)
        t0 = time.perf_counter()
        n = min(max(out["steps"] - warm, len(kept)), 300)
        for i in range(n):
            train(*kept[i % len(kept)])
        _sync(device)
        model = n * cfg.train.batch_size / (time.perf_counter() - t0)
        out["model_captions_per_s"] = round(model, 1)
        out["efficiency"] = round(speed / model, 3)
        if "row_by_row" in out:
            row = out["row_by_row"]
            row["efficiency"] = round(row.get("steady_captions_per_s", row["captions_per_s"]) / model, 3)
            out["batch_over_row_by_row"] = round(speed / row.get("steady_captions_per_s", row["captions_per_s"]), 2)
        out["graph_stats"] = step.stats.as_dict()
        if device.type == "cuda":
            out["peak_gpu_memory_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
    return out


def _through_loader(dataset, cfg, device: torch.device, train, seconds: float, warm: int,  # noqa: ANN001
                    kept: list) -> dict:
    """Train from ``train_loader(dataset)`` for ``seconds``: captions/s, time blocked on the loader, steady
    figures after ``warm`` steps; the first 50 batches go to ``kept`` (for the model-alone figure)."""
    loader = train_loader(dataset, cfg, 0, DistInfo(0, 1, 0, device))
    out: dict = {"loader_dataset": type(loader.dataset).__name__}  # CaptionBatchDataset: whole batches
    waits, losses = [], []
    began = time.perf_counter()
    warm_end = began
    for x, tokens, _ in _timed(loader, waits):
        x, tokens = model_input(x, device), tokens.to(device, non_blocking=True)  # float16 -> float32 here
        losses.append(train(x, tokens))
        if len(kept) < 50:
            kept.append((x.clone(), tokens.clone()))
        if len(waits) == warm:
            _sync(device)
            warm_end = time.perf_counter()
        if time.perf_counter() - began > seconds:
            break
    _sync(device)
    total_s = time.perf_counter() - began
    steps, batch = len(waits), cfg.train.batch_size
    out.update(steps=steps, seconds=round(total_s, 2), captions_per_s=round(steps * batch / total_s, 1),
               loader_wait_s=round(sum(waits), 2), loader_wait_fraction=round(sum(waits) / total_s, 3),
               loss_finite=bool(torch.isfinite(torch.stack(losses)).all()))
    if steps > warm:
        steady_s = total_s - (warm_end - began)
        out["steady_captions_per_s"] = round((steps - warm) * batch / steady_s, 1)
        out["steady_loader_wait_fraction"] = round(sum(waits[warm:]) / steady_s, 3)
    del loader
    return out


def _timed(loader, waits: list[float]):  # noqa: ANN001, ANN202
    """The loader's batches, appending to ``waits`` the seconds spent blocked on each."""
    it = iter(loader)
    while True:
        t0 = time.perf_counter()
        batch = next(it, None)
        if batch is None:
            return
        waits.append(time.perf_counter() - t0)
        yield batch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _RowByRow:
    """``load(index)``: a cache row in its stored dtype, with no ``stack``: the loader reads rows one by one,
    then ``collate_captions`` stacks them (the loader before whole-batch reads; picklable)."""

    def __init__(self, cache: FeatureCache) -> None:
        self.cache = cache

    def __call__(self, index: int) -> torch.Tensor:
        return self.cache.stored(index)


class _Float32Rows:
    """``load(index)``: a cache row decoded to float32 in the worker (the older loader; picklable)."""

    def __init__(self, cache: FeatureCache) -> None:
        self.cache = cache

    def __call__(self, index: int) -> torch.Tensor:
        return self.cache[index]


def loader_scale(quick: bool = False) -> dict:
    """Items/s of the training loader alone over a memory-mapped cache: float32 rows, stored float16 rows read
    one by one, and whole batches gathered in one copy."""
    count = int(os.environ.get("LOADER_IMAGES", 200 if quick else 2_000))
    workers = int(os.environ.get("LOADER_WORKERS", 2))
    seconds = float(os.environ.get("LOADER_SECONDS", 1 if quick else 8))
    rounds = int(os.environ.get("LOADER_ROUNDS", 1 if quick else 3))
    grid, dim = (4, 32) if quick else (14, 2048)
    device = torch.device("cpu")  # the loader's own cost (model_input widens on the GPU, off the host)
    out: dict = {"images": count, "workers": workers, "regions": grid * grid, "dim": dim, "rounds": rounds,
                 "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="loader_scale_", dir=os.environ.get("SCALE_DIR")) as tmp:
        out["cache_gib"] = round(write_cache(Path(tmp) / "train.feats", count, grid, dim), 2)
        cache = FeatureCache.open(Path(tmp) / "train.feats")
        cs = caption_set(count, 500)
        cfg = get_preset("sat_soft", **{"data.num_workers": workers, "train.device": "cpu"})
        vocab = training_vocabulary(cs, cfg.data.min_freq, cfg.data.max_caption_len)
        variants = {"float32_in_worker": _Float32Rows(cache), "stored_dtype": _RowByRow(cache),
                    "batch_gather": cache.loader()}
        datasets = {name: CaptionTrainDataset(cs, vocab, load, cfg.data.max_caption_len)
                    for name, load in variants.items()}
        speeds: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(rounds):
            for name, dataset in datasets.items():
                items, began = 0, None
                loader = train_loader(dataset, cfg, r, DistInfo(0, 1, 0, device))
                out.setdefault("loader_dataset", {})[name] = type(loader.dataset).__name__  # which path
                for i, (x, _, _) in enumerate(loader):
                    out.setdefault("loader_dtype", {})[name] = str(x.dtype).removeprefix("torch.")
                    if i == 2:  # workers started and warm
                        began = time.perf_counter()
                    elif began is not None:
                        items += x.shape[0]
                        if time.perf_counter() - began > seconds:
                            break
                elapsed = time.perf_counter() - began if began is not None else float("nan")
                speeds[name].append(items / elapsed if items else float("nan"))
                del loader
        for name, values in speeds.items():
            out[f"{name}_items_per_s"] = round(float(np.median(values)), 1)
            out[f"{name}_rounds"] = [round(v, 1) for v in values]
        out["speedup"] = round(out["stored_dtype_items_per_s"] / out["float32_in_worker_items_per_s"], 2)
        out["batch_speedup"] = round(out["batch_gather_items_per_s"] / out["stored_dtype_items_per_s"], 2)
    return out


BENCHMARKS = {"coco_scale": coco_scale, "loader_scale": loader_scale}

if __name__ == "__main__":
    print((loader_scale if "--loader" in sys.argv else coco_scale)("--quick" in sys.argv))
