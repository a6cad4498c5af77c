"""The demo's comparison table: its columns, one row per decoder, and plain-text formatting."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

LABELS = {"sat_soft": "SAT soft", "sat_hard": "SAT hard", "transformer": "Transformer"}
LABELS.update({f"{name}+scst": f"{label} + SCST" for name, label in list(LABELS.items())})  # captioner demo --scst

# (key, header, format) of the comparison table; values are None when not measured. "att. sup." is the
# weight of train.attention_supervision (0: trained without); the seen/unseen columns are those of a
# compositional split (captioner demo --unseen-pairs K) and are left out of tables without one.
COMPOSITIONAL = ("objects_correct_seen", "objects_correct_unseen", "unseen_pairs_named")
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("decoder", "decoder", "{}"),
    ("BLEU-1", "B-1", "{:.3f}"),
    ("BLEU-2", "B-2", "{:.3f}"),
    ("BLEU-3", "B-3", "{:.3f}"),
    ("BLEU-4", "B-4", "{:.3f}"),
    ("CIDEr-D", "CIDEr-D", "{:.3f}"),
    ("attention_supervision", "att. sup.", "{:g}"),
    ("objects_correct", "objects ok", "{:.1%}"),
    ("objects_correct_seen", "seen ok", "{:.1%}"),
    ("objects_correct_unseen", "unseen ok", "{:.1%}"),
    ("unseen_pairs_named", "unseen named", "{:.1%}"),
    ("attention_correctness", "att. corr.", "{:.3f}"),
    ("uniform_baseline", "uniform", "{:.3f}"),
    ("ratio", "ratio", "{:.1f}x"),
    ("pointing_accuracy", "pointing", "{:.1%}"),
    ("attention_entropy", "entropy", "{:.2f}"),
    ("uniform_entropy", "log N", "{:.2f}"),
    ("train_seconds", "train s", "{:.0f}"),
    ("steps", "steps", "{:.0f}"),
    ("steps_per_s", "steps/s", "{:.1f}"),
    ("steps_of_reference", "of ref. steps", "{:.0%}"),
    ("epochs", "epochs", "{:.1f}"),
    ("parameters", "params", "{:,}"),
)


def table_row(decoder: str, metrics: dict[str, Any], train_seconds: float, epochs: float,
              params: dict[str, int], steps: int | None = None,
              attention_supervision: float | None = None) -> dict[str, Any]:
    """One row of the comparison table (see ``COLUMNS``); ``steps``: optimizer steps trained;
    ``attention_supervision``: the run's ``train.attention_supervision`` weight."""
    att = metrics.get("attention_correctness") or {}
    ent = metrics.get("attention") or {}
    row: dict[str, Any] = {"decoder": decoder}
    for key in ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "CIDEr-D"):
        row[key] = metrics.get(key)
    for key in ("objects_correct", "attention_correctness", "uniform_baseline", "ratio", "pointing_accuracy",
                "words_scored", "objects_invented", *COMPOSITIONAL, "seen_pairs_named"):
        row[key] = att.get(key)
    row["attention_supervision"] = attention_supervision
    row["attention_entropy"] = ent.get("attention_entropy")
    row["uniform_entropy"] = ent.get("uniform_entropy")
    row.update(train_seconds=round(train_seconds, 1), epochs=epochs, steps=steps,
               steps_per_s=round(steps / train_seconds, 2) if steps and train_seconds > 0 else None, **params)
    return row


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The comparison table as aligned plain text (``-`` where a value is missing)."""
    columns = shown_columns(rows)
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        cells.append([format_value(row.get(key), fmt) for key, _, fmt in columns])
    widths = [max(len(r[j]) for r in cells) for j in range(len(columns))]
    lines = ["  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def shown_columns(rows: Sequence[dict[str, Any]]) -> tuple[tuple[str, str, str], ...]:
    """``COLUMNS`` without the compositional-split ones when no row has them."""
    return tuple(c for c in COLUMNS if c[0] not in COMPOSITIONAL or any(r.get(c[0]) is not None for r in rows))


def format_value(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)
