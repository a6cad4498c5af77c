"""The built-in demo: synthetic scenes, three decoders on a time budget, one comparison report.

``run_demo(DemoOptions(...))``:

1. generates the synthetic scenes (``make_shapes``) unless ``data`` already holds them;
2. trains each decoder (SAT-soft, SAT-hard, Transformer; presets ``<decoder>_demo``) for at
   most ``budget`` seconds into ``out/<decoder>/``;
3. scores the best checkpoint on the test split (``evaluate_checkpoint``: BLEU-1..4, CIDEr-D,
   attention entropy, attention correctness against the object boxes, share of captions naming
   every object correctly) and writes overlays and HTML explorers for a few test images;
4. writes ``out/report.html`` (self-contained) and ``out/report.json``.

Progress is logged step by step (``[2/8] training sat_soft ...``) with tqdm bars inside.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from captioner.errors import ConfigError, DataError

log = logging.getLogger(__name__)

DEMO_DECODERS = ("sat_soft", "sat_hard", "transformer")
DEMO_PRESETS = {name: f"{name}_demo" for name in DEMO_DECODERS}
LABELS = {"sat_soft": "SAT soft", "sat_hard": "SAT hard", "transformer": "Transformer"}
SCENES_INFO = "captioner synthetic shapes"

# (key, header, format) of the comparison table; values are None when not measured
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("decoder", "decoder", "{}"),
    ("BLEU-1", "B-1", "{:.3f}"),
    ("BLEU-2", "B-2", "{:.3f}"),
    ("BLEU-3", "B-3", "{:.3f}"),
    ("BLEU-4", "B-4", "{:.3f}"),
    ("CIDEr-D", "CIDEr-D", "{:.3f}"),
    ("objects_correct", "objects ok", "{:.1%}"),
    ("attention_correctness", "att. corr.", "{:.3f}"),
    ("uniform_baseline", "uniform", "{:.3f}"),
    ("ratio", "ratio", "{:.1f}x"),
    ("pointing_accuracy", "pointing", "{:.1%}"),
    ("attention_entropy", "entropy", "{:.2f}"),
    ("uniform_entropy", "log N", "{:.2f}"),
    ("train_seconds", "train s", "{:.0f}"),
    ("epochs", "epochs", "{:.1f}"),
    ("parameters", "params", "{:,}"),
)


@dataclass
class DemoOptions:
    """What the demo does.

    Attributes:
        data: synthetic-scenes folder (generated when it holds no scenes).
        images: scenes to generate.
        seed: seed of the scenes and of training.
        budget: training seconds per decoder (``train.time_budget``).
        decoders: which of ``DEMO_DECODERS`` to train, in order.
        out: output folder (runs, report).
        overlays: test images written with overlays and explorers per decoder.
        beam_size: beam size of the test captions.
        device: ``"cpu"``, ``"cuda"``, ``"auto"``.
        image_size: side of generated scenes in pixels.
        presets: decoder -> preset name (default ``<decoder>_demo``).
        overrides: dotted config overrides applied to every decoder (e.g. ``{"train.epochs": 1}``).
        progress: show tqdm bars.
    """

    data: Path = Path("data/shapes")
    images: int = 3000
    seed: int = 0
    budget: float = 80.0
    decoders: tuple[str, ...] = DEMO_DECODERS
    out: Path = Path("runs/demo")
    overlays: int = 4
    beam_size: int = 3
    device: str = "cpu"
    image_size: int = 128
    presets: dict[str, str] = field(default_factory=lambda: dict(DEMO_PRESETS))
    overrides: dict[str, Any] = field(default_factory=dict)
    progress: bool = True

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
        if not self.budget > 0:
            raise ConfigError(f"--budget must be > 0 seconds, got {self.budget}")
        if self.overlays < 0 or self.beam_size < 1:
            raise ConfigError("--overlays must be >= 0 and --beam >= 1")

    @classmethod
    def from_args(cls, data: str, images: int | None, seed: int, budget: float | None, decoders: str | Sequence[str],
                  out: str, overlays: int = 4, beam_size: int = 3, device: str = "cpu", quick: bool = False,
                  **extra: Any) -> "DemoOptions":
        """Options from command-line values; ``quick`` picks small defaults for the unset ones."""
        if isinstance(decoders, str):
            decoders = [d.strip() for d in decoders.split(",") if d.strip()]
        quick_overrides = {"train.val_max_images": 50} if quick else {}
        return cls(data=Path(data), images=images or (400 if quick else 3000), seed=seed,
                   budget=budget or (15.0 if quick else 80.0), decoders=tuple(decoders), out=Path(out),
                   overlays=min(overlays, 2) if quick else overlays, beam_size=beam_size, device=device,
                   overrides={**quick_overrides, **extra.pop("overrides", {})}, **extra)


# ----------------------------------------------------------------------------- steps


def ensure_scenes(options: DemoOptions) -> dict[str, Any]:
    """Generate the scenes into ``options.data`` unless a complete scenes folder is already there.

    Returns:
        ``{"generated": bool, "images": int, "seed": ..., "image_size": ...}`` (from the files).
    """
    from captioner.data.shapes import make_shapes

    root = options.data
    files = [root / f"{kind}_{split}.json" for kind in ("captions", "instances") for split in ("train", "val", "test")]
    if all(f.is_file() for f in files):
        info = _scenes_info(files[0])
        log.info("using the synthetic scenes in %s (%s images, seed %s)", root, info.get("images"), info.get("seed"))
        return {"generated": False, **info}
    if root.exists() and any(root.iterdir()) and not (root / "images").is_dir():
        raise DataError(f"{root}: exists and is not a synthetic-scenes folder; pass another --data folder")
    stats = make_shapes(root, images=options.images, seed=options.seed, image_size=options.image_size)
    return {"generated": True, "images": stats["images"], "seed": options.seed, "image_size": options.image_size,
            "seconds": stats["seconds"]}


def _scenes_info(path: Path) -> dict[str, Any]:
    try:
        info = json.loads(path.read_text()).get("info") or {}
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read ({exc})") from None
    if info.get("description") != SCENES_INFO:
        raise DataError(f"{path.parent}: not a synthetic-scenes folder (run the demo with another --data)")
    return {k: info.get(k) for k in ("images", "seed", "image_size")}


def demo_config(decoder: str, options: DemoOptions):  # -> Config
    """The training config of one decoder: its preset + data folder, budget, seed, device, overrides."""
    from captioner.config import get_preset

    overrides = {"data.root": str(options.data), "train.time_budget": float(options.budget),
                 "train.seed": options.seed, "train.device": options.device, **options.overrides}
    return get_preset(options.presets[decoder], **overrides)


@contextlib.contextmanager
def shared_feature_cache(path: Path) -> Iterator[None]:
    """Let every decoder of the demo reuse one feature cache (frozen encoders only)."""
    before = os.environ.get("CAPTIONER_FEATURE_CACHE")
    os.environ["CAPTIONER_FEATURE_CACHE"] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CAPTIONER_FEATURE_CACHE", None)
        else:
            os.environ["CAPTIONER_FEATURE_CACHE"] = before


def pick_images(caption_set: Any, instances: dict[int, list[Any]] | None, count: int) -> list[int]:
    """Indices of ``count`` test images to show: scenes with the most objects first, then by order."""
    def objects(i: int) -> int:
        return len(instances.get(caption_set.images[i].image_id, [])) if instances else 0

    order = sorted(range(len(caption_set.images)), key=lambda i: (-min(objects(i), 2), i))
    return sorted(order[:count])


def write_demo_overlays(metrics: dict[str, Any], checkpoint: Path, data: Path, out_dir: Path, count: int,
                        device: str = "cpu") -> list[dict[str, str]]:
    """Overlays (PNG, GIF) and HTML explorers for ``count`` test images of an evaluated checkpoint.

    Returns:
        One ``{"image_id", "caption", "png", "html", ...}`` dict (paths as strings) per image.
    """
    import torch

    from captioner.checkpoint import load_checkpoint
    from captioner.commands.attend import teacher_forced_attention
    from captioner.data.coco import load_instances
    from captioner.data.images import load_image
    from captioner.data.transforms import ImageTransform, crop_box
    from captioner.visualize import write_overlays

    cs, results = metrics["caption_set"], metrics["results"]
    loaded = load_checkpoint(checkpoint, device=device)
    model, enc = loaded.model.eval(), loaded.config.encoder
    transform = ImageTransform(enc)
    shown = []
    for i in pick_images(cs, load_instances(data, cs.split), count):
        record, result = cs.images[i], results[i]
        image = load_image(record.path)
        with torch.inference_mode():
            features, _ = model.encode(transform(image).unsqueeze(0).to(device))  # (1, N, D)
        all_att = teacher_forced_attention(model, features, result.tokens, loaded.vocab.bos_id, result.grid)
        paths = write_overlays(image, result.words, result.attention.float().numpy(), out_dir,
                               box=crop_box(image.width, image.height, enc), all_attention=all_att,
                               stem=f"test_{record.image_id}", caption=result.text)
        shown.append({"image_id": record.image_id, "caption": result.text,
                      "references": cs.references(record.image_id), **{k: str(p) for k, p in paths.items()}})
    return shown


def parameter_counts(checkpoint: Path) -> dict[str, int]:
    """Total, decoder and trainable-encoder parameter counts of a checkpoint's model."""
    from captioner.checkpoint import load_checkpoint

    loaded = load_checkpoint(checkpoint)
    model, fine_tune = loaded.model, loaded.config.encoder.fine_tune
    decoder = sum(p.numel() for p in model.decoder.parameters())
    encoder = sum(p.numel() for p in model.encoder.parameters())
    return {"parameters": decoder + encoder, "decoder_parameters": decoder,
            "trained_parameters": decoder + (encoder if fine_tune else 0)}


def table_row(decoder: str, metrics: dict[str, Any], train_seconds: float, epochs: float,
              params: dict[str, int]) -> dict[str, Any]:
    """One row of the comparison table (see ``COLUMNS``)."""
    att = metrics.get("attention_correctness") or {}
    ent = metrics.get("attention") or {}
    row: dict[str, Any] = {"decoder": decoder}
    for key in ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "CIDEr-D"):
        row[key] = metrics.get(key)
    for key in ("objects_correct", "attention_correctness", "uniform_baseline", "ratio", "pointing_accuracy",
                "words_scored", "objects_invented"):
        row[key] = att.get(key)
    row["attention_entropy"] = ent.get("attention_entropy")
    row["uniform_entropy"] = ent.get("uniform_entropy")
    row.update(train_seconds=round(train_seconds, 1), epochs=epochs, **params)
    return row


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The comparison table as aligned plain text (``-`` where a value is missing)."""
    cells = [[header for _, header, _ in COLUMNS]]
    for row in rows:
        cells.append([format_value(row.get(key), fmt) for key, _, fmt in COLUMNS])
    widths = [max(len(r[j]) for r in cells) for j in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_value(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def _epochs(history: Sequence[dict[str, Any]], train_items: int, batch_size: int) -> float:
    """Epochs trained, counting a partial last epoch by its steps."""
    if not history:
        return 0.0
    steps_per_epoch = max(1, math.ceil(train_items / batch_size))
    return round(history[-1]["step"] / steps_per_epoch, 2)


# ----------------------------------------------------------------------------- the demo


def run_demo(options: DemoOptions) -> dict[str, Any]:
    """Run the whole demo (see the module docstring); returns the report (also in ``report.json``)."""
    from captioner.data.coco import load_caption_set
    from captioner.evaluate import evaluate_checkpoint
    from captioner.report import write_report
    from captioner.train import train

    start = time.monotonic()
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    total = 1 + 2 * len(options.decoders) + 1
    log.info("[1/%d] synthetic scenes in %s", total, options.data)
    scenes = ensure_scenes(options)
    train_captions = len(load_caption_set(options.data, "train").all_captions())
    rows, runs = [], {}
    with shared_feature_cache(out / "features"):
        for k, name in enumerate(options.decoders):
            cfg = demo_config(name, options)
            run_dir = out / name
            log.info("[%d/%d] training %s (%s) for at most %.0f s -> %s", 2 + 2 * k, total, LABELS[name],
                     options.presets[name], options.budget, run_dir)
            result = train(cfg, run_dir, progress=options.progress)
            if not result.best_checkpoint.exists():
                raise DataError(f"{name}: training wrote no checkpoint (is --budget too small?)")
            log.info("[%d/%d] evaluating %s on the test split (beam %d)", 3 + 2 * k, total, LABELS[name],
                     options.beam_size)
            metrics = evaluate_checkpoint(result.best_checkpoint, options.data, "test", beam_size=options.beam_size,
                                          out_dir=run_dir, device=options.device, progress=options.progress,
                                          meteor=False)
            shown = write_demo_overlays(metrics, result.best_checkpoint, options.data, run_dir / "overlays",
                                        options.overlays, device=options.device)
            row = table_row(name, metrics, result.seconds, _epochs(result.history, train_captions, cfg.train.batch_size),
                            parameter_counts(result.best_checkpoint))
            rows.append(row)
            runs[name] = {"preset": options.presets[name], "config": cfg.to_dict(), "run_dir": str(run_dir),
                          "checkpoint": str(result.best_checkpoint), "best_val_bleu4": result.best_bleu4,
                          "history": result.history, "metrics_file": metrics["paths"]["metrics"],
                          "overlays": shown}
            log.info("%s: BLEU-4 %s, objects correct %s, attention correctness %s (uniform %s)", LABELS[name],
                     format_value(row["BLEU-4"], "{:.3f}"), format_value(row["objects_correct"], "{:.1%}"),
                     format_value(row["attention_correctness"], "{:.3f}"), format_value(row["uniform_baseline"], "{:.3f}"))
    log.info("[%d/%d] writing the report", total, total)
    report = {
        "title": "captioner demo: three attention decoders on synthetic scenes",
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(options).items()},
        "scenes": scenes,
        "table": rows,
        "runs": runs,
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
