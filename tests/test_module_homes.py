"""Names moved out of large modules stay importable from their old homes, as the same objects;
and the small run parts of the training loop answer as documented."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

MOVED = {
    "captioner.checkpoint.store": {"atomic_write": "captioner.checkpoint.atomic"},
    "captioner.checkpoint.atomic": {"atomic_write": "captioner.files"},
    "captioner.features.cache": {"cache_key": "captioner.features.keys", "cache_path": "captioner.features.keys",
                                 "FORMAT_VERSION": "captioner.features.keys", "SUFFIX": "captioner.features.keys",
                                 "SafeImages": "captioner.features.safe_images",
                                 "collate_safe": "captioner.features.safe_images",
                                 "check_batch_errors": "captioner.features.safe_images"},
    "captioner.training.loop": {"TrainForward": "captioner.training.run"},
    "captioner.data.coco": {"check_images": "captioner.data.checks"},
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_moved_names_are_the_same_objects_in_their_old_module(old: str) -> None:
    import importlib

    module = importlib.import_module(old)
    for name, new in MOVED[old].items():
        assert getattr(module, name) is getattr(importlib.import_module(new), name), (old, name)
        assert name in module.__all__


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
