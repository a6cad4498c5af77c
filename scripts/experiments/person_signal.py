"""How well can the encoder's own features say whether a person is in a photo? Logistic probes of several
readings of the label channels (the EfficientNet-Lite0 top stage that the shipped model reads), fitted on
Flickr8k photos (a person named in >= 3 of 5 captions) and scored on the everyday dev set (a person named
in a reference caption): ROC AUC, and precision / recall at the threshold that keeps Flickr8k's prior.

    python scripts/experiments/person_signal.py --cache runs/probe    # after everyday_probe.py cached the regions
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import captioner
from captioner.evaluation.chair import named_objects

sys.path.insert(0, str(Path(__file__).resolve().parent))
from everyday_probe import DATA, dev_sets  # noqa: E402


def auc(scores: torch.Tensor, positives: torch.Tensor) -> float:
    """ROC AUC by ranks (ties averaged)."""
    order = scores.argsort()
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=scores.dtype)
    for v in scores.unique():
        tie = scores == v
        ranks[tie] = ranks[tie].mean()
    p, n = int(positives.sum()), int((~positives).sum())
    return float((ranks[positives].sum() - p * (p + 1) / 2) / (p * n))


def fit(x: torch.Tensor, y: torch.Tensor, decay: float, steps: int = 400) -> tuple:
    mu, sd = x.mean(0), x.std(0) + 1e-4
    z = (x - mu) / sd
    w = torch.zeros(z.size(1), requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=1e-2)
    for _ in range(steps):
        loss = F.binary_cross_entropy_with_logits(z @ w + b, y.float()) + decay * w.pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return lambda v: ((v - mu) / sd) @ w.detach() + b.detach()


def readings(features: torch.Tensor, reading) -> dict[str, torch.Tensor]:
    """Per photo, each way of reading its label channels (B, ...)."""
    label = features[..., reading.feature_dim:].float()  # (B, N, 1280)
    logits = reading.class_logits(label)  # (B, N, C) each region's class logits
    probs = torch.softmax(reading.class_logits(label.mean(1)), -1)  # (B, C) the photo's
    region_probs = torch.softmax(logits, -1)
    return {"class log-probs (the release's probe)": probs.clamp_min(1e-6).log(),
            "pooled 1280-d features": label.mean(1),
            "pooled + max-pooled features": torch.cat([label.mean(1), label.amax(1)], 1),
            "class log-probs + regions' max class probs": torch.cat([probs.clamp_min(1e-6).log(),
                                                                     region_probs.amax(1).clamp_min(1e-6).log()], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path("runs/probe"))
    args = parser.parse_args()
    model = captioner.load("flickr8k")
    reading = model.model.decoder.extension
    sets = dev_sets(DATA)
    train_x = torch.load(args.cache / "flickr8k_dev.pt")
    test_x = torch.load(args.cache / "everyday.pt")
    train_y = torch.tensor([sum("person" in named_objects(r) for r in refs) >= 3 for refs in sets["flickr8k_dev"][1]])
    test_y = torch.tensor([any("person" in named_objects(r) for r in refs) for refs in sets["everyday"][1]])
    with torch.no_grad():
        shipped = reading.labels(reading.class_probs(test_x))[:, -1]
        train_r, test_r = readings(train_x, reading), readings(test_x, reading)
    print(f"Flickr8k dev: {int(train_y.sum())}/{len(train_y)} with a person; everyday dev: "
          f"{int(test_y.sum())}/{len(test_y)}")
    print(f"{'the shipped model person score':48s} AUC {auc(shipped, test_y):.3f}")
    prior = float(train_y.float().mean())
    for name in train_r:
        for decay in (1e-3, 1e-2):
            probe = fit(train_r[name], train_y, decay)
            with torch.no_grad():
                s = probe(test_r[name])
                cut = probe(train_r[name]).quantile(1 - prior)
            said = s >= cut
            tp = int((said & test_y).sum())
            print(f"{name:40s} decay {decay:g}  AUC {auc(s, test_y):.3f}  precision {tp / max(int(said.sum()), 1):.2f}"
                  f"  recall {tp / max(int(test_y.sum()), 1):.2f}")


if __name__ == "__main__":
    main()
