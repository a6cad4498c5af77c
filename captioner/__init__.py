"""captioner: image captioning with visual attention (Show, Attend and Tell; Transformer).

Three lines of Python (see :mod:`captioner.inference`)::

    import captioner
    model = captioner.load("flickr8k")          # a shipped model (captioner.available_models()), or a checkpoint
    print(model.caption(["photo.jpg"])[0].text)

Importing the package is light: torch loads only when ``load``, ``Captioner``, ``Caption`` or
``DecodeOptions`` is first used.
"""

from __future__ import annotations

from typing import Any

from captioner.pretrained import DEFAULT_MODEL, available_models, example_photos, model_card
from captioner.version import __version__

__all__ = ["Caption", "Captioner", "DEFAULT_MODEL", "DecodeOptions", "available_models", "everyday_photos",
           "example_photos", "load", "model_card", "__version__"]

_INFERENCE_NAMES = frozenset({"Caption", "Captioner", "DecodeOptions", "everyday_photos", "load"})


def __getattr__(name: str) -> Any:
    """``captioner.load`` / ``Captioner`` / ``Caption`` / ``DecodeOptions`` / ``everyday_photos``, imported from
    :mod:`captioner.inference` when first used."""
    if name in _INFERENCE_NAMES:
        from captioner import inference

        return getattr(inference, name)
    raise AttributeError(f"module 'captioner' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _INFERENCE_NAMES)
