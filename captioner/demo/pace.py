"""How far each decoder got: its steps against those of the demo's reference figures.

The demo trains on wall-clock budgets, so a machine shared with other work trains fewer steps in
the same seconds, and the scores drop with them (beside two other CPU-heavy jobs on a 2-core
machine, objects named right fell from 98% to about 20%). :func:`pace_notes` says so when a
decoder trained far fewer steps than the default run of docs/demo.md's measured figures, and which
``--budget`` would reach those steps at the pace it had.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from captioner.demo.table import LABELS

__all__ = ["FAR_BELOW", "REFERENCE_STEPS", "pace_notes", "steps_of_reference"]

# Optimizer steps of the default `captioner demo` (budgets 120/120/45 s) alone on the 2-core CPU,
# 2026-11-26: the run behind the measured figures of docs/demo.md.
REFERENCE_STEPS = {"sat_soft": 1876, "sat_hard": 1600, "transformer": 832}
FAR_BELOW = 0.6  # a decoder under this share of its reference steps gets a note


def steps_of_reference(decoder: str, steps: float | None) -> float | None:
    """``steps`` as a share of the decoder's reference steps (None for other rows, e.g. SCST stages)."""
    reference = REFERENCE_STEPS.get(decoder)
    if reference is None or steps is None:
        return None
    return round(steps / reference, 3)


def pace_notes(rows: Sequence[Mapping[str, Any]], budgets: Mapping[str, float]) -> list[str]:
    """One line per decoder that trained under :data:`FAR_BELOW` of its reference steps."""
    notes = []
    for row in rows:
        name, steps = row.get("decoder"), row.get("steps")
        share = steps_of_reference(name, steps)
        if share is None or share >= FAR_BELOW or name not in budgets:
            continue
        budget = budgets[name]
        needed = 5 * math.ceil(budget * REFERENCE_STEPS[name] / max(steps, 1) / 5)
        notes.append(f"{LABELS.get(name, name)} trained {steps:.0f} steps in {budget:.0f} s, {share:.0%} of the "
                     f"{REFERENCE_STEPS[name]} of the reference figures (docs/demo.md): the machine was busy or "
                     f"slower, and its scores are not comparable to them; --budget {name}={needed} would reach them "
                     "at this pace")
    return notes
