"""Kept for old imports: the download helpers now live in the package.

``download``, ``verify`` and ``file_digest`` are :mod:`captioner.download`; ``open_zip``,
``write_members``, ``prepare`` and ``Steps`` are :mod:`captioner.data.downloads`
(``captioner download flickr8k|coco`` uses both).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from captioner.data.downloads import Steps, open_zip, prepare, write_members  # noqa: E402,F401
from captioner.download import CHUNK, download, file_digest, verify  # noqa: E402,F401
