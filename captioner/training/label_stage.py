"""The label stage (``train.stage = "labels"``): a caption model taught to read its encoder's ImageNet labels.

The last stage of the shipped model (docs/training.md, ``scripts/train_shipped_model.sh``). From a SAT
model that does not read labels (``train.init``), :func:`train_labels` builds the same model with
``encoder.labels`` (its regions unchanged, the wheel's original top stage read on each region after them)
and fine-tunes its decoder, the label reading (``captioner.models.labels.SATLabels``) joined:

1. **vocabulary**: the --init model's, grown by the words of the caption-only rows (``train.labels.text``)
   used at least ``text_min_count`` times; a new word's embedding is the mean word's (plus noise), its output
   weight small and its bias the rarest word's, so the decoder starts as it was;
2. **labels**: the photo's lexicon words' probabilities (the ImageNet classifier, frozen) and a **person**
   score, a logistic probe of the classifier's log-probabilities (:func:`fit_person_probe`) fitted on the
   training photos (a person named in >= ``person_min_captions`` of their captions); the saved model's probe
   bias is shifted by the log-odds of a person in the caption-only rows against the photos;
3. **the copy and the veto** pointed at the grown vocabulary (``LabelReading.use_vocabulary``);
4. **steps**: ``photos`` training photos, each with the --init model's own caption (``train.labels.teacher``,
   a self-distillation: Kim & Rush 2016) or a human one, beside as many caption-only rows whose labels are read
   from their own words (75% of their lexicon words kept at 0.15-0.95, a few spurious; the person score drawn
   from the probe's scores of photos with the same person flag) over the regions of a training photo with the
   same person flag. Loss: the cross-entropy of every row plus ``attend_kd`` x the photo rows' attention KL
   to the --init decoder's on the same words (:func:`captioner.training.attention_terms.attention_kl`), so
   that the labels and the caption-only rows do not teach the attention to look elsewhere. Adam: the decoder
   at ``train.lr``, the label reading at ``extension_lr``; gradients clipped at ``train.grad_clip``;
5. **validation** on the val split (real decoding, as every run's) and the run folder: ``best.safetensors``
   (= ``latest.safetensors``), ``release.safetensors`` (float16, the wheel's trunk by reference: the file
   ``captioner/weights/`` ships), ``config.json``, ``vocab.json``, ``metrics.csv``.

The training decoder reads each row's labels from its batch (:class:`SATGivenLabels`: the same weights and
buffers, so its state dict is the model's); the saved model reads them from its label channels.

Shape legend: B photo rows, R rows (photos, then caption-only rows), T caption steps, N regions, D region
width, C ImageNet classes, W lexicon words (labels: W + 1, person last).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from captioner import device as ddp
from captioner.checkpoint.store import pack_release, save_checkpoint
from captioner.models.labels import PersonProbe, SATLabels, fit_person_probe
from captioner.config import Config, ModelConfig, SATConfig
from captioner.data.coco import read_annotations
from captioner.errors import ConfigError, DataError
from captioner.evaluation.chair import named_objects
from captioner.features.dtype import model_input
from captioner.models.base import CaptionDecoder
from captioner.models.model import build_model, resolve_model
from captioner.models.registry import build_decoder
from captioner.text import SPECIALS, Vocabulary, tokenize
from captioner.training.attention_terms import attention_kl
from captioner.training.data import TrainData, load_caption_sets, prepare_data, val_loader
from captioner.training.loop import (InitWeights, TrainResult, check_init_config, check_run_folder, make_run_folder,
                                     move_aside, read_init_checkpoint, score, validate)
from captioner.training.run import MetricsLogger, seed_everything

log = logging.getLogger(__name__)

PROBS_BATCH = 256  # photos per batch when their class probabilities are read from the cached label channels


# ----------------------------------------------------------------------------- the rows' labels


class SATGivenLabels(SATLabels):
    """:class:`SATLabels` reading each row's labels from its batch, not from a photo's label channels: features
    (R, N, D + W + 1) hold the row's labels after its D region channels, the same on every region
    (:func:`with_labels`). A caption-only row has labels read from its words and no photo; the weights and
    buffers are the reading's, so the state dict loads into the model's decoder and back."""

    def read(self, features: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"labels": features[:, 0, self.feature_dim:].float()}  # (R, W+1)


def with_labels(regions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Regions (R, N, D) and labels (R, W+1) -> the features a :class:`SATGivenLabels` decoder reads (R, N, D+W+1)."""
    return torch.cat([regions, labels[:, None, :].to(regions.dtype).expand(-1, regions.size(1), -1)], dim=-1)


def says_person(caption: str) -> bool:
    """Whether a caption names a person (as CHAIR reads it)."""
    return "person" in named_objects(caption)


def person_flags(captions: list[list[str]], min_captions: int) -> torch.Tensor:
    """Per photo, whether at least ``min_captions`` of its captions name a person: (B,) bool."""
    return torch.tensor([sum(map(says_person, caps)) >= min_captions for caps in captions], dtype=torch.bool)


def log_odds(p: float) -> float:
    p = min(max(p, 1e-3), 1 - 1e-3)
    return math.log(p / (1 - p))


def text_labels(caption: str, words: tuple[str, ...], person_scores: torch.Tensor) -> torch.Tensor:
    """The labels (W+1,) of a caption-only row, read from its own words as a photo's would look: each lexicon word
    it names (a plural too) kept with probability 0.75 at a value drawn from 0.15-0.95, up to 3 spurious ones
    below 0.1, the words' sum held <= 1; the person score a sigmoid of one of ``person_scores`` (the probe's
    logits of photos whose person flag is this caption's). Draws from Python's ``random``."""
    tokens = tokenize(caption)
    v, said, joined = torch.zeros(len(words) + 1), set(tokens), " ".join(tokens)
    for k, w in enumerate(words):
        if (w in joined if " " in w else (w in said or w + "s" in said or w + "es" in said)) and random.random() < 0.75:
            v[k] = random.uniform(0.15, 0.95)
    for _ in range(random.randint(0, 3)):
        v[random.randrange(len(words))] += random.uniform(0.0, 0.1)
    if v[:-1].sum() > 1:
        v[:-1] /= v[:-1].sum()
    v[-1] = torch.sigmoid(person_scores[random.randrange(len(person_scores))])
    return v


# ----------------------------------------------------------------------------- its files


def _image_id(row: Any, path: Path, n: int) -> int:
    if not isinstance(row, dict) or isinstance(row.get("image_id"), bool) or not isinstance(row.get("image_id"), int) \
            or not isinstance(row.get("caption"), str):
        raise DataError(f"{path}: entry {n} is not an object with an integer image_id and a caption string")
    return row["image_id"]


def read_text_rows(path: str | Path, exclude: str | Path | None = None) -> list[tuple[int, str]]:
    """The ``(image_id, caption)`` rows of a COCO captions JSON (``annotations``), leaving out every image of the
    COCO captions JSON ``exclude`` (its ``images`` and the images its ``annotations`` caption). DataError naming
    the file for a missing or malformed one."""
    path = Path(path)
    data = read_annotations(path)
    rows = data.get("annotations") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise DataError(f"{path}: not a COCO captions file (no 'annotations' list)")
    found = [(_image_id(a, path, n), a["caption"]) for n, a in enumerate(rows)]
    if exclude is None:
        return found
    exclude = Path(exclude)
    other = read_annotations(exclude)
    if not isinstance(other, dict) or not isinstance(other.get("annotations", []), list) \
            or not isinstance(other.get("images", []), list):
        raise DataError(f"{exclude}: not a COCO captions file (no 'images' or 'annotations' list)")
    drop = {_image_id(a, exclude, n) for n, a in enumerate(other.get("annotations", []))}
    drop |= {i["id"] for i in other.get("images", []) if isinstance(i, dict) and isinstance(i.get("id"), int)}
    return [(i, c) for i, c in found if i not in drop]


def read_teacher(path: str | Path, image_ids: list[int]) -> list[str]:
    """The caption of each of ``image_ids`` in a COCO results file (``captioner evaluate INIT --split train``);
    DataError naming the file when one is missing."""
    path = Path(path)
    rows = read_annotations(path)
    if not isinstance(rows, list):
        raise DataError(f"{path}: not a COCO results file (a list of image_id and caption)")
    found = {_image_id(r, path, n): r["caption"] for n, r in enumerate(rows)}
    missing = [i for i in image_ids if i not in found]
    if missing:
        raise DataError(f"{path}: no caption of {len(missing)} of the {len(image_ids)} training photos (e.g. image "
                        f"{missing[0]}); write it with captioner evaluate INIT --data DATA --split train")
    return [found[i] for i in image_ids]


def grown_vocabulary(vocab: Vocabulary, captions: list[str], min_count: int) -> tuple[Vocabulary, list[str]]:
    """``vocab`` with the words of ``captions`` used at least ``min_count`` times that it lacks appended (sorted)."""
    counts = collections.Counter(w for c in captions for w in tokenize(c))
    added = sorted(w for w, n in counts.items() if n >= min_count and w not in vocab.stoi)
    return (Vocabulary(vocab.itos[len(SPECIALS):] + added), added) if added else (vocab, [])


# ----------------------------------------------------------------------------- its decoders


def check_stage_config(cfg: Config) -> None:
    """What the label stage needs of the run's config (one ConfigError line), before anything is read."""
    if not cfg.train.init:
        raise ConfigError("train.stage=labels starts from a caption model that does not read labels: pass --init "
                          "CHECKPOINT (e.g. the release before the label stage)")
    if not isinstance(cfg.model.decoder, SATConfig):
        raise ConfigError(f"train.stage=labels trains a SAT decoder, got model.decoder.name="
                          f"{cfg.model.decoder.name!r}")
    if not cfg.model.encoder.labels:
        raise ConfigError("train.stage=labels teaches the model to read its encoder's labels: set "
                          "model.encoder.labels=true (the flickr8k_labels preset does)")
    if cfg.model.encoder.fine_tune or not cfg.data.feature_cache:
        raise ConfigError("train.stage=labels trains the decoder on cached features: set "
                          "model.encoder.fine_tune=false and data.feature_cache=true")


def check_init(init: InitWeights, model: ModelConfig) -> None:
    """The --init model is the stage's model without labels: one line otherwise."""
    if init.config.encoder.labels:
        raise ConfigError(f"--init {init.path}: this model reads labels already (model.encoder.labels=true; the "
                          "shipped flickr8k does since its fourth release): start the label stage from a model "
                          "that does not, e.g. the release before it")
    check_init_config(init.path, dataclasses.replace(init.config, encoder=dataclasses.replace(init.config.encoder,
                                                                                             labels=True)), model)


def training_decoder(model: ModelConfig, feature_dim: int, vocab_size: int) -> CaptionDecoder:
    """The model's SAT decoder over :class:`SATGivenLabels` (its state dict is the model decoder's)."""
    d = model.decoder
    reading = SATGivenLabels(feature_dim, d.hidden_dim, d.embed_dim, vocab_size)
    return build_decoder(d, feature_dim=feature_dim, vocab_size=vocab_size, grid=model.encoder.grid, extension=reading)


def base_decoder(init: InitWeights, feature_dim: int) -> CaptionDecoder:
    """The --init model's decoder, frozen and in eval mode: the attention ``attend_kd`` holds the photo rows to."""
    decoder = build_decoder(init.config.decoder, feature_dim=feature_dim, vocab_size=len(init.vocab),
                            grid=init.config.encoder.grid)
    decoder.load_state_dict({k[len("decoder."):]: v for k, v in init.state.items() if k.startswith("decoder.")})
    return decoder.eval().requires_grad_(False)


def load_grown(decoder: CaptionDecoder, init: InitWeights) -> None:
    """The --init decoder's weights into ``decoder`` (its label reading kept as built: zero at first), the rows of
    the words its vocabulary lacks as the mean word's embedding (+ 0.01 noise), a 0.01-noise output weight and
    the rarest word's output bias (draws from torch's generator)."""
    state = {k[len("decoder."):]: v for k, v in init.state.items() if k.startswith("decoder.")}
    grown = ("embedding.weight", "out_word.weight", "out_word.bias")
    own = decoder.state_dict()
    wrong = [k for k in state if k not in own or (k not in grown and own[k].shape != state[k].shape)]
    if wrong:
        raise ConfigError(f"--init {init.path}: its decoder does not fit this model (e.g. {wrong[0]})")
    decoder.load_state_dict({k: v for k, v in state.items() if k not in grown}, strict=False)
    old, v = len(init.vocab), decoder.embedding.num_embeddings
    emb, weight, bias = state["embedding.weight"], state["out_word.weight"], state["out_word.bias"]
    s = len(SPECIALS)
    with torch.no_grad():
        decoder.embedding.weight[:old], decoder.out_word.weight[:old] = emb, weight
        decoder.out_word.bias[:old] = bias
        decoder.embedding.weight[old:] = emb[s:].mean(0) + 0.01 * torch.randn(v - old, emb.size(1))
        decoder.out_word.weight[old:] = 0.01 * torch.randn(v - old, weight.size(1))
        decoder.out_word.bias[old:] = bias[s:].min()


def stage_loss(decoder: CaptionDecoder, base: CaptionDecoder, regions: torch.Tensor, labels: torch.Tensor,
               tokens: torch.Tensor, photos: int, attend_kd: float, known: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The stage's loss on one batch: rows' regions (R, N, D), labels (R, W+1) and tokens (R, T) (``<bos>`` ...
    ``<eos>``, padded), the first ``photos`` rows photos; ``known``: the --init vocabulary's size (its decoder
    reads a grown word as ``<unk>``). Returns (loss, cross-entropy, attention KL or None)."""
    out = decoder(with_labels(regions, labels), tokens[:, :-1])
    targets = tokens[:, 1:]
    ce = F.cross_entropy(out.logits.float().flatten(0, 1), targets.flatten(), ignore_index=Vocabulary.pad_id)
    if not attend_kd:
        return ce, ce, None
    words = tokens[:photos, :-1].masked_fill(tokens[:photos, :-1] >= known, Vocabulary.unk_id)
    with torch.no_grad():
        target = base(regions[:photos], words).attention.float()  # (B, T, N)
    kl = attention_kl(target, out.attention[:photos].float(), targets[:photos] != Vocabulary.pad_id)
    return ce + attend_kd * kl, ce, kl


# ----------------------------------------------------------------------------- the stage


@dataclass
class LabelStage:
    """Everything the stage's steps read, built by :func:`build_label_stage`."""

    cfg: Config
    data: TrainData  # the training photos' (and validation's) cached features of the labelled encoder
    model: Any  # the CaptionModel saved (its decoder reads the labels from the label channels)
    decoder: CaptionDecoder  # the decoder trained (:class:`SATGivenLabels`)
    base: CaptionDecoder  # the --init decoder, frozen
    known: int  # the --init vocabulary's size
    probe: PersonProbe
    shift: float  # log-odds of a person in the caption-only rows against the training photos
    photo_labels: torch.Tensor  # (P, W+1) every training photo's labels (the probe unshifted)
    targets: list[list[str]]  # per training photo, the captions a step draws from (the teacher's: one)
    text: list[str]  # the caption-only rows
    person_scores: dict[bool, torch.Tensor]  # the probe's logits of the photos with that person flag
    photos_by_flag: dict[bool, list[int]]  # the training photos with that person flag (all, where none has it)

    def features(self, rows: list[int]) -> torch.Tensor:
        """The regions (B, N, D) of training photos ``rows``."""
        device = next(self.decoder.parameters()).device
        return stored_rows(self.data, rows, device)[..., :self.decoder.extension.feature_dim]

    def encode(self, caption: str) -> list[int]:
        """A caption's ids, at most ``data.max_caption_len`` words between ``<bos>`` and ``<eos>``."""
        ids = [self.data.vocab.stoi.get(w, Vocabulary.unk_id) for w in tokenize(caption)]
        return [Vocabulary.bos_id, *ids[:self.cfg.data.max_caption_len], Vocabulary.eos_id]

    def batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """One step's rows, drawn from Python's ``random``: regions (R, N, D), labels (R, W+1), tokens (R, T), B."""
        s = self.cfg.train.labels
        rows = random.sample(range(len(self.targets)), s.photos)
        seqs = [self.encode(random.choice(self.targets[i])) for i in rows]
        regions, labels = self.features(rows), self.photo_labels[rows]
        if self.text:
            texts = random.sample(self.text, s.photos)
            seqs += [self.encode(c) for c in texts]
            flags = [says_person(c) for c in texts]
            regions = torch.cat([regions, self.features([random.choice(self.photos_by_flag[f]) for f in flags])])
            words = self.decoder.extension.lexicon.words
            labels = torch.cat([labels, torch.stack([text_labels(c, words, self.person_scores[f])
                                                     for c, f in zip(texts, flags)])])
        tokens = torch.full((len(seqs), max(map(len, seqs))), Vocabulary.pad_id, dtype=torch.long)
        for i, seq in enumerate(seqs):
            tokens[i, :len(seq)] = torch.tensor(seq)
        device = regions.device
        return regions, labels.to(device), tokens.to(device), s.photos


def stored_rows(data: TrainData, rows: list[int], device: torch.device) -> torch.Tensor:
    """The cached features (B, N, D + LITE_DIM) of training photos ``rows``, float32 on ``device``."""
    if data.train_store is not None:
        x = data.train_store.gather(torch.tensor(rows, dtype=torch.long))
    else:
        load = data.train_dataset.load
        x = load.stack(rows) if callable(getattr(load, "stack", None)) else torch.stack([load(i) for i in rows])
    return model_input(x, device)


@torch.no_grad()
def photo_class_probs(reading: SATLabels, data: TrainData, device: torch.device) -> torch.Tensor:
    """Every training photo's ImageNet class probabilities (P, C), read from its cached label channels."""
    count, out = len(data.train_set.images), []
    for start in range(0, count, PROBS_BATCH):
        out.append(reading.class_probs(stored_rows(data, list(range(start, min(start + PROBS_BATCH, count))), device)))
    return torch.cat(out).cpu()


def build_label_stage(cfg: Config, init: InitWeights, run_dir: Path, info: ddp.DistInfo, progress: bool,
                      overwrite: bool = False) -> LabelStage:
    """Read and check the data, then (``overwrite``: an earlier run moved aside) write the run folder's config,
    grow the vocabulary, build the model from ``init``, cache the features and fit the probe."""
    s = cfg.train.labels
    train_set, val_set = load_caption_sets(cfg)
    if len(train_set) < s.photos:
        raise DataError(f"{cfg.data.root}: {len(train_set)} training photos, fewer than the train.labels.photos="
                        f"{s.photos} a step draws")
    text_rows = read_text_rows(s.text, s.text_exclude) if s.text else []
    text = [c for _, c in text_rows]
    if s.text and len(text) < s.photos:
        raise DataError(f"{s.text}: {len(text)} caption-only rows, fewer than the train.labels.photos={s.photos} "
                        "a step draws")
    vocab, added = grown_vocabulary(init.vocab, text, s.text_min_count)
    if s.teacher:  # checked before the first write
        read_teacher(s.teacher, [r.image_id for r in train_set.images])
    if info.is_main:
        log.info("label stage: vocabulary %d -> %d tokens (%d words of %d caption-only rows)", len(init.vocab),
                 len(vocab), len(added), len(text))
        if overwrite:
            move_aside(run_dir)
        make_run_folder(run_dir)
        cfg.save(run_dir / "config.json")
        vocab.save(run_dir / "vocab.json")

    model = build_model(cfg.model, len(vocab))  # the wheel's label stage and classifier; the rest from --init
    encoder_state = {k[len("encoder."):]: v for k, v in init.state.items() if k.startswith("encoder.")}
    missing, unexpected = model.encoder.load_state_dict(encoder_state, strict=False)
    foreign = list(unexpected) + [k for k in missing if "label" not in k]
    if foreign:
        raise ConfigError(f"--init {init.path}: its encoder does not fit this model (e.g. {foreign[0]})")
    model = model.to(info.device)
    feature_dim = model.encoder.out_dim
    decoder = training_decoder(cfg.model, feature_dim, len(vocab))
    decoder.load_state_dict(model.decoder.state_dict())  # the wheel's classifier, the label reading as built
    load_grown(decoder, init)
    decoder = decoder.to(info.device)
    base = base_decoder(init, feature_dim).to(info.device)
    data = prepare_data(cfg, model, vocab, train_set, val_set, run_dir, info, progress)
    train_set = data.train_set  # without the photos whose features could not be read
    captions = [train_set.captions[r.image_id] for r in train_set.images]
    targets = ([[c] for c in read_teacher(s.teacher, [r.image_id for r in train_set.images])] if s.teacher
               else captions)
    flags = person_flags(captions, s.person_min_captions)
    reading = decoder.extension
    probs = photo_class_probs(reading, data, info.device)
    probe = fit_person_probe(probs, flags, steps=s.probe_steps)
    reading.use_person_probe(probe)  # unshifted while training, as the caption-only rows' scores are
    reading.use_vocabulary(vocab.stoi, categories=named_objects, tau=s.veto_tau, person_tau=s.veto_person_tau)
    scores = probe.logit(probs)
    having = {f: [i for i in range(len(flags)) if bool(flags[i]) == f] for f in (True, False)}
    shift = 0.0
    if text_rows:
        by_image: dict[int, list[str]] = collections.defaultdict(list)
        for i, c in text_rows:
            by_image[i].append(c)
        prior_text = sum(sum(map(says_person, c)) >= s.person_min_captions for c in by_image.values()) / len(by_image)
        prior_photos = float(flags.float().mean())
        shift = log_odds(prior_text) - log_odds(prior_photos)
        if info.is_main:
            log.info("label stage: a person in %.2f of the photos and %.2f of the caption-only images (the saved "
                     "probe's bias %+.2f)", prior_photos, prior_text, shift)
    return LabelStage(cfg, data, model, decoder, base, len(init.vocab), probe, shift,
                      reading.labels(probs.to(info.device)), targets, text,
                      {f: scores[flags == f] if having[f] else scores for f in having},
                      {f: having[f] or list(range(len(flags))) for f in having})


def stage_optimizer(decoder: CaptionDecoder, cfg: Config) -> torch.optim.Optimizer:
    """Adam over the decoder: its own weights at ``train.lr``, its label reading's at ``train.labels.extension_lr``."""
    new = list(decoder.extension.parameters())
    old = [p for p in decoder.parameters() if all(p is not q for q in new)]
    return torch.optim.Adam([{"params": old, "lr": cfg.train.lr}, {"params": new, "lr": cfg.train.labels.extension_lr}],
                            betas=cfg.train.betas)


def train_step(stage: LabelStage, optimizer: torch.optim.Optimizer, regions: torch.Tensor, labels: torch.Tensor,
               tokens: torch.Tensor, photos: int) -> dict[str, float]:
    """One optimizer step on a batch (:meth:`LabelStage.batch`); the loss and its terms."""
    t, decoder = stage.cfg.train, stage.decoder
    loss, ce, kl = stage_loss(decoder, stage.base, regions, labels, tokens, photos, t.labels.attend_kd, stage.known)
    if not torch.isfinite(loss):
        raise DataError(f"label stage: non-finite loss ({float(loss.detach())}); nothing was saved")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if t.grad_clip:
        torch.nn.utils.clip_grad_norm_(decoder.parameters(), t.grad_clip)
    optimizer.step()
    return {"loss": float(loss.detach()), "ce": float(ce.detach()),
            **({"attention_kl": float(kl.detach())} if kl is not None else {})}


def train_steps(stage: LabelStage, logger: MetricsLogger | None, progress: bool, budget: float | None) -> dict[str, float]:
    """``train.labels.steps`` steps (fewer when ``budget`` seconds run out); the last logged means."""
    s, t = stage.cfg.train.labels, stage.cfg.train
    optimizer = stage_optimizer(stage.decoder, stage.cfg)
    stage.decoder.train()
    start, sums, count, means = time.monotonic(), collections.Counter(), 0, {}
    bar = tqdm(range(1, s.steps + 1), desc="label stage", unit="step", leave=False, disable=not progress or None)
    for step in bar:
        sums.update(train_step(stage, optimizer, *stage.batch()))
        count += 1
        elapsed = time.monotonic() - start
        last = step == s.steps or (budget is not None and elapsed >= budget)
        if step % t.log_every == 0 or last:
            means = {k: v / count for k, v in sums.items()}
            if logger is not None:
                logger.write("step", {"epoch": 1, "step": step, **means, "lr": t.lr, "seconds": elapsed})
            bar.set_postfix(loss=f"{means['loss']:.3f}", refresh=False)
            sums, count = collections.Counter(), 0
        if last:
            if step < s.steps:
                log.info("label stage: time budget of %.0f s reached at step %d of %d", budget, step, s.steps)
            means["step"] = step
            break
    bar.close()
    return means


def train_labels(cfg: Config, out_dir: str | Path, progress: bool = True, overwrite: bool = False) -> TrainResult:
    """Run the label stage (``train.stage = "labels"``) into the run folder ``out_dir``; see the module's docstring.

    Raises ``CaptionerError`` (one line) for a bad config, --init checkpoint, data or run folder, before
    anything is written; a stage is short, so it is not resumed: rerun it (``overwrite``).
    """
    start = time.monotonic()
    cfg = dataclasses.replace(cfg, model=resolve_model(cfg.model))
    check_stage_config(cfg)
    run_dir = Path(out_dir)
    check_run_folder(run_dir, False, overwrite)
    init = read_init_checkpoint(cfg.train.init)
    check_init(init, cfg.model)
    info = ddp.setup(cfg.train.device)
    try:
        if info.distributed:
            raise ConfigError("train.stage=labels runs in one process: start it without torchrun")
        seed_everything(cfg.train.seed)
        stage = build_label_stage(cfg, init, run_dir, info, progress, overwrite)
        del init
        logger = MetricsLogger(run_dir)
        try:
            means = train_steps(stage, logger, progress, cfg.train.time_budget)
            row = save_stage(stage, run_dir, means, time.monotonic() - start)
            logger.write("epoch", row)
        finally:
            logger.close()
    finally:
        ddp.cleanup(info)
    best = run_dir / "best.safetensors"
    metric = cfg.train.select_metric
    return TrainResult(best, run_dir / "latest.safetensors", row["BLEU-4"], [row], time.monotonic() - start, metric,
                       row[metric], 1)


def save_stage(stage: LabelStage, run_dir: Path, means: dict[str, float], seconds: float) -> dict[str, Any]:
    """The trained reading into the model (the probe's bias shifted), validated and saved; the metrics row."""
    cfg, model = stage.cfg, stage.model
    model.decoder.load_state_dict(stage.decoder.state_dict())
    model.decoder.extension.use_person_probe(stage.probe, stage.shift)
    model.eval()
    data, device = stage.data, next(model.parameters()).device
    info = ddp.DistInfo(0, 1, 0, device)
    shard = validate(model, val_loader(data.val_dataset, cfg, info, store=data.val_store), data.val_set, data.vocab,
                     cfg.train.val_beam, cfg.train.val_max_len, device, data.on_features, options=cfg.decoding)
    metrics = score([shard])
    row = {"epoch": 1, **means, **metrics, "seconds": seconds}
    meta = {"stage": "labels", "init": str(cfg.train.init), "step": int(means.get("step", 0)),
            "val_bleu4": metrics["BLEU-4"], "val_cider_d": metrics["CIDEr-D"], "select_metric": cfg.train.select_metric,
            "val_split": cfg.data.val_split, "train_seed": cfg.train.seed, "person_prior_shift": stage.shift}
    for name in ("latest.safetensors", "best.safetensors"):
        save_checkpoint(run_dir / name, model, data.vocab, metadata=meta)
    info_release = pack_release(run_dir / "best.safetensors", run_dir / "release.safetensors",
                                metadata={"trained_from": "captioner train (train.stage=labels)"})
    log.info("label stage: val BLEU-4 %.4f, CIDEr-D %.4f; %s (%d bytes, SHA-256 %s)", metrics["BLEU-4"],
             metrics["CIDEr-D"], run_dir / "release.safetensors", info_release["bytes"], info_release["sha256"][:8])
    return row
