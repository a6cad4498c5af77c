"""Concept detectors over a frozen encoder's regions (Fang et al. 2015, "From captions to visual concepts and back").

Shape legend: B images, N regions (grid*grid), D feature width, K concepts, F hidden width.

A :class:`ConceptHead` is a small two-layer network applied to every region feature: it scores
each of K *concepts* (the most frequent content words of the training captions: "dog", "ball",
"grass", "red", "jumping") at each region. An image's score for a concept pools its regions'
scores, so the head trains from captions alone by multiple-instance learning: a word in the
image's captions is a positive bag, and some region must carry its evidence
(``captioner.training.detectors`` trains it on a feature cache in minutes).

Two poolings (``pooling``):

* ``"lse"``: a soft maximum, ``(1/r) logsumexp_i(r s_ki)``; its gradient goes to the regions in
  proportion to ``softmax_i(r s_ki)``, which is also the concept's **map** (:meth:`ConceptHead.maps`);
* ``"noisy_or"``: ``P(k) = 1 - prod_i (1 - sigmoid(s_ki))``, Fang et al.'s form; its map is the
  regions' probabilities normalised to sum to one.

The head is used three ways: its image-level probabilities are an extra input of a decoder
(``decoder.concepts``), its maps are a target for the decoder's attention on the words that are
concepts (``train.concept_guide``: grounding learnt from captions alone), and a photo's top
concepts with their maps are listed beside its caption.

A trained head is stored as one safetensors file (:func:`save_concepts` / :func:`load_concepts`)
holding the weights and, in its metadata, the concept words and how the head was built.

**Cross-fitting.** A head sees its own training photos far better than new ones (on Flickr8k, 61% of
a training photo's ten most probable concepts are in its captions, against 44% on dev), so a decoder
trained on those photos learns to trust concepts more than they deserve on any other. A concepts file may also hold
F *fold heads*: the training images are split into F folds by :func:`feature_fold`, a function of
the regions alone (the count of positive feature values, modulo F: the same for a photo wherever its
features come from, with no image ids to carry), and fold head f is trained without fold f. While a
decoder trains, each photo's concepts come from the fold head that never saw it
(:class:`OutOfFoldConcepts`); validation, decoding and the checkpoint use the full head.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from captioner.config.decoders import CONCEPT_POOLINGS
from captioner.errors import CheckpointError, ConfigError
from captioner.files import atomic_write
from captioner.text import STOP_WORDS, Vocabulary

FORMAT = "captioner-concepts"
POOLINGS = CONCEPT_POOLINGS  # the config layer checks decoder.concept_pooling against the same names
INITIAL_BIAS = -4.0  # of the region logits: sigmoid(-4) = 1.8%
MAX_WIDTH = 65_536  # a head's feature and hidden widths (a larger one could not be allocated)
MAX_CONCEPTS = 100_000  # concept words in one head
SHARPNESS = 5.0  # r of the "lse" pooling (r -> infinity: the max; r -> 0: the mean)



def choose_concepts(captions: Iterable[Sequence[str]], k: int, min_images: int = 5) -> list[str]:
    """The ``k`` content words that the most images mention, most frequent first.

    Args:
        captions: per image, its captions' tokens joined or as one list of words (each image once).
        k: how many concepts.
        min_images: a word mentioned for fewer images is never a concept.
    """
    if k < 1:
        raise ConfigError(f"the number of concepts must be >= 1, got {k}")
    counts: Counter[str] = Counter()
    for words in captions:
        counts.update(set(words) - STOP_WORDS)
    ranked = [(n, w) for w, n in counts.items() if n >= min_images and w.isalpha() and len(w) > 1]
    ranked.sort(key=lambda item: (-item[0], item[1]))
    return [w for _, w in ranked[:k]]


class ConceptHead(nn.Module):
    """Per-region concept scores: features (B,N,D) -> logits (B,N,K).

    Args:
        feature_dim: D.
        words: the K concept words, in output order.
        hidden_dim: F, the hidden width (0: one linear layer).
        dropout: on the hidden layer while training.
        pooling: ``"lse"`` or ``"noisy_or"`` (module docstring).
        sharpness: r of ``"lse"``.
    """

    def __init__(self, feature_dim: int, words: Sequence[str], hidden_dim: int = 512, dropout: float = 0.3,
                 pooling: str = "lse", sharpness: float = SHARPNESS) -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ConfigError(f"concept pooling {pooling!r}: use one of {', '.join(POOLINGS)}")
        if not words:
            raise ConfigError("a concept head needs at least one concept word")
        if not 0 <= hidden_dim <= MAX_WIDTH or not 1 <= feature_dim <= MAX_WIDTH:
            raise ConfigError(f"a concept head's widths must be 0..{MAX_WIDTH} (hidden) and 1..{MAX_WIDTH} (features), "
                              f"got {hidden_dim} and {feature_dim}")
        self.words = list(words)
        self.feature_dim, self.hidden_dim = feature_dim, hidden_dim
        self.pooling, self.sharpness, self.dropout_p = pooling, float(sharpness), dropout
        if hidden_dim:
            self.net = nn.Sequential(nn.LayerNorm(feature_dim), nn.Linear(feature_dim, hidden_dim), nn.ReLU(),
                                     nn.Dropout(dropout), nn.Linear(hidden_dim, len(self.words)))
        else:
            self.net = nn.Sequential(nn.LayerNorm(feature_dim), nn.Linear(feature_dim, len(self.words)))
        # most concepts are absent from most images: start every region at a low prior (noisy-OR over
        # 49 regions at p = 0.5 would call every concept present)
        nn.init.constant_(self.net[-1].bias, INITIAL_BIAS)

    @property
    def size(self) -> int:
        """K."""
        return len(self.words)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features (B,N,D) -> region logits (B,N,K), float32."""
        return self.net(features.float())

    def pool(self, region_logits: torch.Tensor) -> torch.Tensor:
        """Region logits (B,N,K) -> image logits (B,K): ``sigmoid`` of them is P(concept in image)."""
        if self.pooling == "lse":
            return torch.logsumexp(region_logits * self.sharpness, dim=1) / self.sharpness
        log_none = -F.softplus(region_logits).sum(dim=1)  # (B, K) log prod_i (1 - p_i) = log(1 - P)
        log_any = torch.log(-torch.expm1(log_none.clamp(max=-1e-6)))  # log P
        return log_any - log_none  # logit(P)

    def probs(self, features: torch.Tensor) -> torch.Tensor:
        """features (B,N,D) -> P(concept in image) (B,K)."""
        return torch.sigmoid(self.pool(self(features)))

    def maps_from_logits(self, region_logits: torch.Tensor) -> torch.Tensor:
        """Region logits (B,N,K) -> each concept's map over the regions (B,K,N), rows summing to 1."""
        logits = region_logits.transpose(1, 2)  # (B, K, N)
        if self.pooling == "lse":
            return torch.softmax(logits * self.sharpness, dim=-1)
        p = torch.sigmoid(logits)
        return p / p.sum(-1, keepdim=True).clamp(min=1e-8)

    def maps(self, features: torch.Tensor) -> torch.Tensor:
        """features (B,N,D) -> each concept's map over the regions (B,K,N)."""
        return self.maps_from_logits(self(features))

    def read(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features (B,N,D) -> P(concept in image) (B,K) and each concept's map (B,K,N), from one pass."""
        logits = self(features)  # (B, N, K)
        return torch.sigmoid(self.pool(logits)), self.maps_from_logits(logits)

    def describe(self) -> dict[str, object]:
        """What rebuilds the head: its metadata in a concepts file."""
        return {"feature_dim": self.feature_dim, "hidden_dim": self.hidden_dim, "dropout": self.dropout_p,
                "pooling": self.pooling, "sharpness": self.sharpness, "words": self.words}


def feature_fold(features: torch.Tensor, folds: int) -> torch.Tensor:
    """Each photo's fold of ``folds`` from its regions alone: features (B,N,D) -> (B,) long in [0, folds).

    The count of positive values modulo ``folds``: exact in any floating dtype and on any device, so the
    fold a head was trained without is found again from the same cached features while a decoder trains.
    """
    return (features > 0).flatten(1).sum(1) % folds


class OutOfFoldConcepts:
    """Each photo's concepts read by the fold head trained without it (module docstring: cross-fitting).

    Args:
        heads: the F fold heads; head f never saw the training photos of fold f.
    """

    def __init__(self, heads: Sequence[ConceptHead]) -> None:
        if len(heads) < 2:
            raise ConfigError(f"cross-fitting needs at least 2 fold heads, got {len(heads)}")
        self.heads = [h.eval().requires_grad_(False) for h in heads]

    @property
    def folds(self) -> int:
        return len(self.heads)

    def to(self, device: torch.device | str) -> "OutOfFoldConcepts":
        self.heads = [h.to(device) for h in self.heads]
        return self

    @torch.no_grad()
    def read(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features (B,N,D) -> P(concept in image) (B,K) and maps (B,K,N), each row from its photo's fold head."""
        fold = feature_fold(features, self.folds)
        b, n = features.shape[:2]
        k = self.heads[0].size
        probs = features.new_zeros(b, k, dtype=torch.float32)
        maps = features.new_zeros(b, k, n, dtype=torch.float32)
        for f, head in enumerate(self.heads):
            rows = (fold == f).nonzero().squeeze(1)
            if len(rows):
                probs[rows], maps[rows] = head.read(features[rows])
        return probs, maps

    def probs(self, features: torch.Tensor) -> torch.Tensor:
        """features (B,N,D) -> P(concept in image) (B,K) from each photo's fold head."""
        return self.read(features)[0]


def save_concepts(head: ConceptHead, path: str | os.PathLike, extra: dict[str, object] | None = None,
                  folds: Sequence[ConceptHead] = ()) -> Path:
    """Write ``head`` as a concepts file (safetensors; metadata: the words and the build, plus ``extra``),
    with the cross-fitting ``folds`` heads (same build and words) when given."""
    if any(h.describe() != head.describe() for h in folds):
        raise ConfigError("every fold head must be built as the full head (same words, width and pooling)")
    meta = {"format": FORMAT, "head": json.dumps(head.describe()), "extra": json.dumps(extra or {}),
            "folds": str(len(folds))}
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    for f, fold_head in enumerate(folds):
        state.update({f"fold{f}.{k}": v.detach().cpu().contiguous() for k, v in fold_head.state_dict().items()})
    path = Path(path)
    data = save(state, metadata=meta)
    atomic_write(path, lambda f: f.write(data))
    return path


def load_concepts(path: str | os.PathLike) -> tuple[ConceptHead, dict[str, object]]:
    """Read a concepts file: the head (eval mode) and the ``extra`` metadata it was saved with."""
    head, extra, _ = load_concepts_with_folds(path)
    return head, extra


def load_concepts_with_folds(path: str | os.PathLike) -> tuple[ConceptHead, dict[str, object], list[ConceptHead]]:
    """Read a concepts file: the head, the ``extra`` metadata and its cross-fitting fold heads (often none)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"concepts file {path} does not exist (train one with `captioner concepts`)")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not a concepts file (format {meta.get('format')!r}, "
                                  f"expected {FORMAT!r})")
        spec = json.loads(meta["head"])
        for key, high in (("feature_dim", MAX_WIDTH), ("hidden_dim", MAX_WIDTH)):
            if not 0 <= int(spec[key]) <= high:
                raise CheckpointError(f"concepts file {path} cannot be read: its head's {key} {int(spec[key])} "
                                      f"is outside 0..{high}")
        if not 1 <= len(spec["words"]) <= MAX_CONCEPTS:
            raise CheckpointError(f"concepts file {path} cannot be read: it names {len(spec['words'])} words "
                                  f"(1 to {MAX_CONCEPTS})")

        def build() -> ConceptHead:
            return ConceptHead(int(spec["feature_dim"]), [str(w) for w in spec["words"]], int(spec["hidden_dim"]),
                               float(spec["dropout"]), str(spec["pooling"]), float(spec["sharpness"]))

        tensors = load_file(str(path))
        head = build()
        head.load_state_dict({k: v for k, v in tensors.items() if not k.startswith("fold")})
        folds = []
        for f in range(int(meta.get("folds", "0"))):
            fold_head = build()
            fold_head.load_state_dict({k[len(f"fold{f}."):]: v for k, v in tensors.items()
                                       if k.startswith(f"fold{f}.")})
            folds.append(fold_head.eval())
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise CheckpointError(f"concepts file {path} cannot be read: {reason}") from None
    return head.eval(), _extra(path, meta.get("extra", "{}")), folds


def _extra(path: Path, text: str) -> dict[str, object]:
    """The ``extra`` metadata of a concepts file: a JSON object (one line naming the file otherwise)."""
    try:
        extra = json.loads(text)
    except (ValueError, RecursionError):
        raise CheckpointError(f"concepts file {path} cannot be read: its 'extra' metadata is not JSON "
                              f"({text[:40]!r}...)") from None
    if not isinstance(extra, dict):
        raise CheckpointError(f"concepts file {path} cannot be read: its 'extra' metadata must be a JSON object, "
                              f"not a {type(extra).__name__}")
    return extra


def restrict_to_vocab(head: ConceptHead, vocab: Vocabulary) -> ConceptHead:
    """The head's concepts that are words of ``vocab`` (a decoder can only name those), weights kept."""
    keep = [k for k, w in enumerate(head.words) if w in vocab.stoi]
    if not keep:
        raise ConfigError("none of the concept words is in the training vocabulary")
    out = ConceptHead(head.feature_dim, [head.words[k] for k in keep], head.hidden_dim, head.dropout_p,
                      head.pooling, head.sharpness)
    state = dict(head.state_dict())
    last = f"net.{len(head.net) - 1}"
    state[f"{last}.weight"] = state[f"{last}.weight"][keep]
    state[f"{last}.bias"] = state[f"{last}.bias"][keep]
    out.load_state_dict(state)
    return out.eval()


def read_concepts(path: str | os.PathLike, encoder_cfg: Any, vocab: Vocabulary) -> ConceptHead:
    """A concepts file's head restricted to ``vocab``, refused when it was trained on another encoder's features."""
    return read_concepts_with_folds(path, encoder_cfg, vocab)[0]


def read_concepts_with_folds(path: str | os.PathLike, encoder_cfg: Any, vocab: Vocabulary
                             ) -> tuple[ConceptHead, list[ConceptHead]]:
    """:func:`read_concepts` and the file's cross-fitting fold heads, restricted to ``vocab`` alike."""
    head, extra, folds = load_concepts_with_folds(path)
    enc = encoder_cfg
    made_for = (extra.get("encoder"), extra.get("grid"), extra.get("image_size"))
    if made_for != (None, None, None) and made_for != (enc.name, enc.grid, enc.image_size):
        raise ConfigError(f"concepts file {path} was trained on {made_for[0]} features "
                          f"({made_for[1]}x{made_for[1]} at {made_for[2]} px); this model's encoder is {enc.name} "
                          f"({enc.grid}x{enc.grid} at {enc.image_size} px)")
    return restrict_to_vocab(head, vocab), [restrict_to_vocab(h, vocab) for h in folds]
