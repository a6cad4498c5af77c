"""The built-in demo: synthetic scenes, three decoders on a time budget, one comparison report.

``run_demo(DemoOptions(...))`` (its steps in docs/demo.md) generates the scenes, pretrains the small CNN
as word detectors, encodes the scenes once, trains SAT-soft, SAT-hard and the Transformer (``jobs`` at a
time) and writes ``out/report.html`` and ``out/report.json``. The decoders share one frozen encoder, so
the table compares decoders, not CNNs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from captioner.config import get_preset
from captioner.data.coco import load_caption_set, load_instances
from captioner.data.images import load_image
from captioner.data.shapes import MAX_UNSEEN_PAIRS, make_shapes
from captioner.demo.report import (LABELS, format_value, pace_notes, read_metrics_csv, steps_of_reference, table_row,
                                   write_report)
from captioner.device import DistInfo, resolve_device
from captioner.errors import ConfigError, DataError
from captioner.evaluation.evaluate import evaluate_checkpoint
from captioner.inference import Captioner, decode_options, load
from captioner.models.model import build_model
from captioner.training.data import load_caption_sets, prepare_data, training_vocabulary
from captioner.training.detectors import pretrain_word_detectors
from captioner.training.loop import train
from captioner.viz.overlays import write_overlays


log = logging.getLogger(__name__)

DEMO_DECODERS = ("sat_soft", "sat_hard", "transformer")
DEMO_PRESETS = {name: f"{name}_demo" for name in DEMO_DECODERS}
SCENES_INFO = "captioner synthetic shapes"
# Training seconds per decoder: the SAT decoders step through words one at a time; the Transformer needs fewer.
DEFAULT_BUDGETS = {"sat_soft": 120.0, "sat_hard": 120.0, "transformer": 45.0}
DEFAULT_ENCODER_BUDGET = 60.0  # seconds of word-detector pretraining of the shared CNN
# The values below were chosen by the demo runs measured in docs/demo.md and docs/grounding.md.
SCST_BUDGET_SHARE = 1.0  # --scst without --scst-budget: this share of the decoder's own budget
SCST_LR_SCALE = 0.1  # the SCST stage's lr, relative to the cross-entropy stage's (Rennie et al. lower it too)
SCST_XE_WEIGHT = 0.25  # the references' cross-entropy mixed into the SCST stage (train.scst.xe_weight)
# train.attention_supervision of each decoder (--no-attention-supervision: 0)
ATTENTION_SUPERVISION = {"sat_soft": 1.0, "sat_hard": 1.0, "transformer": 1.0}
# share of the word-detector CNN's images recoloured (colour channels permuted, hue words out of their loss);
# it also learns from the scenes' boxes. --encoder-from-captions: MIL from the captions alone, no recolouring.
ENCODER_RECOLOUR = 0.5


@dataclass
class DemoOptions:
    """What the demo does.

    Attributes:
        budgets: decoder -> training seconds; ``presets``: decoder -> preset (default ``<decoder>_demo``).
        overrides: dotted config overrides for every decoder (e.g. ``{"train.epochs": 1}``).
        scst_budgets: decoder -> seconds of the self-critical stage.
        attention_supervision: supervise attention with the object boxes (``ATTENTION_SUPERVISION``).
        unseen_pairs: K colour-shape pairs only in test (a compositional split).
        encoder_boxes: pretrain the CNN's word detectors on the boxes and recoloured images too.
    """

    data: Path = Path("data/shapes")  # synthetic-scenes folder (generated when it holds no scenes)
    images: int = 3000  # scenes to generate
    seed: int = 0  # seed of the scenes and of training
    budgets: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_BUDGETS))
    encoder_budget: float = DEFAULT_ENCODER_BUDGET  # seconds of word-detector pretraining of the shared CNN
    decoders: tuple[str, ...] = DEMO_DECODERS  # which of ``DEMO_DECODERS`` to train, in order
    out: Path = Path("runs/demo")  # output folder (runs, report)
    overlays: int = 4  # test images written with overlays and explorers per decoder
    beam_size: int | None = None  # beam size of the test captions; None: ``DecodeOptions()``'s (3)
    device: str = "cpu"  # ``"cpu"``, ``"cuda"``, ``"auto"``
    image_size: int = 128  # side of generated scenes in pixels (the encoder sees its own ``image_size``)
    presets: dict[str, str] = field(default_factory=lambda: dict(DEMO_PRESETS))
    overrides: dict[str, Any] = field(default_factory=dict)
    jobs: int | None = None  # decoders trained at the same time, each in its own process (None: ``default_jobs``)
    progress: bool = True  # show tqdm bars (runs in this process; worker processes log a progress line instead)
    scst: bool = False  # add a self-critical stage after each decoder's cross-entropy budget (``<decoder>+scst`` rows)
    scst_budgets: dict[str, float] = field(default_factory=dict)
    attention_supervision: bool = True
    unseen_pairs: int = 0
    encoder_boxes: bool = True

    def __post_init__(self) -> None:
        self.data, self.out = Path(self.data), Path(self.out)
        self.decoders = tuple(self.decoders)
        unknown = [d for d in self.decoders if d not in DEMO_DECODERS]
        if unknown or not self.decoders:
            raise ConfigError(f"--decoders {','.join(self.decoders) or '(none)'}: choose from {','.join(DEMO_DECODERS)}")
        if len(set(self.decoders)) != len(self.decoders):
            raise ConfigError(f"--decoders lists a decoder twice: {','.join(self.decoders)}")
        if self.images < 30:
            raise ConfigError(f"--images must be >= 30, got {self.images}")
        self.budgets = {**DEFAULT_BUDGETS, **self.budgets}
        bad = {k: v for k, v in self.budgets.items() if k not in DEMO_DECODERS or not v > 0}
        if bad:
            raise ConfigError(f"--budget: each decoder needs a number of seconds > 0 ({', '.join(DEMO_DECODERS)}), "
                              f"got {', '.join(f'{k}={v}' for k, v in bad.items())}")
        if not self.encoder_budget > 0:
            raise ConfigError(f"--encoder-budget must be > 0 seconds, got {self.encoder_budget}")
        if self.jobs is not None and self.jobs < 1:
            raise ConfigError(f"--jobs must be >= 1, got {self.jobs}")
        if self.overlays < 0 or (self.beam_size is not None and self.beam_size < 1):
            raise ConfigError("--overlays must be >= 0 and --beam >= 1")
        if isinstance(self.unseen_pairs, bool) or not isinstance(self.unseen_pairs, int) \
                or not 0 <= self.unseen_pairs <= MAX_UNSEEN_PAIRS:
            raise ConfigError(f"--unseen-pairs must be a whole number from 0 to {MAX_UNSEEN_PAIRS}, "
                              f"got {self.unseen_pairs!r}")
        if self.scst_budgets and not self.scst:
            raise ConfigError("--scst-budget needs --scst")
        bad = {k: v for k, v in self.scst_budgets.items() if k not in DEMO_DECODERS or not v > 0}
        if bad:
            raise ConfigError(f"--scst-budget: each decoder needs a number of seconds > 0 "
                              f"({', '.join(DEMO_DECODERS)}), got {', '.join(f'{k}={v}' for k, v in bad.items())}")
        self.scst_budgets = {name: float(self.scst_budgets.get(name, SCST_BUDGET_SHARE * self.budgets[name]))
                             for name in DEMO_DECODERS} if self.scst else {}

    @classmethod
    def from_args(cls, data: str, images: int | None, seed: int, budget: str | float | None,
                  decoders: str | Sequence[str], out: str, overlays: int = 4, beam_size: int | None = None, device: str = "cpu",
                  quick: bool = False, encoder_budget: float | None = None, scst: bool = False,
                  scst_budget: str | float | None = None, **extra: Any) -> "DemoOptions":
        """Options from command-line values; ``quick`` picks small defaults for the unset ones.

        ``budget`` (and ``scst_budget``) is seconds for every decoder or ``name=seconds`` pairs.
        """
        if isinstance(decoders, str):
            decoders = [d.strip() for d in decoders.split(",") if d.strip()]
        budgets = parse_budgets(budget) if budget is not None else (
            {name: 15.0 for name in DEMO_DECODERS} if quick else {})
        quick_overrides = {"train.val_max_images": 50} if quick else {}
        return cls(data=Path(data), images=images or (400 if quick else 3000), seed=seed, budgets=budgets,
                   encoder_budget=encoder_budget or (10.0 if quick else DEFAULT_ENCODER_BUDGET),
                   decoders=tuple(decoders), out=Path(out), overlays=min(overlays, 2) if quick else overlays,
                   beam_size=beam_size, device=device, overrides={**quick_overrides, **extra.pop("overrides", {})},
                   scst=scst,
                   scst_budgets=parse_budgets(scst_budget, "--scst-budget") if scst_budget is not None else {},
                   **extra)


def parse_budgets(text: str | float, flag: str = "--budget") -> dict[str, float]:
    """``"90"`` -> every decoder 90 s; ``"sat_soft=150,transformer=60"`` -> those two (others keep defaults)."""
    if isinstance(text, (int, float)):
        return {name: float(text) for name in DEMO_DECODERS}
    text = str(text).strip()
    try:
        if "=" not in text:
            return {name: float(text) for name in DEMO_DECODERS}
        pairs = [part.split("=", 1) for part in text.split(",") if part.strip()]
        return {name.strip(): float(value) for name, value in pairs}
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give seconds (90) or decoder=seconds pairs "
                          f"(sat_soft=150,transformer=60)") from None


# ----------------------------------------------------------------------------- steps
def ensure_scenes(options: DemoOptions) -> dict[str, Any]:
    """Generate the scenes unless complete; ``{"generated", "images", "seed", "image_size"}`` from the files."""
    root = options.data
    files = [root / f"{kind}_{split}.json" for kind in ("captions", "instances") for split in ("train", "val", "test")]
    if all(f.is_file() for f in files):
        info = _scenes_info(files[0])
        held = len(info.pop("unseen_pairs") or [])
        if held != options.unseen_pairs:
            raise DataError(f"{root}: its scenes hold {held} unseen colour-shape pairs, not {options.unseen_pairs}; "
                            f"pass another --data folder")
        log.info("using the synthetic scenes in %s (%s images, seed %s)", root, info.get("images"), info.get("seed"))
        return {"generated": False, **info, "unseen_pairs": held}
    if root.exists() and any(root.iterdir()) and not (root / "images").is_dir():
        raise DataError(f"{root}: exists and is not a synthetic-scenes folder; pass another --data folder")
    stats = make_shapes(root, images=options.images, seed=options.seed, image_size=options.image_size,
                        unseen_pairs=options.unseen_pairs, overwrite=True)  # a scenes folder left incomplete
    return {"generated": True, "images": stats["images"], "seed": options.seed, "image_size": options.image_size,
            "seconds": stats["seconds"], "unseen_pairs": options.unseen_pairs}


def _scenes_info(path: Path) -> dict[str, Any]:
    try:
        info = json.loads(path.read_text()).get("info") or {}
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read ({exc})") from None
    if info.get("description") != SCENES_INFO:
        raise DataError(f"{path.parent}: not a synthetic-scenes folder (run the demo with another --data)")
    return {k: info.get(k) for k in ("images", "seed", "image_size", "unseen_pairs")}


def demo_config(decoder: str, options: DemoOptions, encoder_weights: Path | None = None):  # -> Config
    """One decoder's training config: its preset, data folder, budget, seed, overrides (and frozen ``encoder_weights``)."""
    overrides: dict[str, Any] = {"data.root": str(options.data), "train.time_budget": float(options.budgets[decoder]),
                                 "train.seed": options.seed, "train.device": options.device,
                                 "train.attention_supervision": (ATTENTION_SUPERVISION[decoder]
                                                                 if options.attention_supervision else 0.0)}
    if encoder_weights is not None:
        overrides.update({"model.encoder.pretrained": True, "model.encoder.weights": str(encoder_weights),
                          "model.encoder.fine_tune": False, "data.feature_cache": True,
                          "data.feature_cache_dir": str(options.out / "features")})
    return get_preset(options.presets[decoder], **{**overrides, **options.overrides})


def scst_config(decoder: str, cfg: Any, options: DemoOptions):  # -> Config
    """The self-critical stage of one decoder: its cross-entropy config, now ``train.objective=scst``
    from ``out/<decoder>/best.safetensors`` for ``options.scst_budgets[decoder]`` seconds."""
    return cfg.override(**{"train.objective": "scst", "train.init": str(options.out / decoder / "best.safetensors"),
                           "train.time_budget": options.scst_budgets[decoder],
                           "train.lr": cfg.train.lr * SCST_LR_SCALE, "train.scst.xe_weight": SCST_XE_WEIGHT})


def default_jobs(options: DemoOptions) -> int:
    """Decoders trained at once: one process per core on a CPU (their small ops scale badly across
    threads), one at a time on a GPU."""
    import torch

    on_gpu = options.device.startswith("cuda") or (options.device == "auto" and torch.cuda.is_available())
    return 1 if on_gpu else max(1, min(os.cpu_count() or 1, len(options.decoders)))


def pretrain_encoder(options: DemoOptions) -> dict[str, Any]:
    """Step 2: word-detector pretraining of the demo CNN into ``out/encoder.safetensors``."""
    cfg = demo_config(options.decoders[0], options)
    recolour = ENCODER_RECOLOUR if options.encoder_boxes else 0.0
    result = pretrain_word_detectors(cfg, options.out / "encoder.safetensors", seconds=options.encoder_budget,
                                     progress=options.progress, boxes=options.encoder_boxes, recolour=recolour)
    return {"weights": str(result.weights), "steps": result.steps, "seconds": round(result.seconds, 1),
            "grounded_images": result.grounded_images, "recolour": recolour,
            "first_loss": round(result.first_loss, 4), "last_loss": round(result.last_loss, 4),
            "encoder": {k: v for k, v in cfg.model.encoder.__dict__.items() if k in ("name", "width", "grid",
                                                                                     "image_size")}}


# ----------------------------------------------------------------------------- the demo
def run_demo(options: DemoOptions) -> dict[str, Any]:
    """Run the whole demo (see the module docstring); returns the report (also in ``report.json``)."""
    start = time.monotonic()
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    log.info("[1/5] synthetic scenes in %s", options.data)
    scenes = ensure_scenes(options)
    log.info("[2/5] pretraining the CNN as word detectors on the training captions%s for %.0f s",
             " and boxes, half the images recoloured" if options.encoder_boxes else "", options.encoder_budget)
    encoder = pretrain_encoder(options)
    configs = {name: demo_config(name, options, Path(encoder["weights"])) for name in options.decoders}
    log.info("[3/5] encoding the scenes once with the frozen CNN")
    build_feature_caches(configs[options.decoders[0]], progress=options.progress)
    common = {"beam_size": options.beam_size, "overlays": options.overlays,
              "train_captions": len(load_caption_set(options.data, "train").all_captions())}
    jobs = {name: {"cfg": configs[name], "run_dir": out / name} for name in options.decoders}
    if options.scst:  # the second stage runs in the same job, right after the first
        for name, job in jobs.items():
            job["scst_cfg"] = scst_config(name, configs[name], options)
    processes = min(options.jobs or default_jobs(options), len(jobs))
    log.info("[4/5] training %s over the frozen CNN (%s)", ", ".join(LABELS[n] for n in options.decoders),
             ", ".join(f"{LABELS[n]} {options.budgets[n]:.0f} s" for n in options.decoders))
    if processes > 1:
        done = run_parallel(jobs, processes, **common)
    else:
        done = {}
        for name, job in jobs.items():
            log.info("training %s (%s) -> %s", LABELS[name], options.presets[name], job["run_dir"])
            done[name] = run_decoder(name, progress=options.progress, **job, **common)
    log.info("[5/5] writing the report")  # (the SCST stages, with --scst, ran inside step 4's jobs)
    names = []
    for name in options.decoders:
        done[name]["run"]["preset"] = options.presets[name]
        done[name]["run"]["budget"] = options.budgets[name]
        names.append(name)
        scst = done[name].pop("scst", None)
        if scst is not None:
            scst["run"]["preset"] = options.presets[name]
            scst["run"]["budget"] = options.scst_budgets[name]
            done[f"{name}+scst"] = scst
            names.append(f"{name}+scst")
    for name in names:
        done[name]["row"]["steps_of_reference"] = steps_of_reference(name, done[name]["row"].get("steps"))
    pace = pace_notes([done[name]["row"] for name in names],  # only the presets the reference figures used
                      {n: b for n, b in options.budgets.items() if options.presets.get(n) == f"{n}_demo"})
    for note in pace:
        log.warning("warning: %s", note)
    report = {
        "title": "captioner demo: three attention decoders on synthetic scenes",
        "pace": pace,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(options).items()},
        "scenes": scenes,
        "encoder": encoder,
        "table": [done[name]["row"] for name in names],
        "runs": {name: done[name]["run"] for name in names},
        "environment": _environment(),
        "seconds": round(time.monotonic() - start, 1),
        "paths": {"html": str(out / "report.html"), "json": str(out / "report.json")},
    }
    write_report(report, out)
    return report


def _environment() -> dict[str, Any]:
    import platform

    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(), "cuda": torch.cuda.is_available()}


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
    """Overlays and explorers for ``count`` test images; one ``{"image_id", "caption", "png", ...}`` dict each."""
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
    """Train one decoder, score its best checkpoint on the test split, draw overlays, then its SCST stage if any.

    ``threads``: torch threads here (None leaves them). Returns ``{"row", "run"}`` (JSON-compatible),
    plus ``"scst"`` for the self-critical stage when ``scst_cfg`` is given.
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
    """Run ``run_decoder`` for ``jobs`` (name -> its kwargs) in ``processes`` workers; name -> result.

    ``**kwargs`` are common to all. A worker's ``CaptionerError`` is re-raised here.
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
