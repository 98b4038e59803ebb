"""Unified-memory machines (DGX Spark GB10, Grace-Hopper GH200, Grace-Blackwell GB200/GB300):
detection, allocator set-up before CUDA starts, and the memory policy the engine applies.

On these machines the GPU reaches the host's memory directly (GB10: one 128 GB pool; Grace
superchips: NVLink-C2C, cache-coherent), so moving encoders or the VAE "to the CPU" saves nothing
and costs copies, pinned staging buffers are pointless, and in-memory caches are cheap.

Detection uses what the device reports, never "capability >= 9" (a discrete H100/H200 is not
unified):

1. the environment override ``QWEN_TRAINER_UNIFIED_MEMORY=1|0`` (also true/false, yes/no, on/off);
2. ``cudaDeviceProp.integrated`` (torch's ``is_integrated``): the GPU shares the host's memory;
3. an aarch64 host whose GPU is a Grace superchip or GB10 by name (``GH200``, ``GB200``,
   ``GB300``, ``GB10``, ...): read from torch once CUDA is up, or from the kernel driver
   (``/proc/driver/nvidia/gpus/*/information``) before, so detection never initialises CUDA.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from loguru import logger

from .device_facts import DeviceFacts, read_device_facts

ENV_OVERRIDE = "QWEN_TRAINER_UNIFIED_MEMORY"
ALLOC_ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the second is torch >= 2.9's name
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}

# GH200 / GB200 / GB300 / GB10 as a word of the device name ("NVIDIA GH200 480GB"), never the
# "80GB" of a memory size (no letter or digit may precede it).
_SUPERCHIP_NAME = re.compile(r"(?<![A-Za-z0-9])G[HB]\d{2,3}(?![0-9])", re.IGNORECASE)

_pending_fraction: Optional[float] = None


def _env_override() -> Optional[bool]:
    raw = os.environ.get(ENV_OVERRIDE, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    if raw:
        logger.warning(f"{ENV_OVERRIDE}={raw!r} is not 1/0 (true/false); detecting instead")
    return None


def detect_unified_memory(facts: Optional[DeviceFacts] = None) -> Tuple[bool, str]:
    """(unified?, why). Does not initialise CUDA when ``facts`` is left out."""
    override = _env_override()
    if override is not None:
        return override, f"{ENV_OVERRIDE}={os.environ[ENV_OVERRIDE]}"
    facts = read_device_facts(init_cuda=False) if facts is None else facts
    if facts.is_integrated:
        return True, f"{facts.name} reports an integrated GPU (shares host memory)"
    if facts.host_arch.lower() in ("aarch64", "arm64") and _SUPERCHIP_NAME.search(facts.name):
        return True, f"{facts.name} on an aarch64 host: Grace/GB10 superchip with coherent host memory"
    return False, f"{facts.name}: discrete memory" if facts.name != "cpu" else "no GPU"


def is_unified_memory_system(facts: Optional[DeviceFacts] = None) -> bool:
    """True on GB10 (DGX Spark) and Grace-Hopper/Grace-Blackwell; False on discrete GPUs and CPUs.

    ``QWEN_TRAINER_UNIFIED_MEMORY=1|0`` overrides the detection. Safe to call before CUDA starts.
    """
    return detect_unified_memory(facts)[0]


# --------------------------------------------------------------------------- allocator


def _merge_alloc_conf(current: str, key: str, value: str) -> str:
    """Add ``key:value`` to an allocator config string unless the user already set ``key``."""
    items = [item.strip() for item in current.split(",") if item.strip()]
    if any(item.split(":", 1)[0].strip() == key for item in items):
        return ",".join(items)
    return ",".join(items + [f"{key}:{value}"])


def _uses_malloc_async(conf: str) -> bool:
    return "cudamallocasync" in conf.replace(" ", "").lower()


def setup_unified_memory_env(memory_fraction: float = 0.9) -> Dict[str, str]:
    """Ask for expandable segments in the CUDA allocator and remember the memory fraction.

    Call before anything initialises CUDA (before the Accelerator): the allocator reads
    ``PYTORCH_CUDA_ALLOC_CONF`` once, when CUDA starts. Settings the user already made are kept
    (an explicit ``expandable_segments:False`` stays); with ``backend:cudaMallocAsync`` nothing is
    added (that allocator has no segments). Whichever of ``PYTORCH_CUDA_ALLOC_CONF`` /
    ``PYTORCH_ALLOC_CONF`` is set is extended, the first one otherwise. The fraction is applied by
    ``apply_memory_fraction()`` once CUDA is up. Returns the allocator variables now set.
    """
    global _pending_fraction
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    _pending_fraction = memory_fraction
    names = [n for n in ALLOC_ENV_VARS if os.environ.get(n)] or [ALLOC_ENV_VARS[0]]
    for name in names:
        current = os.environ.get(name, "")
        if _uses_malloc_async(current):
            logger.info(f"{name}={current}: cudaMallocAsync has no expandable segments; left as is")
            continue
        os.environ[name] = _merge_alloc_conf(current, "expandable_segments", "True")
    if torch.cuda.is_initialized():
        logger.warning("setup_unified_memory_env() was called after CUDA was initialised: the "
                       "allocator settings cannot take effect in this process. Call it before "
                       "creating the Accelerator or touching torch.cuda.")
    return {n: os.environ[n] for n in ALLOC_ENV_VARS if n in os.environ}


def apply_memory_fraction(fraction: Optional[float] = None, device: Optional[int] = None) -> bool:
    """Cap this process's CUDA allocations at ``fraction`` of the device memory (on GB10: of the
    shared pool, leaving the rest to the OS and data loading). None uses the fraction given to
    ``setup_unified_memory_env``. Initialises CUDA. Returns whether a cap was set.
    """
    fraction = _pending_fraction if fraction is None else fraction
    if fraction is None or fraction >= 1 or not torch.cuda.is_available():
        return False
    device = torch.cuda.current_device() if device is None else device
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    logger.info(f"CUDA memory fraction for device {device}: {fraction:.2f}")
    return True


# --------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class MemoryPolicy:
    """How the engine places memory. The config's explicit switches (``disable_cpu_offload``,
    ``pin_memory: false``, ...) still win over it."""

    unified_memory: bool
    cpu_offload: bool  # move text encoder / VAE off the GPU after the cache pass
    pin_memory: bool  # DataLoader pinned host buffers
    num_workers: int  # DataLoader workers
    cache_in_memory: bool  # keep precomputed embeddings/latents in RAM instead of on disk
    memory_fraction: float  # CUDA allocator cap (1.0: none)

    def to_dict(self) -> Dict[str, Any]:
        """The policy as a plain dict."""
        return asdict(self)


def memory_policy(unified: Optional[bool] = None, *, memory_fraction: float = 0.9,
                  facts: Optional[DeviceFacts] = None) -> MemoryPolicy:
    """The memory policy for this machine (``unified`` None: detect it)."""
    facts = read_device_facts(init_cuda=False) if facts is None else facts
    unified = is_unified_memory_system(facts) if unified is None else unified
    cpus = max(1, facts.cpu_count)
    if unified:
        # One memory pool: offload and pinning only copy; fewer workers leave the pool to training.
        return MemoryPolicy(True, cpu_offload=False, pin_memory=False, num_workers=min(4, cpus),
                            cache_in_memory=True, memory_fraction=memory_fraction)
    has_gpu = facts.has_gpu or (not facts.complete and facts.driver_present)
    return MemoryPolicy(False, cpu_offload=has_gpu, pin_memory=has_gpu, num_workers=min(8, cpus),
                        cache_in_memory=False, memory_fraction=1.0)


def get_memory_config(unified: Optional[bool] = None, *, memory_fraction: float = 0.9,
                      facts: Optional[DeviceFacts] = None) -> Dict[str, Any]:
    """The memory policy as a dict: unified_memory, cpu_offload, pin_memory, num_workers,
    cache_in_memory, memory_fraction."""
    return memory_policy(unified, memory_fraction=memory_fraction, facts=facts).to_dict()
