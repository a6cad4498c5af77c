"""Self-critical training step speed, beside the cross-entropy step of the same decoder.

Shape legend: B images, K samples per image, N regions, D feature width, V vocabulary, T words.

For the lite presets' decoders (``sat_soft_lite``, ``sat_hard_lite``, ``transformer_lite``: 7x7
regions of 1280-d EfficientNet-Lite0 features) on random features, a vocabulary of ~1000 words and
random 5-reference caption sets:

* **xe**: one cross-entropy step (teacher forcing, ``CaptionLoss``, backward, Adam) on B captions of
  10-16 words;
* **scst**: one self-critical step on B images with K = 5 samples each (sampling through the
  decoder contract, greedy baseline, CIDEr-D reward with corpus document frequencies, teacher-
  forced re-scoring, backward, Adam), of which **reward_s** is the reward's share (Python CIDEr-D)
  and **greedy_s** the greedy caption's decoding (done every step with either baseline: it is
  the baseline of ``greedy`` and the logged ``scst_greedy_reward`` of both).

``captions_per_s`` counts trained captions: B for xe, B * K sampled captions for scst. CUDA is used
when present.

    python scripts/benchmark.py --only scst_step [--quick] [--json]
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from captioner.config import get_preset  # noqa: E402
from captioner.models.model import build_decoder  # noqa: E402
from captioner.text import Vocabulary  # noqa: E402
from captioner.training.objective import CaptionLoss  # noqa: E402
from captioner.training.scst import CaptionReward, SelfCritical  # noqa: E402

FULL = {"presets": ("sat_soft_lite", "sat_hard_lite", "transformer_lite"), "batch": 16, "grid": 7,
        "feature_dim": 1280, "words": 1000, "images": 2000, "steps": 10}
QUICK = {"presets": ("sat_soft_tiny", "transformer_tiny"), "batch": 4, "grid": 4, "feature_dim": 32, "words": 60,
         "images": 50, "steps": 2}
SAMPLES = 5


def _corpus(s: dict, rng: random.Random) -> tuple[Vocabulary, list[list[str]]]:
    words = [f"w{i}" for i in range(s["words"])]
    refs = [[" ".join(rng.choice(words) for _ in range(rng.randint(8, 14))) for _ in range(5)]
            for _ in range(s["images"])]
    return Vocabulary.build([" ".join(words)], min_freq=1), refs


def _timed(fn, steps: int, device: torch.device) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def _one(preset: str, s: dict, device: torch.device) -> dict:
    rng = random.Random(0)
    torch.manual_seed(0)
    cfg = get_preset(preset)
    vocab, refs = _corpus(s, rng)
    decoder = build_decoder(cfg.model.decoder, s["feature_dim"], len(vocab), s["grid"]).to(device).train()
    opt = torch.optim.Adam(decoder.parameters(), lr=1e-5)
    B, N = s["batch"], s["grid"] ** 2
    features = torch.randn(B, N, s["feature_dim"], device=device)
    tokens = torch.zeros(B, 18, dtype=torch.long)
    for b in range(B):
        n = rng.randint(10, 16)
        tokens[b, 0], tokens[b, n + 1] = vocab.bos_id, vocab.eos_id
        tokens[b, 1:n + 1] = torch.randint(4, len(vocab), (n,))
    tokens = tokens.to(device)
    xe_loss = CaptionLoss(pad_id=vocab.pad_id, alpha_c=1.0 if cfg.model.decoder.name == "sat" else 0.0).to(device)

    def xe_step() -> None:
        opt.zero_grad(set_to_none=True)
        xe_loss(decoder(features, tokens[:, :-1]), tokens[:, 1:]).total.backward()
        opt.step()

    t0 = time.perf_counter()
    reward = CaptionReward(refs)  # document frequencies: counted once, here
    df_seconds = time.perf_counter() - t0
    scst = SelfCritical(reward, vocab, samples=SAMPLES, baseline="greedy", max_len=16)
    index = torch.arange(B)
    spent = {"reward": 0.0, "greedy": 0.0}

    def timed(key: str, fn):  # noqa: ANN001, ANN202
        def call(*args):  # noqa: ANN002, ANN202
            t0 = time.perf_counter()
            out = fn(*args)
            spent[key] += time.perf_counter() - t0
            return out
        return call

    scst.reward = timed("reward", reward.__call__)  # type: ignore[assignment]  # the same reward, timed
    scst._greedy = timed("greedy", scst._greedy)  # type: ignore[method-assign]  # the greedy decode, every step

    def scst_step() -> None:
        opt.zero_grad(set_to_none=True)
        result = scst.batch_loss(decoder, decoder, None, features, index)
        result.total.backward()
        opt.step()

    xe_s = _timed(xe_step, s["steps"], device)
    scst_s = _timed(scst_step, s["steps"], device)
    reward_s = spent["reward"] / (s["steps"] + 1)
    greedy_s = spent["greedy"] / (s["steps"] + 1)
    return {"xe_step_s": round(xe_s, 4), "xe_captions_per_s": round(B / xe_s, 1),
            "scst_step_s": round(scst_s, 4), "scst_captions_per_s": round(B * SAMPLES / scst_s, 1),
            "scst_images_per_s": round(B / scst_s, 1), "reward_s": round(reward_s, 4),
            "reward_share": round(reward_s / scst_s, 3), "greedy_s": round(greedy_s, 4),
            "greedy_share": round(greedy_s / scst_s, 3), "doc_freq_once_s": round(df_seconds, 3)}


def bench_scst_step(quick: bool = False) -> dict:
    s = QUICK if quick else FULL
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = {"device": str(device), "batch_images": s["batch"], "samples": SAMPLES, "vocab": s["words"] + 4,
           "regions": s["grid"] ** 2, "feature_dim": s["feature_dim"]}
    for preset in s["presets"]:
        out[preset] = _one(preset, s, device)
    return out


BENCHMARKS = {"scst_step": bench_scst_step}
