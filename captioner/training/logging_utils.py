"""Training logs: ``metrics.csv`` (step rows and epoch rows) and optional TensorBoard scalars.

Only rank 0 creates a ``MetricsLogger``. The CSV has a fixed header (:data:`COLUMNS`); a cell is
empty when the value does not apply (e.g. BLEU on step rows). On resume the file is cut back to
the rows the saved training state has seen, so a resumed run continues one clean table.
"""

from __future__ import annotations

import csv
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from captioner.errors import CaptionerError
from captioner.files import check_regular

log = logging.getLogger(__name__)

COLUMNS = (
    "kind", "epoch", "step", "loss", "ce", "doubly_stochastic", "reinforce", "entropy", "baseline", "advantage_scale",
    "share_ce", "share_doubly_stochastic", "share_entropy",
    "grounding", "grounded_words", "grounding_in_box", "share_grounding",  # train.attention_supervision
    "concept_guide", "concept_guided_words", "share_concept_guide",  # train.concept_guide
    "scst_reward", "scst_baseline_reward", "scst_better", "scst_greedy_reward", "scst_better_than_greedy", "scst_xe",
    "lr", "captions_per_s", "BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "CIDEr-D", "attention_entropy",
    "val_images", "val_words", "partial", "seconds",
)


class RunningMean:
    """Caption-weighted running means of named loss parts."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.count = 0.0

    def add(self, parts: Mapping[str, float], count: float) -> None:
        for key, value in parts.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value) * count
        self.count += count

    def means(self) -> dict[str, float]:
        return {k: v / self.count for k, v in self.sums.items()} if self.count else {}

    def state_dict(self) -> dict[str, Any]:
        return {"sums": dict(self.sums), "count": self.count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sums = {k: float(v) for k, v in state["sums"].items()}
        self.count = float(state["count"])


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


class MetricsLogger:
    """Appends rows to ``<run>/metrics.csv`` and mirrors numbers to TensorBoard when available.

    Args:
        run_dir: the run folder.
        keep_until_step: when resuming, drop existing rows whose ``step`` is larger (they belong
            to work the saved state does not include); None starts a new file.
        tensorboard: write ``<run>/tensorboard`` event files if ``torch.utils.tensorboard`` imports.
    """

    def __init__(self, run_dir: str | os.PathLike, keep_until_step: int | None = None,
                 tensorboard: bool = True) -> None:
        self.path = Path(run_dir) / "metrics.csv"
        if os.path.lexists(self.path):  # opening a named pipe here would block
            check_regular(self.path, None, CaptionerError, "metrics file")
        rows: list[dict[str, str]] = []
        if keep_until_step is not None and self.path.exists():
            with open(self.path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if r.get("step") and int(r["step"]) <= keep_until_step]
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        self._file = open(self.path, "a", newline="")
        self._writer = csv.DictWriter(self._file, COLUMNS, extrasaction="ignore")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except Exception as exc:  # optional dependency: any import/setup failure just disables it
                log.debug("TensorBoard logging disabled (%s)", exc)

    def write(self, kind: str, row: Mapping[str, Any]) -> None:
        """Write one ``kind`` ("step" or "epoch") row; numbers also go to TensorBoard."""
        self._writer.writerow({k: _cell(v) for k, v in {"kind": kind, **row}.items()})
        self._file.flush()
        if self._tb is not None:
            step = int(row.get("step", 0))
            for key, value in row.items():
                if key not in ("epoch", "step", "partial") and isinstance(value, (int, float)) and value is not None:
                    self._tb.add_scalar(f"{kind}/{key}", float(value), step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
