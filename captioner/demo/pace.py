"""How far each decoder got: its steps against those of the demo's reference figures.

The demo trains on wall-clock budgets, so a machine shared with other work trains fewer steps in
the same seconds, and the scores drop with them (beside two other CPU-heavy jobs on a 2-core
machine, objects named right fell from 98% to about 20%). :func:`pace_notes` says so when a
decoder trained far fewer steps than the default run of docs/demo.md's measured figures, why (a
slower pace, or a shorter budget), and which ``--budget`` would reach those steps at its pace.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["FAR_BELOW", "REFERENCE", "pace_notes", "steps_of_reference"]

# (optimizer steps, budget in seconds) of each decoder in the default `captioner demo` alone on the
# 2-core CPU, 2026-11-26: the run behind the measured figures of docs/demo.md (presets <decoder>_demo).
REFERENCE = {"sat_soft": (1876, 120.0), "sat_hard": (1600, 120.0), "transformer": (832, 45.0)}
FAR_BELOW = 0.6  # a decoder under this share of its reference steps (or pace) gets a note


def steps_of_reference(decoder: str, steps: float | None) -> float | None:
    """``steps`` as a share of the decoder's reference steps (None for other rows, e.g. SCST stages)."""
    if decoder not in REFERENCE or steps is None:
        return None
    return round(steps / REFERENCE[decoder][0], 3)


def pace_notes(rows: Sequence[Mapping[str, Any]], budgets: Mapping[str, float]) -> list[str]:
    """One line per decoder (with a budget in ``budgets``) that trained under :data:`FAR_BELOW` of its
    reference steps: how many, why, and the ``--budget`` that would reach them."""
    notes = []
    for row in rows:
        name, steps = row.get("decoder"), row.get("steps")
        share = steps_of_reference(name, steps)
        if share is None or share >= FAR_BELOW or name not in budgets:
            continue
        ref_steps, ref_budget = REFERENCE[name]
        budget = budgets[name]
        pace = (steps / budget) / (ref_steps / ref_budget)
        why = (f"it trained at {pace:.0%} of the reference pace: the machine was busy or slower" if pace < FAR_BELOW
               else f"its budget was {budget:.0f} s against {ref_budget:.0f} s")
        needed = 5 * math.ceil(budget * ref_steps / max(steps, 1) / 5)
        notes.append(f"{name} trained {steps:.0f} steps in {budget:.0f} s, {share:.0%} of the {ref_steps} of the "
                     f"reference figures (docs/demo.md), so its scores are not comparable to them; {why}; "
                     f"--budget {name}={needed} would reach them at this pace")
    return notes
