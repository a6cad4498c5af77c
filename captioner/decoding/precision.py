"""Decoding in bfloat16: the search's arithmetic in 16-bit floats, for speed on a CPU with native
bfloat16 (``avx512_bf16`` or AMX) or a GPU.

``DecodeOptions(precision="bfloat16")`` (``--precision bfloat16``) makes :func:`captioner.decoding.search.decode`
search with :func:`decoder_for` (the decoder's weights and the region features in bfloat16) instead of
the decoder itself. The beams are still ranked in float64 and the attention maps returned in float32;
only the decoder's products are rounded to bfloat16's 8 significant bits, so a near tie between two
words can fall the other way: on Flickr8k dev 40 of the 1,000 captions differ from float32 decoding
(docs/benchmarks.md gives the scores of both; they do not move beyond that noise). float32, the default, is the reference.

* A decoder that has a fused step of its own decodes with it: the SAT LSTM without an extension
  (``SATDecoder.fused_steps``, ``captioner.models.lstm.FusedSATSteps``), the same step with its matrix
  products fused (three per word instead of eight) and the word-embedding half of the LSTM's input
  product read from a table. This is what halves the search's time on a CPU, where it is bound by
  those products.
* Any other decoder (the Transformer, the SAT with concepts, an ensemble) decodes with a bfloat16
  copy of itself.

The low-precision decoder is built on first use and kept beside the decoder (never a submodule, so
checkpoints never see it); it is rebuilt when a weight changes (an optimizer step, ``load_state_dict``,
``.to()``).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from captioner.config.schema import DECODE_PRECISIONS
from captioner.models.lstm import FusedSATSteps

PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # DecodeOptions.precision -> dtype
assert tuple(PRECISIONS) == DECODE_PRECISIONS


def decoder_for(decoder: nn.Module, precision: str) -> nn.Module:
    """The decoder a search in ``precision`` steps: ``decoder`` itself for float32; for bfloat16 its own
    fused steps (``decoder.fused_steps(dtype)``, where it has them) or else a bfloat16 copy, kept on
    ``decoder`` until a weight changes.

    Raises:
        ValueError: a precision that is not in :data:`PRECISIONS`.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: use one of {sorted(PRECISIONS)}")
    dtype = PRECISIONS[precision]
    if dtype == torch.float32:
        return decoder
    tensors = [*decoder.parameters(), *decoder.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    key = (dtype, device, getattr(decoder, "hard_test_mode", None),
           tuple((t.data_ptr(), t._version) for t in tensors))
    cached = decoder.__dict__.get("_low_precision")
    if cached is not None and cached[0] == key:
        return cached[1]
    fused = getattr(decoder, "fused_steps", None)
    low = (fused(dtype) if fused is not None else None) or _copy_in(decoder, dtype)
    low.eval()
    decoder.__dict__["_low_precision"] = (key, low)
    return low


def prepare(decoder: nn.Module, features: torch.Tensor, precision: str) -> tuple[nn.Module, torch.Tensor]:
    """(the decoder to step, the features to give its ``init_state``) for a search in ``precision``:
    fused steps take the float32 features (it computes the initial state from them in
    float32), a bfloat16 copy takes them in bfloat16."""
    stepper = decoder_for(decoder, precision)
    if stepper is decoder or isinstance(stepper, FusedSATSteps):
        return stepper, features
    return stepper, features.to(PRECISIONS[precision])


def _copy_in(decoder: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``decoder`` with its floating-point weights in ``dtype`` (the original untouched), but
    for the submodules that declare ``runs_in_float32`` (the concept head)."""
    caches = ("_low_precision", "_step_cache")  # what the decoder keeps of its weights: not copied into the copy
    saved = {key: decoder.__dict__.pop(key) for key in caches if key in decoder.__dict__}
    try:
        low = copy.deepcopy(decoder).to(dtype)
        for module in low.modules():
            if getattr(module, "runs_in_float32", False):
                module.float()
        return low
    finally:
        decoder.__dict__.update(saved)
