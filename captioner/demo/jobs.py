"""The demo's per-decoder work: train, score, draw overlays; in this process or in worker processes.

``run_decoder(name, cfg, ...)`` trains one decoder, scores its best checkpoint on the test split
and writes overlays for a few test images; ``run_parallel`` runs several at once, one process
each with its own torch threads, and logs one progress line every ``PROGRESS_SECONDS`` (each
worker's own log goes to ``<run>/demo.log``). ``build_feature_caches`` encodes the scenes once,
before the workers open the shared cache.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from captioner.data.coco import load_instances
from captioner.data.images import load_image
from captioner.demo.report import LABELS, format_value, read_metrics_csv, table_row
from captioner.device import resolve_device
from captioner.errors import DataError
from captioner.evaluation.evaluate import evaluate_checkpoint
from captioner.inference import Captioner, decode_options, load
from captioner.models.model import build_model
from captioner.training.data import load_caption_sets, prepare_data, training_vocabulary
from captioner.training.distributed import DistInfo
from captioner.training.loop import train
from captioner.viz.overlays import write_overlays

log = logging.getLogger(__name__)

PROGRESS_SECONDS = 15.0  # parallel runs: seconds between progress lines


def pick_images(caption_set: Any, instances: dict[int, list[Any]] | None, count: int) -> list[int]:
    """Indices of ``count`` test images to show: scenes with two or more objects first, then by order."""
    def objects(i: int) -> int:
        return len(instances.get(caption_set.images[i].image_id, [])) if instances else 0

    order = sorted(range(len(caption_set.images)), key=lambda i: (-min(objects(i), 2), i))
    return sorted(order[:count])


def write_demo_overlays(metrics: dict[str, Any], model: Captioner, data: Path, out_dir: Path,
                        count: int) -> list[dict[str, Any]]:
    """Overlays (PNG, GIF) and HTML explorers for ``count`` test images of an evaluated model (loaded once).

    Returns:
        One ``{"image_id", "caption", "references", "png", "gif", "json", "html"}`` dict per image.
    """
    cs, results = metrics["caption_set"], metrics["results"]
    shown = []
    for i in pick_images(cs, load_instances(data, cs.split), count):
        record, result = cs.images[i], results[i]
        image = load_image(record.path)
        all_att = model.teacher_forced(image, result.tokens)  # (L, layers, heads, g, g) or None
        placed = dataclasses.replace(result, box=model.crop_box(image), all_attention=all_att)
        paths = write_overlays(image, placed, out_dir, stem=f"test_{record.image_id}")
        shown.append({"image_id": record.image_id, "caption": result.text,
                      "references": cs.references(record.image_id), **{k: str(p) for k, p in paths.items()}})
    return shown


def parameter_counts(loaded: Captioner) -> dict[str, int]:
    """Total, decoder and trained parameter counts of a loaded model."""
    model, fine_tune = loaded.model, loaded.config.encoder.fine_tune
    decoder = sum(p.numel() for p in model.decoder.parameters())
    encoder = sum(p.numel() for p in model.encoder.parameters())
    return {"parameters": decoder + encoder, "decoder_parameters": decoder,
            "trained_parameters": decoder + (encoder if fine_tune else 0)}


def epochs_trained(history: Sequence[dict[str, Any]], train_items: int, batch_size: int) -> float:
    """Epochs trained, counting a partial last epoch by its steps."""
    if not history:
        return 0.0
    return round(history[-1]["step"] / max(1, math.ceil(train_items / batch_size)), 2)


def run_decoder(name: str, cfg: Any, run_dir: Path, beam_size: int | None, overlays: int, train_captions: int,
                progress: bool = True, threads: int | None = None, scst_cfg: Any = None) -> dict[str, Any]:
    """Train one decoder, score its best checkpoint on the test split, draw overlays; then, with
    ``scst_cfg``, the same for its self-critical stage (``<run_dir>+scst``, ``--init`` from this one).

    Args:
        name: decoder name (the table's first column).
        cfg: its training ``Config`` (``data.root`` is the scenes folder).
        run_dir: run folder.
        beam_size: beam size of the test captions.
        overlays: test images drawn with overlays.
        train_captions: training captions (items per epoch), for the epoch count.
        progress: show tqdm bars.
        threads: torch threads to use here (worker processes); None leaves the setting alone.
        scst_cfg: the self-critical stage's config (``captioner.demo.pipeline.scst_config``), or None.

    Returns:
        ``{"row": table row, "run": run summary}`` (JSON-compatible), plus ``"scst"``: the same
        for the self-critical stage when ``scst_cfg`` is given.
    """
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    done = _train_and_score(name, cfg, run_dir, beam_size, overlays, train_captions, progress)
    if scst_cfg is not None:
        scst_name = f"{name}+scst"
        log.info("%s: self-critical stage from %s (%.0f s)", scst_name, scst_cfg.train.init, scst_cfg.train.time_budget)
        done["scst"] = _train_and_score(scst_name, scst_cfg, run_dir.with_name(run_dir.name + "+scst"), beam_size,
                                        overlays, train_captions, progress)
    return done


def _train_and_score(name: str, cfg: Any, run_dir: Path, beam_size: int | None, overlays: int, train_captions: int,
                     progress: bool) -> dict[str, Any]:
    device = str(resolve_device(cfg.train.device, 0, option="train.device"))
    result = train(cfg, run_dir, progress=progress, overwrite=True)  # a demo re-run moves the last one aside
    if not result.best_checkpoint.exists():
        raise DataError(f"{name}: training wrote no checkpoint (is --budget too small?)")
    options = decode_options(**({} if beam_size is None else {"beam_size": beam_size}))
    log.info("evaluating %s on the test split (beam %d)", LABELS.get(name, name), options.beam_size)
    model = load(result.best_checkpoint, device=device)  # once: scores, overlays and parameter counts
    metrics = evaluate_checkpoint(result.best_checkpoint, cfg.data.root, "test", options, out_dir=run_dir,
                                  device=device, progress=progress, meteor=False,
                                  coco_caption=False, model=model)  # synthetic scenes: no paper to compare with
    shown = write_demo_overlays(metrics, model, Path(cfg.data.root), run_dir / "overlays", overlays)
    steps = int(result.history[-1]["step"]) if result.history else None
    row = table_row(name, metrics, result.seconds, epochs_trained(result.history, train_captions,
                                                                  cfg.train.batch_size),
                    parameter_counts(model), steps=steps,
                    attention_supervision=cfg.train.attention_supervision)
    log.info("%s: BLEU-4 %s, objects correct %s, attention correctness %s (uniform %s)", LABELS.get(name, name),
             format_value(row["BLEU-4"], "{:.3f}"), format_value(row["objects_correct"], "{:.1%}"),
             format_value(row["attention_correctness"], "{:.3f}"), format_value(row["uniform_baseline"], "{:.3f}"))
    run = {"config": cfg.to_dict(), "run_dir": str(run_dir), "checkpoint": str(result.best_checkpoint),
           "best_val_bleu4": result.best_bleu4, "history": result.history,
           "metrics_file": metrics["paths"]["metrics"], "overlays": shown}
    return {"row": row, "run": run}


def _worker(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``run_decoder`` in a worker process; its log lines go to ``<run_dir>/demo.log``."""
    run_dir = Path(kwargs["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "demo.log", mode="a")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        return run_decoder(name, progress=False, **kwargs)
    finally:
        root.removeHandler(handler)
        handler.close()


def progress_line(run_dirs: dict[str, Path]) -> str:
    """``sat_soft step 250 loss 0.61 val B-4 0.52 | ...`` from each run's ``metrics.csv``."""
    parts = []
    for name, run_dir in run_dirs.items():
        steps, epochs = read_metrics_csv(run_dir)
        text = f"{name} starting"
        if steps or epochs:
            last = max(steps + epochs, key=lambda r: r.get("step", 0))
            text = f"{name} step {last.get('step', 0):.0f} loss {last.get('ce', last.get('loss', math.nan)):.2f}"
            if epochs:
                text += f" val B-4 {epochs[-1].get('BLEU-4', math.nan):.2f}"
        parts.append(text)
    return " | ".join(parts)


def run_parallel(jobs: dict[str, dict[str, Any]], processes: int, **kwargs: Any) -> dict[str, dict[str, Any]]:
    """Run ``run_decoder`` for several decoders in ``processes`` worker processes, in ``jobs`` order.

    Args:
        jobs: decoder name -> ``run_decoder`` keyword arguments of that decoder (``cfg``, ``run_dir``).
        processes: worker processes (each gets ``os.cpu_count() // processes`` torch threads, at least 1).
        **kwargs: ``run_decoder`` keyword arguments common to all (``beam_size``, ``overlays``,
            ``train_captions``).

    Returns:
        Decoder name -> ``run_decoder`` result. A worker's ``CaptionerError`` is re-raised here.
    """
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    threads = max(1, (os.cpu_count() or 1) // processes)
    log.info("training %s in %d worker processes (%d thread%s each); their logs: <run>/demo.log",
             ", ".join(jobs), processes, threads, "s" if threads > 1 else "")
    done: dict[str, dict[str, Any]] = {}
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_worker, name, {**kwargs, **job, "threads": threads}): name
                   for name, job in jobs.items()}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=PROGRESS_SECONDS, return_when=FIRST_COMPLETED)
            for future in finished:
                name = futures[future]
                done[name] = future.result()
                row = done[name]["row"]
                log.info("%s finished: BLEU-4 %.3f, objects correct %.1f%%, attention %.1fx uniform", name,
                         row["BLEU-4"] or 0.0, 100 * (row["objects_correct"] or 0.0), row["ratio"] or 0.0)
            running = {futures[f]: jobs[futures[f]]["run_dir"] for f in pending
                       if Path(jobs[futures[f]]["run_dir"], "metrics.csv").exists()}
            if running:
                log.info("  %s", progress_line(running))
    return done


def build_feature_caches(cfg: Any, progress: bool = True) -> None:
    """Build a frozen-encoder config's train/val feature caches once, before parallel runs open them."""
    train_set, val_set = load_caption_sets(cfg)
    vocab = training_vocabulary(train_set, cfg.data.min_freq, cfg.data.max_caption_len)
    model = build_model(cfg.model, len(vocab))
    info = DistInfo(0, 1, 0, resolve_device(cfg.train.device, 0, option="train.device"))
    # only the files are wanted here: not holding the features in memory (each run does that itself)
    prepare_data(cfg.override(**{"data.in_memory_mb": 0.0}), model, vocab, train_set, val_set, Path(cfg.data.feature_cache_dir), info, progress)
