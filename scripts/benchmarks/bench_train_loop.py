"""Training-loop efficiency: the real ``captioner train`` loop against the bare model step.

For each decoder family (presets ``sat_soft_lite``, ``sat_hard_lite``, ``transformer_lite``; on a
GPU the ``*_lite_gpu`` presets at paper-like scale; the ``*_tiny`` presets with ``--quick``) on
synthetic scenes through the feature cache:

* **loop**: the real ``train`` code path (loader or in-memory batches, loss, optimizer, clipping,
  logging, one validation and checkpoint per epoch as configured), 3 epochs. ``loop_captions_per_s``
  is the training phase of epochs 2-3 as ``metrics.csv`` logs it (batches, loss, optimizer,
  logging: what a long COCO epoch is made of); ``loop_with_validation_captions_per_s`` also counts
  each epoch's validation and checkpoints (a 1-epoch run is subtracted from the 3-epoch one, so
  set-up cancels out). Validation decodes 10% of the images with beam search after every 38-step
  epoch here, far more often than on COCO, so the second figure is a floor;
* **model**: forward + loss + backward + clip + Adam step of the same model on the same epoch's
  batches, gathered beforehand onto the device (same caption lengths, so the same work per step),
  as many steps as two epochs of the loop.

``efficiency = loop_captions_per_s / model_captions_per_s``. CUDA is used when present; there each
preset also runs under bf16 autocast (rows ``<preset>:bf16``), the bare step under the same autocast.

    python scripts/benchmark.py --only train_loop --json
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from captioner.config import get_preset  # noqa: E402

PRESETS = ("sat_soft_lite", "sat_hard_lite", "transformer_lite")
GPU_PRESETS = ("sat_soft_lite_gpu", "sat_hard_lite_gpu", "transformer_lite_gpu")  # 448 px, 14x14x1280, batch 128
QUICK_PRESETS = ("sat_soft_tiny", "transformer_tiny")


def _loop_seconds(cfg, out: Path, epochs: int) -> float:
    from captioner.training.loop import train

    cfg.train.epochs = epochs
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    train(cfg, out, progress=False)
    return time.perf_counter() - t0


def _model_captions_per_s(cfg, data_root: str, steps: int, device: torch.device) -> float:
    """Bare steps of the same model on one real batch already on the device."""
    from captioner.features.dtype import model_input
    from captioner.models.model import build_model
    from captioner.text import Vocabulary
    from captioner.training.data import load_caption_sets, prepare_data, train_loader
    from captioner.device import DistInfo
    from captioner.training.objective import CaptionLoss
    from captioner.training.optim import build_optimizer, setup_precision

    train_set, val_set = load_caption_sets(cfg)
    vocab = Vocabulary.build(train_set.all_captions(), min_freq=cfg.data.min_freq)
    torch.manual_seed(0)
    model = build_model(cfg.model, len(vocab)).to(device)
    info = DistInfo(0, 1, 0, device)
    data = prepare_data(cfg, model, vocab, train_set, val_set, Path(cfg.data.feature_cache_dir), info, False)
    # the epoch's own batches (their caption lengths set the SAT time loop's length), already in place
    batches = [(model_input(x, device), tokens.to(device))  # cached features widened to float32 as in the loop
               for x, tokens, _ in train_loader(data.train_dataset, cfg, 0, info, store=data.train_store)]
    t = cfg.train
    criterion = CaptionLoss.from_config(t, cfg.model.decoder, vocab.pad_id).to(device)  # what train() uses
    optimizer = build_optimizer(model, t, train_encoder=False)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    precision = setup_precision(t.amp, device)  # the loop's autocast (bf16 in the GPU presets), not its compile
    model.train()

    def step(x: torch.Tensor, tokens: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        with precision.autocast():
            loss = criterion(model.decoder(x, tokens[:, :-1]), tokens[:, 1:]).total
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        optimizer.step()

    for x, tokens in batches[:3]:
        step(x, tokens)
    if device.type == "cuda":
        torch.cuda.synchronize()
    captions = 0
    t0 = time.perf_counter()
    for i in range(steps):
        x, tokens = batches[i % len(batches)]
        step(x, tokens)
        captions += x.shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return captions / (time.perf_counter() - t0)


def train_loop(quick: bool = False) -> dict:
    """Loop vs bare-model captions/s per preset; the summary keys are the worst family's."""
    from captioner.data.shapes import make_shapes

    logging.getLogger("captioner").setLevel(logging.WARNING)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    presets = QUICK_PRESETS if quick else GPU_PRESETS if device.type == "cuda" else PRESETS
    images = 60 if quick else 1200 if device.type == "cuda" else 300
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench_train_loop_") as tmp:
        root = Path(tmp) / "scenes"
        make_shapes(root, images=images, seed=0, image_size=64 if quick else 128)
        # on a GPU each preset runs as configured (fp32) and again under bf16 autocast ("<preset>:bf16")
        runs = [(p, {}) for p in presets]
        if device.type == "cuda":
            runs = [r for p in presets for r in ((p, {}), (f"{p}:bf16", {"train.amp": "bf16"}))]
        for row, extra in runs:
            preset = row.split(":")[0]
            cfg = get_preset(preset, **{"data.root": str(root), "data.feature_cache_dir": str(Path(tmp) / "features"),
                                        "train.device": device.type, "train.patience": 100,
                                        "model.encoder.fine_tune": False, "data.feature_cache": True, **extra})
            one = _loop_seconds(cfg, Path(tmp) / "run1", 1)  # also builds the feature cache (outside the timing)
            one = _loop_seconds(cfg, Path(tmp) / "run1", 1)
            three = _loop_seconds(cfg, Path(tmp) / "run3", 3)
            captions = 2 * len(list(_captions(cfg)))
            with_validation = captions / max(three - one, 1e-9)
            loop = _logged_speed(Path(tmp) / "run3")
            batches = 2 * -(-len(list(_captions(cfg))) // cfg.train.batch_size)
            model = _model_captions_per_s(cfg, str(root), batches, device)
            rows[row] = {"loop_captions_per_s": round(loop, 1), "model_captions_per_s": round(model, 1),
                            "efficiency": round(loop / model, 3),
                            "loop_with_validation_captions_per_s": round(with_validation, 1),
                            "efficiency_with_validation": round(with_validation / model, 3)}
    worst = min(rows.values(), key=lambda r: r["efficiency"])
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    return {**worst, "device": name, "threads": torch.get_num_threads(), "images": images, "presets": rows}


def _logged_speed(run_dir: Path) -> float:
    """Mean ``captions_per_s`` of the epoch rows after the first (the loop's own timing of its batches)."""
    import csv

    with open(run_dir / "metrics.csv", newline="") as f:
        rows = [float(r["captions_per_s"]) for r in csv.DictReader(f) if r["kind"] == "epoch"]
    steady = rows[1:] or rows
    return sum(steady) / len(steady)


def _captions(cfg):
    from captioner.data.coco import load_caption_set

    cs = load_caption_set(cfg.data.root, cfg.data.train_split)
    return cs.all_captions()


BENCHMARKS = {"train_loop": train_loop}

if __name__ == "__main__":
    print(train_loop("--quick" in sys.argv))
