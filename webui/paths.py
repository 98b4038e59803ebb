"""Resolving names from requests to files: nothing outside a given root is ever read.

A request names a run by its folder name and a file by a path relative to that folder. Absolute
paths, ``..`` and symlinks that lead out of the root are refused, and so is any name with odd
characters; the check is on the resolved path, so a symlink inside the root pointing elsewhere is
caught too.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class OutsideRoot(ValueError):
    """A requested path that is not inside its root (or not a valid name)."""


def check_name(name: str) -> str:
    """``name`` when it is a plain folder or file name (letters, digits, ``._-``; no leading dot)."""
    if not NAME.fullmatch(name or ""):
        raise OutsideRoot(f"'{name}' is not a valid name (letters, digits, '.', '_', '-'; no leading dot)")
    return name


def safe_join(root: Path, relative: str) -> Path:
    """``root / relative`` resolved, when it stays inside ``root``; ``OutsideRoot`` otherwise. A
    request's paths use '/'; a backslash is a file name's own character here (POSIX), not a separator."""
    parts = PurePosixPath(relative)
    if not relative or parts.is_absolute() or ".." in parts.parts or ":" in relative or "\x00" in relative:
        raise OutsideRoot(f"path '{relative}' must be relative, without '..'")
    base = root.resolve()
    target = (base / parts).resolve()
    if not target.is_relative_to(base):  # a symlink leading out
        raise OutsideRoot(f"path '{relative}' leads outside its folder")  # (the server's own paths are not shown)
    return target


def run_folder(runs_dir: Path, run_id: str) -> Path:
    """The folder of run ``run_id`` (a folder name directly under ``runs_dir``)."""
    return safe_join(runs_dir, check_name(run_id))
