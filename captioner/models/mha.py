"""Multi-head attention that can return its weights (for overlays) or take the fused fast path.

Shape legend: B batch, Tq query steps, Tk key steps (tokens for self-attention, N regions for
cross-attention), d model width, H heads, dh = d // H head width.

Two paths compute the same thing, softmax(Q K^T / sqrt(dh)) V:

* fused: ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient kernels
  where available); it cannot return the weights;
* manual: explicit scores and softmax, returning the weights (B, H, Tq, Tk).

Keys/values are projected by ``project_kv`` so a caller can compute them once (e.g. the image
regions of a cross-attention layer, once per image) and pass them to ``attend`` many times.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from captioner.errors import ConfigError


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention with H heads.

    Args:
        d_model: query width and output width d.
        num_heads: number of heads H (must divide ``d_model``).
        kv_dim: width of the key/value source (defaults to ``d_model``).
    """

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

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = False,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend projected queries to projected keys/values.

        Args:
            q: (B, H, Tq, dh) queries.
            k: (B, H, Tk, dh) keys.
            v: (B, H, Tk, dh) values.
            causal: query i sees keys 0..i only (requires Tq == Tk).
            need_weights: take the manual path and return the weights.

        Returns:
            (output (B, Tq, d), weights (B, H, Tq, Tk) or None).
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
            weights = scores.softmax(dim=-1)  # (B, H, Tq, Tk)
            out = weights @ v  # (B, H, Tq, dh)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # (B, H, Tq, dh)
        b, _, t, _ = out.shape
        out = out.transpose(1, 2).reshape(b, t, self.d_model)  # (B, Tq, d)
        return self.out_proj(out), weights

    def forward(
        self,
        x: torch.Tensor,
        source: torch.Tensor | None = None,
        causal: bool = False,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend ``x`` (B, Tq, d) to ``source`` (B, Tk, kv_dim) (self-attention when None)."""
        k, v = self.project_kv(x if source is None else source)  # (B, H, Tk, dh) each
        return self.attend(self.project_q(x), k, v, causal=causal, need_weights=need_weights)
