"""Exception types.

Every error a user can cause (a bad file, a wrong checkpoint, a bad option) is raised as a
``CaptionerError`` subclass with a one-line message that names the offending file or value.
The CLI prints that line and exits non-zero instead of showing a traceback.
"""

from __future__ import annotations


def one_line(text: str) -> str:
    """``text`` on one line: newlines and other control characters shown as escapes (``\\n``)."""
    return "".join(ch if ch >= " " or ch == "\t" else repr(ch)[1:-1] for ch in text)


class CaptionerError(Exception):
    """Base class for user-facing errors (one-line message, no traceback in the CLI)."""


class ConfigError(CaptionerError, ValueError):
    """An invalid configuration value, preset name or override."""


class DataError(CaptionerError):
    """A bad annotation file, a missing image or a dataset that cannot be used."""


class ImageLoadError(DataError):
    """An image file that is missing, empty, truncated or not an image."""


class EmptyCaptionError(CaptionerError):
    """The model wrote no word for a photo (``<eos>`` first): a failure to caption it, not a caption.
    The message names the photo and the beam size."""


class CheckpointError(CaptionerError):
    """A checkpoint that is truncated, foreign, unsafe or does not match."""


class ImageInputError(DataError, ValueError):
    """An image handed to the Python API that cannot be captioned: the wrong type, dtype or shape,
    an empty or too large image, or NaN/inf values (see :mod:`captioner.data.images`)."""
