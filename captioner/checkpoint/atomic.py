"""Atomic file writes: readers see either the old file or the complete new one, never a torn one.

The function lives in :mod:`captioner.files` (the base layer, so that the vocabulary and the config
can write atomically too) and stays importable from here as the same object.
"""

from __future__ import annotations

from captioner.files import atomic_write

__all__ = ["atomic_write"]
