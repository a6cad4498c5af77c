"""Score a checkpoint on a dataset split and write the metrics and a COCO results file.

``evaluate_checkpoint`` decodes every image of the split and scores the captions against **all**
raw references of each image (docs/evaluation.md): BLEU-1..4, METEOR and ROUGE-L on the 0-1 scale
and CIDEr-D (METEOR and ROUGE-L None without ``pycocoevalcap``), coco-caption's own scores
(``coco/...``) when pycocoevalcap and Java are present, the attention entropy per word, object
hallucination (:mod:`.chair`), and with object boxes attention correctness of the generated and the
reference words, and the compositional split of the scenes. It writes ``metrics_<split>.json`` and
``captions_<split>_results.json`` (the COCO results format) to ``out_dir``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from captioner.checkpoint.remote import is_remote
from captioner.checkpoint.store import read_checkpoint_metadata
from captioner.data.caption_set import check_images
from captioner.data.coco import load_caption_set, load_instances
from captioner.data.dataset import SafeImages, check_batch_errors, collate_safe, image_loader
from captioner.decoding.search import DecodeOptions
from captioner.errors import ConfigError, DataError
from captioner.evaluation.attention_metrics import (attention_correctness_for_results, attention_entropy_summary,
                                                    compositional_scores, reference_correctness)
from captioner.evaluation.chair import chair_scores
from captioner.evaluation.metrics import (COCO_KEYS, METRIC_KEYS, SCALE_NOTE, caption_metrics, coco_caption_metrics,
                                          write_coco_results)
from captioner.files import Outputs, atomic_write, safe_name, writable_folder
from captioner.inference import Captioner, checkpoint_path, decode_options, load
from captioner.models.base import eval_mode
from captioner.pretrained import is_model_name
from captioner.text import tokenize

log = logging.getLogger(__name__)

PAPER_NOTE = ("papers print every score x100 (BLEU-4 0.243 -> 24.3, CIDEr-D 1.06 -> 106); "
              "None means the metric is unavailable here")


@dataclass
class SplitCaptions:
    """Decoded captions (``results``) aligned with ``caption_set.images``; ``skipped``: unreadable files left out."""

    caption_set: Any
    results: list[Any]
    skipped: list[str]


def changed_options(options: DecodeOptions) -> dict[str, Any]:
    """The decoding options that differ from ``DecodeOptions()``'s defaults (``{}``: a plain beam search), so a
    metrics file says how its captions were searched (``veto``, ``constrain``, ``lm_weight`` and ``lm``...)."""
    default = DecodeOptions()
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
            if getattr(options, f.name) != getattr(default, f.name)}


def caption_split(engine: Captioner, caption_set: Any, options: DecodeOptions | None = None, batch_size: int = 32,
                  skip_bad: bool = False, progress: bool = True, num_workers: int = 0,
                  **decoding: Any) -> SplitCaptions:
    """Caption every image of ``caption_set`` in batches through ``engine.caption``.

    ``skip_bad``: leave out unreadable images (logged) instead of raising ``ImageLoadError``.
    ``**decoding``: ``DecodeOptions`` fields replacing those of ``options``.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    options = decode_options(options, **decoding)
    data = SafeImages(image_loader(caption_set, engine.transform), len(caption_set.images))
    batches = DataLoader(data, batch_size=engine.stream_chunk(batch_size), num_workers=num_workers,
                         collate_fn=collate_safe)  # priced as caption_stream prices it
    kept: list[int] = []
    results: list[Any] = []
    with tqdm(total=len(data), desc=f"captioning {caption_set.split}", unit="img", disable=not progress or None) as bar:
        for pixels, indices, errors in batches:
            check_batch_errors(errors, skip_bad, f"{caption_set.name}/{caption_set.split}")
            if pixels is not None:
                results += engine.caption(pixels, options=options, attention=True, batch_size=batch_size,
                                          allow_empty=True)  # scored as a caption with no word
                kept += [i for i, error in zip(indices, errors) if error is None]
            bar.update(len(indices))
    skipped = [caption_set.images[i].file_name for i in sorted(set(range(len(data))) - set(kept))]
    if len(kept) != len(caption_set.images):
        caption_set = caption_set.subset(kept)
    return SplitCaptions(caption_set, results, skipped)


@dataclass
class ForcedCaption:
    """One reference fed to the decoder: its L ``words`` and the (L, g, g) ``attention`` at the step predicting each."""

    words: list[str]
    attention: torch.Tensor


def reference_attention(engine: Captioner, caption_set: Any, batch_size: int = 32, progress: bool = True,
                        num_workers: int = 0, reading_step: bool = False) -> list[list[ForcedCaption]]:
    """Where the model looks along each image's reference captions (teacher forcing): ``ForcedCaption`` lists per image.

    Words outside the vocabulary enter as ``<unk>`` and keep their written form; a caption is cut to
    the decoder's ``max_len``. ``reading_step``: give each word the attention of the step whose input
    it is, instead of the step that predicts it.
    """
    vocab, model = engine.vocab, engine.model
    shift = int(reading_step)  # 1: the steps read <bos> w1 .. wL and word t takes step t + 1's map
    limit = max(1, engine.config.decoder.max_len - 1 - shift)  # every decoder family has max_len (DecoderConfig)
    data = SafeImages(image_loader(caption_set, engine.transform), len(caption_set.images))
    batches = DataLoader(data, batch_size=engine.stream_chunk(batch_size), num_workers=num_workers,
                         collate_fn=collate_safe)
    out: list[list[ForcedCaption]] = [[] for _ in caption_set.images]
    with eval_mode(model), torch.inference_mode(), tqdm(total=len(data), desc="attention on the references",
                                                       unit="img", disable=not progress or None) as bar:
        for pixels, indices, errors in batches:
            if pixels is not None:
                kept = [i for i, error in zip(indices, errors) if error is None]
                features, grid = model.encode(pixels.to(engine.device))  # (B, N, D)
                rows, captions = [], []
                for b, i in enumerate(kept):
                    for text in caption_set.references(caption_set.images[i].image_id):
                        words = tokenize(text)[:limit]
                        if words:
                            rows.append(b)
                            captions.append((i, words))
                if captions:
                    longest = max(len(w) for _, w in captions) + shift
                    inputs = torch.full((len(captions), longest), vocab.pad_id, dtype=torch.long)
                    for r, (_, words) in enumerate(captions):
                        ids = vocab.encode(words)[:len(words) + shift]  # <bos> w1 .. w(L-1): step t predicts word t
                        inputs[r, :len(ids)] = torch.tensor(ids)
                    att = model.decoder(features[torch.tensor(rows, device=features.device)],
                                        inputs.to(engine.device)).attention  # (R, L, N)
                    att = att.float().cpu().reshape(len(captions), longest, int(grid[0]), int(grid[1]))
                    for r, (i, words) in enumerate(captions):
                        out[i].append(ForcedCaption(words, att[r, shift:shift + len(words)]))
            bar.update(len(indices))
    return out


def ratio_line(summary: dict[str, Any], with_captions: bool = True) -> str:
    """A correctness summary in one line: ratio to uniform [95% interval], pointing, words (of captions)."""
    low, high = summary.get("ratio_interval") or (float("nan"), float("nan"))
    of = summary.get("captions_scored") if with_captions else None
    return (f"{summary['ratio']:.2f}x uniform [95% {low:.2f}-{high:.2f}], pointing {summary['pointing_accuracy']:.2f}, "
            f"{summary['words_scored']} words" + (f" of {of} captions" if of is not None else ""))


@dataclass(frozen=True)
class EvaluateOptions:
    """How :func:`evaluate_checkpoint` reads a split and what it scores (the search has ``DecodeOptions``).

    Attributes:
        out_dir: where the two JSON files go (default: the checkpoint's folder).
        images_dir: image folder when it is not where the layout puts it.
        max_images: score only the first N images; ``skip_missing``: leave out unreadable ones;
            ``files_outside``: score images the caption file names outside its image folder.
        meteor: compute METEOR (starts Java); ``coco_caption``: also the coco-caption scores.
        references_attention: with boxes, also score attention along the references (encodes twice).
        overwrite: replace an earlier evaluation's files of the same split (False: refuse them).
    """

    batch_size: int = 32
    out_dir: str | os.PathLike | None = None
    images_dir: str | os.PathLike | None = None
    max_images: int | None = None
    skip_missing: bool = False
    files_outside: bool = False
    device: str | torch.device = "cpu"
    precision: str | None = None  # the encoder's arithmetic as ``load(precision=...)``: float32, int8; None: default
    progress: bool = True
    num_workers: int = 0
    meteor: bool = True
    coco_caption: bool = True
    references_attention: bool = True
    overwrite: bool = True

    def __post_init__(self) -> None:
        if self.max_images is not None and self.max_images < 1:
            raise ConfigError(f"max_images must be >= 1, got {self.max_images}")
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ConfigError(f"num_workers must be an integer >= 0, got {self.num_workers!r}")


_EVALUATE_FIELDS = frozenset(f.name for f in dataclasses.fields(EvaluateOptions))


def evaluate_checkpoint(checkpoint: str | os.PathLike | list, data_root: str | os.PathLike, split: str = "test",
                        options: DecodeOptions | None = None, settings: EvaluateOptions | None = None,
                        model: Captioner | None = None, **changes: Any) -> dict[str, Any]:
    """Decode a split with a checkpoint, score it, and write the metrics and COCO results files.

    ``checkpoint``: one, or a list decoded as an ensemble (``out_dir`` then required); ``data_root``: as for
    ``load_caption_set``; ``model``: ``checkpoint`` already loaded (None: loaded here); ``**changes``: fields
    of :class:`EvaluateOptions` or ``DecodeOptions`` replacing those given. Returns the content of
    ``metrics_<split>.json``, plus ``"results"`` (the ``Caption`` list) and ``"caption_set"`` (not written).
    """
    settings = dataclasses.replace(settings or EvaluateOptions(),
                                   **{k: v for k, v in changes.items() if k in _EVALUATE_FIELDS})
    options = decode_options(options, **{k: v for k, v in changes.items() if k not in _EVALUATE_FIELDS})
    start = time.perf_counter()
    checkpoint, out_dir, ensemble = _output_folder(checkpoint, settings.out_dir)
    if model is None:  # each checkpoint found and its header read (no weights) before anything else
        for spec in checkpoint if isinstance(checkpoint, (list, tuple)) else [checkpoint]:
            read_checkpoint_metadata(checkpoint_path(spec))
    name = safe_name(split, "split")
    outputs = Outputs(Path(out_dir), force=settings.overwrite, option="--out", replace_own=False, error=DataError)
    outputs.check([Path(out_dir) / f"metrics_{name}.json", Path(out_dir) / f"captions_{name}_results.json"])
    cs = load_caption_set(data_root, split, settings.images_dir, files_outside=settings.files_outside)
    listed = len(cs.images)
    cs = check_images(cs, skip_missing=settings.skip_missing)
    missing = listed - len(cs.images)
    if settings.max_images is not None and settings.max_images < len(cs.images):
        cs = cs.subset(range(settings.max_images))
    loaded = model if model is not None else load(checkpoint, device=settings.device,  # once the inputs are read
                                                  precision=settings.precision)
    log.info("evaluating %s on %s/%s: %d images, beam %d", checkpoint, data_root, split, len(cs), options.beam_size)
    decoded = caption_split(loaded, cs, options, batch_size=settings.batch_size, skip_bad=settings.skip_missing,
                            progress=settings.progress, num_workers=settings.num_workers)
    cs, results = decoded.caption_set, decoded.results
    references = [cs.references(rec.image_id) for rec in cs.images]
    report: dict[str, Any] = _scores([r.text for r in results], references, settings)
    instances = load_instances(data_root, split, settings.images_dir)
    correctness = _attention_scores(loaded, cs, results, instances, settings)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"{out}: cannot create the output folder ({exc.strerror or exc})") from None
    name = safe_name(split, "split")  # the output files stay inside ``out``
    metrics_path = out / f"metrics_{name}.json"
    results_path = out / f"captions_{name}_results.json"
    report.update({
        "scale": SCALE_NOTE,
        "note": PAPER_NOTE,
        "checkpoint": [str(c) for c in checkpoint] if ensemble else str(checkpoint),
        "data": str(data_root),
        "split": split,
        "beam_size": options.beam_size,
        "max_len": options.max_len,
        "allow_unk": options.allow_unk,
        "decoding": changed_options(options),
        "num_images": len(cs.images),
        "num_references": sum(len(r) for r in references),
        "images_listed": listed,
        "missing_images": missing,
        "unreadable_images": decoded.skipped,
        "unfinished_captions": sum(not getattr(r, "finished", True) for r in results),
        "attention": attention_entropy_summary(results),
        "chair": _hallucination(cs, [r.text for r in results], references, instances),
        **correctness,
        "decoder": loaded.config.decoder.name,
        "attention_type": loaded.config.decoder.attention_kind,
        "seconds": round(time.perf_counter() - start, 3),
        "paths": {"metrics": str(metrics_path), "results": str(results_path)},
    })
    write_coco_results(results_path, [(rec.image_id, r.text) for rec, r in zip(cs.images, results)])
    text = json.dumps(report, indent=2) + "\n"
    atomic_write(metrics_path, lambda f: f.write(text.encode()))
    outputs.record([metrics_path, results_path])
    log.info("wrote %s and %s", metrics_path, results_path)
    report["results"] = results
    report["caption_set"] = cs
    return report


def _output_folder(checkpoint: Any, out_dir: str | os.PathLike | None) -> tuple[Any, str | os.PathLike, bool]:
    """(the checkpoint or the ensemble's list, the folder the files go to, whether it is an ensemble),
    the folder checked writable before hours of work."""
    if isinstance(checkpoint, (list, tuple)) and len(checkpoint) == 1:
        checkpoint = checkpoint[0]
    ensemble = isinstance(checkpoint, (list, tuple))
    if ensemble:  # its scores are not any one member's
        if out_dir is None:
            raise ConfigError(f"an ensemble of {len(checkpoint)} checkpoints writes its scores to a folder of its "
                              "own: give one (--out)")
    elif is_remote(checkpoint) or is_model_name(checkpoint):
        if out_dir is None:
            raise ConfigError(f"{checkpoint}: give an output folder (--out) for a checkpoint loaded from a URL, "
                              "the Hub or the package (a shipped model)")
    else:
        checkpoint = Path(checkpoint)
        home = checkpoint if checkpoint.is_dir() else checkpoint.parent  # a run folder, or the file's folder
        out_dir = home if out_dir is None else out_dir
    writable_folder(Path(out_dir), DataError)
    return checkpoint, out_dir, ensemble


def _scores(hypotheses: list[str], references: list[list[str]], settings: EvaluateOptions) -> dict[str, Any]:
    """The built-in scores (METRIC_KEYS first), then the coco-caption ones and a note on them."""
    scores = caption_metrics(hypotheses, references, meteor=settings.meteor)
    if settings.coco_caption:
        coco_scores, coco_note = coco_caption_metrics(hypotheses, references, meteor=settings.meteor)
    else:
        coco_scores, coco_note = dict.fromkeys(COCO_KEYS), "coco-caption scores not computed: turned off"
    if coco_scores["coco/BLEU-4"] is None:
        log.info("%s; the built-in scores only", coco_note)
    report: dict[str, Any] = {key: scores.get(key) for key in METRIC_KEYS}
    report.update({k: v for k, v in scores.items() if k not in report})
    report.update(coco_scores)
    report["coco_caption_note"] = coco_note
    return report


def _hallucination(cs: Any, captions: list[str], references: list[list[str]], instances: Any) -> dict[str, Any]:
    """CHAIR-s, CHAIR-i and coverage (:func:`.chair.chair_scores`), and the captions naming an absent object."""
    boxes = None if instances is None else [[b.category for b in instances.get(rec.image_id, [])] for rec in cs.images]
    scores = chair_scores(captions, references, boxes)
    report = scores.as_dict()
    report["hallucinations"] = [
        {"image_id": rec.image_id, "file_name": rec.file_name, "caption": text, "absent": seen["absent"],
         "present": seen["present"]}
        for rec, text, seen in zip(cs.images, captions, scores.per_image) if seen["absent"]]
    return report


def _attention_scores(loaded: Captioner, cs: Any, results: list[Any], instances: Any,
                      settings: EvaluateOptions) -> dict[str, Any]:
    """Attention correctness of the captions (and along the references) where the split has boxes."""
    correctness = on_references = None
    if instances is not None:
        correctness = attention_correctness_for_results(results, cs, instances, loaded.config.encoder)
        correctness.update(compositional_scores(results, cs, instances) or {})  # make-shapes --unseen-pairs
        if settings.references_attention:
            forced = reference_attention(loaded, cs, batch_size=settings.batch_size, progress=settings.progress,
                                         num_workers=settings.num_workers)
            on_references = reference_correctness(forced, cs, instances, loaded.config.encoder)
    return {"attention_correctness": correctness, "reference_attention_correctness": on_references}

