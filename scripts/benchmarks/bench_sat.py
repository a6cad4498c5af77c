"""Training-step speed of the SAT soft-attention decoder vs. a tutorial-style re-implementation.

Shape legend: B batch, N regions, D feature width, T caption steps, V vocabulary.

One step = forward + backward + Adam on random region features at the paper's sizes (B 32,
14x14x2048 features, V 10,000, embedding/attention/LSTM width 512, captions of 11-21 words with
padding). The baseline computes the same model (same weights, same loss) the way popular
re-implementations do: sort the batch by length and shrink it step by step, recompute the
encoder-side attention projection ``W_f f`` at every step, form the context with an elementwise
product + sum, and run the output layer inside the loop. Our decoder instead projects ``W_f f``
once, hoists the embedding half of the LSTM input projection out of the loop, fuses every
matmul that reads ``h_{t-1}`` into one, computes the additive attention's tanh as an exactly
equivalent in-place sigmoid (cheaper on CPU), and runs the deep output once over all steps.

    python scripts/benchmark.py --only sat_train [--quick] [--json]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from captioner.models.lstm import SATDecoder  # noqa: E402
from captioner.training.objective import CaptionLoss  # noqa: E402
from timing import best_times  # noqa: E402

PAPER = {"batch": 32, "grid": 14, "feature_dim": 2048, "vocab": 10_000, "width": 512, "min_len": 11, "max_len": 21}
QUICK = {"batch": 8, "grid": 7, "feature_dim": 256, "vocab": 1_000, "width": 64, "min_len": 6, "max_len": 12}


class TutorialSAT(nn.Module):
    """The common re-implementation pattern, reading the weights of a ``SATDecoder``."""

    def __init__(self, decoder: SATDecoder) -> None:
        super().__init__()
        self.d = decoder

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns predictions (B,T,V), alphas (B,T,N), sorted targets (B,T) and the sort order."""
        d = self.d
        lengths, order = lengths.sort(descending=True)
        features, tokens = features[order], tokens[order]  # (B, N, D), (B, T+1)
        decode_lengths = (lengths - 1).tolist()
        B, N, _ = features.shape
        T = max(decode_lengths)
        emb = d.embedding(tokens)  # (B, T+1, M)
        mean = features.mean(dim=1)
        h, c = torch.tanh(d.init_h(mean)), torch.tanh(d.init_c(mean))  # (B, H)
        predictions = features.new_zeros(B, T, d.vocab_size)
        alphas = features.new_zeros(B, T, N)
        for t in range(T):
            bt = sum(n > t for n in decode_lengths)
            att_f = d.attention.feature_proj(features[:bt])  # (bt, N, A) -- recomputed every step
            att_h = d.attention.hidden_proj(h[:bt])  # (bt, A)
            e = d.attention.score(torch.tanh(att_f + att_h.unsqueeze(1))).squeeze(2)  # (bt, N)
            alpha = torch.softmax(e, dim=1)  # (bt, N)
            z = (features[:bt] * alpha.unsqueeze(2)).sum(dim=1)  # (bt, D)
            gated = torch.sigmoid(d.gate(h[:bt])) * z  # (bt, D)
            h, c = d.lstm(torch.cat([emb[:bt, t], gated], dim=1), (h[:bt], c[:bt]))  # (bt, H)
            deep = emb[:bt, t] + d.out_hidden(d.dropout(h)) + d.out_context(gated)  # (bt, M)
            predictions[:bt, t] = d.out_word(d.dropout(deep))  # (bt, V)
            alphas[:bt, t] = alpha
        return predictions, alphas, tokens[:, 1:], order


def tutorial_loss(preds: torch.Tensor, alphas: torch.Tensor, targets: torch.Tensor, alpha_c: float) -> torch.Tensor:
    mask = targets != 0  # (B, T)
    ce = F.cross_entropy(preds[mask], targets[mask])
    return ce + alpha_c * ((1.0 - (alphas * mask.unsqueeze(-1)).sum(dim=1)) ** 2).sum(dim=1).mean()


def make_batch(s: dict, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random features (B,N,D), padded tokens (B,T+1) [bos w.. eos pad..], lengths (B,) incl. bos/eos."""
    B, N = s["batch"], s["grid"] ** 2
    features = torch.randn(B, N, s["feature_dim"], generator=gen).relu()
    lengths = torch.randint(s["min_len"] + 2, s["max_len"] + 3, (B,), generator=gen)
    tokens = torch.zeros(B, int(lengths.max()), dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        tokens[i, 0], tokens[i, n - 1] = 1, 2
        tokens[i, 1:n - 1] = torch.randint(4, s["vocab"], (n - 2,), generator=gen)
    return features, tokens, lengths


def sat_train(quick: bool = False) -> dict:
    """Captions per second of one SAT training step, ours vs. the tutorial-style baseline.

    On a GPU (used when present) both run in fp32, and ours also under bf16 autocast
    (``bf16_captions_per_s``, ``bf16_speedup`` = bf16 over fp32 of the same decoder).
    """
    s = QUICK if quick else PAPER
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    w = s["width"]
    decoder = SATDecoder(s["vocab"], s["feature_dim"], embed_dim=w, hidden_dim=w, attention_dim=w, dropout=0.5)
    decoder.to(device)
    baseline = TutorialSAT(decoder)
    features, tokens, lengths = (t.to(device) for t in make_batch(s, gen))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    loss_fn = CaptionLoss(alpha_c=1.0, ds_form="sum")  # the tutorial's (and the paper's) penalty form

    decoder.eval()  # same weights, no dropout: both implementations give the same loss
    with torch.no_grad():
        ours = loss_fn(decoder(features, inputs), targets).total
        preds, alphas, sorted_targets, _ = baseline(features, tokens, lengths)
        theirs = tutorial_loss(preds, alphas, sorted_targets, 1.0)
    if not torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4):
        raise RuntimeError(f"baseline and decoder disagree: {ours.item():.6f} vs {theirs.item():.6f}")
    decoder.train()
    optimizer = torch.optim.Adam(decoder.parameters(), lr=1e-4)

    def step_ours() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(decoder(features, inputs), targets).total.backward()
        optimizer.step()

    def step_baseline() -> None:
        optimizer.zero_grad(set_to_none=True)
        preds, alphas, sorted_targets, _ = baseline(features, tokens, lengths)
        tutorial_loss(preds, alphas, sorted_targets, 1.0).backward()
        optimizer.step()

    if device.type != "cuda":
        best = best_times({"ours": step_ours, "baseline": step_baseline}, device, repeats=5 if quick else 3)
        t_ours, t_base = best["ours"], best["baseline"]
        return {
            "captions_per_s": s["batch"] / t_ours,
            "baseline_captions_per_s": s["batch"] / t_base,
            "ratio": t_base / t_ours,
            "threads": torch.get_num_threads(),
            "device": device.type,
        }

    def step_ours_bf16() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(decoder(features, inputs), targets).total
        loss.backward()
        optimizer.step()

    best = best_times({"ours": step_ours, "baseline": step_baseline, "bf16": step_ours_bf16}, device, repeats=10)
    t_ours, t_base, t_bf16 = best["ours"], best["baseline"], best["bf16"]
    return {
        "captions_per_s": s["batch"] / t_ours,
        "baseline_captions_per_s": s["batch"] / t_base,
        "ratio": t_base / t_ours,
        "bf16_captions_per_s": s["batch"] / t_bf16,
        "bf16_speedup": t_ours / t_bf16,
        "device": torch.cuda.get_device_name(),
    }


BENCHMARKS = {"sat_train": sat_train}

if __name__ == "__main__":
    print(sat_train("--quick" in sys.argv))
