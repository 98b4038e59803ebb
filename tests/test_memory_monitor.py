"""utils.memory_monitor: host/GPU figures and per-phase peaks, on this (CPU) machine."""

import gc
import json
import mmap
import sys

import pytest
import torch

from utils.memory_monitor import (
    MemoryMonitor,
    get_memory_stats,
    log_memory_usage,
    reset_peak_memory_stats,
)

LINUX = sys.platform.startswith("linux")
BLOCK = 256 * 2**20  # bytes touched inside a phase


def _allocate(nbytes: int = BLOCK) -> mmap.mmap:
    """``nbytes`` of resident memory that is returned to the system when freed: an anonymous map with
    every page written. (A tensor this size came from malloc's heap in CI, reusing memory that was
    already resident and keeping it after the free, so RSS did not follow it.)"""
    block = mmap.mmap(-1, nbytes)
    for offset in range(0, nbytes, mmap.PAGESIZE):
        block[offset] = 1
    return block


def test_get_memory_stats_host_figures():
    stats = get_memory_stats()
    assert stats["host_rss_gib"] > 0
    if LINUX:
        assert stats["host_peak_rss_gib"] >= stats["host_rss_gib"]
        assert 0 < stats["host_available_gib"] <= stats["host_total_gib"]
    assert all(isinstance(v, float) for v in stats.values())


def test_get_memory_stats_leaves_cuda_alone():
    if torch.cuda.is_initialized():
        pytest.skip("CUDA already initialised in this process")
    stats = get_memory_stats()
    assert not any(k.startswith("gpu_") for k in stats)
    assert not torch.cuda.is_initialized()


def test_rss_follows_allocations():
    gc.collect()  # earlier tests' garbage is not freed in the middle of the measurement
    before = get_memory_stats()["host_rss_gib"]
    block = _allocate()
    alive = get_memory_stats()["host_rss_gib"]
    block.close()
    freed = get_memory_stats()["host_rss_gib"]
    assert alive - before > 0.8 * BLOCK / 2**30 and alive - freed > 0.8 * BLOCK / 2**30


def test_log_memory_usage(logs):
    stats = log_memory_usage("before_training")
    assert stats["host_rss_gib"] > 0
    assert "Memory [before_training]" in logs[-1]["message"] and "host_rss=" in logs[-1]["message"]


def test_reset_peak_memory_stats_runs_without_cuda():
    reset_peak_memory_stats()
    reset_peak_memory_stats(host=True)


def test_phase_records_peaks_and_writes(logs):
    written = []
    monitor = MemoryMonitor(writer=lambda tag, value, step: written.append((tag, value, step)))
    gc.collect()
    with monitor.phase("cache_pass", step=3):
        block = _allocate()
        block.close()
    record = monitor.summary()["phases"]["cache_pass"]
    assert record["runs"] == 1 and record["seconds"] >= 0
    if LINUX:
        # The block was freed before the phase ended: only a peak measurement sees it.
        assert record["host_peak_rss_gib"] >= get_memory_stats()["host_rss_gib"] + 0.8 * BLOCK / 2**30
    assert ("memory/cache_pass/host_peak_rss_gib", record["host_peak_rss_gib"], 3) in written
    assert any("Memory phase 'cache_pass'" in r["message"] for r in logs)


@pytest.mark.skipif(not LINUX, reason="per-phase host peaks need /proc/self/clear_refs")
def test_host_peak_is_per_phase():
    monitor = MemoryMonitor()
    with monitor.phase("big"):
        del_me = _allocate()
        del_me.close()
    with monitor.phase("small"):
        pass
    phases = monitor.summary()["phases"]
    assert phases["big"]["host_peak_exact"] and phases["small"]["host_peak_exact"]
    assert phases["big"]["host_peak_rss_gib"] - phases["small"]["host_peak_rss_gib"] > 0.8 * BLOCK / 2**30
    # The lifetime peak survives the resets of VmHWM.
    assert monitor.summary()["peak"]["host_peak_rss_gib"] >= phases["big"]["host_peak_rss_gib"]


def test_repeated_phase_merges_runs():
    monitor = MemoryMonitor()
    for _ in range(3):
        with monitor.phase("checkpoint"):
            pass
    assert monitor.summary()["phases"]["checkpoint"]["runs"] == 3


def test_summary_is_json_and_logged(logs):
    monitor = MemoryMonitor()
    with monitor.phase("load"):
        pass
    with monitor.phase("first_step"):
        pass
    summary = monitor.log_summary()
    assert json.loads(json.dumps(summary)) == summary
    assert set(summary["phases"]) == {"load", "first_step"}
    assert set(summary["peak"]) == {"host_peak_rss_gib", "gpu_peak_allocated_gib", "gpu_peak_reserved_gib"}
    assert any("Memory peak overall" in r["message"] for r in logs)


def test_phase_records_even_when_the_block_raises():
    monitor = MemoryMonitor()
    with pytest.raises(RuntimeError):
        with monitor.phase("load"):
            raise RuntimeError("boom")
    assert monitor.summary()["phases"]["load"]["runs"] == 1


def test_broken_writer_does_not_stop_training(logs):
    def writer(tag, value, step):
        raise OSError("disk full")

    monitor = MemoryMonitor(writer=writer)
    with monitor.phase("load"):
        pass
    assert any("writer failed" in r["message"] for r in logs if r["level"].name == "WARNING")


def test_disabled_monitor_records_nothing():
    monitor = MemoryMonitor(enabled=False)
    with monitor.phase("load"):
        pass
    assert monitor.summary()["phases"] == {}
