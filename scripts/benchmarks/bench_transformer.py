"""Transformer decoder benchmarks (run through ``scripts/benchmark.py``).

* ``transformer_train``: one training step (forward, backward, Adam) at batch 32, 196 regions x
  2048 features, vocabulary 10,000, width 512, 3 layers, 8 heads, ff 2048, 20 caption steps.
  Reports captions/s with the default attention paths (fused kernels except the last layer's
  cross-attention) and with every layer on the manual, weight-returning path.
* ``transformer_cache``: per-token decoding time (``step`` calls only; ``init_state`` is shared),
  20 greedy tokens for 8 images, with the key/value cache versus re-running the whole prefix at
  every step (``init_state(..., use_cache=False)``).

Uses CUDA when available, else the CPU (one thread, see ``_threads``); ``--quick`` shrinks every size.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from captioner.models.base import State  # noqa: E402
from timing import best_times  # noqa: E402
from captioner.models.transformer import TransformerCaptionDecoder  # noqa: E402

FULL = dict(batch=32, regions=196, feature_dim=2048, vocab=10_000, d_model=512, layers=3, heads=8, ff=2048, steps=20)
QUICK = dict(batch=4, regions=16, feature_dim=64, vocab=200, d_model=32, layers=2, heads=4, ff=64, steps=6)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _decoder(size: dict, device: torch.device) -> TransformerCaptionDecoder:
    torch.manual_seed(0)
    grid = int(size["regions"] ** 0.5)
    dec = TransformerCaptionDecoder(vocab_size=size["vocab"], feature_dim=size["feature_dim"], grid=grid,
                                    d_model=size["d_model"], num_layers=size["layers"], num_heads=size["heads"],
                                    ff_dim=size["ff"], dropout=0.1, max_len=size["steps"])
    return dec.to(device)


@contextmanager
def _threads(device: torch.device) -> Iterator[None]:
    """CPU runs use one intra-op thread: on a shared machine, multi-threaded timings swing by 10x."""
    old = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def bench_train(quick: bool) -> dict:
    size, device = (QUICK if quick else FULL), _device()
    dec = _decoder(size, device).train()
    opt = torch.optim.Adam(dec.parameters(), lr=1e-4)
    b, t, v = size["batch"], size["steps"], size["vocab"]
    features = torch.randn(b, size["regions"], size["feature_dim"], device=device)
    tokens = torch.randint(4, v, (b, t + 1), device=device)

    def train_step(need_all: bool) -> None:
        out = dec(features, tokens[:, :-1], need_all_attention=need_all)
        loss = F.cross_entropy(out.logits.reshape(-1, v), tokens[:, 1:].reshape(-1), ignore_index=0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    with _threads(device):
        best = best_times({"fused": lambda: train_step(False), "manual": lambda: train_step(True)},
                           device, 2 if quick else 3)
    return {"device": device.type, "captions_per_s": b / best["fused"], "captions_per_s_all_manual": b / best["manual"]}


def bench_cache(quick: bool) -> dict:
    size, device = (QUICK if quick else FULL), _device()
    dec = _decoder(size, device).eval()
    b, t = (2 if quick else 8), (6 if quick else 20)
    features = torch.randn(b, size["regions"], size["feature_dim"], device=device)

    def generate(start: State) -> None:  # the steps only: init_state is the same for both
        state = start
        prev = torch.full((b,), 1, dtype=torch.long, device=device)
        for _ in range(t):
            log_probs, state, _ = dec.step(prev, state)
            prev = log_probs.argmax(-1)

    with torch.inference_mode(), _threads(device):
        with_cache, without = dec.init_state(features), dec.init_state(features, use_cache=False)
        best = best_times({"cached": lambda: generate(with_cache), "uncached": lambda: generate(without)}, device, 3)
    return {"device": device.type, "cached_ms_per_token": 1000 * best["cached"] / t,
            "uncached_ms_per_token": 1000 * best["uncached"] / t, "ratio": best["uncached"] / best["cached"]}


BENCHMARKS = {"transformer_train": bench_train, "transformer_cache": bench_cache}
