"""The demo report: ``report.html`` (self-contained) and ``report.json``.

The page holds the comparison table, the training curves, a few test images per decoder with
their overlays and links to their explorers; nothing is fetched from the network. The demo trains
on wall-clock budgets, so :func:`pace_notes` says when a decoder trained far fewer steps than the
figures of docs/demo.md, why, and which ``--budget`` would reach them.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from captioner.errors import DataError
from captioner.files import atomic_write

log = logging.getLogger(__name__)


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
    ("steps_of_reference", "of ref. steps", "{:.0%}"),
    ("steps_per_s", "steps/s", "{:.1f}"),
    ("epochs", "epochs", "{:.1f}"),
    ("parameters", "params", "{:,}"),
)


def table_row(decoder: str, metrics: dict[str, Any], train_seconds: float, epochs: float, params: dict[str, int],
              steps: int | None = None, attention_supervision: float | None = None) -> dict[str, Any]:
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


# --- pace: how far each decoder got against the reference figures ---

# (optimizer steps, budget in seconds) of each decoder in the default `captioner demo` on a 2-core CPU:
# the run behind the measured figures of docs/demo.md (presets <decoder>_demo).
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


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1200px;color:#222;padding:0 1em}
table{border-collapse:collapse;font-size:14px;margin:1em 0}th,td{padding:4px 8px;border-bottom:1px solid #ddd;text-align:right}
th:first-child,td:first-child{text-align:left}th{background:#f4f4f4}
.note{color:#555;font-size:13px;max-width:900px}figure{margin:1em 0}figcaption{font-size:14px;margin-top:4px}
img.overlay{max-width:100%;border:1px solid #ccc}h2{margin-top:2em;border-bottom:2px solid #eee}
.warning{background:#fff4e0;border-left:4px solid #e69500;padding:6px 10px;max-width:900px}
"""


def read_metrics_csv(run_dir: str | os.PathLike) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """``(step_rows, epoch_rows)`` of a run's ``metrics.csv`` with numeric cells as floats."""
    path = Path(run_dir) / "metrics.csv"
    steps: list[dict[str, float]] = []
    epochs: list[dict[str, float]] = []
    if not path.is_file():
        return steps, epochs
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            values = {}
            for key, cell in row.items():
                try:
                    values[key] = float(cell)
                except (TypeError, ValueError):
                    continue
            (steps if row.get("kind") == "step" else epochs).append(values)
    return steps, epochs


def curves_png(runs: dict[str, str | os.PathLike], labels: dict[str, str] | None = None) -> bytes | None:
    """Training loss per step and validation BLEU-4 per epoch of several runs, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    data = {name: read_metrics_csv(d) for name, d in runs.items()}
    if not any(s or e for s, e in data.values()):
        return None
    fig, (ax_loss, ax_bleu) = plt.subplots(1, 2, figsize=(11, 3.6))
    for name, (steps, epochs) in data.items():
        label = (labels or {}).get(name, name)
        pts = [(r["step"], r.get("ce", r.get("loss"))) for r in steps if "step" in r and ("ce" in r or "loss" in r)
               and "scst_reward" not in r]  # a self-critical stage logs -reward, not a cross-entropy
        if pts:
            ax_loss.plot(*zip(*pts), label=label)
        pts = [(r["seconds"], r["BLEU-4"]) for r in epochs if "seconds" in r and "BLEU-4" in r]
        if pts:
            ax_bleu.plot(*zip(*pts), marker="o", label=label)
    ax_loss.set(xlabel="step", ylabel="cross-entropy", title="training loss")
    ax_bleu.set(xlabel="training seconds", ylabel="BLEU-4 (0-1)", title="validation BLEU-4 (greedy)", ylim=(0, 1))
    for ax in (ax_loss, ax_bleu):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _cell(value: Any, fmt: str) -> str:
    return html.escape(format_value(value, fmt))


def render_table(rows: Sequence[dict[str, Any]], labels: dict[str, str]) -> str:
    """HTML comparison table (columns of ``captioner.demo.report.COLUMNS``)."""
    columns = shown_columns(rows)
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h, _ in columns)
    body = []
    for row in rows:
        cells = [html.escape(labels.get(row["decoder"], row["decoder"]))]
        cells += [_cell(row.get(key), fmt) for key, _, fmt in columns[1:]]
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


_NOTES = """<p class="note">BLEU-1..4 on the 0-1 scale and CIDEr-D on the coco-caption scale (0-10), against
all 5 references of each test image. <b>att. sup.</b>: the weight of the attention supervision by the object boxes
the decoder trained with (<code>train.attention_supervision</code>; 0: without, <code>--no-attention-supervision</code>);
<b>seen ok</b> / <b>unseen ok</b> / <b>unseen named</b> (with <code>--unseen-pairs</code>): objects ok over test scenes
with only seen colour-shape pairs / with a pair never seen in training, and the share of those unseen pairs named right.
<b>objects ok</b>: share of test captions that name every object with its right colour and shape
and invent none. <b>att. corr.</b>: for each word naming an object (and the colour/size words before it),
the share of its attention mass inside the object's ground-truth box, with the attention placed on the
original image; <b>uniform</b>: what uniform attention scores on the same boxes (the boxes' area share);
<b>ratio</b> = att. corr. / uniform; <b>pointing</b>: the most attended region's centre lies in the box.
<b>entropy</b>: mean attention entropy per generated word (nats), against <b>log N</b> for uniform attention
over N regions. The Transformer's maps are its last layer's cross-attention averaged over heads.
<b>train s</b>: wall time of training (features, training, validation).</p>"""


def _overlay_section(label: str, run: dict[str, Any], out_dir: Path) -> str:
    parts = [f"<h2>{html.escape(label)}</h2>"]
    metrics_file = run.get("metrics_file")
    if metrics_file:
        parts.append(f'<p class="note">metrics: <a href="{html.escape(_rel(metrics_file, out_dir))}">'
                     f'{html.escape(_rel(metrics_file, out_dir))}</a>; checkpoint: '
                     f'{html.escape(_rel(run.get("checkpoint", ""), out_dir))}</p>')
    for item in run.get("overlays", []):
        try:
            png = Path(item["png"]).read_bytes()
        except OSError as exc:
            log.warning("%s: overlay missing (%s)", item.get("png"), exc)
            continue
        refs = "; ".join(item.get("references", [])[:2])
        parts.append(
            f'<figure><img class="overlay" src="{data_uri(png)}" alt="attention overlays">'
            f'<figcaption><b>{html.escape(item["caption"])}</b> &mdash; image {item["image_id"]}, '
            f'<a href="{html.escape(_rel(item["html"], out_dir))}">explorer</a>'
            f'<br><span class="note">references include: {html.escape(refs)}</span></figcaption></figure>')
    return "\n".join(parts)


def _rel(path: str | os.PathLike, base: Path) -> str:
    try:
        return Path(os.path.relpath(Path(path).resolve(), base.resolve())).as_posix()
    except ValueError:  # another drive (Windows)
        return Path(path).as_posix()


def render_html(report: dict[str, Any], out_dir: str | os.PathLike) -> str:
    """The whole report page as one self-contained HTML string."""
    out_dir = Path(out_dir)
    runs = report.get("runs", {})
    curves = curves_png({n: r["run_dir"] for n, r in runs.items()}, LABELS)
    scenes = report.get("scenes", {})
    opts = report.get("options", {})
    env = report.get("environment", {})
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(report.get('title', 'captioner demo'))}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(report.get('title', 'captioner demo'))}</h1>",
        f"<p>{scenes.get('images')} synthetic scenes (seed {scenes.get('seed')}, {scenes.get('image_size')} px) in "
        f"<code>{html.escape(str(opts.get('data')))}</code>; training budgets "
        f"{html.escape(_budgets(runs))}; test captions with beam {opts.get('beam_size')}; total time "
        f"{report.get('seconds', 0):.0f} s on {env.get('cpus')} CPU(s), torch {html.escape(str(env.get('torch')))}, "
        f"{env.get('threads')} threads.</p>",
        _encoder_note(report.get("encoder")),
        render_table(report.get("table", []), LABELS),
        "".join(f'<p class="warning"><b>Fewer steps than usual:</b> {html.escape(n)}.</p>'
                for n in report.get("pace", [])),
        _NOTES,
    ]
    if curves:
        parts.append(f'<h2>Training</h2><img src="{data_uri(curves)}" alt="training curves" style="max-width:100%">')
    for name, run in runs.items():
        parts.append(_overlay_section(LABELS.get(name, name), run, out_dir))
    parts.append("</body></html>")
    return "\n".join(parts)


def _budgets(runs: dict[str, Any]) -> str:
    return ", ".join(f"{LABELS.get(n, n)} {r['budget']:.0f} s" for n, r in runs.items() if r.get("budget")) or "-"


def _encoder_note(encoder: dict[str, Any] | None) -> str:
    if not encoder:
        return ""
    enc = encoder.get("encoder", {})
    return (f'<p class="note">Encoder, shared and frozen: a {enc.get("name", "")} CNN (width {enc.get("width")}, '
            f'{enc.get("image_size")} px in, {enc.get("grid")}x{enc.get("grid")} regions) trained from scratch for '
            f'{encoder.get("seconds", 0):.0f} s ({encoder.get("steps")} steps) as word detectors on the training '
            f'captions (multiple-instance learning, Fang et al. 2015{_detector_extras(encoder)}; loss '
            f'{encoder.get("first_loss")} &rarr; {encoder.get("last_loss")}), then its features were cached once '
            f'for all decoders.</p>')


def _detector_extras(encoder: dict[str, Any]) -> str:
    parts = []
    if encoder.get("grounded_images"):
        parts.append(f'the object words of {encoder["grounded_images"]} images also region by region on their '
                     f'boxes')
    if encoder.get("recolour"):
        parts.append(f'{encoder["recolour"]:.0%} of the images recoloured, their colour words left out')
    return "".join(f"; {p}" for p in parts)


def write_report(report: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write ``report.html`` and ``report.json`` into ``out_dir`` (atomically): ``{"html": path, "json": path}``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"html": out_dir / "report.html", "json": out_dir / "report.json"}
    _atomic_write(paths["json"], json.dumps(report, indent=2, default=str) + "\n")
    _atomic_write(paths["html"], render_html(report, out_dir))
    log.info("wrote %s and %s", paths["html"], paths["json"])
    return paths


def _atomic_write(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode("utf-8")), error=DataError)
