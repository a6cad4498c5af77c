"""The demo says when a decoder trained far fewer steps than its reference figures (a busy machine)."""

from __future__ import annotations

from captioner.demo.report import REFERENCE, format_table, pace_notes, render_html, steps_of_reference


def test_a_busy_machine_is_named_with_the_budget_that_would_reach_the_reference() -> None:
    rows = [{"decoder": "sat_soft", "steps": 525}, {"decoder": "sat_hard", "steps": 1500},
            {"decoder": "transformer", "steps": 166}, {"decoder": "sat_soft+scst", "steps": 10}]
    notes = pace_notes(rows, {"sat_soft": 120.0, "sat_hard": 120.0, "transformer": 45.0})
    assert notes == [
        "sat_soft trained 525 steps in 120 s, 28% of the 1876 of the reference figures (docs/demo.md), so its "
        "scores are not comparable to them; it trained at 28% of the reference pace: the machine was busy or "
        "slower; --budget sat_soft=430 would reach them at this pace",
        "transformer trained 166 steps in 45 s, 20% of the 832 of the reference figures (docs/demo.md), so its "
        "scores are not comparable to them; it trained at 20% of the reference pace: the machine was busy or "
        "slower; --budget transformer=230 would reach them at this pace"]
    at_reference = [{"decoder": n, "steps": s} for n, (s, _) in REFERENCE.items()]
    assert pace_notes(at_reference, {n: b for n, (_, b) in REFERENCE.items()}) == []
    assert steps_of_reference("sat_hard", 800) == 0.5 and steps_of_reference("sat_hard+scst", 800) is None


def test_a_short_budget_is_named_as_the_reason() -> None:
    [note] = pace_notes([{"decoder": "sat_hard", "steps": 200}], {"sat_hard": 15.0})
    assert "its budget was 15 s against 120 s; --budget sat_hard=120 would reach them" in note
    assert pace_notes([{"decoder": "sat_hard", "steps": 200}], {}) == []  # another preset: not compared


def test_the_table_and_the_report_show_it(tmp_path) -> None:
    row = {"decoder": "transformer", "steps": 166, "steps_of_reference": steps_of_reference("transformer", 166)}
    table = format_table([row])
    assert "of ref. steps" in table.splitlines()[0] and "20%" in table.splitlines()[-1]
    notes = pace_notes([row], {"transformer": 45.0})
    page = render_html({"table": [row], "runs": {}, "pace": notes}, tmp_path)
    assert '<p class="warning"><b>Fewer steps than usual:</b> transformer trained 166 steps' in page
