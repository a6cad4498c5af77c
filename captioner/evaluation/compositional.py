"""Scores of a compositional split of the synthetic scenes (``captioner make-shapes --unseen-pairs K``).

The split keeps K colour-shape pairs out of train and val; the test split has scenes with one of
them and scenes without. A decoder that composes colour and shape names the unseen pairs as well as
the seen ones; one that memorised pairs does not. Reported (``compositional_scores``):

* ``objects_correct_seen`` / ``objects_correct_unseen``: the share of captions naming every object
  right (``caption_object_accuracy``), over test scenes without / with an unseen pair;
* ``unseen_pairs_named`` / ``seen_pairs_named``: over the objects whose pair is unseen / seen, the
  share the caption names with its own colour directly before its shape noun (``"purple star"``);
* ``scenes_seen``, ``scenes_unseen``, ``objects_unseen``: the counts behind them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from captioner.evaluation.attention_metrics import caption_object_accuracy
from captioner.evaluation.object_words import find_mentions


def _pair(obj: Any) -> tuple[str, str]:
    return str(obj.attributes.get("color", "")).lower(), obj.category


def pair_named(words: Sequence[str], obj: Any) -> bool:
    """The caption names ``obj``'s shape with ``obj``'s colour word directly before it."""
    color, shape = _pair(obj)
    return any(m.category == shape and m.attributes.get("color") == color for m in find_mentions(words, "shapes"))


def _share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def compositional_scores(results: Sequence[Any], caption_set: Any, instances: Any) -> dict[str, Any] | None:
    """Seen/unseen scores of decoded test captions (module docstring), or None without unseen pairs.

    Args:
        results: one caption per image (``words``), aligned with ``caption_set.images``.
        caption_set: the decoded images.
        instances: ``load_instances`` output; its ``unseen_pairs`` says which pairs were held out.
    """
    unseen = {(c.lower(), s) for c, s in getattr(instances, "unseen_pairs", ())}
    if not unseen:
        return None
    correct: dict[bool, list[bool]] = {False: [], True: []}
    named: dict[bool, list[bool]] = {False: [], True: []}
    for result, record in zip(results, caption_set.images):
        objects = instances.get(record.image_id, [])
        has_unseen = any(_pair(o) in unseen for o in objects)
        correct[has_unseen].append(caption_object_accuracy(result.words, objects))
        for obj in objects:
            named[_pair(obj) in unseen].append(pair_named(result.words, obj))
    return {"unseen_pairs": sorted(" ".join(p) for p in unseen),
            "objects_correct_seen": _share(correct[False]), "objects_correct_unseen": _share(correct[True]),
            "seen_pairs_named": _share(named[False]), "unseen_pairs_named": _share(named[True]),
            "scenes_seen": len(correct[False]), "scenes_unseen": len(correct[True]),
            "objects_unseen": len(named[True])}
