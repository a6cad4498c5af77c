"""Image-file checks of a caption set before anything trains (``check_images``).

Moved out of ``captioner.data.coco``, which still exports ``check_images`` as the same object.
"""

from __future__ import annotations

import logging

from captioner.data.caption_set import CaptionSet, all_missing_message
from captioner.data.images import DEFAULT_MAX_PIXELS, probe_image
from captioner.errors import DataError, ImageLoadError

log = logging.getLogger(__name__)

__all__ = ["check_images"]


def check_images(cs: CaptionSet, skip_missing: bool = False, check_headers: bool = True,
                 max_pixels: int | None = None, workers: int = 8) -> CaptionSet:
    """Find missing and unreadable image files before training.

    Every file must exist; with ``check_headers`` its header must also parse as an image of at
    most ``max_pixels`` pixels (:func:`captioner.data.images.probe_image`, no pixel decoding), so
    empty files, text files named ``.jpg``, broken headers and decompression bombs are found here
    rather than in the middle of an epoch. Truncated pixel data is only seen when an image is
    decoded (the feature cache and evaluation skip such images when asked).

    Args:
        cs: a caption set.
        skip_missing: return a copy without the missing or unreadable images (logged) instead of
            failing.
        check_headers: also open each file's header (threaded; about a millisecond per file).
        max_pixels: size limit (default :data:`captioner.data.images.DEFAULT_MAX_PIXELS`).
        workers: threads for the header checks.

    Returns:
        ``cs`` itself when every file is fine, else the filtered copy.

    Raises:
        DataError: some files are missing or unreadable and ``skip_missing`` is False, or all of
            them are.
    """
    missing = [i for i, r in enumerate(cs.images) if not r.path.is_file()]
    where = cs.images_dir if cs.images_dir is not None else (cs.images[0].path.parent if cs.images else cs.root)
    total = len(cs.images)
    if missing:
        examples = ", ".join(cs.images[i].file_name for i in missing[:3])
        if len(missing) == total:
            raise DataError(all_missing_message(total, examples, where))
        if not skip_missing:
            raise DataError(f"{len(missing)} of {total} image files are missing (e.g. {examples}) under {where}; "
                            "pass --skip-missing to skip them")
        log.warning("skipping %d of %d images whose files are missing (e.g. %s) under %s",
                    len(missing), total, examples, where)
    gone = set(missing)
    bad: list[tuple[int, str]] = []
    if check_headers:
        bad = _unreadable([i for i in range(total) if i not in gone], cs, max_pixels, workers)
    if bad:
        examples = "; ".join(f"{cs.images[i].file_name}: {reason}" for i, reason in bad[:3])
        if len(bad) + len(gone) == total:
            raise DataError(f"none of the {total} image files can be read (e.g. {examples}) under {where}")
        if not skip_missing:
            raise DataError(f"{len(bad)} of {total} image files cannot be read (e.g. {examples}) under {where}; "
                            "pass --skip-missing to skip them")
        log.warning("skipping %d of %d images whose files cannot be read (e.g. %s) under %s",
                    len(bad), total, examples, where)
        gone |= {i for i, _ in bad}
    if not gone:
        return cs
    return cs.subset([i for i in range(total) if i not in gone])


def _unreadable(indices: list[int], cs: CaptionSet, max_pixels: int | None, workers: int) -> list[tuple[int, str]]:
    """``(index, reason)`` of the images whose header does not parse (reason without the path)."""
    from concurrent.futures import ThreadPoolExecutor


    limit = DEFAULT_MAX_PIXELS if max_pixels is None else max_pixels

    def probe(i: int) -> str | None:
        path = cs.images[i].path
        try:
            probe_image(path, max_pixels=limit)
        except ImageLoadError as exc:
            text = str(exc)
            prefix = f"{path}: "
            return text[len(prefix):] if text.startswith(prefix) else text
        return None

    if len(indices) < 64 or workers <= 1:
        reasons = [probe(i) for i in indices]
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            reasons = list(pool.map(probe, indices, chunksize=64))
    return [(i, r) for i, r in zip(indices, reasons) if r is not None]
