"""One run per output folder: ``<output_dir>/run.lock``.

The lock holds ``{"host": str, "pid": int, "started": float}`` (the trainer's main process) and is
created with ``O_EXCL``, so of two runs started together exactly one gets it. A lock whose owner ran
on this host and is no longer alive (kill -9, power loss) is stale and taken over; a lock from
another host cannot be checked from here and is never taken over.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

from loguru import logger

from utils.errors import ConfigError

LOCK_NAME = "run.lock"


class RunLock:
    """The lock of one output folder, held by this process from ``acquire`` to ``release``."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / LOCK_NAME
        self.owner: Dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        self.held = False

    def acquire(self) -> None:
        """Take the lock, or raise ``ConfigError`` naming the folder and the run that holds it."""
        with _folder_mutex(self.path.parent):  # a stale lock is replaced by one run, not two
            for _ in range(2):
                if self._create():
                    self.held = True
                    return
                holder = read_lock(self.path)
                if holder is None or not _is_stale(holder):
                    raise ConfigError(_refusal(self.path, holder))
                logger.warning(f"{self.path}: taking over the lock of a run that is gone "
                               f"(pid {holder['pid']} on {holder['host']}, started {_when(holder['started'])})")
                self.path.unlink(missing_ok=True)
        raise ConfigError(_refusal(self.path, read_lock(self.path)))

    def release(self) -> None:
        """Remove the lock if it is still ours."""
        if self.held and read_lock(self.path) == self.owner:
            self.path.unlink(missing_ok=True)
        self.held = False

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            json.dump(self.owner, fh)
            fh.flush()
            os.fsync(fh.fileno())
        return True


def read_lock(path: Path) -> Optional[Dict[str, Any]]:
    """The owner recorded in a lock file, or None when it is missing or unreadable."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and isinstance(data.get("host"), str) and isinstance(data.get("pid"), int) \
        and isinstance(data.get("started"), (int, float))
    return data if ok else None


def _is_stale(holder: Dict[str, Any]) -> bool:
    """Same host and the pid no longer runs (another host's process cannot be checked)."""
    if holder["host"] != socket.gethostname():
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _refusal(path: Path, holder: Optional[Dict[str, Any]]) -> str:
    folder = path.parent
    if holder is None:
        return (f"output_dir '{folder}' is in use by another run ({path} exists but names no owner); "
                f"if no run uses this folder, delete {path}")
    return (f"output_dir '{folder}' is in use by another run (pid {holder['pid']} on {holder['host']}, started "
            f"{_when(holder['started'])}); wait for it, stop it, or choose another output_dir (if that run is "
            f"gone, delete {path})")


def _when(started: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))


@contextmanager
def _folder_mutex(folder: Path) -> Iterator[None]:
    """An advisory lock on the folder itself while the lock file is checked and written."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the flock
