"""Every number option of every command is checked while the command line is parsed, with a range."""

from __future__ import annotations

import argparse

import pytest

from captioner.cli import build_parser, main


def _number_options() -> list[tuple[str, argparse.Action]]:
    found = []
    top = build_parser()
    stack = [("", top)]
    while stack:
        prefix, parser = stack.pop()
        for action in parser._actions:  # noqa: SLF001 - argparse keeps them there
            if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
                stack.extend((f"{prefix} {name}".strip(), sub) for name, sub in action.choices.items())
            elif action.type is not None and action.option_strings:
                found.append((prefix, action))
    return found


def test_every_number_option_has_a_range() -> None:
    options = _number_options()
    bare = [f"{command} {action.option_strings[-1]}" for command, action in options
            if action.type in (int, float) or getattr(action.type, "__name__", "") == "finite_float"]
    assert bare == []  # int / float / finite_float accept any size: use int_range / float_range
    ranged = [(command, action) for command, action in options
              if getattr(action.type, "__name__", "") in ("whole number", "number")]
    assert len(ranged) >= 30
    for command, action in ranged:
        with pytest.raises(argparse.ArgumentTypeError, match="must be|expected"):
            action.type("-1e300")  # below every range (and not a whole number)
        with pytest.raises(argparse.ArgumentTypeError, match="must be|expected"):
            action.type("100000000000000000000000")  # above every range


@pytest.mark.parametrize("argv, message", [
    (["caption", "x.png", "--beam", "0"], "argument --beam: must be between 1 and 10000, got 0"),
    (["caption", "x.png", "--alpha", "2"], "argument --alpha: must be at least 0 and at most 1, got 2"),
    (["evaluate", "-c", "m.safetensors", "--workers", "100000"], "argument --workers: must be between 0 and 64"),
    (["train", "--epochs", "-2"], "argument --epochs: must be between 1 and 100000, got -2"),
    (["train", "--lr", "0"], "argument --lr: must be over 0 and at most 10, got 0"),
    (["demo", "--jobs", "0"], "argument --jobs: must be between 1 and 256, got 0"),
    (["attend", "x.png", "--head", "0"], "argument --head: must be between 1 and 1000, got 0"),
])
def test_a_number_out_of_range_is_one_usage_line(argv: list[str], message: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_an_error_line_quotes_a_huge_value_by_a_prefix(capsys) -> None:
    assert main(["train", "--preset", "sat_soft_tiny", "--set", "encoder.name=" + "x" * 1_000_000]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) <= 1100 and err.rstrip().endswith("...")
