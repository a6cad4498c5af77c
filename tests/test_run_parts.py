"""The small run parts of the training loop answer as documented."""

from __future__ import annotations

import time
from pathlib import Path


def test_run_folder_names_the_last_good_checkpoint(tmp_path: Path) -> None:
    from captioner.training.run import RunFolder

    folder = RunFolder(tmp_path)
    assert folder.last_good() == "no checkpoint was written yet"
    (tmp_path / "latest.safetensors").write_bytes(b"")
    assert folder.last_good() == f"last good checkpoint: {tmp_path / 'latest.safetensors'}"


def test_clock_counts_earlier_sessions_and_the_budget_from_this_call() -> None:
    from captioner.training.run import Clock

    clock = Clock(start=time.monotonic() - 10.0, budget=5.0, seconds_before=100.0)
    assert clock.time_up()
    assert 10.0 <= clock.session_seconds() < 60.0
    assert 110.0 <= clock.elapsed() < 160.0
    assert not Clock(start=time.monotonic(), budget=5.0).time_up()
    assert not Clock(start=time.monotonic() - 1e6, budget=None).time_up()
