"""Validation during training: decode captions for real and score them with BLEU and CIDEr-D.

``validate`` runs on one shard of the validation images (one per rank under torchrun) and
returns hypotheses and references; ``score`` merges the shards and computes BLEU-1..4 (0-1
scale), CIDEr-D (coco-caption's scale, document frequencies from the validation references, as
``captioner evaluate`` computes it on its split) and the mean attention entropy per generated word.
Decoding bans ``<unk>`` as ``captioner evaluate`` does by default.
"""

from __future__ import annotations

import dataclasses

from typing import Any

import torch
from torch.utils.data import DataLoader

from captioner import inference
from captioner.decoding.search import DecodeOptions
from captioner.evaluation.metrics import bleu, cider_d
from captioner.features.dtype import model_input
from captioner.models.base import attention_entropy
from captioner.models.captioner import CaptionModel
from captioner.text import Vocabulary


@torch.inference_mode()
def validate(model: CaptionModel, loader: DataLoader, val_set: Any, vocab: Vocabulary, beam_size: int, max_len: int,
             device: torch.device, on_features: bool, options: Any = None) -> dict[str, Any]:
    """Decode captions for the loader's images and collect hypotheses and references.

    Args:
        model: the (unwrapped) captioner.
        loader: yields (x, image_index) with x region features (B,N,D) or images (B,3,S,S).
        val_set: the caption set ``image_index`` points into (references come from it).
        vocab: vocabulary of the model.
        beam_size, max_len: decoding options (beam 1 is greedy).
        device: where to run.
        on_features: ``x`` holds cached features rather than images.
        options: the config's ``decoding`` section (a ``DecodeOptions``: length penalty, ``<unk>``);
            ``beam_size`` and ``max_len`` replace its own. None: the defaults.

    Returns:
        ``{"hypotheses", "references", "entropy_sum", "words"}`` (merge shards, then :func:`score`).
    """
    base = options if options is not None else DecodeOptions()
    options = dataclasses.replace(base, beam_size=beam_size, max_len=max_len, n_best=1)
    hyps: list[str] = []
    refs: list[list[str]] = []
    entropy_sum, words = 0.0, 0
    for batch in loader:
        if batch is None:  # no readable image in this batch (data.skip_missing)
            continue
        x, index = batch
        x = model_input(x, device)  # cached features: float16/bfloat16 -> float32 on the device
        if on_features:
            results = inference.caption_features(model, x, vocab, options)
        else:
            results = inference.caption_images(model, x, vocab, options)
        for res, i in zip(results, index.tolist()):
            hyps.append(res.text)
            refs.append(val_set.references(val_set.images[i].image_id))
            if res.attention.numel():
                entropy_sum += float(attention_entropy(res.attention.flatten(1).float()).sum())  # (L, N) -> (L,)
                words += res.attention.size(0)
    return {"hypotheses": hyps, "references": refs, "entropy_sum": entropy_sum, "words": words}


def score(shards: list[dict[str, Any]]) -> dict[str, float]:
    """Corpus BLEU-1..4 (0-1), CIDEr-D and mean attention entropy per generated word over merged shards."""
    hyps = [h for s in shards for h in s["hypotheses"]]
    refs = [r for s in shards for r in s["references"]]
    words = sum(s["words"] for s in shards)
    out = {k: float(v) for k, v in bleu(hyps, refs).items()}
    out["CIDEr-D"] = float(cider_d(hyps, refs))
    out["attention_entropy"] = sum(s["entropy_sum"] for s in shards) / words if words else float("nan")
    out["val_images"] = len(hyps)
    out["val_words"] = words / len(hyps) if hyps else 0.0  # mean caption length (0: only empty captions)
    return out
