"""A full disk, whatever library hit it, as one clear error.

Out of space reaches the trainer in several forms: Python's ``OSError(ENOSPC)``, safetensors'
``SafetensorError: ... No space left on device (os error 28)``, and torch's serializer's
``RuntimeError: basic_ios::clear: iostream error`` or ``[enforce fail at inline_container.cc] unexpected
pos`` (which carry no errno: those count as a full disk only when the folder has next to no space left).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Iterator, Optional

from utils.errors import UserError

_SPACE_TEXTS = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")
_TORCH_WRITE_TEXTS = ("basic_ios::clear", "unexpected pos", "file write failed")
_NEARLY_FULL = 64 * 2**20  # a torch write error with less free space than this is a full disk


class DiskFullError(UserError):
    """Writing into the output folder (or the cache) failed for lack of space."""


def is_disk_full(exc: BaseException, folder: Optional[Path] = None) -> bool:
    """Whether ``exc`` (or an exception it chains) is an out-of-space error."""
    for error in chain(exc):
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(error)
        if any(s in text for s in _SPACE_TEXTS):
            return True
        if folder is not None and any(s in text for s in _TORCH_WRITE_TEXTS):
            free = free_bytes(folder)
            return free is not None and free < _NEARLY_FULL
    return False


def free_bytes(folder: Path) -> Optional[int]:
    """Free space of the filesystem holding ``folder`` (its nearest existing parent), or None."""
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (0 when it is missing)."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file()) if Path(folder).is_dir() else 0


def human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def message(what: str, folder: Path, last_checkpoint: Optional[Path], needed: Optional[int] = None) -> str:
    """The one line of a full disk: what failed, where, the space, the last good checkpoint, how to go on."""
    free = free_bytes(folder)
    space = f"{human(free)} free" if free is not None else "no space left"
    if needed:
        space += f", about {human(needed)} needed"
    resume = (f"the last good checkpoint is {last_checkpoint} (intact); free space and resume with "
              "resume_from_checkpoint=latest") if last_checkpoint else \
        "there is no checkpoint yet; free space and run the same command again"
    return f"{what} failed: the disk is full ({folder}: {space}); {resume}"


def where(exc: BaseException) -> str:
    """The innermost function of this project that ``exc`` passed through, e.g.
    ``FeatureCache.put in image_datasets/cache.py``: safetensors' and torch's errors name no file."""
    root = Path(__file__).resolve().parents[2]  # trainer/run_folder/ -> the project
    found = "the run"
    tb = exc.__traceback__
    while tb is not None:
        path = Path(tb.tb_frame.f_code.co_filename).resolve()
        if root in path.parents and "site-packages" not in path.parts:
            code = tb.tb_frame.f_code
            found = f"{getattr(code, 'co_qualname', code.co_name)} in {path.relative_to(root)}"
        tb = tb.tb_next
    return found


def chain(exc: BaseException) -> Iterator[BaseException]:
    seen = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
