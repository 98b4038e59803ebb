"""Writing the user's small files so that a crash or a full disk never leaves half of one."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> Path:
    """Write ``text`` (UTF-8) beside ``path`` and rename it into place: a reader sees the old file or
    the new one, never half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)  # a full disk keeps no half-written file
        except OSError:
            pass  # (a read-only folder refuses this too): the error to report is the write's
        raise
    return path
