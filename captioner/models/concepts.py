"""Concept detectors over a frozen encoder's regions (Fang et al. 2015), what a decoder reads of them, and
the tags a caption shows. docs/grounding.md and docs/models_sat.md explain the method.

Shape legend: B images, N regions (grid*grid), D feature width, K concepts, F hidden width.

:class:`ConceptHead` scores K concepts (frequent caption words) at every region and pools them into
P(concept in image); its pooling weights are each concept's map over the regions. :class:`SATConcepts`
and :class:`TransformerConcepts` are the decoder extension that reads them (built by :func:`build_extension`;
the decoders never import this module).
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

from captioner.config.decoders import CONCEPT_POOLINGS, ConceptsConfig, DecoderConfig, SATConfig, TransformerConfig
from captioner.models.labels import SATLabels, TransformerLabels
from captioner.errors import CheckpointError, ConfigError
from captioner.files import atomic_write, check_regular
from captioner.models.base import DecoderExtension, SATExtension, TransformerExtension
from captioner.text import STOP_WORDS, Vocabulary

FORMAT = "captioner-concepts"
POOLINGS = CONCEPT_POOLINGS  # the config layer checks concepts.pooling against the same names
INITIAL_BIAS = -4.0  # of the region logits: sigmoid(-4) = 1.8%
MAX_WIDTH = 65_536  # a head's feature and hidden widths (a larger one could not be allocated)
MAX_CONCEPTS = 100_000  # concept words in one head
SHARPNESS = 5.0  # r of the "lse" pooling (r -> infinity: the max; r -> 0: the mean)
CONCEPT_TOKENS = 10  # the Transformer's memory tokens of a photo's most probable concepts (fewer when it reads fewer)


def choose_concepts(captions: Iterable[Sequence[str]], k: int, min_images: int = 5) -> list[str]:
    """The ``k`` content words that the most images mention (``captions``: one word list per image), most
    frequent first; a word mentioned for fewer than ``min_images`` images is never a concept."""
    if k < 1:
        raise ConfigError(f"the number of concepts must be >= 1, got {k}")
    counts: Counter[str] = Counter()
    for words in captions:
        counts.update(set(words) - STOP_WORDS)
    ranked = [(n, w) for w, n in counts.items() if n >= min_images and w.isalpha() and len(w) > 1]
    ranked.sort(key=lambda item: (-item[0], item[1]))
    return [w for _, w in ranked[:k]]


class ConceptHead(nn.Module):
    """Per-region concept scores: features (B,N,D) -> logits (B,N,K) for the K ``words``, in order.

    ``hidden_dim`` F (0: one linear layer); ``pooling`` ``"lse"`` (``sharpness`` r) or ``"noisy_or"``.
    """

    runs_in_float32 = True  # a bfloat16 copy of a decoder keeps this head in float32 (it reads float32 features)

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
        # most concepts are absent from most images: every region starts at a low prior
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
    """Each photo's concepts read by the fold head trained without it: head f of ``heads`` never saw the
    training photos of fold f (cross-fitting)."""

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
    if not os.path.lexists(path):
        raise CheckpointError(f"concepts file {path} does not exist (train one with `captioner concepts`)")
    check_regular(path, MAX_CONCEPTS_BYTES, CheckpointError, "concepts file")  # never a pipe or a device
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not a concepts file (format {meta.get('format')!r}, "
                                  f"expected {FORMAT!r})")
        spec = _head_spec(path, meta.get("head"))
        folds_count = _fold_count(path, meta.get("folds", "0"))

        def build() -> ConceptHead:
            return ConceptHead(spec["feature_dim"], spec["words"], spec["hidden_dim"], spec["dropout"],
                               spec["pooling"], spec["sharpness"])

        tensors = load_file(str(path))
        head = build()
        prefixes = [f"fold{f}." for f in range(folds_count)]
        stray = next((k for k in tensors if k.startswith("fold") and not k.startswith(tuple(prefixes))), None)
        if stray is not None:
            raise CheckpointError(f"concepts file {path} cannot be read: it holds tensor {stray!r}, but its 'folds' "
                                  f"metadata says {folds_count} fold heads")
        _load_head(path, head, {k: v for k, v in tensors.items() if not k.startswith("fold")}, "")
        folds = []
        for prefix in prefixes:
            fold_head = build()
            _load_head(path, fold_head, {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)},
                       prefix)
            folds.append(fold_head.eval())
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise CheckpointError(f"concepts file {path} cannot be read: {reason}") from None
    return head.eval(), _extra(path, meta.get("extra", "{}")), folds


MAX_CONCEPTS_BYTES = 4 << 30  # a concepts file larger than this is refused before it is opened
MAX_FOLDS = 100  # fold heads in one concepts file (``captioner concepts --folds``)


def _head_spec(path: Path, text: str | None) -> dict[str, Any]:
    """The ``head`` metadata of a concepts file, each field checked (one line naming the file and the field)."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"concepts file {path} cannot be read: {what}")

    if text is None:
        raise bad("it has no 'head' metadata (the head's words and widths)")
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError):
        raise bad(f"its 'head' metadata is not JSON ({text[:40]!r}...)") from None
    if not isinstance(spec, dict):
        raise bad(f"its 'head' metadata must be a JSON object, not a {type(spec).__name__}")
    fields = {"feature_dim": (int, 1, MAX_WIDTH), "hidden_dim": (int, 0, MAX_WIDTH), "dropout": (float, 0.0, 1.0),
              "sharpness": (float, 1e-6, 1e6)}
    out: dict[str, Any] = {}
    for key, (kind, low, high) in fields.items():
        value = spec.get(key)
        allowed = (int,) if kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, allowed) or not low <= value <= high:  # NaN fails too
            what = "an integer" if kind is int else "a number"
            raise bad(f"its head's {key!r} must be {what} from {low:g} to {high:g}, got {value!r:.40}")
        out[key] = kind(value)
    words = spec.get("words")
    if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words) \
            or not 1 <= len(words) <= MAX_CONCEPTS:
        raise bad(f"its head's 'words' must be a list of 1 to {MAX_CONCEPTS} words, got {words!r:.40}")
    if spec.get("pooling") not in POOLINGS:
        raise bad(f"its head's 'pooling' must be one of {', '.join(POOLINGS)}, got {spec.get('pooling')!r:.40}")
    return {**out, "words": words, "pooling": spec["pooling"]}


def _fold_count(path: Path, text: str) -> int:
    """The ``folds`` metadata of a concepts file: how many cross-fitting heads it holds, 0 to :data:`MAX_FOLDS`."""
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_FOLDS:
        raise CheckpointError(f"concepts file {path} cannot be read: its 'folds' metadata must be a whole number "
                              f"from 0 to {MAX_FOLDS}, got {text[:40]!r}")
    return int(text)


def _load_head(path: Path, head: ConceptHead, state: dict[str, torch.Tensor], prefix: str) -> None:
    """Fill ``head`` from ``state``, naming the first missing, unexpected, reshaped or non-finite tensor."""
    own = head.state_dict()
    for key, tensor in own.items():
        if key not in state:
            raise CheckpointError(f"concepts file {path} cannot be read: it lacks tensor {prefix + key!r} of its head")
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise CheckpointError(f"concepts file {path} cannot be read: tensor {prefix + key!r} has shape "
                                  f"{tuple(state[key].shape)}; its head's widths and words need {tuple(tensor.shape)}")
        if not torch.isfinite(state[key]).all():
            raise CheckpointError(f"concepts file {path} cannot be read: tensor {prefix + key!r} holds NaN or "
                                  "infinite values")
    unexpected = next((k for k in state if k not in own), None)
    if unexpected is not None:
        raise CheckpointError(f"concepts file {path} cannot be read: it holds tensor {prefix + unexpected!r}, "
                              "which its head does not have")
    head.load_state_dict(state)


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
    if "encoder" in extra and not isinstance(extra["encoder"], str):
        raise CheckpointError(f"concepts file {path} cannot be read: its 'extra' field 'encoder' must be an "
                              f"encoder's name, got {extra['encoder']!r:.40}")
    for key in ("grid", "image_size"):  # what read_concepts compares with the model's encoder
        value = extra.get(key)
        if key in extra and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise CheckpointError(f"concepts file {path} cannot be read: its 'extra' field {key!r} must be a whole "
                                  f"number >= 1, got {value!r:.40}")
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


# ----------------------------------------------------------------------------- what a decoder reads of them


class ConceptReading(DecoderExtension):
    """A decoder's reading of a photo's concepts, the extension both decoder families share.

    Holds a frozen :class:`ConceptHead` over the raw regions (``concept_head``, always in eval mode) and
    the vocabulary id of each of its K concepts (``concept_ids``), filled from a concepts file, then from
    the checkpoint. With ``concept_prior`` also the prior's pointer over the K concepts and "none"
    (``concept_query``, W_q) and its learned weight lambda (``prior_scale``, from 1).
    """

    def __init__(self, feature_dim: int, concepts: int, concept_hidden: int = 512, concept_pooling: str = "lse",
                 concept_sharpness: float = SHARPNESS) -> None:
        super().__init__()
        self.concepts = concepts
        self.concept_head = ConceptHead(feature_dim, [""] * concepts, concept_hidden, pooling=concept_pooling,
                                        sharpness=concept_sharpness).requires_grad_(False).eval()
        self.register_buffer("concept_ids", torch.zeros(concepts, dtype=torch.long))  # vocab id of each concept
        self.concept_prior = False

    def _add_prior(self, width: int, concept_prior: bool) -> None:
        self.concept_prior = concept_prior
        if concept_prior:
            self.concept_query = nn.Linear(width, self.concepts + 1)  # W_q: K concepts, then "none"
            self.prior_scale = nn.Parameter(torch.ones(()))  # lambda

    def train(self, mode: bool = True) -> ConceptReading:
        super().train(mode)
        self.concept_head.eval()  # frozen: no dropout in training either
        return self

    def use_concept_folds(self, folds: Any) -> None:
        """Read concepts from ``folds`` (an :class:`OutOfFoldConcepts`: each training photo's fold head) while
        in training mode; ``None``: always the frozen ``concept_head``. The fold heads are not part of the
        weights: validation, decoding and checkpoints see the full head only."""
        self.__dict__["_concept_folds"] = folds  # not a submodule: never saved, never moved by .to()

    def _reader(self) -> Any:
        folds = self.__dict__.get("_concept_folds")
        return folds if self.training and folds is not None else self.concept_head

    def concept_probs(self, features: torch.Tensor) -> torch.Tensor:
        """P(concept in image) (B,K) from the raw region features (B,N,D), no gradient."""
        with torch.no_grad():
            return self._reader().probs(features)

    def read_concepts(self, features: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """P(concept in image) (B,K) from one pass of the head over the raw regions (B,N,D), no gradient, and,
        with the prior, its per-image constants (else None): ``concept_logp`` log P (B,K) and the concepts'
        maps ``concept_maps`` (B,K,N), in the features' dtype."""
        if not self.concept_prior:
            return self.concept_probs(features), None
        with torch.no_grad():
            probs, maps = self._reader().read(features)
        return probs, {"concept_logp": probs.clamp(min=1e-6).log().to(features.dtype),
                       "concept_maps": maps.to(features.dtype)}

    def read(self, features: torch.Tensor) -> dict[str, torch.Tensor]:
        probs, prior = self.read_concepts(features)
        return {"concept_probs": probs, **(prior or {})}

    @staticmethod
    def prior_map(pointer: torch.Tensor, logp: torch.Tensor, maps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The concept prior over the regions from a pointer over the photo's concepts and "none".

        Args:
            pointer: the pointer's logits (B,K+1) or (B,T,K+1): K concepts, then "none".
            logp: log P(concept in image) (B,K), added to the concepts' logits (a concept the photo
                lacks is hardly pointed at).
            maps: the concepts' maps (B,K,N).

        Returns:
            ``sum_k q_k maps_k + q_none / N`` (B,N) or (B,T,N), summing to one, and log q (B[,T],K+1).
        """
        single = pointer.dim() == 2
        if single:
            pointer = pointer.unsqueeze(1)  # (B, 1, K+1)
        k = logp.shape[-1]
        log_q = F.log_softmax(torch.cat([pointer[..., :k] + logp.unsqueeze(1), pointer[..., k:]], dim=-1), dim=-1)
        q = log_q.exp()  # (B, T, K+1)
        prior = q[..., :k] @ maps + q[..., k:] / maps.shape[-1]  # (B, T, N)
        return (prior.squeeze(1), log_q.squeeze(1)) if single else (prior, log_q)

    def _aux(self, static: dict[str, torch.Tensor], log_q: torch.Tensor | None) -> dict[str, torch.Tensor]:
        return {} if log_q is None else {"concept_pointer": log_q, "concept_probs": static["concept_probs"]}


class SATConcepts(ConceptReading, SATExtension):
    """What the SAT LSTM reads of a photo's concepts (docs/models_sat.md has the equations).

    The K probabilities p go into h0, c0 (``init_concepts``) and the deep output (``out_concepts``, L_p).
    With ``concept_prior`` a pointer ``u = W_q h + U_q E y`` (``concept_query``, ``concept_query_word``)
    over the K concepts and "none" gives ``q = softmax(u_{1..K} + log p ; u_{K+1})``, the prior
    ``sum_k q_k m_k + q_none / N`` over the regions (m_k: concept k's map) and the attention
    ``softmax(log alpha + lambda log prior)``; the pointer's log q is ``aux["concept_pointer"]`` (B,T,K+1).
    H: the LSTM width; M: the word embedding width.
    """

    def __init__(self, feature_dim: int, hidden_dim: int, concepts: int, embed_dim: int, concept_prior: bool = False,
                 **head: Any) -> None:
        super().__init__(feature_dim, concepts, **head)
        self.init_concepts = nn.Linear(concepts, 2 * hidden_dim, bias=False)  # into h0 and c0
        self.out_concepts = nn.Linear(concepts, embed_dim, bias=False)  # L_p: into the deep output
        self._add_prior(hidden_dim, concept_prior)  # W_q reads h
        if concept_prior:
            self.concept_query_word = nn.Linear(embed_dim, concepts + 1, bias=False)  # U_q: ... and the previous word

    def initial_state(self, static: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.init_concepts(static["concept_probs"].to(self.init_concepts.weight.dtype))  # (B, 2H)

    def query_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (self.concept_query.weight, self.concept_query.bias) if self.concept_prior else None

    def word_query(self, emb: torch.Tensor) -> torch.Tensor | None:
        return self.concept_query_word(emb) if self.concept_prior else None

    def filter_attention(self, log_alpha: torch.Tensor, query: torch.Tensor | None, word: torch.Tensor | None,
                         static: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.concept_prior:
            return log_alpha, None
        prior, log_q = self.prior_map(query + word, static["concept_logp"], static["concept_maps"])  # (B,N), (B,K+1)
        return F.log_softmax(log_alpha + self.prior_scale * prior.clamp(min=1e-12).log(), dim=-1), log_q

    def output(self, static: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.out_concepts(static["concept_probs"].to(self.out_concepts.weight.dtype))  # (B, M) L_p p

    def aux(self, static: dict[str, torch.Tensor], records: list[Any]) -> dict[str, torch.Tensor]:
        return self._aux(static, torch.stack(records, dim=1) if records else None)  # (B, T, K+1)


class ConceptTokens(nn.Module):
    """A photo's most probable concepts as memory tokens: probabilities (B, K) -> tokens (B, T, d).

    ``token_t = LN(W_w E[id_t] + p_t u)`` for the T = min(:data:`CONCEPT_TOKENS`, K) concepts of highest
    probability p_t, most probable first; ``id_t`` is the concept's vocabulary id and E the decoder's word
    embedding (shared, so a concept token starts out as the word it names). ``u`` tells the decoder how
    surely the photo shows the concept.
    """

    def __init__(self, d_model: int, concepts: int) -> None:
        super().__init__()
        self.count = min(CONCEPT_TOKENS, concepts)  # T
        self.word = nn.Linear(d_model, d_model, bias=False)  # W_w
        self.prob = nn.Parameter(torch.randn(d_model) * d_model**-0.5)  # u
        self.norm = nn.LayerNorm(d_model)

    def forward(self, probs: torch.Tensor, concept_ids: torch.Tensor, embed: nn.Embedding) -> torch.Tensor:
        """probs (B, K), concept_ids (K,) vocabulary ids, embed: E -> tokens (B, T, d)."""
        p, index = probs.topk(self.count, dim=-1)  # (B, T) each
        words = embed(concept_ids[index])  # (B, T, d)
        return self.norm(self.word(words) + p.unsqueeze(-1).to(words.dtype) * self.prob)  # (B, T, d)


class TransformerConcepts(ConceptReading, TransformerExtension):
    """What the Transformer reads of a photo's concepts (You et al. 2016; docs/models_transformer.md).

    The photo's T = min(:data:`CONCEPT_TOKENS`, K) most probable concepts join the memory after the N
    regions as :class:`ConceptTokens` (``concept_tokens``). With ``concept_prior`` the last layer's
    cross-attention gets a pointer ``q = softmax([W_q x]_{1..K} + log p ; [W_q x]_{K+1})`` read from the
    normed token state x of its queries; every head's region scores get ``lambda log(N prior)`` added
    (0 on the concept tokens, and on the regions when q says "none"); log q is ``aux["concept_pointer"]``.
    d: the model width.
    """

    def __init__(self, feature_dim: int, d_model: int, concepts: int, concept_prior: bool = False,
                 **head: Any) -> None:
        super().__init__(feature_dim, concepts, **head)
        self.concept_tokens = ConceptTokens(d_model, concepts)
        self._add_prior(d_model, concept_prior)

    def memory(self, static: dict[str, torch.Tensor], embed: nn.Embedding) -> torch.Tensor:
        return self.concept_tokens(static["concept_probs"], self.concept_ids, embed)  # (B, T, d)

    def cross_bias(self, h: torch.Tensor, static: dict[str, torch.Tensor], memory_size: int
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.concept_prior:
            return None, None
        maps = static["concept_maps"]  # (B, K, N)
        prior, log_q = self.prior_map(self.concept_query(h), static["concept_logp"], maps)
        n = maps.shape[-1]
        regions = self.prior_scale * (prior * n).clamp(min=1e-12).log()  # (B, T, N), 0 where uniform
        return F.pad(regions, (0, memory_size - n)).unsqueeze(1).to(h.dtype), log_q  # (B, 1, T, S)

    def aux(self, static: dict[str, torch.Tensor], records: list[Any]) -> dict[str, torch.Tensor]:
        return self._aux(static, records[0] if records else None)


READERS = (SATConfig, TransformerConfig)  # the decoder families whose extension reads concepts


def build_extension(cfg: ConceptsConfig, decoder: DecoderConfig, feature_dim: int, labels: bool = False,
                    vocab_size: int = 0) -> DecoderExtension | None:
    """The decoder's extension from ``model.concepts`` (``cfg``; K = ``cfg.count``) or, with ``labels``
    (``encoder.labels``), the encoder's labels (over a ``vocab_size`` vocabulary): None when it reads neither; the ``decoder`` config's family
    picks the reading, ConfigError for one that cannot read them or for both at once."""
    if labels:
        if cfg.count:
            raise ConfigError(f"a decoder reads concepts (concepts.count={cfg.count}) or the encoder's labels "
                              "(encoder.labels=true), not both")
        if isinstance(decoder, SATConfig):
            return SATLabels(feature_dim, decoder.hidden_dim, decoder.embed_dim, vocab_size)
        if isinstance(decoder, TransformerConfig):
            return TransformerLabels(feature_dim, decoder.d_model, vocab_size)
        raise ConfigError(f"the {decoder.name} decoder cannot read the encoder's labels: set encoder.labels=false")
    if not cfg.count:
        if cfg.prior:
            raise ConfigError("concepts.prior needs a decoder that reads concepts (train.concepts=FILE, "
                              "train.concept_input=true)")
        return None
    head = {"concept_hidden": cfg.hidden, "concept_pooling": cfg.pooling, "concept_sharpness": cfg.sharpness}
    if isinstance(decoder, SATConfig):
        return SATConcepts(feature_dim, decoder.hidden_dim, cfg.count, decoder.embed_dim, cfg.prior, **head)
    if isinstance(decoder, TransformerConfig):
        return TransformerConcepts(feature_dim, decoder.d_model, cfg.count, cfg.prior, **head)
    raise ConfigError(f"the {decoder.name} decoder cannot read concepts (concepts.count={cfg.count}): "
                      "set concepts.count=0")


TOP_CONCEPTS = 8  # concepts listed per photo
MIN_CONCEPT_PROB = 0.05  # ... found with at least this probability


def photo_tags(extension: Any, features: torch.Tensor, vocab: Vocabulary, grid: tuple[int, int],
               k: int = TOP_CONCEPTS, min_prob: float = MIN_CONCEPT_PROB
               ) -> list[tuple[list[tuple[str, float]] | None, torch.Tensor | None]]:
    """Per image, the top concepts ``[(word, probability)]`` and their maps (C, g, g) of a decoder's
    extension (anything with ``concept_head.read`` and ``concept_ids``), or ``(None, None)`` without one."""
    if getattr(extension, "concept_head", None) is None:
        return [(None, None)] * features.size(0)
    with torch.no_grad():
        probs, maps = extension.concept_head.read(features)  # (B, K), (B, K, N)
    out = []
    for b in range(features.size(0)):
        top = [int(i) for i in probs[b].argsort(descending=True)[:k] if float(probs[b, i]) >= min_prob]
        words = [(vocab.itos[int(extension.concept_ids[i])], round(float(probs[b, i]), 4)) for i in top]
        out.append((words, maps[b, top].reshape(len(top), *grid).float().cpu()))
    return out
