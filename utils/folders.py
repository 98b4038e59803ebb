"""The folders a run writes (``output_dir``, ``cache_dir``): created and checked before any work, each
mistake one line naming the key, the path and what to do instead of an ``OSError`` traceback."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Optional

from utils.errors import ConfigError

# Folders of the operating system: a run's outputs or cache never belong there (as root nothing stops it).
SYSTEM_FOLDERS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/sbin", "/sys", "/usr")


def system_folder(path: str | Path) -> Optional[str]:
    """The system folder ``path`` is (or is inside), or None; ``/`` itself counts."""
    resolved = Path(path).expanduser().resolve()
    if resolved == Path("/"):
        return "/"
    return next((root for root in SYSTEM_FOLDERS if resolved == Path(root) or Path(root) in resolved.parents), None)


def writable_folder(path: str | Path, key: str) -> Path:
    """Create ``path`` (with its parents) and check a file can be written in it; raise ``ConfigError``
    naming ``key`` when it cannot. A full disk is left to the caller's out-of-space message."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise ConfigError(f"key '{key}': {why_not_writable(folder, exc)}") from None
    return folder


def why_not_writable(folder: Path, exc: OSError) -> str:
    """What is wrong with ``folder`` as a place to write, and what to do (one line)."""
    if folder.exists() and not folder.is_dir():
        return f"'{folder}' is a file, not a folder; choose a folder path (or move the file away)"
    blocker = next((p for p in folder.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None or exc.errno == errno.ENOTDIR:
        return f"'{folder}' is inside '{blocker or folder.parent}', which is a file; choose a folder path"
    if exc.errno == errno.EROFS:
        return f"'{folder}' cannot be written: the file system is read-only; choose a folder on a writable disk"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (f"'{folder}' cannot be written: permission denied; choose a folder you can write to "
                "(or change its permissions)")
    return f"'{folder}' cannot be created or written: {exc.strerror or exc}; choose another folder"
