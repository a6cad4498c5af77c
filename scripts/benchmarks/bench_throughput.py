"""Captioning throughput on a CPU: the user's path beside its encoder bound and beside the path as it
was before the encoder ran channels-last and loading overlapped the search. One process, one run,
the same photos and the same model for every row.

* ``caption_*``: ``Captioner.caption(paths, beam=3, attention=True, batch_size=32)`` (now: channels-last
  encoder with BatchNorm folded into its convolutions, files read by threads and the next batch
  encoded while the current one is searched);
* ``before_*``: the same captions the way they were made before: NCHW encoder with its BatchNorm
  layers, each batch read, then encoded, then searched, one after the other;
* ``caption_bf16_*``: the same with ``precision="bfloat16"`` (the decoder's arithmetic in bfloat16:
  :mod:`captioner.decoding.search`; the encoder and the reading as above);
* ``caption_int8_*``: the same with the encoder in 8-bit integers (``load(..., precision="int8")``: the
  shipped model's calibration; the decoder float32), and ``bound_int8_*`` its reading + encoding alone;
  ``caption_int8_*_over_caption``: int8 photos/s over float32's, measured side by side;
* ``bound_*``: reading + encoding alone (no search), as the caption path now does it: what the caption
  path could reach if the search cost nothing;
* ``cache_*``: ``FeatureCache.build`` on the 224-px photos, now and as before (NCHW, serial reads).

Photos: COCO-sized JPEGs (``coco``: 640-px photos, about 640 x 480) and 224-px JPEGs (``small``).
Real photos come from ``../shared/data`` when that folder exists, else synthetic smooth images
of the same sizes. The model: ``CAPTIONER_BENCH_MODEL`` (a name or checkpoint path), else the
shipped default model when there is one, else ``transformer_flickr8k`` with random decoder
weights (which writes 20-word captions: a heavier search than a trained model's).

    python scripts/benchmark.py --only caption_throughput
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
PHOTOS = 256


def _photos(folder: Path, count: int, small: bool) -> list[Path]:
    """``count`` JPEGs in ``folder``: real ones repeated under new names, or synthetic ones."""
    import numpy as np
    from PIL import Image

    source = SHARED / ("flickr8k/images" if small else "coco2017-mini/train2017")
    real = sorted(source.glob("*.jpg")) if source.is_dir() else []
    folder.mkdir(parents=True)
    out = []
    rng = np.random.default_rng(0)
    for i in range(count):
        path = folder / f"photo{i:04d}.jpg"
        if real:
            shutil.copyfile(real[i % len(real)], path)
        else:
            h, w = (224, 224) if small else (480, 640)
            coarse = rng.integers(0, 255, (h // 16, w // 16, 3), dtype=np.uint8)
            Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC).save(path, quality=90)
        out.append(path)
    return out


def _model():
    import torch

    import captioner
    from captioner.config import get_preset
    from captioner.inference import Captioner
    from captioner.models.model import build_model
    from captioner.text import Vocabulary

    name = os.environ.get("CAPTIONER_BENCH_MODEL")
    if name:
        return captioner.load(name, device="cpu", precision="float32"), name
    default = getattr(captioner, "DEFAULT_MODEL", None)
    if default:
        return captioner.load(default, device="cpu", precision="float32"), default
    torch.manual_seed(0)
    vocab = Vocabulary([f"word{i}" for i in range(2600)])
    model = build_model(get_preset("transformer_flickr8k").model, len(vocab), load_pretrained=True)
    return Captioner(model.eval(), vocab, torch.device("cpu")), "transformer_flickr8k, random decoder"


def _calibration(model_name: str) -> Path | None:
    """The int8 calibration of the benchmarked model (a shipped name or a checkpoint file); None: no int8 rows."""
    from captioner.errors import CaptionerError
    from captioner.inference import calibration_path, checkpoint_path

    try:
        return calibration_path(model_name, checkpoint_path(model_name))
    except CaptionerError:  # the random-decoder fallback: no file, no calibration
        return None


@contextlib.contextmanager
def _before(captioner_model):
    """The encoder in NCHW without folded BatchNorm and the feature cache's reads serial, as before;
    restored on exit."""
    import captioner.features.cache as cache

    encoder = captioner_model.model.encoder
    old_format, old_batches, old_fold = encoder.memory_format, cache.prefetched_batches, encoder.fold_batchnorm

    def serial(data, batch_size, threads=0):
        from captioner.data.dataset import collate_safe
        for start in range(0, len(data), batch_size):
            yield collate_safe([data[i] for i in range(start, min(start + batch_size, len(data)))])

    import torch
    encoder.memory_format = torch.contiguous_format
    encoder.fold_batchnorm = False
    cache.prefetched_batches = serial
    try:
        yield
    finally:
        encoder.memory_format = old_format
        encoder.fold_batchnorm = old_fold
        cache.prefetched_batches = old_batches


def _caption_before(m, paths: list[Path], batch: int, options) -> None:
    """The caption path as it was: per batch, read every file in full, transform, encode, search."""
    import torch

    from captioner.data.images import load_image
    from captioner.inference import caption_features

    with torch.no_grad():
        for start in range(0, len(paths), batch):
            pixels = torch.stack([m.transform(load_image(p)) for p in paths[start:start + batch]])
            features, grid = m.model.encode(pixels)
            caption_features(m.model, features, m.vocab, options, grid=(int(grid[0]), int(grid[1])))


def _bound(m, paths: list[Path], batch: int) -> None:
    """Reading (threads, reduced JPEG decoding) and encoding alone: the caption path without its search."""
    import torch

    from captioner.data.dataset import ImageLoader, SafeImages, prefetched_batches

    data = SafeImages(ImageLoader(paths, m.transform), len(paths))
    with torch.no_grad():
        for pixels, _, _ in prefetched_batches(data, batch):
            m.model.encode(pixels)


def _cache(m, folder: Path, paths: list[Path], tag: str) -> None:
    from types import SimpleNamespace

    from captioner.features.cache import FeatureCache

    images = [SimpleNamespace(path=p, file_name=p.name) for p in paths]
    FeatureCache.build(m.model.encoder, SimpleNamespace(images=images), m.transform, folder / f"{tag}.feats",
                       batch_size=32, progress=False)


def _rate(fn, count: int, repeats: int = 1) -> float:
    """Photos/s of ``fn`` (``count`` photos): the best of ``repeats`` runs (the least disturbed by other work)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return count / best


def caption_throughput(quick: bool, photos: int | None = None) -> dict:
    """``photos``: how many of each set (default: 32 with ``quick``, else PHOTOS)."""
    import torch

    from captioner.decoding.search import DecodeOptions
    from captioner.language import fusion_unavailable
    from captioner.models.base import eval_mode

    from captioner.models.quantize import Int8Lite, int8_available, read_calibration

    count = photos or (32 if quick else PHOTOS)
    repeats = 1 if quick else 2  # each row the best of two runs: the bound and the paths alike
    m, model_name = _model()
    options = DecodeOptions(beam_size=3)
    out: dict = {"model": model_name, "photos": count, "threads": torch.get_num_threads()}
    encoder = m.model.encoder
    calibration = _calibration(model_name)
    int8 = Int8Lite(encoder.trunk, read_calibration(calibration)) if calibration and int8_available() else None

    @contextlib.contextmanager
    def in_int8():
        encoder.use_int8(int8)
        try:
            yield
        finally:
            encoder.use_int8(None)

    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        folder = Path(tmp)
        sets = {"coco": _photos(folder / "coco", count, small=False),
                "small": _photos(folder / "small", count, small=True)}
        with eval_mode(m.model):
            m.caption(sets["small"][:4], beam=3, batch_size=4)  # warm-up: weights converted, kernels chosen
            m.caption(sets["small"][:4], beam=3, batch_size=4, precision="bfloat16")
            with in_int8():
                m.caption(sets["small"][:4], beam=3, batch_size=4)
            for name, paths in sets.items():
                out[f"caption_{name}_per_s"] = _rate(
                    lambda: m.caption(paths, beam=3, attention=True, batch_size=32), count, repeats)
                out[f"caption_bf16_{name}_per_s"] = _rate(
                    lambda: m.caption(paths, beam=3, attention=True, batch_size=32, precision="bfloat16"), count, repeats)
                out[f"bound_{name}_per_s"] = _rate(lambda: _bound(m, paths, 32), count, repeats)
                if int8 is not None:
                    with in_int8():
                        out[f"caption_int8_{name}_per_s"] = _rate(
                            lambda: m.caption(paths, beam=3, attention=True, batch_size=32), count, repeats)
                        out[f"bound_int8_{name}_per_s"] = _rate(lambda: _bound(m, paths, 32), count, repeats)
                    out[f"caption_int8_{name}_over_caption"] = (out[f"caption_int8_{name}_per_s"]
                                                                / out[f"caption_{name}_per_s"])
                    out[f"caption_int8_{name}_over_bound_int8"] = (out[f"caption_int8_{name}_per_s"]
                                                                   / out[f"bound_int8_{name}_per_s"])
                with _before(m):
                    out[f"before_{name}_per_s"] = _rate(lambda: _caption_before(m, paths, 32, options), count, repeats)
                out[f"caption_{name}_over_before"] = out[f"caption_{name}_per_s"] / out[f"before_{name}_per_s"]
                out[f"caption_{name}_over_bound"] = out[f"caption_{name}_per_s"] / out[f"bound_{name}_per_s"]
                out[f"caption_bf16_{name}_over_bound"] = out[f"caption_bf16_{name}_per_s"] / out[f"bound_{name}_per_s"]
            if not fusion_unavailable("coco", m.vocab):  # everyday photos with the packaged language model fused in (--lm-weight 0.3)
                coco = sets["coco"]
                out["caption_lm_coco_per_s"] = _rate(
                    lambda: m.caption(coco, beam=3, attention=True, batch_size=32, lm_weight=0.3), count, repeats)
                out["caption_lm_over_caption_coco"] = out["caption_lm_coco_per_s"] / out["caption_coco_per_s"]
            small = sets["small"]
            with _before(m):
                out["cache_before_per_s"] = _rate(lambda: _cache(m, folder, small, "before"), count, repeats)
            out["cache_per_s"] = _rate(lambda: _cache(m, folder, small, "now"), count, repeats)
            out["cache_over_before"] = out["cache_per_s"] / out["cache_before_per_s"]
    return out


BENCHMARKS = {"caption_throughput": caption_throughput}
