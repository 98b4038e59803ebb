"""GPU and host memory figures, and per-phase peaks (load, cache pass, first step, checkpoint).

Host figures come from ``/proc`` on Linux (``VmRSS``/``VmHWM`` of ``/proc/self/status``,
``MemAvailable``/``MemTotal`` of ``/proc/meminfo``), else from psutil if it is installed, else
only the peak from ``resource``. GPU figures are read only once CUDA is initialised: a monitor
must not start CUDA (that would freeze the allocator settings).

On a unified-memory machine (GB10) GPU allocations come out of the same pool as host memory, so
``host_available_gib`` already accounts for them.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import torch
from loguru import logger

GIB = 2**30
Writer = Callable[[str, float, int], None]


# --------------------------------------------------------------------------- host


def _proc_kib(path: str, keys: tuple) -> Dict[str, int]:
    """``key: <n> kB`` lines of a /proc file, in bytes."""
    found: Dict[str, int] = {}
    try:
        for line in Path(path).read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in keys and rest.split():
                found[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return found


def _host_stats() -> Dict[str, float]:
    status = _proc_kib("/proc/self/status", ("VmRSS", "VmHWM"))
    meminfo = _proc_kib("/proc/meminfo", ("MemAvailable", "MemTotal"))
    stats = {"host_rss_gib": status.get("VmRSS"), "host_peak_rss_gib": status.get("VmHWM"),
             "host_available_gib": meminfo.get("MemAvailable"), "host_total_gib": meminfo.get("MemTotal")}
    if stats["host_rss_gib"] is None:
        stats.update(_host_stats_fallback())
    return {k: round(v / GIB, 3) for k, v in stats.items() if v is not None}


def _host_stats_fallback() -> Dict[str, Optional[int]]:
    """Non-Linux: psutil when installed (not a dependency), and the peak from ``resource``."""
    stats: Dict[str, Optional[int]] = {}
    try:
        import psutil

        stats["host_rss_gib"] = psutil.Process().memory_info().rss
        memory = psutil.virtual_memory()
        stats["host_available_gib"], stats["host_total_gib"] = memory.available, memory.total
    except ImportError:
        pass
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        stats["host_peak_rss_gib"] = peak if sys.platform == "darwin" else peak * 1024  # bytes vs KiB
    except (ImportError, OSError):
        pass
    return stats


def _reset_host_peak() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------- GPU


def _gpu_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _gpu_stats(device: Optional[int] = None) -> Dict[str, float]:
    if not _gpu_ready():
        return {}
    stats = {
        "gpu_allocated_gib": torch.cuda.memory_allocated(device),
        "gpu_reserved_gib": torch.cuda.memory_reserved(device),
        "gpu_peak_allocated_gib": torch.cuda.max_memory_allocated(device),
        "gpu_peak_reserved_gib": torch.cuda.max_memory_reserved(device),
    }
    try:
        free, total = torch.cuda.mem_get_info(device)
        stats.update(gpu_free_gib=free, gpu_total_gib=total)
    except RuntimeError:  # some drivers/platforms cannot report it
        pass
    return {k: round(v / GIB, 3) for k, v in stats.items()}


def get_memory_stats(device: Optional[int] = None) -> Dict[str, float]:
    """Memory now, in GiB: ``gpu_*`` (allocated, reserved, their peaks, free/total) once CUDA is
    initialised, and ``host_*`` (RSS, peak RSS, available, total)."""
    return {**_gpu_stats(device), **_host_stats()}


def _format(stats: Dict[str, float]) -> str:
    return ", ".join(f"{k.removesuffix('_gib')}={v:.2f}GiB" for k, v in stats.items())


def log_memory_usage(tag: str = "", device: Optional[int] = None) -> Dict[str, float]:
    """Log ``get_memory_stats()`` under ``tag``; returns the stats."""
    stats = get_memory_stats(device)
    logger.info(f"Memory [{tag}]: {_format(stats)}")
    return stats


def reset_peak_memory_stats(device: Optional[int] = None, host: bool = False) -> None:
    """Reset the GPU peak counters (when CUDA is up) and, with ``host=True``, the host's VmHWM."""
    if _gpu_ready():
        torch.cuda.reset_peak_memory_stats(device)
    if host:
        _reset_host_peak()


# --------------------------------------------------------------------------- phases


@dataclass
class PhaseRecord:
    """Peaks of one named phase (the maxima over all its runs), in GiB."""

    runs: int = 0
    seconds: float = 0.0
    gpu_peak_allocated_gib: float = 0.0
    gpu_peak_reserved_gib: float = 0.0
    host_peak_rss_gib: float = 0.0
    host_peak_exact: bool = True  # False: a lower bound (see MemoryMonitor)

    def merge(self, measured: Dict[str, float], seconds: float, exact: bool) -> None:
        self.runs += 1
        self.seconds += seconds
        for key in ("gpu_peak_allocated_gib", "gpu_peak_reserved_gib", "host_peak_rss_gib"):
            setattr(self, key, max(getattr(self, key), measured.get(key, 0.0)))
        self.host_peak_exact = self.host_peak_exact and exact


@dataclass
class MemoryMonitor:
    """Per-phase memory peaks, logged at each phase end and summarised at the end of training.

    ``with monitor.phase("cache_pass", step=0): ...`` resets the GPU peak counters at the start
    and reads ``max_memory_allocated`` at the end (so code inside the phase should not reset
    them). Host peak: the kernel's VmHWM is a process-lifetime maximum; on Linux the monitor
    resets it at phase start (``/proc/self/clear_refs``), which makes the phase peak exact. Where
    that is not possible it takes VmHWM when the phase set a new process record, else the larger
    of RSS at start and end, a lower bound marked ``host_peak_exact: False``. Resetting VmHWM
    affects other readers of it in this process; the monitor keeps the lifetime peak itself.

    ``writer(tag, value, step)``, when given, receives every phase figure (e.g. tensorboard's
    ``add_scalar``) under ``memory/<phase>/<figure>``.
    """

    writer: Optional[Writer] = None
    device: Optional[int] = None
    enabled: bool = True
    phases: Dict[str, PhaseRecord] = field(default_factory=dict)
    _lifetime_host_peak: float = field(default=0.0, init=False, repr=False)

    @contextlib.contextmanager
    def phase(self, name: str, step: int = 0) -> Iterator[None]:
        """Measure the peaks of the enclosed block as phase ``name``."""
        if not self.enabled:
            yield
            return
        before = _host_stats()
        self._lifetime_host_peak = max(self._lifetime_host_peak, before.get("host_peak_rss_gib", 0.0))
        exact = _reset_host_peak()
        reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._finish(name, step, before, exact, time.perf_counter() - start)

    def _finish(self, name: str, step: int, before: Dict[str, float], exact: bool, seconds: float) -> None:
        after = get_memory_stats(self.device)
        host_peak, exact = self._host_peak(before, after, exact)
        measured = {k: after[k] for k in ("gpu_peak_allocated_gib", "gpu_peak_reserved_gib") if k in after}
        measured["host_peak_rss_gib"] = host_peak
        self._lifetime_host_peak = max(self._lifetime_host_peak, host_peak)
        self.phases.setdefault(name, PhaseRecord()).merge(measured, seconds, exact)
        logger.info(f"Memory phase '{name}' ({seconds:.1f}s): {_format(measured)}"
                    + ("" if exact else " (host peak is a lower bound)"))
        for key, value in measured.items():
            self._write(f"memory/{name}/{key.removesuffix('_gib')}_gib", value, step)

    @staticmethod
    def _host_peak(before: Dict[str, float], after: Dict[str, float], reset_ok: bool) -> tuple:
        hwm = after.get("host_peak_rss_gib", 0.0)
        if reset_ok or hwm > before.get("host_peak_rss_gib", 0.0):
            return hwm, True  # VmHWM was reset, or the phase set a new lifetime record
        return max(before.get("host_rss_gib", 0.0), after.get("host_rss_gib", 0.0)), False

    def _write(self, tag: str, value: float, step: int) -> None:
        if self.writer is None:
            return
        try:
            self.writer(tag, float(value), step)
        except Exception as error:  # a broken tracker must not stop training
            logger.warning(f"memory monitor writer failed on {tag}: {error}")

    def summary(self) -> Dict[str, object]:
        """``{"phases": {name: peaks...}, "peak": {overall maxima}}``, in GiB."""
        phases = {name: asdict(record) for name, record in self.phases.items()}
        peak: Dict[str, float] = {"host_peak_rss_gib": self._lifetime_host_peak}
        for key in ("gpu_peak_allocated_gib", "gpu_peak_reserved_gib"):
            values: List[float] = [getattr(r, key) for r in self.phases.values()]
            peak[key] = max(values, default=0.0)
        return {"phases": phases, "peak": peak}

    def log_summary(self) -> Dict[str, object]:
        """Log one line per phase and the overall peaks; returns ``summary()``."""
        summary = self.summary()
        for name, record in summary["phases"].items():  # type: ignore[union-attr]
            figures = {k: v for k, v in record.items() if k.endswith("_gib")}
            logger.info(f"Memory peak '{name}' x{record['runs']}: {_format(figures)}")
        logger.info(f"Memory peak overall: {_format(summary['peak'])}")  # type: ignore[arg-type]
        return summary
