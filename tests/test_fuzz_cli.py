"""Fuzzing the command line and the Python API with values of the wrong type (issue 26).

Each CLI case runs one command with every option valid but one, which gets a seeded random value
of the wrong type or out of range (a word for a number, NaN, a huge number, a pipe or a device for
a file, a file for a folder, a name too long for the file system, a newline...). Training cases
point at an empty dataset folder, so an option that is wrongly accepted still ends before any
training, in the data check. Every case must give exit code 1 or 2, exactly one line on stderr,
no traceback, no file changed outside the output folder, within a bounded time; the test process
must stay under 2 GB. The API cases call ``captioner.load`` and ``Captioner.caption`` with
wrong-typed arguments and expect a ``CaptionerError`` with a one-line message, nothing else.
"""

from __future__ import annotations

import hashlib
import os
import random
import resource
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from captioner.cli import main
from captioner.errors import CaptionerError

SEED = 26
VALUES_PER_OPTION = 4
SECONDS_PER_CASE = 30.0
WORDS = ["abc", "", " ", "1.5", "nan", "inf", "-inf", "1e999", "[1, 2]", "{}", "null", "true", "0x10", "a\nb",
         "\udcff", "é\u202e", "x" * 300]
INTS = WORDS + ["0", "-1", "-99999999999999999999", "99999999999999999999"]  # the last: HUGE
HUGE = "99999999999999999999"
VALID = {("evaluate", "--workers"): {"0"}, ("make-shapes", "--seed"): {"0", HUGE}, ("evaluate", "--max-images"): {HUGE},
         ("evaluate", "--batch-size"): {HUGE}, ("caption", "--batch-size"): {HUGE}}  # right values after all
FLOATS = WORDS[:1] + ["", "nan", "inf", "-inf", "1e999", "-1", "2", "[0.5]", "1,5"]


def _paths(ws: Path) -> list[str]:
    """Values for an option that wants a file: things that are not a usable file."""
    return [str(ws / "missing.bin"), "/dev/zero", str(ws / "pipe"), str(ws / "empty_dataset"),
            str(ws / "notes.txt" / "sub"),
            str(ws / ("n" * 300)), str(ws / "broken"), "", "a\nb"]


def _folders(ws: Path) -> list[str]:
    """Values for an option that wants a folder to write in: things that are not one."""
    return [str(ws / "notes.txt"), str(ws / "notes.txt" / "sub"), "/dev/null/x", str(ws / ("n" * 300)), "/proc/x"]


def _wrong_setting(rng: random.Random) -> str:
    """``key=value`` for a random config key, with a value of another type than the key's."""
    import dataclasses

    from captioner.config import DataConfig, DecodeOptions, EncoderConfig, SATConfig, TrainConfig
    from captioner.config.parse import field_types

    sections = {"train": TrainConfig, "data": DataConfig, "encoder": EncoderConfig, "decoder": SATConfig,
                "decoding": DecodeOptions}
    prefix, cls = rng.choice(sorted(sections.items()))
    field = rng.choice([f.name for f in dataclasses.fields(cls) if f.name != "name"])
    hint = str(field_types(cls)[field])
    if "str" in hint:
        value = rng.choice(["1", "2.5", "true", "[1]", "{}"])
    elif "bool" in hint:
        value = rng.choice(["1", "0", "abc", "[]", "2.5"])
    else:
        value = rng.choice(["abc", '"1"', "true", "{}", "NaN", "Infinity", "[[1]]", "2.5" if "int" in hint else "x"])
    return f"{prefix}.{field}={value}"


def _cases(ws: Path, data: Path, ckpt: Path, image: Path) -> list[tuple[str, list[str]]]:
    """(what was fuzzed, argv) for every command, seeded."""
    rng = random.Random(SEED)
    empty = ws / "empty_dataset"
    out = ws / "out"
    options: dict[str, tuple[list[str], dict[str, list[str]]]] = {
        "train": (["train", "--preset", "sat_soft_tiny", "--data", str(empty), "--out", str(out / "run"),
                   "--no-progress"],
                  {"--epochs": INTS, "--batch-size": INTS, "--lr": FLOATS, "--time-budget": FLOATS,
                   "--device": WORDS, "--preset": WORDS, "--config": _paths(ws), "--init": _paths(ws),
                   "--out": _folders(ws), "--data": _paths(ws), "--set": ["set"]}),
        "caption": (["caption", str(image), "-c", str(ckpt), "--beam", "1", "--max-len", "2"],
                    {"--beam": INTS, "--max-len": INTS, "--batch-size": INTS, "--alpha": FLOATS, "--cmap": WORDS,
                     "--device": WORDS, "-c": _paths(ws), "PATH": _paths(ws), "--overlay": _folders(ws)}),
        "attend": (["attend", str(image), "-c", str(ckpt), "--out", str(out / "attend"), "--beam", "1",
                    "--max-len", "2"],
                   {"--beam": INTS, "--max-len": INTS, "--alpha": FLOATS, "--cmap": WORDS, "--layer": INTS,
                    "--head": INTS, "--stem": ["", ".", "..", "../x", "a/b", "a\nb"], "--device": WORDS,
                    "-c": _paths(ws), "IMAGE": _paths(ws), "--out": _folders(ws)}),
        "evaluate": (["evaluate", str(ckpt), "--data", str(data), "--out", str(out / "eval"), "--no-progress",
                      "--no-meteor", "--beam", "1", "--max-len", "2"],
                     {"--beam": INTS, "--max-len": INTS, "--batch-size": INTS, "--max-images": INTS,
                      "--workers": INTS, "--split": WORDS, "--device": WORDS, "--images": _paths(ws),
                      "--data": _paths(ws), "CHECKPOINT": _paths(ws), "--out": _folders(ws)}),
        "make-shapes": (["make-shapes", "--out", str(out / "shapes"), "--images", "3", "--image-size", "32"],
                        {"--images": INTS, "--image-size": INTS, "--seed": INTS, "--out": _folders(ws)}),
    }
    cases = []
    for command, (base, fuzzable) in options.items():
        for option in sorted(fuzzable):  # every option, a few random wrong values each
            values = fuzzable[option] * (VALUES_PER_OPTION if option == "--set" else 1)
            for value in rng.sample(values, min(VALUES_PER_OPTION, len(values))):
                if value in VALID.get((command, option), ()):
                    continue  # a right value after all
                argv = list(base)
                if option == "--set":
                    value = _wrong_setting(rng)
                    argv += ["--set", value]
                elif command == "caption" and option in ("--cmap", "--alpha"):
                    argv += [option, value, "--overlay", str(out / "overlays")]  # only read with overlays
                elif option in ("PATH", "IMAGE", "CHECKPOINT"):
                    argv[1] = value  # the positional argument
                elif option in argv:
                    argv[argv.index(option) + 1] = value
                else:
                    argv += [option, value]
                cases.append((f"{command} {option}={value[:40]!r}", argv))
    return cases


def _tree(*roots: Path) -> dict[str, str]:
    state = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_symlink() or not path.is_file():
                state[str(path)] = "link" if path.is_symlink() else "dir" if path.is_dir() else "special"
            else:
                state[str(path)] = hashlib.sha1(path.read_bytes()).hexdigest()
    return state


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory, untrained_checkpoint) -> dict[str, Path]:
    ws = tmp_path_factory.mktemp("fuzz")
    ckpt = untrained_checkpoint(ws, "sat_soft_tiny")
    image = ws / "photo.png"
    Image.new("RGB", (20, 12), (10, 200, 10)).save(image)
    (ws / "notes.txt").write_text("a file, not a folder")
    (ws / "broken").symlink_to(ws / "nowhere")
    os.mkfifo(ws / "pipe")
    (ws / "empty_dataset").mkdir()
    (ws / "out").mkdir()
    return {"ws": ws, "ckpt": ckpt, "image": image}



def reset_peak_memory() -> None:
    """Start the process's peak resident memory (VmHWM) afresh, where Linux allows it (clear_refs 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_memory_gb() -> float:
    """The process's peak resident memory since :func:`reset_peak_memory` (VmHWM), else since it started."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024**2  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB on Linux


@pytest.mark.timeout(300)
def test_cli_options_with_wrong_values_give_one_line_and_change_nothing(
        workspace: dict[str, Path], tiny_shapes: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    ws = workspace["ws"]
    monkeypatch.chdir(ws / "out")  # relative defaults (runs/<preset>) land in the output folder
    reset_peak_memory()  # the peak of these cases, not of the tests this process ran before them
    before = _tree(ws, tiny_shapes)
    failures = []
    for what, argv in _cases(ws, tiny_shapes, workspace["ckpt"], workspace["image"]):
        began = time.monotonic()
        try:
            code = main(argv)
        except BaseException as exc:  # noqa: BLE001 - anything escaping main() is the bug being looked for
            failures.append(f"{what}: {type(exc).__name__} escaped: {str(exc)[:160]}")
            capsys.readouterr()
            continue
        seconds = time.monotonic() - began
        err = capsys.readouterr().err
        lines = err.splitlines()
        if code not in (1, 2) or len(lines) != 1 or "Traceback" in err or seconds > SECONDS_PER_CASE:
            failures.append(f"{what}: exit {code}, {seconds:.1f} s, stderr {err[:300]!r}")
    after = {k: v for k, v in _tree(ws, tiny_shapes).items() if not k.startswith(str(ws / "out"))}
    assert after == {k: v for k, v in before.items() if not k.startswith(str(ws / "out"))}, "files changed"
    assert not failures, "\n".join(failures)
    assert peak_memory_gb() < 2.0


def _api_values(rng: random.Random, side: int) -> list[Any]:
    """Wrong-typed things to pass where an image goes."""
    return [None, 3, 2.5, "", b"\xff", "nowhere.png", "a\x00b", "/dev/zero", [[]], {"a": 1}, object(),
            torch.zeros(3, side, side, dtype=torch.uint8), torch.zeros(side, side), torch.zeros(1, 1, 3, side, side),
            torch.full((3, side, side), float("nan")), torch.zeros(3, side, side, dtype=torch.int32),
            Image.new("RGB", (0, 5)), Image.new("RGB", (9000, 8000)), torch.zeros(3, side + rng.randint(1, 9), side)]


@pytest.mark.timeout(120)
def test_api_inputs_with_wrong_types_raise_one_line_captioner_errors(workspace: dict[str, Path]) -> None:
    import captioner

    rng = random.Random(SEED)
    for bad in ("nowhere.safetensors", "", "a\x00b", "/dev/zero", str(workspace["ws"] / "pipe"), 3, None):
        for device in ("cpu", "meta", "gpu", 7):
            try:
                captioner.load(bad, device=device)
            except CaptionerError as exc:
                assert str(exc) and "\n" not in str(exc), (bad, device, str(exc))
            except Exception as exc:  # noqa: BLE001
                pytest.fail(f"load({bad!r}, device={device!r}): {type(exc).__name__}: {exc}")
            else:
                pytest.fail(f"load({bad!r}, device={device!r}) succeeded")
    model = captioner.load(workspace["ckpt"], device="cpu")
    side = model.transform.size
    good = workspace["image"]
    kwargs_pool: dict[str, list[Any]] = {
        "beam": [0, -1, 1.5, "3", None, True, 10**9], "max_len": [0, "20", 2.5, None, -3, False, 10**12],
        "batch_size": [0, "8", 1.5, None, True], "attention": ["yes", 1, None], "all_heads": ["no", 0, []],
        "allow_unk": ["true", 1, None], "options": [3, "beam", {"beam_size": 2}],
    }
    cases: list[tuple[Any, dict[str, Any]]] = [(value, {}) for value in _api_values(rng, side)]
    for name, values in kwargs_pool.items():
        cases += [(good, {name: value}) for value in values]
    rng.shuffle(cases)
    for images, kwargs in cases:
        began = time.monotonic()
        try:
            model.caption(images, **{"max_len": 2, **kwargs})
        except CaptionerError as exc:
            assert str(exc) and "\n" not in str(exc), (kwargs, str(exc))
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"caption({type(images).__name__}, {kwargs}): {type(exc).__name__}: {str(exc)[:200]}")
        else:
            pytest.fail(f"caption({images!r:.60}, {kwargs}) was accepted")
        assert time.monotonic() - began < SECONDS_PER_CASE
