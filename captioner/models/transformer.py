"""Transformer caption decoder (Vaswani et al. 2017) with cross-attention over image regions.

Shape legend: B batch, N regions (= g*g), D feature width, T caption steps, V vocabulary,
d model width, L layers, H heads, dh = d // H, t tokens decoded so far, Tq/Tk query/key steps.

Pre-norm blocks written by hand (``nn.TransformerDecoderLayer`` cannot return cross-attention
weights)::

    x = x + Drop(SelfAttn(LN(x)))          causal, fused kernel
    x = x + Drop(CrossAttn(LN(x), memory)) memory = LN(Linear(features)) + row/col embedding
    x = x + Drop(FFN(LN(x)))

The overlay view ``attention`` is the last layer's cross-attention averaged over heads; only that
layer takes the manual (weight-returning) path unless ``need_all_attention=True``; the others use
``scaled_dot_product_attention``. Both compute softmax(Q K^T / sqrt(dh)) V.

``init_state`` projects the regions to keys/values once per image (``State.static``); ``step``
keeps a key/value cache of the self-attention (``State.dynamic``). No key-padding mask is needed:
padding sits after ``<eos>`` and causal attention never looks ahead.

An optional ``self.extension`` (:class:`~captioner.models.base.TransformerExtension`) may append
memory tokens after the N regions (the reported attention stays over the regions:
:meth:`TransformerCaptionDecoder.region_weights`), bias the last layer's cross-attention, add ``aux``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from captioner.config import TransformerConfig
from captioner.data.images import attention_entropy
from captioner.errors import ConfigError
from captioner.models.base import CaptionDecoder, DecoderOutput, State, TransformerExtension
from captioner.models.registry import register_decoder

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values: (B, H, S, dh) each


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention with H heads (dividing ``d_model``) over a ``kv_dim``-wide source."""

    def __init__(self, d_model: int, num_heads: int, kv_dim: int | None = None) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ConfigError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.kv_proj = nn.Linear(kv_dim or d_model, 2 * d_model)  # keys and values in one matmul
        self.out_proj = nn.Linear(d_model, d_model)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, dh)

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """Queries: (B, Tq, d) -> (B, H, Tq, dh)."""
        return self._split(self.q_proj(x))

    def project_kv(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values: (B, Tk, kv_dim) -> two (B, H, Tk, dh) tensors."""
        k, v = self.kv_proj(source).chunk(2, dim=-1)  # (B, Tk, d) each
        return self._split(k), self._split(v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
               need_weights: bool = False,
               bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend (B, H, Tq, dh) queries to (B, H, Tk, dh) keys/values: (output (B, Tq, d), weights or None).

        ``causal``: query i sees keys 0..i only (Tq == Tk). ``need_weights``: the manual path, returning
        (B, H, Tq, Tk) weights. ``bias``: (B, 1, Tq, Tk) added to the scores (not with ``causal``).
        """
        if causal and q.shape[2] != k.shape[2]:
            raise ValueError(f"causal attention needs Tq == Tk, got {q.shape[2]} and {k.shape[2]}")
        weights = None
        if need_weights:
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, H, Tq, Tk)
            if causal:
                t = q.shape[2]
                future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)  # (Tq, Tk)
                scores = scores.masked_fill(future, float("-inf"))
            if bias is not None:
                scores = scores + bias
            weights = scores.softmax(dim=-1)  # (B, H, Tq, Tk)
            out = weights @ v  # (B, H, Tq, dh)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal)  # (B, H, Tq, dh)
        b, _, t, _ = out.shape
        out = out.transpose(1, 2).reshape(b, t, self.d_model)  # (B, Tq, d)
        return self.out_proj(out), weights

    def forward(self, x: torch.Tensor, source: torch.Tensor | None = None, causal: bool = False,
                need_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend ``x`` (B, Tq, d) to ``source`` (B, Tk, kv_dim) (self-attention when None)."""
        k, v = self.project_kv(x if source is None else source)  # (B, H, Tk, dh) each
        return self.attend(self.project_q(x), k, v, causal=causal, need_weights=need_weights)


def sinusoidal_positions(length: int, dim: int, device: torch.device | None = None) -> torch.Tensor:
    """Sinusoidal position table (length, dim): sin on even, cos on odd channels."""
    pos = torch.arange(length, dtype=torch.float32, device=device)[:, None]  # (length, 1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32, device=device) * (-math.log(10000.0) / dim))
    angles = pos * freq  # (length, ceil(dim/2))
    table = torch.zeros(length, dim, device=device)
    table[:, 0::2] = angles.sin()
    table[:, 1::2] = angles.cos()[:, : dim // 2]
    return table


class RegionEmbedding(nn.Module):
    """Region features -> memory: LN(Linear(features)) + row embedding + column embedding."""

    def __init__(self, feature_dim: int, d_model: int, grid: int) -> None:
        super().__init__()
        self.feature_dim = feature_dim
        self.grid = grid
        self.proj = nn.Linear(feature_dim, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.row = nn.Embedding(grid, d_model)
        self.col = nn.Embedding(grid, d_model)
        nn.init.normal_(self.row.weight, std=0.02)
        nn.init.normal_(self.col.weight, std=0.02)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features (B, N, D) -> memory (B, N, d)."""
        if features.dim() != 3:
            raise ConfigError(f"features must be (B, N, D), got shape {tuple(features.shape)}")
        n, dim = features.shape[1:]
        if n != self.grid**2 or dim != self.feature_dim:
            raise ConfigError(f"features of shape (N={n}, D={dim}) do not match the decoder "
                              f"(grid {self.grid} -> N={self.grid ** 2}, D={self.feature_dim})")
        idx = torch.arange(n, device=features.device)  # (N,)
        pos = self.row(idx // self.grid) + self.col(idx % self.grid)  # (N, d)
        return self.norm(self.proj(features)) + pos  # (B, N, d)


class DecoderBlock(nn.Module):
    """One pre-norm block: causal self-attention, cross-attention over regions, feed-forward."""

    def __init__(self, d_model: int, num_heads: int, ff_dim: int, dropout: float) -> None:
        super().__init__()
        self.ln_self = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(d_model, num_heads)
        self.ln_cross = nn.LayerNorm(d_model)
        self.cross_attn = MultiHeadAttention(d_model, num_heads)
        self.ln_ff = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, ff_dim), nn.ReLU(), nn.Linear(ff_dim, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, memory: KV, past: KV | None = None, need_weights: bool = False,
        cross_bias: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, KV]:
        """Run the block on (B, T, d) token states (T = 1 when ``past`` is given).

        Args:
            memory: this layer's memory keys/values, (B, H, S, dh) each (S = N + the extension's tokens).
            past: cached self-attention keys/values of earlier steps, (B, H, t, dh) each.
            cross_bias: normed token states (B, T, d) -> a (B, 1, T, S) bias of the cross-attention scores.

        Returns:
            (x (B, T, d), cross weights (B, H, T, S) or None, self keys/values incl. this step).
        """
        h = self.ln_self(x)  # (B, T, d)
        q = self.self_attn.project_q(h)  # (B, H, T, dh)
        k, v = self.self_attn.project_kv(h)  # (B, H, T, dh) each
        if past is not None:
            k = torch.cat([past[0], k], dim=2)  # (B, H, t+1, dh)
            v = torch.cat([past[1], v], dim=2)  # (B, H, t+1, dh)
        a, _ = self.self_attn.attend(q, k, v, causal=past is None)  # (B, T, d)
        x = x + self.drop(a)
        h = self.ln_cross(x)  # (B, T, d)
        bias = cross_bias(h) if cross_bias is not None else None
        c, weights = self.cross_attn.attend(self.cross_attn.project_q(h), *memory, need_weights=need_weights,
                                            bias=bias)
        x = x + self.drop(c)  # (B, T, d)
        x = x + self.drop(self.ff(self.ln_ff(x)))  # (B, T, d)
        return x, weights, (k, v)


@register_decoder(TransformerConfig)
class TransformerCaptionDecoder(CaptionDecoder):
    """Transformer decoder over g x g image regions (``vocab_size`` .. ``num_heads``: V, D, g, d, L, H).

    ``dropout``: on embeddings, memory and every residual branch; ``max_len``: the precomputed position
    table's length (longer captions extend it); ``extension``: None gives the paper's decoder.
    """

    def __init__(self, vocab_size: int, feature_dim: int, grid: int, d_model: int = 512, num_layers: int = 3,
                 num_heads: int = 8, ff_dim: int = 2048, dropout: float = 0.1, max_len: int = 50,
                 tie_embeddings: bool = False, extension: TransformerExtension | None = None) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ConfigError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.max_len = max_len
        self.regions = RegionEmbedding(feature_dim, d_model, grid)
        self.embed = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.embed.weight, std=d_model**-0.5)  # x sqrt(d) -> unit scale
        self.embed_scale = math.sqrt(d_model)
        # <bos> + max_len words (+1 spare); not saved in checkpoints, rebuilt from the arguments.
        self.register_buffer("positions", sinusoidal_positions(max_len + 2, d_model), persistent=False)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(DecoderBlock(d_model, num_heads, ff_dim, dropout) for _ in range(num_layers))
        self.ln_final = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab_size)
        if tie_embeddings:
            self.out.weight = self.embed.weight
        self.extension = extension if extension is not None else TransformerExtension()  # default: every point a no-op

    def derived_buffers(self) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        """``positions`` is not stored in checkpoints: the sinusoidal table of its shape."""
        return {"positions": lambda table: sinusoidal_positions(table.shape[0], table.shape[1])}

    # ------------------------------------------------------------------ shared pieces

    def _embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """tokens (B, T) at positions start.. -> (B, T, d)."""
        end = start + tokens.shape[1]
        table = self.positions
        if end > table.shape[0]:
            table = sinusoidal_positions(end, self.d_model, device=table.device)
        x = self.embed(tokens) * self.embed_scale + table[start:end].to(self.embed.weight.dtype)  # (B, T, d)
        return self.drop(x)

    def _memory(self, features: torch.Tensor, extra: dict[str, torch.Tensor]) -> list[KV]:
        """Project the memory once: per layer (keys, values), (B, H, S, dh) each."""
        memory = self.regions(self.extension.regions(features))  # (B, N, d)
        tokens = self.extension.memory(extra, self.embed)  # (B, T, d) or None
        if tokens is not None:
            memory = torch.cat([memory, tokens.to(memory.dtype)], dim=1)  # (B, N + T, d)
        memory = self.drop(memory)
        # contiguous once here, so the per-step matmuls do not copy them at every step
        return [tuple(t.contiguous() for t in block.cross_attn.project_kv(memory)) for block in self.blocks]

    def region_weights(self, weights: torch.Tensor) -> torch.Tensor:
        """Cross-attention weights (..., S) -> over the N regions (..., N), memory tokens dropped, renormalised."""
        n = self.regions.grid**2
        if weights.shape[-1] == n:
            return weights
        regions = weights[..., :n]
        return regions / regions.sum(-1, keepdim=True).clamp_min(torch.finfo(regions.dtype).tiny)

    def _run(
        self, x: torch.Tensor, memory: list[KV], pasts: list[KV] | None, need_all: bool,
        extra: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[KV], list[Any]]:
        """Blocks + final norm. Returns (h (B, T, d), cross weights over the regions per layer that
        returned them (B, H, T, N), new self-attention keys/values per layer, the extension's records)."""
        weights, presents, records = [], [], []

        def extension_bias(h: torch.Tensor) -> torch.Tensor | None:  # the last layer's, from the extension
            bias, record = self.extension.cross_bias(h, extra, memory[-1][0].shape[2])
            if record is not None:
                records.append(record)
            return bias

        for i, block in enumerate(self.blocks):
            last = i == self.num_layers - 1
            x, w, kv = block(x, memory[i], None if pasts is None else pasts[i], need_weights=need_all or last,
                             cross_bias=extension_bias if last else None)
            if w is not None:
                weights.append(self.region_weights(w))
            presents.append(kv)
        return self.ln_final(x), weights, presents, records

    # ------------------------------------------------------------------ CaptionDecoder API

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, need_all_attention: bool = False) -> DecoderOutput:
        """Teacher forcing on (B, T) inputs ``[<bos> w1 .. wn <eos> <pad>..][:, :-1]``.

        Returns ``DecoderOutput`` with logits (B, T, V), attention (B, T, N), attention_entropy (B, T),
        all_attention (B, T, L, H, N) when ``need_all_attention``, and the extension's ``aux``.
        """
        extra = self.extension.read(features)  # from the regions as given
        memory = self._memory(features, extra)  # L x (B, H, S, dh)
        h, weights, _, records = self._run(self._embed(tokens, 0), memory, None, need_all_attention, extra)  # (B,T,d)
        logits, _ = self.extension.word_scores(self.out(h), h, extra)  # (B, T, V)
        attention = weights[-1].mean(dim=1)  # (B, T, N)
        all_attention = None
        if need_all_attention:
            all_attention = torch.stack(weights, dim=1).permute(0, 3, 1, 2, 4)  # (B, T, L, H, N)
        aux = self.extension.aux(extra, records)
        return DecoderOutput(logits=logits, attention=attention, all_attention=all_attention,
                             attention_entropy=attention_entropy(attention), aux=aux)

    def init_state(self, features: torch.Tensor, use_cache: bool = True) -> State:
        """Project the regions once and start empty caches.

        ``use_cache=False`` re-runs the whole prefix at every step (same outputs; a benchmark's baseline).
        The state holds static ``memory_k``/``memory_v`` (L x (B, H, S, dh)) and the extension's constants,
        and dynamic ``self_k``/``self_v`` (L x (B, H, t, dh)) or ``prefix`` (B, t), and ``step``.
        """
        extra = self.extension.read(features)
        memory = self._memory(features, extra)
        b = features.shape[0]
        static = {"memory_k": [k for k, _ in memory], "memory_v": [v for _, v in memory], **extra}
        dynamic: dict[str, Any] = {"step": 0}
        if use_cache:
            empty = memory[0][0].new_zeros(b, self.num_heads, 0, self.d_model // self.num_heads)  # (B, H, 0, dh)
            dynamic["self_k"] = [empty] * self.num_layers
            dynamic["self_v"] = [empty] * self.num_layers
        else:
            dynamic["prefix"] = torch.zeros(b, 0, dtype=torch.long, device=features.device)  # (B, 0)
        return State(static, dynamic)

    def state_bytes_per_word(self) -> int:
        """The self-attention cache: a key and a value of width d per layer and word."""
        return 2 * self.num_layers * self.d_model * self.embed.weight.element_size()

    def step(self, prev_tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State, torch.Tensor]:
        """One step: prev_tokens (B,) -> (log_probs (B, V), new state, attention (B, N) of the last layer, mean over heads)."""
        memory = list(zip(state.static["memory_k"], state.static["memory_v"]))
        past = state.dynamic
        dynamic: dict[str, Any] = {"step": past["step"] + 1}
        if "prefix" in past:  # uncached: re-run every earlier token
            prefix = torch.cat([past["prefix"], prev_tokens[:, None]], dim=1)  # (B, t+1)
            h, weights, _, _ = self._run(self._embed(prefix, 0), memory, None, False, state.static)  # (B, t+1, d)
            dynamic["prefix"] = prefix
        else:
            x = self._embed(prev_tokens[:, None], past["step"])  # (B, 1, d)
            pasts = list(zip(past["self_k"], past["self_v"]))
            h, weights, presents, _ = self._run(x, memory, pasts, False, state.static)  # (B, 1, d)
            dynamic["self_k"] = [k for k, _ in presents]  # L x (B, H, t+1, dh)
            dynamic["self_v"] = [v for _, v in presents]
        last = h[:, -1]  # (B, d)
        scores, outputs = self.extension.word_scores(self.out(last), last, state.static)
        attention = weights[-1][:, :, -1].mean(dim=1)  # (B, N)
        return F.log_softmax(scores.float(), dim=-1), State(state.static, dynamic, outputs=outputs), attention
