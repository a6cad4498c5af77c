"""``captioner.files.hold_lock`` / ``lock_is_free``: the one lock (``filelock``) the feature cache and the download cache share."""

from __future__ import annotations

from pathlib import Path

import pytest

from captioner.errors import CaptionerError, DataError
from captioner.files import hold_lock, lock_file, lock_is_free


def test_lock_file_sits_beside_what_it_guards(tmp_path: Path) -> None:
    assert lock_file(tmp_path / "model.safetensors") == tmp_path / "model.safetensors.lock"


def test_a_held_lock_keeps_a_second_holder_out_until_it_is_released(tmp_path: Path) -> None:
    lock = lock_file(tmp_path / "cache.feats")
    assert lock_is_free(lock, 0.0)  # no lock file yet
    with hold_lock(lock) as held:
        assert held == lock and lock.exists()
        assert not lock_is_free(lock, 0.2)
        with pytest.raises(CaptionerError, match="held by another process"):
            with hold_lock(lock, timeout=0.2):
                pass
        with pytest.raises(DataError, match="busy"):
            with hold_lock(lock, timeout=0.0, busy=lambda: DataError("busy")):
                pass
    assert lock_is_free(lock, 0.0)
    with hold_lock(lock, timeout=0.0):  # free again: taken at once
        pass


def test_a_block_that_raises_still_releases_the_lock(tmp_path: Path) -> None:
    lock = lock_file(tmp_path / "x")
    with pytest.raises(ValueError):
        with hold_lock(lock):
            raise ValueError("inside")
    assert lock_is_free(lock, 0.0)


def test_a_lock_held_by_another_process_is_seen(tmp_path: Path) -> None:
    import subprocess
    import sys

    lock = lock_file(tmp_path / "x")
    code = ("import sys, time; from filelock import FileLock; l = FileLock(sys.argv[1]); l.acquire(); "
            "print('held', flush=True); time.sleep(30)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not lock_is_free(lock, 0.1)
    finally:
        holder.kill()
        holder.wait()
    assert lock_is_free(lock, 2.0)  # the system dropped the dead holder's lock


def test_release_lock_file_removes_a_free_lock_and_its_empty_folder(tmp_path: Path) -> None:
    from captioner.files import release_lock_file

    folder = tmp_path / "urls" / "abc"
    folder.mkdir(parents=True)
    lock = lock_file(folder / "model.safetensors")
    with hold_lock(lock):
        release_lock_file(lock)  # held (by another holder, as far as a new lock can tell): left alone
        assert lock.exists()
    (folder / "model.safetensors.part").write_bytes(b"x")  # something to resume: the folder stays
    release_lock_file(lock)
    assert not lock.exists() and folder.is_dir()
    (folder / "model.safetensors.part").unlink()
    lock.touch()
    release_lock_file(lock)
    assert not folder.exists()
