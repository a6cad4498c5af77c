"""Option value types shared by the commands (argparse ``type=`` callables).

A value argparse cannot take is reported by the parser as one usage line and exit code 2.
"""

from __future__ import annotations

import argparse
import math


def finite_float(text: str) -> float:
    """``float(text)``, refusing ``nan``, ``inf`` and ``-inf`` (they pass every ``<`` and ``>`` test wrongly)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value
