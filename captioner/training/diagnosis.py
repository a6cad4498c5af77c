"""What a non-finite loss at a run's first step points to.

The first loss is computed before any weight update, so the learning rate cannot be the cause and
skipping batches cannot help: the inputs or the model as built are at fault. The batch itself
says which: features that are NaN/inf (a feature cache written before the cache checked its
values stored float16 overflow as inf), features far larger than a pretrained encoder's (an
encoder with random weights: a ResNet-101 reaches 2.4e5), or finite, moderate inputs (then the
model's initialisation, or fp16 autocast overflowing).
"""

from __future__ import annotations

import math

import torch

from captioner.config import EncoderConfig

HUGE = 1e3  # a pretrained encoder's features stay well below this after pooling


def _encoder_name(enc: EncoderConfig) -> str:
    return enc.name if enc.pretrained else f"{enc.name} with random weights (model.encoder.pretrained=false)"


def first_loss_cause(inputs: torch.Tensor | None, encoder: EncoderConfig, autocast: torch.dtype | None) -> str:
    """The likely cause of a non-finite loss at the first step, in a few words for one error line.

    Args:
        inputs: the batch the loss came from: features (B, N, D) or images (B, 3, S, S).
        encoder: the run's encoder configuration.
        autocast: the run's autocast dtype (None for fp32).

    Returns:
        A clause naming the largest input value and what to change.
    """
    fp16 = "; train.amp=fp16 overflows beyond 65504, try train.amp=bf16" if autocast == torch.float16 else ""
    if inputs is None or inputs.numel() == 0:
        return f"check the input data and the encoder {_encoder_name(encoder)}{fp16}"
    top = float(inputs.detach().abs().amax())
    if inputs.dim() != 3:  # images: the features are made inside the model
        if not math.isfinite(top):
            return f"the batch's input images hold {top} values"
        return (f"the input images are finite, so the encoder {_encoder_name(encoder)} may produce huge "
                f"activations, or the decoder's initialisation is at fault{fp16}")
    if not math.isfinite(top):
        return (f"the batch's input features hold {top} values: delete the feature cache (in "
                f"data.feature_cache_dir, $CAPTIONER_FEATURE_CACHE or the run's features/) so that it is rebuilt and checked")
    if top > HUGE:
        return (f"the batch's input features reach {top:.3g}, far beyond a pretrained encoder's: the encoder "
                f"{_encoder_name(encoder)} produces huge activations that overflow the decoder{fp16}")
    return (f"the batch's input features are finite (largest |value| {top:.3g}), so look at the decoder's "
            f"initialisation and the model config{fp16}")
