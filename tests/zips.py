"""Zip archives built in memory, as the download tests serve them."""

from __future__ import annotations

import io
import zipfile


def zip_bytes(files: dict[str, bytes]) -> bytes:
    """The bytes of a zip holding ``files`` (member name -> contents)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return buf.getvalue()
