"""CUDA version, device capability and feature support, from what the machine actually has.

Every public function takes an optional ``facts: DeviceFacts``. Left out, the facts are read from
this machine (``read_device_facts``); tests and ``python -m utils.device_report --simulate gb10`` pass
facts of another machine instead (``utils.device_report.REFERENCE_DEVICES``), so no torch internals
are patched.

The bottom of the platform layer: ``utils.attention``, ``utils.compat`` and ``utils.unified_memory``
build on it. ``utils.cuda_utils`` is the name the CUDA 13 plan gave users (it re-exports this module
and ``utils.device_report``'s summary); code here imports from where things live.

Reading GPU facts initialises CUDA. Call ``utils.unified_memory.setup_unified_memory_env`` (which
does not) before anything here when the allocator settings matter.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from loguru import logger

Capability = Tuple[int, int]
CPU_CAPABILITY: Capability = (0, 0)

# Optional packages whose presence changes what can be used (import names).
OPTIONAL_PACKAGES: Tuple[str, ...] = (
    "flash_attn",  # FlashAttention-2 (pip install flash-attn)
    "flash_attn_interface",  # FlashAttention-3, built from flash-attention/hopper
    "torchao",  # fp8 training (convert_to_float8_training)
    "bitsandbytes",  # 8-bit optimizers
    "optimum.quanto",  # weight quantization
    "fastsafetensors",  # fast checkpoint loading
    "triton",
)

# The range of GPUs torch's fused SDPA kernels accept (torch's sdp_utils.cpp, current sources:
# flash and cuDNN [sm_80, sm_121], memory-efficient [sm_50, sm_121]).
SDPA_MAX_CAPABILITY: Capability = (12, 1)


@dataclass(frozen=True)
class DeviceFacts:
    """What the machine reports: the only input of every decision in the platform layer."""

    name: str = "cpu"
    capability: Capability = CPU_CAPABILITY  # (0, 0): no usable CUDA device
    total_memory: int = 0  # bytes, as torch reports it (system RAM on GB10)
    is_integrated: bool = False  # cudaDeviceProp.integrated: GPU shares host memory
    cuda_version: Optional[str] = None  # torch.version.cuda: the CUDA torch was built with
    arch_list: Tuple[str, ...] = ()  # torch.cuda.get_arch_list()
    multiprocessor_count: int = 0
    packages: frozenset = frozenset()  # importable OPTIONAL_PACKAGES
    host_arch: str = "x86_64"  # platform.machine()
    cudnn_version: Optional[int] = None  # torch.backends.cudnn.version(), e.g. 91002
    torch_version: str = ""
    torch_flash_sdp: bool = False  # torch compiled with its flash SDPA kernels
    torch_flash_impls: Tuple[str, ...] = ()  # torch.nn.attention.list_flash_attention_impls()
    has_scaled_mm: bool = False  # torch._scaled_mm (fp8 GEMM)
    driver_present: bool = False  # an NVIDIA kernel driver is loaded (/proc/driver/nvidia)
    cpu_count: int = 1
    device_index: int = 0
    complete: bool = True  # False: GPU facts left unread so as not to initialise CUDA

    @property
    def has_gpu(self) -> bool:
        """A CUDA device is visible to torch."""
        return self.capability != CPU_CAPABILITY

    @property
    def sm(self) -> str:
        """The capability as an arch name, e.g. ``sm_121``; ``cpu`` without a GPU."""
        return f"sm_{self.capability[0]}{self.capability[1]}" if self.has_gpu else "cpu"


# --------------------------------------------------------------------------- reading the machine


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a missing parent package of a dotted name
        return False


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))  # honours taskset / cgroup cpusets
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cudnn_version() -> Optional[int]:
    try:
        return torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:  # a broken libcudnn must not stop the checks that report it
        return None


def _torch_flash_impls() -> Tuple[str, ...]:
    try:
        from torch.nn.attention import list_flash_attention_impls  # torch >= 2.10
    except ImportError:
        return ()
    return tuple(list_flash_attention_impls())


def _driver_gpu_names(root: Path = Path("/proc/driver/nvidia/gpus")) -> List[str]:
    """GPU model names from the kernel driver, read without initialising CUDA (Linux only)."""
    names = []
    for info in sorted(root.glob("*/information")):
        try:
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    names.append(line.split(":", 1)[1].strip())
        except OSError:
            continue
    return names


def _default_device_index() -> int:
    if torch.cuda.is_initialized():
        return torch.cuda.current_device()
    # Before the Accelerator picks a device, each launched process is LOCAL_RANK (unless the
    # launcher gave each process a single visible device).
    rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    return rank if rank < max(1, torch.cuda.device_count()) else 0


def _host_facts() -> Dict[str, Any]:
    return dict(
        cuda_version=torch.version.cuda,
        arch_list=tuple(torch.cuda.get_arch_list()),
        packages=frozenset(p for p in OPTIONAL_PACKAGES if _importable(p)),
        host_arch=platform.machine(),
        cudnn_version=_cudnn_version(),
        torch_version=torch.__version__,
        torch_flash_sdp=bool(torch.backends.cuda.is_flash_attention_available()),
        torch_flash_impls=_torch_flash_impls(),
        has_scaled_mm=hasattr(torch, "_scaled_mm"),
        driver_present=Path("/proc/driver/nvidia/version").exists(),
        cpu_count=_cpu_count(),
    )


def _gpu_facts(index: int) -> Dict[str, Any]:
    props = torch.cuda.get_device_properties(index)  # initialises CUDA
    return dict(
        name=props.name,
        capability=(props.major, props.minor),
        total_memory=int(props.total_memory),
        is_integrated=bool(getattr(props, "is_integrated", False)),
        multiprocessor_count=int(props.multi_processor_count),
        device_index=index,
    )


@functools.lru_cache(maxsize=None)
def _read_full(index: int) -> DeviceFacts:
    host = _host_facts()
    if not torch.cuda.is_available():
        return DeviceFacts(**host)
    return DeviceFacts(**host, **_gpu_facts(index))


def read_device_facts(device_index: Optional[int] = None, init_cuda: bool = True) -> DeviceFacts:
    """Facts of this machine (cached).

    With ``init_cuda=False`` and CUDA not yet initialised, the GPU's properties are not read
    (that would freeze the allocator settings): only its name, from the kernel driver, and the
    host facts are filled in, and ``complete`` is False.
    """
    index = _default_device_index() if device_index is None else device_index
    if init_cuda or torch.cuda.is_initialized() or not torch.cuda.is_available():
        return _read_full(index)
    names = _driver_gpu_names()
    return DeviceFacts(**_host_facts(), name=names[0] if names else "unknown NVIDIA GPU",
                       device_index=index, complete=False)


def refresh_device_facts() -> None:
    """Forget the cached facts (after installing a package, or in tests)."""
    _read_full.cache_clear()


def _facts(facts: Optional[DeviceFacts]) -> DeviceFacts:
    return read_device_facts() if facts is None else facts


# --------------------------------------------------------------------------- versions


def parse_version(version: Optional[str]) -> Optional[Tuple[int, ...]]:
    """``"12.10"`` -> ``(12, 10)``; ``"2.13.0+cu130"`` -> ``(2, 13, 0)``; None/"N/A" -> None."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version)) if version else None
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


def compare_versions(a: Optional[str], b: Optional[str]) -> int:
    """-1, 0 or 1 as a <, ==, > b, numerically per component ("12.10" > "12.9").

    Missing components count as 0 ("13" == "13.0"); an unparsable or missing version is lower
    than any real one.
    """
    pa, pb = parse_version(a), parse_version(b)
    if pa is None or pb is None:
        return (pa is not None) - (pb is not None)
    width = max(len(pa), len(pb))
    pa, pb = pa + (0,) * (width - len(pa)), pb + (0,) * (width - len(pb))
    return (pa > pb) - (pa < pb)


def version_at_least(version: Optional[str], minimum: str) -> bool:
    """True when ``version`` parses and is >= ``minimum``."""
    return parse_version(version) is not None and compare_versions(version, minimum) >= 0


def get_cuda_version(facts: Optional[DeviceFacts] = None) -> str:
    """The CUDA version torch was built with (``torch.version.cuda``), or ``"N/A"`` for a CPU build.

    A string either way, as the user's plan and tests expect (``"N/A"``, not None).
    """
    return _facts(facts).cuda_version or "N/A"


# --------------------------------------------------------------------------- capability


def get_device_capability(facts: Optional[DeviceFacts] = None) -> Capability:
    """(major, minor) compute capability of the current device; (0, 0) without CUDA."""
    return tuple(_facts(facts).capability)  # type: ignore[return-value]


_ARCH_BY_CAPABILITY: Dict[Capability, str] = {
    (7, 0): "Volta", (7, 2): "Volta", (7, 5): "Turing",
    (8, 0): "Ampere", (8, 6): "Ampere", (8, 7): "Ampere", (8, 9): "Ada Lovelace",
    (9, 0): "Hopper",
    (10, 0): "Blackwell", (10, 1): "Blackwell", (10, 3): "Blackwell", (11, 0): "Blackwell",
    (12, 0): "Blackwell", (12, 1): "Blackwell",
}
_ARCH_BY_MAJOR = {3: "Kepler", 5: "Maxwell", 6: "Pascal", 7: "Volta", 8: "Ampere", 9: "Hopper",
                  10: "Blackwell", 11: "Blackwell", 12: "Blackwell"}


def get_architecture_name(cap: Optional[Capability] = None, facts: Optional[DeviceFacts] = None) -> str:
    """Architecture of a capability: (9, 0) -> "Hopper", (12, 1) -> "Blackwell"; "CPU" for (0, 0)."""
    cap = tuple(cap) if cap is not None else get_device_capability(facts)
    if cap == CPU_CAPABILITY:
        return "CPU"
    return _ARCH_BY_CAPABILITY.get(cap) or _ARCH_BY_MAJOR.get(cap[0], f"unknown (sm_{cap[0]}{cap[1]})")


def is_hopper_or_newer(facts: Optional[DeviceFacts] = None) -> bool:
    """Capability >= 9.0 (Hopper, Blackwell). A generation test: use ``supports_feature`` for features."""
    return get_device_capability(facts) >= (9, 0)


def is_ampere_or_newer(facts: Optional[DeviceFacts] = None) -> bool:
    """Capability >= 8.0 (Ampere, Ada, Hopper, Blackwell)."""
    return get_device_capability(facts) >= (8, 0)


# Code built for these runs only on exactly this capability: the integrated (Tegra) GPUs, whose
# binaries are not interchangeable with the discrete ones of the same major (as torch's own table).
_EXACT_ONLY = {53, 62, 72, 87, 101}


def _parse_arch(entry: str) -> Optional[Tuple[str, int, str]]:
    """``"sm_121a"`` -> ("sm", 121, "a"); ``"compute_90"`` -> ("compute", 90, "")."""
    match = re.fullmatch(r"(sm|compute)_(\d+)([af]?)", entry.strip())
    return (match.group(1), int(match.group(2)), match.group(3)) if match else None


def arch_support_mode(cap: Optional[Capability] = None, facts: Optional[DeviceFacts] = None) -> str:
    """How torch's kernels reach this GPU.

    ``native`` (built for exactly this sm), ``compatible`` (SASS of an earlier minor of the same
    major: CUDA's binary compatibility, e.g. sm_120 code on a sm_121 GB10), ``ptx`` (only PTX of an
    older arch, JIT-compiled at first use), ``unsupported``, or ``no_gpu``.
    """
    facts = _facts(facts)
    cap = tuple(cap) if cap is not None else facts.capability
    if cap == CPU_CAPABILITY:
        return "no_gpu"
    device = cap[0] * 10 + cap[1]
    modes = {_arch_mode(parsed, device) for parsed in map(_parse_arch, facts.arch_list) if parsed}
    for mode in ("native", "compatible", "ptx"):
        if mode in modes:
            return mode
    return "unsupported"


def _arch_mode(parsed: Tuple[str, int, str], device: int) -> Optional[str]:
    kind, code, suffix = parsed
    if code == device:
        return "native" if kind == "sm" else "ptx"
    if suffix == "a" or code in _EXACT_ONLY or device in _EXACT_ONLY:
        return None  # arch-specific ("a") and Tegra code never run elsewhere
    if kind == "sm":
        # SASS for X.y runs on X.z with z >= y ("f" family code follows the same rule).
        return "compatible" if code // 10 == device // 10 and code % 10 <= device % 10 else None
    return "ptx" if code <= device else None  # PTX is JIT-compiled forward to any newer GPU


def torch_supports_arch(cap: Optional[Capability] = None, facts: Optional[DeviceFacts] = None) -> bool:
    """True when the installed torch has kernels that run on this GPU (natively, by binary
    compatibility or by PTX JIT). False without a GPU."""
    return arch_support_mode(cap, facts) in ("native", "compatible", "ptx")


# --------------------------------------------------------------------------- features


def _gpu_ok(f: DeviceFacts) -> bool:
    """A GPU that the installed torch can run kernels on: the gate of every GPU feature."""
    return f.has_gpu and torch_supports_arch(facts=f)


def _in_sdpa_range(f: DeviceFacts, low: Capability) -> bool:
    return low <= f.capability <= SDPA_MAX_CAPABILITY


FeatureRule = Tuple[str, Callable[[DeviceFacts], bool]]

# name -> (rule in words, predicate). The words are what compat messages and the docs say.
FEATURE_RULES: Dict[str, FeatureRule] = {
    "tf32": (
        "an Ampere or newer GPU (sm_80+) and torch built with CUDA 11+",
        lambda f: _gpu_ok(f) and f.capability >= (8, 0) and version_at_least(f.cuda_version, "11.0"),
    ),
    "bf16": (
        "an Ampere or newer GPU (sm_80+); older GPUs only emulate bf16, slowly",
        lambda f: _gpu_ok(f) and f.capability >= (8, 0) and version_at_least(f.cuda_version, "11.0"),
    ),
    "fp8": (
        "fp8 tensor cores (Ada sm_89, Hopper sm_90, Blackwell sm_100+), CUDA 12.1+ and torch._scaled_mm",
        lambda f: _gpu_ok(f) and f.capability >= (8, 9) and version_at_least(f.cuda_version, "12.1")
        and f.has_scaled_mm,
    ),
    "fp8_training": (
        "everything fp8 needs, plus the torchao package (float8 training)",
        lambda f: FEATURE_RULES["fp8"][1](f) and "torchao" in f.packages,
    ),
    "flash_attention_2": (
        "the flash-attn package (FlashAttention-2) and an sm_80+ GPU",
        lambda f: _gpu_ok(f) and f.capability >= (8, 0) and "flash_attn" in f.packages,
    ),
    "flash_attention_3": (
        "a Hopper GPU (exactly sm_90: FA3's kernels are sm_90a), CUDA 12.3+, the flash_attn_interface "
        "package (FlashAttention-3 built from flash-attention/hopper) and a torch with the FA3 SDPA "
        "registry (torch >= 2.10)",
        lambda f: _gpu_ok(f) and f.capability == (9, 0) and version_at_least(f.cuda_version, "12.3")
        and "flash_attn_interface" in f.packages and "FA3" in f.torch_flash_impls,
    ),
    "flash_sdp": (
        "torch built with its flash SDPA kernels and a GPU in [sm_80, sm_121]",
        lambda f: _gpu_ok(f) and f.torch_flash_sdp and _in_sdpa_range(f, (8, 0)),
    ),
    "efficient_sdp": (
        "a GPU in [sm_50, sm_121] (torch's memory-efficient SDPA kernel)",
        lambda f: _gpu_ok(f) and _in_sdpa_range(f, (5, 0)),
    ),
    "cudnn_sdp": (
        "torch built with cuDNN 9.0+ and a GPU in [sm_80, sm_121]",
        lambda f: _gpu_ok(f) and (f.cudnn_version or 0) >= 90000 and _in_sdpa_range(f, (8, 0)),
    ),
}

# Names of the user's plan and config keys, mapped to the rules above.
FEATURE_ALIASES: Dict[str, str] = {
    "tf32_compute": "tf32",
    "fp8_native": "fp8",
    "flash_attention": "flash_attention_2",
    "fa2": "flash_attention_2",
    "fa3": "flash_attention_3",
    "flash3": "flash_attention_3",
    "cudnn": "cudnn_sdp",
}

KNOWN_FEATURES: Tuple[str, ...] = tuple(FEATURE_RULES) + tuple(FEATURE_ALIASES)


def canonical_feature(name: str) -> Optional[str]:
    """The rule name for a feature or alias; None when unknown."""
    key = name.strip().lower()
    key = FEATURE_ALIASES.get(key, key)
    return key if key in FEATURE_RULES else None


def feature_rule(name: str) -> str:
    """What a feature needs, in words."""
    key = canonical_feature(name)
    if key is None:
        raise ValueError(f"unknown feature '{name}'; known: {', '.join(KNOWN_FEATURES)}")
    return FEATURE_RULES[key][0]


@functools.lru_cache(maxsize=None)
def _warn_unknown_feature(name: str) -> None:
    logger.warning(f"supports_feature: unknown feature '{name}' (known: {', '.join(KNOWN_FEATURES)})")


def supports_feature(feature: str, facts: Optional[DeviceFacts] = None) -> bool:
    """Whether ``feature`` can be used here, from the GPU, torch's CUDA build and installed packages.

    Unknown names are False (with a warning). Without a GPU every feature is False.
    """
    key = canonical_feature(feature)
    if key is None:
        _warn_unknown_feature(feature)
        return False
    return bool(FEATURE_RULES[key][1](_facts(facts)))


def get_features(facts: Optional[DeviceFacts] = None) -> Dict[str, bool]:
    """Every feature rule evaluated on one set of facts."""
    facts = _facts(facts)
    return {name: supports_feature(name, facts) for name in FEATURE_RULES}


# --------------------------------------------------------------------------- precision


def get_recommended_dtype(facts: Optional[DeviceFacts] = None) -> torch.dtype:
    """bf16 on sm_80+; fp16 on older GPUs (no fast bf16 there); fp32 on the CPU.

    CPU runs are tests and tiny models: fp32 keeps them exact and deterministic, and bf16 on a CPU
    only pays off with AMX/AVX512-BF16 units, which this choice does not try to detect.
    """
    facts = _facts(facts)
    if supports_feature("bf16", facts):
        return torch.bfloat16
    return torch.float16 if _gpu_ok(facts) else torch.float32


def get_recommended_mixed_precision(facts: Optional[DeviceFacts] = None) -> str:
    """The accelerate ``mixed_precision`` matching ``get_recommended_dtype``: bf16, fp16 or no."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(get_recommended_dtype(facts), "no")


def enable_tf32(enable: bool = True, facts: Optional[DeviceFacts] = None) -> bool:
    """Turn TF32 on (or off) for CUDA matmuls and cuDNN convolutions. Returns whether it is on.

    Uses ``torch.set_float32_matmul_precision`` for matmuls: in torch 2.13 setting
    ``torch.backends.cuda.matmul.fp32_precision`` directly makes every later read of
    ``allow_tf32`` or ``get_float32_matmul_precision()`` raise (mixed legacy/new API), and
    accelerate, diffusers and transformers still read those; the precision call keeps both in step.
    A no-op returning False where TF32 is not supported (pre-Ampere, CPU).
    """
    if not supports_feature("tf32", facts):
        return False
    torch.set_float32_matmul_precision("high" if enable else "highest")
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        conv.fp32_precision = "tf32" if enable else "ieee"  # torch >= 2.9 API
    else:
        torch.backends.cudnn.allow_tf32 = enable
    return enable
