"""Knowledge distillation (Kim & Rush 2016): a teacher's captions and word distributions as targets.

**Sequence level.** ``teacher_dataset(data, results, out)`` writes a dataset folder with the human
captions of every image plus the teacher's caption of each training image (other splits keep their
human captions only). Images are linked, and the folder keeps the source's name, so a feature
cache built for the source serves the student too.

**Word level.** ``write_word_targets(teacher, data, out)`` keeps, at each step of every caption of
a split, the teacher's ``top_k`` next words and their probabilities in one safetensors file;
``train.word_distill`` names it, and :class:`WordDistillation` adds ``train.word_distill_weight`` x
KL(teacher top-k || student) beside the cross-entropy.

Shape legend: B batch rows, T caption steps, V vocabulary, k kept words per step, P steps of all
cached captions.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_safetensors
from tqdm import tqdm

from captioner.config.schema import check_number
from captioner.data.coco import MAX_ANNOTATION_BYTES, load_caption_set, read_annotations
from captioner.data.dataset import collate_captions
from captioner.errors import DataError
from captioner.files import atomic_write, check_regular, read_text
from captioner.inference import Captioner, load
from captioner.models.base import DecoderOutput, eval_mode
from captioner.network import show_progress
from captioner.text import Vocabulary
from captioner.training.attention_terms import cross_entropy_only

log = logging.getLogger(__name__)

CAPTIONS = "captions_coco_format.json"
SPLITS = "splits.tsv"
WORD_TARGETS_FORMAT = "captioner-word-targets"
WORD_TARGETS_VERSION = "1"
MAX_TOP_K = 1000  # the widest top-k a targets file may keep (``captioner distill words --top-k``)
MAX_WORD_TARGETS_BYTES = 8 << 30  # a targets file larger than this is refused before it is opened


def _write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode("utf-8")), error=DataError)


def _train_names(splits: Path, split: str) -> set[str]:
    if not os.path.lexists(splits):
        raise DataError(f"{splits}: split file not found (the layout needs {SPLITS} beside {CAPTIONS})")
    rows = list(csv.reader(io.StringIO(read_text(splits, MAX_ANNOTATION_BYTES, DataError, "split file"), newline=""),
                           delimiter="\t"))
    return {row[0] for row in rows[1:] if len(row) >= 2 and row[1] == split}


def teacher_dataset(data: str | os.PathLike, results: str | os.PathLike, out: str | os.PathLike,
                    split: str = "train", keep_human: bool = True) -> dict[str, int]:
    """Write ``out/<name of data>/``: ``data``'s captions plus the teacher's (``results``) for ``split``'s images.

    ``keep_human=False``: ``split``'s images keep only the teacher's caption (Seq-KD proper). Returns
    the caption counts ``{"images", "human", "teacher"}``. Raises ``DataError`` for a missing or
    malformed file, or a teacher caption of an image outside ``split``.
    """
    data, results = Path(data), Path(results)
    source = read_annotations(data / CAPTIONS)
    rows = read_annotations(results)
    if not isinstance(source, dict) or not isinstance(source.get("images"), list) \
            or not isinstance(source.get("annotations"), list):
        raise DataError(f"{data / CAPTIONS}: not a COCO caption file (needs 'images' and 'annotations' lists)")
    if not isinstance(rows, list):
        raise DataError(f"{results}: a COCO results file is a list of {{'image_id', 'caption'}}")
    train = _train_names(data / SPLITS, split)
    in_split = {img["id"] for img in source["images"] if img.get("file_name") in train}
    next_id = max((a["id"] for a in source["annotations"]), default=0) + 1
    teacher = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("caption"), str) or "image_id" not in row:
            raise DataError(f"{results}: entry {i} is not {{'image_id', 'caption'}}")
        if row["image_id"] not in in_split:
            raise DataError(f"{results}: image_id {row['image_id']!r} is not a {split} image of {data}; "
                            "only training images may get teacher captions")
        teacher.append({"id": next_id + i, "image_id": row["image_id"], "caption": row["caption"],
                        "teacher": True})
    target = Path(out) / data.name
    target.mkdir(parents=True, exist_ok=True)
    human = [a for a in source["annotations"] if keep_human or a.get("image_id") not in in_split]
    merged = dict(source, annotations=human + teacher)
    _write_text(target / CAPTIONS, json.dumps(merged))
    _write_text(target / SPLITS, read_text(data / SPLITS, MAX_ANNOTATION_BYTES, DataError, "split file"))
    images = target / "images"
    if images.is_symlink() or images.exists():
        if images.resolve() != (data / "images").resolve():
            raise DataError(f"{images}: exists and is not a link to {data / 'images'}; remove it first")
    else:
        images.symlink_to((data / "images").resolve(), target_is_directory=True)
    return {"images": len(source["images"]), "human": len(human), "teacher": len(teacher)}


# ----------------------------------------------------------------------------- word level


def _chunks(n: int, size: int) -> list[range]:
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def write_word_targets(teacher: Any, data: str | os.PathLike, out: str | os.PathLike, split: str = "train",
                 top_k: int = 8, batch_size: int = 32, progress: bool | None = None,
                 device: str = "auto") -> dict[str, float]:
    """Write ``out`` (safetensors): the teacher's ``top_k`` next words along every caption of ``split``.

    ``teacher``: a ``Captioner`` or what ``captioner.load`` takes (loaded on ``device`` once the data is read);
    ``batch_size``: images at a time (fewer where their pixels and activations would take too much memory).
    Returns ``{"images", "captions", "steps", "top_k", "mass"}`` (``mass``: the mean probability kept).
    Raises ``DataError`` for an unreadable dataset or image, ``ConfigError`` for a size < 1 or ``top_k``
    over :data:`MAX_TOP_K`.
    """
    check_number("write_word_targets: top_k", top_k, lambda v: 1 <= v <= MAX_TOP_K, f"an integer from 1 to {MAX_TOP_K}",
                 int)
    check_number("write_word_targets: batch_size", batch_size, lambda v: v >= 1, "an integer from 1", int)
    cs = load_caption_set(data, split)  # the input first: a bad dataset is named before the teacher loads
    if not len(cs):
        raise DataError(f"{data}: split {split!r} has no images")
    model = teacher if isinstance(teacher, Captioner) else load(teacher, device=device, progress=False)
    vocab: Vocabulary = model.vocab
    k = min(top_k, len(vocab))
    batch_size = model.stream_chunk(batch_size)  # priced as caption_stream prices it
    tokens: list[int] = []
    offsets, step_offsets, image_of = [0], [0], []
    top_ids: list[torch.Tensor] = []
    top_probs: list[torch.Tensor] = []
    mass, steps = 0.0, 0
    show = show_progress(progress)
    decoder = model.model.decoder
    with eval_mode(model.model), torch.no_grad(), \
            tqdm(total=len(cs), unit="img", desc="teacher words", disable=not show) as bar:
        for chunk in _chunks(len(cs), batch_size):
            records = [cs.images[i] for i in chunk]
            features, _ = model.encode([r.path for r in records])  # (b, N, D)
            items = [(features[j], torch.tensor(vocab.encode(caption)), i)  # (regions, [<bos> w.. <eos>], image)
                     for j, (i, record) in enumerate(zip(chunk, records)) for caption in cs.captions[record.image_id]]
            if not items:
                bar.update(len(records))
                continue
            regions, batch, images = collate_captions(items)  # (C, N, D), (C, T) padded, (C,)
            image_of.extend(images.tolist())
            taught = decoder(regions, batch[:, :-1].to(features.device))
            log_probs = torch.log_softmax(taught.logits.float(), dim=-1).cpu()  # (C, T-1, V)
            probs, ids = log_probs.exp().topk(k, dim=-1)  # (C, T-1, k)
            for r, (_, caption_ids, _) in enumerate(items):
                n = len(caption_ids) - 1  # steps: each predicts the next word (the last, <eos>)
                tokens.extend(caption_ids.tolist())
                offsets.append(len(tokens))
                step_offsets.append(step_offsets[-1] + n)
                top_ids.append(ids[r, :n].to(torch.int32))
                top_probs.append(probs[r, :n])
                mass += float(probs[r, :n].sum())
                steps += n
            bar.update(len(records))
    tensors = {
        "tokens": torch.tensor(tokens, dtype=torch.int32),  # every caption [<bos> w.. <eos>], one after another
        "offsets": torch.tensor(offsets, dtype=torch.int64),  # (C + 1,) caption c: tokens[offsets[c]:offsets[c + 1]]
        "step_offsets": torch.tensor(step_offsets, dtype=torch.int64),  # (C + 1,) its rows of top_ids / top_probs
        "image": torch.tensor(image_of, dtype=torch.int32),  # (C,) index into the metadata's images
        "top_ids": torch.cat(top_ids) if top_ids else torch.zeros(0, k, dtype=torch.int32),  # (P, k)
        "top_probs": (torch.cat(top_probs) if top_probs else torch.zeros(0, k)).to(torch.float16),  # (P, k)
    }
    metadata = {"format": WORD_TARGETS_FORMAT, "version": WORD_TARGETS_VERSION, "split": split,
                "top_k": str(k), "vocab": json.dumps(vocab.itos),
                "images": json.dumps([r.file_name for r in cs.images]), "teacher": repr(model)}
    blob = save_safetensors({name: t.contiguous() for name, t in tensors.items()}, metadata)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda f: f.write(blob), error=DataError)
    return {"images": len(cs), "captions": len(offsets) - 1, "steps": steps, "top_k": k,
            "mass": mass / steps if steps else math.nan}


_INTEGER_DTYPES = ("I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# name -> (dimensions, dtypes): what write_word_targets writes, checked from the header before any tensor is read
_TENSORS = {"tokens": (1, _INTEGER_DTYPES), "offsets": (1, _INTEGER_DTYPES), "step_offsets": (1, _INTEGER_DTYPES),
            "image": (1, _INTEGER_DTYPES), "top_ids": (2, _INTEGER_DTYPES), "top_probs": (2, _FLOAT_DTYPES)}
_PROB_SLACK = 1e-2  # float16 rounding of k probabilities: a row may sum a little over 1


def _metadata_list(path: Path, meta: dict[str, str], field: str) -> list[str]:
    """A metadata field that holds a JSON list of strings (``vocab``, ``images``)."""
    try:
        value = json.loads(meta.get(field, ""))
    except (ValueError, RecursionError):
        raise DataError(f"{path}: metadata {field!r} is not JSON (a list of strings)") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise DataError(f"{path}: metadata {field!r} must be a JSON list of strings")
    return value


def _check_layout(path: Path, shapes: dict[str, tuple[list[int], str]], meta: dict[str, str]) -> tuple[int, int]:
    """Check the header's shapes and dtypes and the metadata before any tensor is read: (vocabulary size,
    number of images) of the metadata."""
    for name, (dims, dtypes) in _TENSORS.items():
        shape, dtype = shapes[name]
        if len(shape) != dims:
            raise DataError(f"{path}: tensor {name!r} has shape {tuple(shape)}; it must have {dims} dimension"
                            f"{'s' if dims > 1 else ''}")
        if dtype not in dtypes:
            kind = "an integer" if dtypes is _INTEGER_DTYPES else "a floating"
            raise DataError(f"{path}: tensor {name!r} is {dtype}; it must be {kind} type")
    vocab = _metadata_list(path, meta, "vocab")
    images = _metadata_list(path, meta, "images")
    if len(vocab) < 4:
        raise DataError(f"{path}: metadata 'vocab' holds {len(vocab)} words; a vocabulary has at least the 4 "
                        "special tokens")
    try:
        top_k = int(meta.get("top_k", ""))
    except ValueError:
        raise DataError(f"{path}: metadata 'top_k' {meta.get('top_k')!r} is not an integer") from None
    bound = min(MAX_TOP_K, len(vocab))
    if not 1 <= top_k <= bound:
        raise DataError(f"{path}: metadata 'top_k' {top_k} is outside 1..{bound} (at most {MAX_TOP_K} and at most "
                        f"the vocabulary's {len(vocab)} words)")
    captions, steps = shapes["image"][0][0], shapes["top_ids"][0][0]
    expected = {"offsets": [captions + 1], "step_offsets": [captions + 1], "top_ids": [steps, top_k],
                "top_probs": [steps, top_k]}
    for name, want in expected.items():
        if list(shapes[name][0]) != want:
            raise DataError(f"{path}: tensor {name!r} has shape {tuple(shapes[name][0])}; with {captions} captions, "
                            f"{steps} steps and top_k {top_k} it must be {tuple(want)}")
    return len(vocab), len(images)


def _check_range(path: Path, name: str, values: torch.Tensor, low: int, high: int, what: str) -> None:
    """Every value of ``values`` within [low, high), else one line naming the tensor and the first bad value."""
    bad = ((values < low) | (values >= high)).nonzero()
    if len(bad):
        at = tuple(int(i) for i in bad[0])
        where = at[0] if len(at) == 1 else at
        raise DataError(f"{path}: tensor {name!r} holds {int(values[at])} at {where}, outside {low}..{high - 1} "
                        f"({what})")


def _check_values(path: Path, tensors: dict[str, torch.Tensor], vocab_size: int, image_count: int) -> None:
    """Ids within the vocabulary, offsets that cut the tokens and steps into captions, probabilities in [0, 1]."""
    tokens, offsets, steps = tensors["tokens"].long(), tensors["offsets"].long(), tensors["step_offsets"].long()
    _check_range(path, "tokens", tokens, 0, vocab_size, f"the ids of the {vocab_size}-word vocabulary")
    _check_range(path, "top_ids", tensors["top_ids"].long(), 0, vocab_size,
                 f"the ids of the {vocab_size}-word vocabulary")
    _check_range(path, "image", tensors["image"].long(), 0, image_count,
                 f"indices into the metadata's {image_count} images")
    for name, cut, total in (("offsets", offsets, len(tokens)), ("step_offsets", steps, len(tensors["top_ids"]))):
        if int(cut[0]) != 0 or int(cut[-1]) != total:
            raise DataError(f"{path}: tensor {name!r} runs from {int(cut[0])} to {int(cut[-1])}; it must run "
                            f"from 0 to {total}")
    lengths = offsets.diff()  # (C,) tokens of each caption, <bos> and <eos> included
    short = (lengths < 2).nonzero()
    if len(short):
        c = int(short[0])
        raise DataError(f"{path}: tensor 'offsets' gives caption {c} {int(lengths[c])} tokens; each caption has "
                        "at least <bos> and <eos>")
    wrong = (steps.diff() != lengths - 1).nonzero()
    if len(wrong):
        c = int(wrong[0])
        raise DataError(f"{path}: tensor 'step_offsets' gives caption {c} {int(steps[c + 1] - steps[c])} steps; "
                        f"its {int(lengths[c])} tokens predict {int(lengths[c]) - 1}")
    probs = tensors["top_probs"].float()
    bad = (~probs.isfinite() | (probs < 0) | (probs > 1)).nonzero()
    if len(bad):
        at = tuple(int(i) for i in bad[0])
        raise DataError(f"{path}: tensor 'top_probs' holds {float(probs[at]):.4g} at {at}; probabilities are finite "
                        "and within [0, 1]")
    over = (probs.sum(dim=1) > 1 + _PROB_SLACK).nonzero()
    if len(over):
        row = int(over[0])
        raise DataError(f"{path}: tensor 'top_probs' row {row} sums to {float(probs[row].sum()):.4g}; the "
                        "probabilities of one step sum to at most 1")


def read_word_targets(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a :func:`write_word_targets` file, checked before use: the header's shapes,
    dtypes and metadata before any tensor is read, then ids, image indices, offsets and probabilities
    (finite, within [0, 1]); ``DataError`` naming the file and the field."""
    path = Path(path)
    if not os.path.lexists(path):
        raise DataError(f"{path}: word-distillation targets not found (write them with "
                        "captioner.training.distill.write_word_targets)")
    check_regular(path, MAX_WORD_TARGETS_BYTES, DataError, "word-distillation targets file")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            names = set(f.keys())
            if metadata.get("format") != WORD_TARGETS_FORMAT or any(n not in names for n in _TENSORS):
                raise DataError(f"{path}: not a word-distillation targets file (format {metadata.get('format')!r})")
            if metadata.get("version") != WORD_TARGETS_VERSION:
                raise DataError(f"{path}: word-targets version {metadata.get('version')!r}; this package reads "
                                f"version {WORD_TARGETS_VERSION}")
            shapes = {n: (f.get_slice(n).get_shape(), f.get_slice(n).get_dtype()) for n in _TENSORS}
            vocab_size, image_count = _check_layout(path, shapes, metadata)
            tensors = {name: f.get_tensor(name) for name in _TENSORS}
    except (SafetensorError, OSError, ValueError) as exc:
        raise DataError(f"{path}: not a safetensors file ({exc})") from None
    _check_values(path, tensors, vocab_size, image_count)
    return tensors, metadata


class WordDistillation:
    """``train.word_distill``: KL(teacher's top-k || student) at each step of each cached caption.

    A batch row whose image and words match a caption of the file gets the term; others none. The
    teacher's probabilities are renormalised over the student's vocabulary. ``max_len``:
    ``data.max_caption_len``. Raises ``DataError`` for a file holding no caption of the training set.
    """

    name = "word_distill"

    def __init__(self, path: str | os.PathLike, train_set: Any, vocab: Vocabulary, weight: float,
                 max_len: int) -> None:
        tensors, meta = read_word_targets(path)
        self.weight = float(weight)
        self.pad_id = vocab.pad_id
        teacher_words = json.loads(meta["vocab"])
        to_student = np.array([vocab.stoi.get(w, -1) for w in teacher_words], dtype=np.int64)  # teacher id -> student
        index_of = {r.file_name: i for i, r in enumerate(train_set.images)}
        names = json.loads(meta["images"])
        tokens, offsets = tensors["tokens"].numpy().astype(np.int64), tensors["offsets"].numpy()
        steps = tensors["step_offsets"].numpy()
        images = tensors["image"].numpy()
        top_ids = to_student[tensors["top_ids"].numpy().astype(np.int64)]  # (P, k), -1: a word the student lacks
        top_probs = np.where(top_ids >= 0, tensors["top_probs"].float().numpy(), 0.0)
        total = top_probs.sum(axis=1, keepdims=True)
        self.top_ids = torch.from_numpy(np.maximum(top_ids, 0))  # (P, k)
        self.top_probs = torch.from_numpy(np.divide(top_probs, total, out=np.zeros_like(top_probs),
                                                    where=total > 0)).float()  # (P, k), rows sum to 1 (or 0)
        # the teacher's entropy at each step, so that the term is a KL: 0 when the student agrees
        p = self.top_probs
        self.entropy = -(p * torch.log(p.clamp(min=1e-12))).sum(dim=1)  # (P,)
        self.table: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}
        skipped = 0
        for c in range(len(offsets) - 1):
            image = index_of.get(names[int(images[c])]) if 0 <= int(images[c]) < len(names) else None
            ids = to_student[tokens[offsets[c]:offsets[c + 1]]]
            if image is None or (ids < 0).any():
                skipped += 1
                continue
            words = ids[1:-1]
            kept = [vocab.bos_id, *words[:max_len].tolist(), vocab.eos_id]
            n = len(kept) - 1 if len(words) <= max_len else max_len  # a cut caption: its <eos> step is not the teacher's
            self.table.setdefault((image, tuple(kept)), (int(steps[c]), n))
        if not self.table:
            raise DataError(f"{path}: none of its {len(offsets) - 1} captions is a caption of the training set "
                            f"{train_set.name!r} ({train_set.split}): were the targets written for another dataset?")
        log.info("word distillation: %d captions of %s (%d skipped: another image or a word outside the "
                 "vocabulary), top %s words a step, weight %g", len(self.table), path, skipped,
                 meta.get("top_k"), self.weight)
        self.stats: dict[str, torch.Tensor] = {}

    def lookup(self, tokens: torch.Tensor, image_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row and step, the teacher's ids (B, T-1, k), probabilities (B, T-1, k) and entropy (B, T-1); 0 where absent."""
        B, T = tokens.shape
        k = self.top_ids.size(1)
        ids = torch.zeros(B, T - 1, k, dtype=torch.long)
        probs = torch.zeros(B, T - 1, k)
        entropy = torch.zeros(B, T - 1)
        for b, (row, image) in enumerate(zip(tokens.tolist(), image_index.tolist())):
            words = tuple(t for t in row if t != self.pad_id)
            found = self.table.get((int(image), words))
            if found is None:
                continue
            start, n = found
            ids[b, :n] = self.top_ids[start:start + n]
            probs[b, :n] = self.top_probs[start:start + n]
            entropy[b, :n] = self.entropy[start:start + n]
        return ids, probs, entropy

    def __call__(self, output: DecoderOutput, batch: Any) -> torch.Tensor:
        logits = output.logits  # (B, T-1, V)
        ids, probs, entropy = self.lookup(batch.tokens, batch.image_index)
        device = logits.device
        ids, probs, entropy = ids.to(device), probs.to(device), entropy.to(device)
        log_q = F.log_softmax(logits.float(), dim=-1).gather(-1, ids)  # (B, T-1, k)
        cross = -(probs * log_q).sum(dim=-1)  # (B, T-1)
        real = probs.sum(dim=-1) > 0  # (B, T-1) steps with a teacher distribution
        count = real.sum()
        value = ((cross - entropy) * real).sum() / count.clamp(min=1)
        rows = real.any(dim=1).float().mean()
        self.stats = {"word_distill_rows": rows.detach()}
        return value


def build_word_distillation(cfg: Any, train_set: Any, vocab: Vocabulary) -> WordDistillation | None:
    """The ``train.word_distill`` term of cross-entropy training, or None when it is off."""
    t = cfg.train
    if not t.word_distill or not t.word_distill_weight:
        return None
    if not cross_entropy_only("train.word_distill", t.objective):
        return None
    return WordDistillation(t.word_distill, train_set, vocab, t.word_distill_weight, cfg.data.max_caption_len)


def check_word_targets(cfg: Any) -> None:
    """The run's ``train.word_distill`` file, checked before the run writes anything (a bad file leaves no run
    folder behind; DataError as :func:`read_word_targets`); :func:`build_word_distillation` reads it again
    once the training set is final."""
    t = cfg.train
    if t.word_distill and t.word_distill_weight:  # named, so checked (even where the objective ignores it)
        read_word_targets(t.word_distill)
