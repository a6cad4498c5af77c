"""The interface every caption decoder keeps, so search, training and overlays never branch on type.

Shape legend: B batch, N regions (grid*grid), D feature width, T caption steps, V vocabulary,
L decoder layers, H attention heads.

A decoder is an ``nn.Module`` with:

* ``forward(features (B,N,D), tokens (B,T), need_all_attention=False) -> DecoderOutput`` —
  teacher forcing: ``tokens`` are the inputs ``[<bos> w1 .. wn <eos> <pad>..][:, :-1]``; logits at
  step t predict token t+1. Outputs are in input order (no sorting inside); padded steps are
  allowed and simply ignored by the loss.
* ``init_state(features (B,N,D)) -> State`` — everything ``step`` needs: per-image constants
  (region features, their projections, cross-attention keys/values) computed once, in
  ``State.static``; what changes per step (LSTM h/c, self-attention cache), in ``State.dynamic``.
* ``step(prev_tokens (B,), state) -> (log_probs (B,V), State, attention (B,N))`` — one decoding
  step; the new state's ``static`` is the very same dict as the input's (nothing per-image is
  recomputed or changed in place), its ``dynamic`` is new.

Search and sampling move batch rows with the ``State`` methods, never by looking inside a decoder's
state: ``select(index)`` when rows change image (an image's row repeated for its beams or samples,
finished images dropped) and ``reorder(index)`` when beams only move among the rows of their own
image, which leaves ``static`` alone: every row of an image holds the same constants, so there is
nothing to copy.

A decoder may also read a photo's concepts (``captioner.models.concepts``): :meth:`CaptionDecoder.add_concept_head`
gives it a frozen concept head (``concept_head``, always in eval mode, no gradient) and the vocabulary id
of each concept (``concept_ids``, a buffer); :meth:`CaptionDecoder.concept_probs` reads P(concept in image)
(B,K) from the regions. Training fills both from a concepts file (``captioner.training.detectors``), the
checkpoint carries them, and ``Caption.concepts`` lists a photo's top concepts from them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from captioner.errors import ConfigError
from captioner.models.concepts import SHARPNESS, ConceptHead


@dataclass
class DecoderOutput:
    """What ``forward`` returns.

    Attributes:
        logits: (B, T, V) unnormalised next-token scores.
        attention: (B, T, N) attention over regions for each step (the overlay view; for the
            Transformer the last layer's cross-attention averaged over heads). Always a distribution
            over the N regions: a decoder that also attends to other memory (the Transformer's concept
            tokens) drops those columns and renormalises.
        all_attention: (B, T, L, H, N) per-layer, per-head cross-attention (Transformer, when
            ``need_all_attention=True``), else None.
        sample_log_probs: (B, T) log-probability of the sampled region at each step (hard
            attention in training mode only), else None. Used by the REINFORCE term.
        attention_entropy: (B, T) entropy of the attention distribution at each step (nats), or None.
        aux: extra named tensors a decoder wants to expose (e.g. the gate beta, (B, T)).
    """

    logits: torch.Tensor
    attention: torch.Tensor | None = None
    all_attention: torch.Tensor | None = None
    sample_log_probs: torch.Tensor | None = None
    attention_entropy: torch.Tensor | None = None
    aux: dict[str, torch.Tensor] = field(default_factory=dict)


def reorder_nested(value: Any, index: torch.Tensor) -> Any:
    """Index-select dim 0 of every tensor inside dicts/lists/tuples; other values pass through."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, index.to(value.device)) if value.dim() > 0 else value
    if isinstance(value, dict):
        return {k: reorder_nested(v, index) for k, v in value.items()}
    if isinstance(value, list):
        return [reorder_nested(v, index) for v in value]
    if isinstance(value, tuple):
        return tuple(reorder_nested(v, index) for v in value)
    return value


@dataclass(frozen=True)
class State:
    """A decoder's state between steps; every tensor is batch-first (dim 0 = decoder row).

    Attributes:
        static: per-image constants from ``init_state`` (e.g. features (B,N,D), projected (B,N,A),
            memory_k / memory_v L x (B,H,N,dh)); ``step`` passes the same dict on. Rows of one image
            hold equal values.
        dynamic: what ``step`` replaces at every step (e.g. h, c (B,H); self_k / self_v
            L x (B,H,t,dh)); non-tensor values (a step counter) are shared by all rows.
    """

    static: dict[str, Any]
    dynamic: dict[str, Any]

    def select(self, index: torch.Tensor) -> State:
        """Rows ``index`` (B',) of everything: row i of the result is row ``index[i]``, of any image."""
        return State(reorder_nested(self.static, index), reorder_nested(self.dynamic, index))

    def reorder(self, index: torch.Tensor) -> State:
        """Rows ``index`` (B,) of ``dynamic``, ``static`` shared as it is.

        Only for moves within an image: row ``index[i]`` must show the same image as row i (beam
        search between steps), so the constants of row i are already right.
        """
        return State(self.static, reorder_nested(self.dynamic, index))


class CaptionDecoder(nn.Module):
    """Base class: subclasses implement ``forward``, ``init_state`` and ``step``."""

    vocab_size: int
    concepts: int = 0  # K, the concepts the decoder reads (add_concept_head); 0: none

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, need_all_attention: bool = False) -> DecoderOutput:
        raise NotImplementedError

    def init_state(self, features: torch.Tensor) -> State:
        raise NotImplementedError

    def step(self, prev_tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State, torch.Tensor]:
        raise NotImplementedError

    def add_concept_head(self, feature_dim: int, concepts: int, hidden_dim: int = 512, pooling: str = "lse",
                         sharpness: float = SHARPNESS) -> None:
        """Hold a frozen concept head over the raw regions and the vocabulary id of each of its K concepts.

        ``concept_head`` (a :class:`ConceptHead` of ``concepts`` outputs) never trains and is in eval mode
        whatever the decoder's mode; ``concept_ids`` (K,) is a buffer. Both start blank: their values come
        from a concepts file (``captioner.training.detectors.install_concepts``), then from the checkpoint.
        ``concepts=0``: nothing is added and :meth:`concept_probs` gives None.
        """
        self.concepts = concepts
        if not concepts:
            return
        self.concept_head = ConceptHead(feature_dim, [""] * concepts, hidden_dim, pooling=pooling,
                                        sharpness=sharpness).requires_grad_(False).eval()
        self.register_buffer("concept_ids", torch.zeros(concepts, dtype=torch.long))  # vocab id of each concept

    def add_concept_prior(self, width: int, concept_prior: bool) -> None:
        """The concept prior's pointer over the K concepts and "none", read from a state of ``width``
        (``concept_query``, W_q), and its learned weight lambda (``prior_scale``, from 1); needs the concepts."""
        if concept_prior and not self.concepts:
            raise ConfigError("decoder.concept_prior needs a decoder that reads concepts (train.concepts=FILE, "
                              "train.concept_input=true)")
        self.concept_prior = concept_prior
        if concept_prior:
            self.concept_query = nn.Linear(width, self.concepts + 1)  # W_q: K concepts, then "none"
            self.prior_scale = nn.Parameter(torch.ones(()))  # lambda

    def train(self, mode: bool = True) -> "CaptionDecoder":
        super().train(mode)
        if self.concepts:
            self.concept_head.eval()  # frozen: no dropout in training either
        return self

    def use_concept_folds(self, folds: Any) -> None:
        """Read concepts from ``folds`` (an ``OutOfFoldConcepts``: each training photo's fold head) while the
        decoder is in training mode; ``None``: always the frozen ``concept_head``. The fold heads are not
        part of the decoder's weights: validation, decoding and checkpoints see the full head only."""
        self.__dict__["_concept_folds"] = folds  # not a submodule: never saved, never moved by .to()

    def _concept_reader(self) -> Any:
        """What reads the photo's concepts now: the fold heads while training with them, else the head."""
        folds = self.__dict__.get("_concept_folds")
        return folds if self.training and folds is not None else self.concept_head

    def concept_probs(self, features: torch.Tensor) -> torch.Tensor | None:
        """P(concept in image) (B,K) from the raw region features (B,N,D), no gradient; None without concepts."""
        if not self.concepts:
            return None
        with torch.no_grad():
            return self._concept_reader().probs(features)

    def read_concepts(self, features: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, torch.Tensor] | None]:
        """What the decoder reads of the photo's concepts, from one pass of the frozen head over the raw
        regions (B,N,D), no gradient: P(concept in image) (B,K) (None without concepts) and, with the
        concept prior, its per-image constants (else None): log P(concept in image) ``concept_logp`` (B,K)
        and the concepts' maps ``concept_maps`` (B,K,N), in the features' dtype."""
        if not getattr(self, "concept_prior", False):
            return self.concept_probs(features), None
        with torch.no_grad():
            probs, maps = self._concept_reader().read(features)
        return probs, {"concept_logp": probs.clamp(min=1e-6).log().to(features.dtype),
                       "concept_maps": maps.to(features.dtype)}

    @staticmethod
    def concept_prior_map(pointer: torch.Tensor, logp: torch.Tensor, maps: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
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

    def derived_buffers(self) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        """The non-persistent buffers this module recomputes rather than stores: ``{attribute: fn}``.

        ``fn(t)`` gives the buffer's value from a tensor of its shape and dtype (a meta tensor when a
        checkpoint is loaded: ``captioner.checkpoint.store`` allocates the model empty, fills the
        stored weights and recomputes these). None here: a decoder that registers such a buffer
        says how to recompute it.
        """
        return {}

    def state_bytes_per_word(self) -> int:
        """Bytes one row's decoding state grows by per generated word (0: a state of fixed size, the LSTM).

        Search uses it to bound its memory before it starts (``captioner.decoding.search``).
        """
        return 0


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """Run a block with ``module`` in eval mode, then give it back the mode it had (even on an error)."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)
