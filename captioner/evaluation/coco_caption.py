"""The papers' scoring: coco-caption BLEU-1..4, METEOR, ROUGE-L and CIDEr-D through pycocoevalcap.

Published captioning numbers (Xu et al. 2015 and after) come from the coco-caption toolkit:
every caption is tokenised by Stanford CoreNLP's PTBTokenizer (lowercased; the punctuation tokens
``. , ? ! : ; - -- ... ' '' ` `` -LRB- -RRB-`` dropped; ``man's`` -> ``man 's``, ``t-shirt`` stays
one token), then scored by its own BLEU (closest reference length), METEOR 1.5, ROUGE-L and
CIDEr-D (document frequencies from the evaluated references). :func:`coco_caption_metrics` does
exactly that with pycocoevalcap's own classes, so its numbers are comparable with the papers'.
The built-in scores (:mod:`captioner.evaluation.metrics`) use the package's tokenizer instead;
on the same tokens the two implementations agree (see docs/evaluation.md for measured gaps).

Needs the ``metrics`` extra (``pip install 'captioner[metrics]'``) and Java on ``PATH``; without
them :func:`unavailable_reason` says why and nothing is computed. Cost: the tokeniser starts one
Java process for hypotheses and references together (about 0.5-1 s); METEOR starts another (a few
seconds). pycocoevalcap's tokeniser writes its temporary file next to its jar, so its folder must
be writable. Keys carry a ``coco/`` prefix (``coco/BLEU-4``), beside the built-in ``BLEU-4``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Hashable, Iterator, Mapping, Sequence

from captioner.evaluation.metrics import _meteor, _tokenized

COCO_KEYS = ("coco/BLEU-1", "coco/BLEU-2", "coco/BLEU-3", "coco/BLEU-4", "coco/METEOR", "coco/ROUGE-L",
             "coco/CIDEr-D")
LABEL = "coco-caption scores (pycocoevalcap, PTB tokenisation: the papers' scoring)"
# Characters Java (or Python's splitlines) may take for a line end: the tokeniser reads one caption per line.
_LINE_BREAKS = re.compile("[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")
_SENTINEL = "captionersentinel"


def unavailable_reason() -> str | None:
    """Why coco-caption scores cannot be computed here, or None when they can."""
    try:
        from pycocoevalcap.bleu.bleu import Bleu  # noqa: F401
        from pycocoevalcap.cider.cider import Cider  # noqa: F401
        from pycocoevalcap.rouge.rouge import Rouge  # noqa: F401
        from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer  # noqa: F401
    except ImportError:
        return "needs pycocoevalcap: pip install 'captioner[metrics]'"
    if shutil.which("java") is None:
        return "needs Java on PATH for the PTB tokeniser"
    return None


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[list[str]]:
    """Send file descriptor 2 to a temporary file (Java's progress line); yields its lines afterwards."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines += tmp.read().decode(errors="replace").splitlines()


def ptb_tokenize(captions: Mapping[Hashable, Sequence[str]]) -> dict[Hashable, list[str]]:
    """PTB-tokenise captions with pycocoevalcap's ``PTBTokenizer``, in one Java process.

    Args:
        captions: ``{key: [caption, ...]}``.

    Returns:
        ``{key: [tokenised caption, ...]}`` (space-separated tokens, in the same order).

    Raises:
        RuntimeError: the tokeniser failed or its output lines do not line up with the captions.
    """
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    sentinel = ("captioner", "sentinel")  # its tokens show that no caption was split over two lines
    data = {k: [{"caption": _LINE_BREAKS.sub(" ", c)} for c in caps] for k, caps in captions.items()}
    data[sentinel] = [{"caption": _SENTINEL}]
    with _quiet_stderr() as messages:
        try:
            out = PTBTokenizer().tokenize(data)
        except Exception as exc:  # Java missing or crashing, an unwritable package folder
            raise RuntimeError(f"PTB tokeniser failed: {exc}") from None
    if out.get(sentinel) != [_SENTINEL] or any(len(out.get(k, ())) != len(v) for k, v in captions.items()):
        detail = next((m for m in reversed(messages) if m.strip()), "output lines do not match the captions")
        raise RuntimeError(f"PTB tokeniser failed: {detail}")
    del out[sentinel]
    return out


def coco_caption_metrics(hypotheses: Sequence[str], references: Sequence[Sequence[str]],
                         meteor: bool = True) -> tuple[dict[str, float | None], str]:
    """coco-caption scores of one caption per image against all its references.

    Args:
        hypotheses: one generated caption per image (raw text).
        references: per image, all its reference captions (raw text).
        meteor: also run METEOR (a second Java process, a few seconds).

    Returns:
        ``({"coco/BLEU-1": .., ..., "coco/CIDEr-D": ..}, note)``: every value None and the note
        saying why when the scores cannot be computed here; ``coco/METEOR`` None when METEOR is off
        or fails. BLEU, METEOR and ROUGE-L on the 0-1 scale, CIDEr-D on coco-caption's x10 scale.
    """
    _tokenized(hypotheses, references)  # the built-in scorers' input checks, one message for both
    empty: dict[str, float | None] = dict.fromkeys(COCO_KEYS)
    reason = unavailable_reason()
    if reason is not None:
        return empty, f"coco-caption scores not computed: {reason}"
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    raw: dict[Hashable, Sequence[str]] = {("hyp", i): [h] for i, h in enumerate(hypotheses)}
    raw.update({("ref", i): list(refs) for i, refs in enumerate(references)})
    try:
        tokens = ptb_tokenize(raw)
    except RuntimeError as exc:
        return empty, f"coco-caption scores not computed: {str(exc).splitlines()[0]}"
    gts = {i: tokens[("ref", i)] for i in range(len(references))}
    res = {i: tokens[("hyp", i)] for i in range(len(hypotheses))}
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    out: dict[str, float | None] = {f"coco/BLEU-{n + 1}": float(b) for n, b in enumerate(bleu)}
    out["coco/METEOR"] = _meteor(gts, res) if meteor else None
    out["coco/ROUGE-L"] = float(Rouge().compute_score(gts, res)[0])
    out["coco/CIDEr-D"] = float(Cider().compute_score(gts, res)[0])
    note = "PTB tokenisation and scorers of pycocoevalcap, as in the papers"
    if out["coco/METEOR"] is None:
        note += "; METEOR " + ("off" if not meteor else "failed (see the log)")
    return out, note
