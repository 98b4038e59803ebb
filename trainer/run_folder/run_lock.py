"""One run per output folder: ``<output_dir>/run.lock``.

The lock holds ``{"host": str, "pid": int, "started": float}`` (the trainer's main process). It is never
seen empty: the owner is written to a temporary file first, which is then hard-linked into place
(``link`` fails when a lock exists, so of two runs started together exactly one gets it). The owning
process keeps an ``flock`` on the file for as long as it runs; the kernel drops it when the process
dies however it dies (kill -9, a full disk mid-way, power loss). So a lock no live process holds is
stale and taken over, whatever it contains (an owner, nothing, garbage). A lock naming another host
is never taken over: a lock on a network filesystem cannot be checked from here.

The owner also holds an ``flock`` on the output folder itself (its descriptor), which nobody deletes by
hand while the run uses it: a ``run.lock`` deleted during the run (as a stale one may be) leaves the
folder locked, and a second run is refused all the same.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Dict, Optional

from loguru import logger

from utils.errors import ConfigError

LOCK_NAME = "run.lock"
_HELD: Dict[Path, int] = {}  # the locks this process holds -> the descriptor keeping their flock
_FOLDERS: Dict[Path, int] = {}  # the same locks -> the descriptor keeping their folder's flock


class RunLock:
    """The lock of one output folder, held by this process from ``acquire`` to ``release``."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / LOCK_NAME
        self.owner: Dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        self.held = False

    def acquire(self) -> None:
        """Take the lock, or raise ``ConfigError`` naming the folder and the run that holds it."""
        folder_fd = _lock_folder(self.path.parent)  # one run at a time past here: a stale lock is replaced once
        try:
            self._take_lock_file()
        except BaseException:
            if folder_fd is not None:
                os.close(folder_fd)
            raise
        if folder_fd is not None:
            _FOLDERS[self.path] = folder_fd
        self.held = True

    def _take_lock_file(self) -> None:
        """``run.lock`` written with this process as its owner; a stale one is taken over."""
        if self.path.is_dir() and not self.path.is_symlink():
            raise ConfigError(f"{self.path} is a folder, not a lock file: remove it (it is not the trainer's) "
                              "or choose another output_dir")
        _remove_orphans(self.path)
        for _ in range(2):
            if self._create():
                return
            holder = read_lock(self.path)
            if not _is_stale(self.path, holder):
                raise ConfigError(_refusal(self.path, holder))
            logger.warning(f"{self.path}: taking over the lock of a run that is gone ({_describe(holder)})")
            self.path.unlink(missing_ok=True)
        raise ConfigError(_refusal(self.path, read_lock(self.path)))

    def release(self) -> None:
        """Remove the lock if it is still ours; let go of the folder."""
        fd = _HELD.pop(self.path, None) if self.held else None
        if fd is not None:
            if _same_file(fd, self.path):
                self.path.unlink(missing_ok=True)
            os.close(fd)  # drops the flock
        folder_fd = _FOLDERS.pop(self.path, None) if self.held else None
        if folder_fd is not None:
            os.close(folder_fd)
        self.held = False

    def _create(self) -> bool:
        """Write the owner beside the lock, flocked, and link it into place; False if a lock exists."""
        tmp = self.path.with_name(f".{LOCK_NAME}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held before the lock can be seen
            data = json.dumps(self.owner).encode()
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
            os.fsync(fd)
            if not _link(tmp, self.path):
                os.close(fd)
                return False
        except BaseException:
            os.close(fd)
            raise
        finally:
            tmp.unlink(missing_ok=True)
        _HELD[self.path] = fd
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


def live_owner(folder: Path) -> Optional[Dict[str, Any]]:
    """The owner recorded in ``folder``'s lock while a live process on this machine holds it (its flock):
    the one liveness rule for the trainer and the web page. None when there is no lock, it is stale, or
    it names another host (which cannot be checked from here)."""
    path = Path(folder) / LOCK_NAME
    holder = read_lock(path)
    if holder is None or holder["host"] != socket.gethostname():
        return None
    return holder if is_held(path) else None


def is_held(path: Path) -> bool:
    """Whether a live process holds the lock file ``path`` (its flock), on this machine."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # a filesystem without flock: say held, so nothing is taken over on a guess
        return True
    finally:
        os.close(fd)
    return False


def _is_stale(path: Path, holder: Optional[Dict[str, Any]]) -> bool:
    """No live process holds the lock (this one included). Another host's lock cannot be checked from
    here: a flock on a network filesystem is not to be trusted."""
    if holder is not None and holder["host"] != socket.gethostname():
        return False
    return not is_held(path)


def _link(tmp: Path, lock: Path) -> bool:
    """``tmp`` as ``lock``, atomically, unless a lock exists."""
    try:
        os.link(tmp, lock)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV):
            raise
        # A filesystem without hard links (FAT, some network shares): the folder mutex orders the runs.
        if lock.exists():
            return False
        os.replace(tmp, lock)
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        mine, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _remove_orphans(lock: Path) -> None:
    """Temporary owner files of runs killed before their lock was in place (none holds them)."""
    for tmp in lock.parent.glob(f".{LOCK_NAME}.*.tmp"):
        if not is_held(tmp):
            tmp.unlink(missing_ok=True)


def _describe(holder: Optional[Dict[str, Any]]) -> str:
    if holder is None:
        return "the lock names no owner"
    return f"pid {holder['pid']} on {holder['host']}, started {_when(holder['started'])}"


def _refusal(path: Path, holder: Optional[Dict[str, Any]]) -> str:
    """Why the folder is refused. Deleting the lock is suggested only for another host's, which cannot
    be checked from here: on this host a live process holds it (a gone run's lock is taken over)."""
    folder = path.parent
    if holder is None:
        return (f"output_dir '{folder}' is in use by another run ({path} is held by a running process but names "
                f"no owner yet); wait for it, or choose another output_dir")
    gone = f" (if that run is gone, delete {path})" if holder["host"] != socket.gethostname() else ""
    return (f"output_dir '{folder}' is in use by another run (pid {holder['pid']} on {holder['host']}, started "
            f"{_when(holder['started'])}); wait for it, stop it, or choose another output_dir{gone}")


def _folder_refusal(path: Path) -> str:
    """A live process on this host holds the folder's flock (its ``run.lock`` may have been deleted)."""
    holder = read_lock(path)
    if holder is not None:
        return _refusal(path, holder)
    return (f"output_dir '{path.parent}' is in use by another run on this machine (it holds the folder locked; "
            f"{path} is missing, deleted during that run or not written yet); wait for it, stop it, or choose "
            "another output_dir")


def _when(started: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))


def _lock_folder(folder: Path) -> Optional[int]:
    """The descriptor of ``folder`` holding its flock for the run; ``ConfigError`` when a live process
    holds it. None where the filesystem has no flock for folders (some network shares): ``run.lock``
    alone then guards it."""
    fd = os.open(folder, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(_folder_refusal(Path(folder) / LOCK_NAME)) from None
    except OSError:
        os.close(fd)
        return None
    return fd


def _close_in_child() -> None:
    """A forked child (a data-loader worker) must not keep the lock's flocks alive after the run dies."""
    for fd in [*_HELD.values(), *_FOLDERS.values()]:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()
    _FOLDERS.clear()


os.register_at_fork(after_in_child=_close_in_child)
