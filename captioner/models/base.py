"""The interface every caption decoder keeps, so search, training and overlays never branch on type.

Shape legend: B batch, N regions (grid*grid), D feature width, T caption steps, V vocabulary,
L decoder layers, H attention heads.

A decoder is an ``nn.Module`` with ``forward`` (teacher forcing: logits at step t predict token t+1),
``init_state`` (per-image constants once, in ``State.static``) and ``step`` (a new ``State.dynamic``);
docs/architecture.md gives the contract. Search moves rows only through ``State``: ``select`` when rows
change image, ``reorder`` within an image, ``regroup`` for a decoder with ``groups_rows``.

An optional addition is one component, ``decoder.extension``, called at the named points of
:class:`SATExtension` / :class:`TransformerExtension`, whose defaults leave the paper's decoder.
Its weights sit under ``extension.`` in the ``state_dict``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class DecoderOutput:
    """What ``forward`` returns.

    Attributes:
        logits: (B, T, V) unnormalised next-token scores.
        attention: (B, T, N) the overlay view (Transformer: last layer's cross-attention, mean over
            heads), always a distribution over the N regions.
        all_attention: (B, T, L, H, N) per-layer, per-head cross-attention when asked, else None.
        sample_log_probs: (B, T) log-probability of the sampled region (hard attention, training).
        attention_entropy: (B, T) entropy of the attention at each step (nats), or None.
        aux: other named tensors (e.g. the gate beta, (B, T)).
    """

    logits: torch.Tensor
    attention: torch.Tensor | None = None
    all_attention: torch.Tensor | None = None
    sample_log_probs: torch.Tensor | None = None
    attention_entropy: torch.Tensor | None = None
    aux: dict[str, torch.Tensor] = field(default_factory=dict)


def map_rows(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to every tensor of at least one dimension inside dicts/lists/tuples (its dim 0 is
    the row); 0-d tensors and other values pass through."""
    if isinstance(value, torch.Tensor):
        return fn(value) if value.dim() > 0 else value
    if isinstance(value, dict):
        return {k: map_rows(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [map_rows(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(map_rows(v, fn) for v in value)
    return value


def reorder_nested(value: Any, index: torch.Tensor) -> Any:
    """Index-select dim 0 of every tensor inside dicts/lists/tuples; other values pass through."""
    return map_rows(value, lambda t: t.index_select(0, index.to(t.device)))


@dataclass(frozen=True)
class State:
    """A decoder's state between steps; every tensor is batch-first.

    Attributes:
        static: per-image constants from ``init_state``, passed on unchanged by ``step``.
        dynamic: what ``step`` replaces (e.g. h, c; self_k / self_v); non-tensors are shared by all rows.
        group: decoder rows per row of ``static``: dynamic row r reads static row ``r // group``
            (above 1 only for a decoder whose ``groups_rows`` is True).
        outputs: what the step that made this state reports of its rows besides the scores (the extension's
            ``word_scores`` outputs, e.g. ``copy_share`` (R, W')); read by the search right after the step,
            not carried by ``select``, ``reorder`` or ``regroup``.
    """

    static: dict[str, Any]
    dynamic: dict[str, Any]
    group: int = 1
    outputs: dict[str, Any] = field(default_factory=dict)

    def select(self, index: torch.Tensor) -> State:
        """Rows ``index`` (B',) of everything: row i of the result is row ``index[i]``, of any image."""
        if self.group != 1:
            raise ValueError("State.select on a grouped state: use regroup")
        return State(reorder_nested(self.static, index), reorder_nested(self.dynamic, index))

    def reorder(self, index: torch.Tensor) -> State:
        """Rows ``index`` (B,) of ``dynamic``, ``static`` shared: only for moves within an image."""
        return State(self.static, reorder_nested(self.dynamic, index), self.group)

    def regroup(self, images: torch.Tensor | None, rows: torch.Tensor, group: int) -> State:
        """Static rows ``images`` (None: all, nothing copied) and dynamic ``rows``, ``group`` decoder rows per static row."""
        static = self.static if images is None else reorder_nested(self.static, images)
        return State(static, reorder_nested(self.dynamic, rows), group)


def expand_groups(value: Any, group: int) -> Any:
    """Every tensor inside dicts/lists/tuples with each row repeated ``group`` times (a grouped
    state's per-image constants, one row per decoder row); 1 returns ``value`` itself."""
    if group == 1:
        return value
    return map_rows(value, lambda t: t.repeat_interleave(group, dim=0))


class CaptionDecoder(nn.Module):
    """Base class: subclasses implement ``forward``, ``init_state`` and ``step``, and set ``self.extension``."""

    vocab_size: int
    groups_rows: bool = False  # True: ``step`` reads a grouped ``State`` (``State.group`` > 1)

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, need_all_attention: bool = False) -> DecoderOutput:
        raise NotImplementedError

    def init_state(self, features: torch.Tensor) -> State:
        raise NotImplementedError

    def step(self, prev_tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State, torch.Tensor]:
        raise NotImplementedError

    def derived_buffers(self) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        """The non-persistent buffers recomputed rather than stored: ``{attribute: fn(tensor of its shape) -> value}``."""
        return {}

    def state_bytes_per_word(self) -> int:
        """Bytes one row's decoding state grows by per word (0: fixed size), for search's memory bound."""
        return 0


class WrappedDecoder(CaptionDecoder):
    """A decoder whose steps another one makes (a search-time wrapper: fusion, a logit filter): it reads as
    the wrapped ``decoder`` (vocabulary, extension, grouping, state size) and never switches its mode."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder
        self.vocab_size = decoder.vocab_size
        self.training = decoder.training  # not .train(): that would switch shared parts' dropout on

    @property
    def extension(self) -> nn.Module | None:  # type: ignore[override]
        return getattr(self.decoder, "extension", None)

    @property
    def groups_rows(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.decoder, "groups_rows", False))

    def state_bytes_per_word(self) -> int:
        return self.decoder.state_bytes_per_word() if hasattr(self.decoder, "state_bytes_per_word") else 0


class DecoderExtension(nn.Module):
    """An optional addition to a decoder, called at the named points its family declares (the subclasses).

    Every point's default leaves the decoder as its paper wrote it. The points shared by both families:
    """

    def derived_buffers(self) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        """The non-persistent buffers recomputed rather than stored, as ``CaptionDecoder.derived_buffers``."""
        return {}

    def read(self, features: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-image constants from the regions as the encoder gave them (B,N,D), read once per image and
        kept in ``State.static`` (flat: the names must not clash with the decoder's own)."""
        return {}

    def regions(self, features: torch.Tensor) -> torch.Tensor:
        """The regions (B,N,D) the decoder attends over, from what the encoder gave (B,N,D') (default: all of it)."""
        return features

    def word_scores(self, logits: torch.Tensor, hidden: torch.Tensor, static: dict[str, torch.Tensor]
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The decoder's next-word scores (B[,T],V), from its logits and the state they were read from (B[,T],M)
        and :meth:`read`'s constants (B,...): logits, or log-probabilities (default: the logits); and named
        per-row outputs a step reports in ``State.outputs`` (default: none)."""
        return logits, {}

    def aux(self, static: dict[str, torch.Tensor], records: list[Any]) -> dict[str, torch.Tensor]:
        """Named outputs for ``DecoderOutput.aux`` after a teacher-forced pass, from :meth:`read`'s constants
        and what the attention points returned (in the order they were called)."""
        return {}


class SATExtension(DecoderExtension):
    """The points of ``captioner.models.lstm.SATDecoder`` (h: LSTM width H, M: word embedding width)."""

    def initial_state(self, static: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """(B, 2H) added to ``[init_h(mean f); init_c(mean f)]`` before the tanh, or None."""
        return None

    def query_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Weight (R, H) and bias (R,) of R rows read from ``h_{t-1}`` at every step (fused into the
        decoder's one per-step matmul of h), or None."""
        return None

    def word_query(self, emb: torch.Tensor) -> torch.Tensor | None:
        """What is read from the previous word's embedding (..., M) -> (..., R), or None."""
        return None

    def filter_attention(self, log_alpha: torch.Tensor, query: torch.Tensor | None, word: torch.Tensor | None,
                         static: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """One step's attention log alpha (B,N) -> (log alpha (B,N), a record for :meth:`aux` or None), given
        the rows read from h (B,R) and from the previous word (B,R)."""
        return log_alpha, None

    def output(self, static: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """(B, M) added to the deep output ``E y + L_h h + L_z z`` before ``L_o``, or None."""
        return None


class TransformerExtension(DecoderExtension):
    """The points of ``captioner.models.transformer.TransformerCaptionDecoder`` (d: model width)."""

    def memory(self, static: dict[str, torch.Tensor], embed: nn.Embedding) -> torch.Tensor | None:
        """Tokens (B, S', d) appended to the memory after the N regions (every layer's cross-attention reads
        them; the attention the decoder reports stays over the regions), or None."""
        return None

    def cross_bias(self, h: torch.Tensor, static: dict[str, torch.Tensor], memory_size: int
                   ) -> tuple[torch.Tensor | None, Any]:
        """The last layer's cross-attention: normed token states (B,T,d) -> (a bias (B,1,T,S) of its scores
        or None, a record for :meth:`aux` or None)."""
        return None, None


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """Run a block with ``module`` in eval mode, then give it back the mode it had (even on an error)."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)
