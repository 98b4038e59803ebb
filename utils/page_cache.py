"""The OS page cache, asked and changed: how much of a file is cached (``mincore``), evicting a file,
reading one in. The loader's ``auto`` choice and the load benchmarks share these (Linux; elsewhere
the question answers None)."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path
from typing import Optional, Sequence, Union

PathLike = Union[str, os.PathLike]


def cached_fraction(files: Sequence[PathLike]) -> Optional[float]:
    """The share of the files' pages in the page cache; None where it cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):  # no libc with mmap / mincore
        return None
    cached = total = 0
    for path in files:
        size = os.path.getsize(path)
        if size == 0:
            continue
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        with open(path, "rb") as fh:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fh.fileno(), 0)
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            residency = (ctypes.c_ubyte * pages)()
            if libc.mincore(address, size, residency) != 0:
                return None
            cached += sum(b & 1 for b in bytes(residency))
            total += pages
        finally:
            libc.munmap(address, size)
    return cached / total if total else None


def evict(path: PathLike) -> None:
    """Drop a file's pages from the cache (best effort; written pages are synced first, since dirty
    pages cannot be dropped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_in(path: PathLike) -> None:
    """Read a whole file, so its pages are cached."""
    with open(Path(path), "rb", buffering=0) as fh:
        while fh.read(64 << 20):
            pass
