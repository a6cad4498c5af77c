"""The SAT training step (forward, loss, backward) as one CUDA graph per shape (``train.cuda_graph``).

Shape legend: B batch, N regions, D feature width, L tokens of a batch (``<bos>`` .. ``<eos>``, padded),
S = L - 1 decoder steps, S' its bucket (S rounded up to a multiple of ``multiple``), V vocabulary.

Why: the word-by-word recurrence issues a few dozen small kernels per word; at batch 32 the GPU waits
on the CPU to launch them. A CUDA graph records every kernel of one step once and replays them with
one launch. Graphs need fixed shapes and fixed addresses, so each batch is copied into static buffers
of its bucket: features (B,N,D) and tokens (B,S'+1), the steps beyond the batch's own filled with
``<pad>``. The loss ignores ``<pad>`` targets everywhere (cross-entropy, doubly stochastic penalty,
REINFORCE, entropy bonus) and the recurrence is causal, so the padded steps change neither the loss
nor any gradient (up to float summation order). One graph per ``(B, N, D, S')`` is captured the
first time that shape comes and replayed for every later batch of it; ``max_graphs`` bounds their
number (their activations stay allocated), and shapes beyond it, or whose capture fails, run
eagerly on the same buffers (logged once).

Why ``torch.cuda.graphs`` and not ``torch.compile(mode="reduce-overhead")``: compiling forward and
backward of the unrolled time loop takes minutes per bucket (and again for each new bucket), while
capturing takes a few eager steps; the eager kernels are already the fused ones of
:class:`~captioner.models.lstm.SATDecoder`, so the graph removes the launch cost without changing the
arithmetic: the captured step computes exactly what the eager step computes on the same buffers.

The optimizer step stays outside the graph (a handful of fused ``foreach`` launches), so learning
rate schedules, clipping and ``train.skip_nonfinite`` work unchanged. Gradients land in the graph's
own ``.grad`` tensors; :meth:`GraphedStep.__call__` points every parameter's ``.grad`` at the
bucket's tensors before the optimizer reads them.

Under ``train.amp=bf16`` the autocast casts are captured too (``cache_enabled=False``, as CUDA graphs
require), so they cost no launches; the weights stay fp32 (the optimizer's master copy).
On the CPU the same wrapper runs the padded static-buffer path eagerly (``capture=False``): the
tests check it against the plain step there.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from captioner.cuda_graphs import record_graph
from captioner.errors import ConfigError
from captioner.losses import LossResult
from captioner.training.objective import Batch, TrainModel

log = logging.getLogger(__name__)

BUCKET_MULTIPLE = 8  # decoder steps are padded up to a multiple of this
MAX_GRAPHS = 8  # graphs kept per GraphedStep; shapes beyond run eagerly
WARMUP_STEPS = 3  # eager steps on a side stream before a capture (lazy cuBLAS / autograd set-up)


def bucket_steps(steps: int, multiple: int = BUCKET_MULTIPLE) -> int:
    """Decoder steps padded up to a multiple of ``multiple`` (at least one bucket)."""
    if multiple < 1:
        raise ConfigError(f"bucket multiple must be >= 1, got {multiple}")
    return max(multiple, math.ceil(steps / multiple) * multiple)


@dataclass
class GraphStats:
    """What a :class:`GraphedStep` did: graphs captured, replays, eager steps, failed captures."""

    captures: int = 0
    replays: int = 0
    eager_steps: int = 0
    failed: int = 0
    buckets: dict[tuple[int, ...], int] = field(default_factory=dict)  # shape key -> steps run with it

    def as_dict(self) -> dict[str, Any]:
        return {"captures": self.captures, "replays": self.replays, "eager_steps": self.eager_steps,
                "failed_captures": self.failed,
                "buckets": {"x".join(map(str, k)): v for k, v in sorted(self.buckets.items())}}


@dataclass
class _Entry:
    """Static buffers of one shape and, once captured, its graph and outputs."""

    features: torch.Tensor  # (B, N, D)
    tokens: torch.Tensor  # (B, S'+1) long
    image_index: torch.Tensor  # (B,) long, -1 when the caller gave none
    graph: Any = None  # torch.cuda.CUDAGraph
    stats: torch.Tensor | None = None  # (2 + terms,) total, objective, terms (static output of the graph)
    keys: list[str] = field(default_factory=list)
    grads: list[torch.Tensor | None] = field(default_factory=list)
    eager: bool = False  # capture failed or graphs ran out: run eagerly on the buffers


class GraphedStep:
    """Forward, loss and backward of ``decoder`` on padded static buffers, captured per shape on CUDA.

    Args:
        decoder: the trained decoder (``forward(features, tokens)``; the SAT decoders).
        criterion: the training objective (``CrossEntropy``: ``loss(model, batch)``) or a bare
            ``CaptionLoss`` (``criterion(output, targets)``); its targets ignore ``pad_id``.
        pad_id: the ``<pad>`` id the padding uses (the loss's).
        autocast_dtype: run forward and loss under autocast of this dtype (None: fp32).
        multiple: bucket steps to a multiple of this.
        max_graphs: at most this many captured shapes.
        capture: capture CUDA graphs (default: when the decoder's parameters are on a CUDA device).
    """

    def __init__(self, decoder: nn.Module, criterion: nn.Module, pad_id: int, autocast_dtype: torch.dtype | None = None,
                 multiple: int = BUCKET_MULTIPLE, max_graphs: int = MAX_GRAPHS, capture: bool | None = None) -> None:
        params = [p for p in decoder.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("train.cuda_graph: the decoder has no trainable parameters")
        self.device = params[0].device
        if capture is None:
            capture = self.device.type == "cuda"
        if capture and self.device.type != "cuda":
            raise ConfigError(f"train.cuda_graph needs a CUDA device (the decoder is on {self.device})")
        if max_graphs < 0:
            raise ConfigError(f"max_graphs must be >= 0, got {max_graphs}")
        bucket_steps(1, multiple)  # checks multiple
        self.decoder, self.criterion, self.pad_id = decoder, criterion, pad_id
        self.params = params
        self.autocast_dtype = autocast_dtype
        self.multiple, self.max_graphs, self.capture = multiple, max_graphs, capture
        self.stats = GraphStats()
        self._entries: dict[tuple[int, ...], _Entry] = {}

    # ------------------------------------------------------------------ the step

    def key(self, features: torch.Tensor, tokens: torch.Tensor) -> tuple[int, int, int, int]:
        """``(B, N, D, S')`` of a batch: features (B,N,D), tokens (B,L)."""
        if features.dim() != 3 or tokens.dim() != 2 or features.shape[0] != tokens.shape[0]:
            raise ValueError(f"features {tuple(features.shape)} and tokens {tuple(tokens.shape)}: "
                             "expected (B, N, D) and (B, L)")
        if tokens.shape[1] < 2:
            raise ValueError(f"tokens {tuple(tokens.shape)}: a caption needs <bos> and at least one target")
        B, N, D = features.shape
        return B, N, D, bucket_steps(tokens.shape[1] - 1, self.multiple)

    def __call__(self, features: torch.Tensor, tokens: torch.Tensor,
                 image_index: torch.Tensor | None = None) -> LossResult:
        """One batch: features (B,N,D), tokens (B,L) ``[<bos> w.. <eos> <pad>..]``, image_index (B,).

        Leaves the gradients in every parameter's ``.grad`` (the caller clips and steps; it must not
        zero them to None between this call and the optimizer step) and returns the batch's loss.
        """
        key = self.key(features, tokens)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._new_entry(key, features.dtype)
        self._fill(entry, features, tokens, image_index)
        self.stats.buckets[key] = self.stats.buckets.get(key, 0) + 1
        if entry.graph is None and not entry.eager:
            self._capture(key, entry)
        if entry.graph is not None:
            entry.graph.replay()
            self.stats.replays += 1
            for p, g in zip(self.params, entry.grads):
                p.grad = g
            stats = entry.stats.clone()  # the next replay overwrites the graph's own outputs
            keys = entry.keys
        else:
            stats, keys = self._eager(entry)
        return LossResult(total=stats[0], objective=stats[1], terms=dict(zip(keys, stats[2:].unbind())),
                          captions=key[0])

    @property
    def graphs(self) -> int:
        """Graphs held now."""
        return sum(e.graph is not None for e in self._entries.values())

    # ------------------------------------------------------------------ pieces

    def _new_entry(self, key: tuple[int, ...], dtype: torch.dtype) -> _Entry:
        B, N, D, steps = key
        entry = _Entry(torch.zeros(B, N, D, dtype=dtype, device=self.device),
                       torch.full((B, steps + 1), self.pad_id, dtype=torch.long, device=self.device),
                       torch.full((B,), -1, dtype=torch.long, device=self.device))
        held = sum(not e.eager for e in self._entries.values())
        if not self.capture or held >= self.max_graphs:
            entry.eager = True
            if self.capture:
                log.warning("train.cuda_graph: %d graphs held; batches of shape %s run eagerly", held, key)
        self._entries[key] = entry
        return entry

    def _fill(self, entry: _Entry, features: torch.Tensor, tokens: torch.Tensor,
              image_index: torch.Tensor | None) -> None:
        """Copy a batch into the entry's buffers; the steps beyond it become ``<pad>``."""
        L = tokens.shape[1]
        entry.features.copy_(features, non_blocking=True)
        if image_index is not None:
            entry.image_index.copy_(image_index, non_blocking=True)
        entry.tokens[:, :L].copy_(tokens, non_blocking=True)
        if L < entry.tokens.shape[1]:
            entry.tokens[:, L:].fill_(self.pad_id)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        # the cast cache must be off under capture (cached casts would outlive the graph's pool)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=False)

    def _forward_backward(self, entry: _Entry) -> tuple[torch.Tensor, list[str]]:
        """Loss and gradients on the entry's buffers: the work a graph records."""
        with self._autocast():
            if hasattr(self.criterion, "loss"):  # a training objective: its extra terms too
                batch = Batch(entry.features, entry.tokens, entry.image_index)
                result = self.criterion.loss(TrainModel(self.decoder, self.decoder), batch)
            else:
                out = self.decoder(entry.features, entry.tokens[:, :-1])  # logits (B, S', V)
                result = self.criterion(out, entry.tokens[:, 1:])
        keys = sorted(result.terms)
        stats = torch.stack([result.total.detach().float(), result.objective.float(),
                             *(result.terms[k].float() for k in keys)])  # (2 + terms,)
        result.total.backward()
        return stats, keys

    def _clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def _eager(self, entry: _Entry) -> tuple[torch.Tensor, list[str]]:
        self._clear_grads()
        self.stats.eager_steps += 1
        return self._forward_backward(entry)

    def _capture(self, key: tuple[int, ...], entry: _Entry) -> None:
        """Warm up on a side stream, then record the step; a failure leaves the shape eager (logged)."""
        saved = {k: v.detach().clone() for k, v in self.criterion.state_dict().items()}
        try:
            recorded = record_graph(lambda: self._forward_backward(entry), self.device, warmup=WARMUP_STEPS,
                                    before=self._clear_grads)
        finally:
            # warm-up steps ran for real: give the loss its moving averages back (REINFORCE baseline)
            with torch.no_grad():
                for k, v in self.criterion.state_dict().items():
                    if k in saved:
                        v.copy_(saved[k])
        if recorded.graph is None:  # this shape runs eagerly, reported
            entry.eager, entry.graph = True, None
            self.stats.failed += 1
            log.warning("train.cuda_graph: capturing shape %s failed (%s); it runs eagerly", key,
                        recorded.failure[:200])
            self._clear_grads()
            return
        graph, (stats, keys) = recorded.graph, recorded.out
        entry.graph, entry.stats, entry.keys = graph, stats, keys
        entry.grads = [p.grad for p in self.params]
        self.stats.captures += 1
        log.info("train.cuda_graph: captured shape (B %d, N %d, D %d, %d steps); %d graph(s)", *key,
                 self.stats.captures)


def check_cuda_graph(train_cfg: Any, decoder_name: str, on_features: bool, device: torch.device,
                     distributed: bool) -> None:
    """Refuse ``train.cuda_graph`` where it cannot run, with one line saying why."""
    if device.type != "cuda":
        raise ConfigError(f"train.cuda_graph needs a CUDA device (training on {device}); set it to false")
    if decoder_name != "sat":
        raise ConfigError(f"train.cuda_graph captures the SAT decoders' step; decoder {decoder_name!r} is not one")
    if not on_features:
        raise ConfigError("train.cuda_graph needs cached features (data.feature_cache=true, a frozen encoder)")
    if distributed:
        raise ConfigError("train.cuda_graph runs on one process; it is not supported under torchrun")
    if train_cfg.objective != "xe":
        raise ConfigError(f"train.cuda_graph captures the cross-entropy step; train.objective={train_cfg.objective!r}")
    if train_cfg.compile:
        raise ConfigError("train.cuda_graph and train.compile are alternatives; set one of them to false")
    if train_cfg.attention_supervision:
        raise ConfigError("train.cuda_graph does not capture train.attention_supervision (its box targets are built "
                          "per batch on the host); set one of them to 0/false")
    if train_cfg.amp == "fp16" or (train_cfg.amp == "auto" and not torch.cuda.is_bf16_supported()):
        raise ConfigError("train.cuda_graph does not capture fp16 with a gradient scaler; use train.amp=bf16 or off")
