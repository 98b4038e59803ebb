"""What the trainer detects on a machine and would pick there, and the reference machines it targets.

    python -m utils.device_report                  # this machine, as JSON
    python -m utils.device_report --simulate gb10  # a reference machine (h100 h200 a100 rtx4090 t4 gb10 gh200 cpu)

``simulate_device`` gives the ``DeviceFacts`` of a reference machine, so the rules of
``utils.device_facts``, ``utils.attention`` and ``utils.compat`` are asked about it without patching torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Dict, Iterable, Optional

from .attention import best_available_backend
from .device_facts import (
    DeviceFacts,
    arch_support_mode,
    get_architecture_name,
    get_cuda_version,
    get_features,
    get_recommended_dtype,
    get_recommended_mixed_precision,
    read_device_facts,
)
from .unified_memory import detect_unified_memory

# --------------------------------------------------------------------------- summary


def get_optimal_settings(facts: Optional[DeviceFacts] = None) -> Dict[str, Any]:
    """What this machine supports and what the trainer will pick, as a JSON-serialisable dict.

    Keeps the keys of the user's plan (``use_flash_attention_3``, ``use_fp8``, ``use_tf32``,
    ``use_flash_attention_2``, ``cuda_version``, ``compute_capability``).
    """
    facts = read_device_facts() if facts is None else facts
    features = get_features(facts)
    return {
        "device_name": facts.name,
        "compute_capability": list(facts.capability),
        "sm": facts.sm,
        "architecture": get_architecture_name(facts.capability),
        "total_memory_gib": round(facts.total_memory / 2**30, 1),
        "is_integrated": facts.is_integrated,
        "unified_memory": detect_unified_memory(facts)[0],
        "host_arch": facts.host_arch,
        "cuda_version": get_cuda_version(facts),
        "torch_version": facts.torch_version,
        "cudnn_version": facts.cudnn_version,
        "torch_arch_support": arch_support_mode(facts=facts),
        "dtype": str(get_recommended_dtype(facts)).replace("torch.", ""),
        "mixed_precision": get_recommended_mixed_precision(facts),
        "features": features,
        "attention_backend": best_available_backend(facts),
        "tf32": features["tf32"],
        "use_flash_attention_3": features["flash_attention_3"],
        "use_flash_attention_2": features["flash_attention_2"],
        "use_fp8": features["fp8"],
        "use_tf32": features["tf32"],
        "optional_packages": sorted(facts.packages),
    }


# --------------------------------------------------------------------------- reference machines

_GiB = 2**30
_MiB = 2**20
# torch's published arch lists (torch/cuda/__init__.py PYTORCH_RELEASES_CODE_CC, torch 2.13).
ARCH_LIST_CU130_X86 = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")
ARCH_LIST_CU130_ARM = ("sm_80", "sm_90", "sm_100", "sm_110", "sm_120")
ARCH_LIST_CU126_X86 = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
ARCH_LIST_CU126_ARM = ("sm_80", "sm_90")

_TORCH_213_CUDA = dict(torch_version="2.13.0+cu130", cuda_version="13.0", cudnn_version=91300,
                       torch_flash_sdp=True, torch_flash_impls=("FA3", "FA4"), has_scaled_mm=True,
                       driver_present=True)


def _ref(**kw: Any) -> DeviceFacts:
    return DeviceFacts(**{**_TORCH_213_CUDA, **kw})


# The machines this trainer targets, as torch 2.13 + cu130 wheels report them, with no optional
# packages installed (add them with dataclasses.replace). Memory sizes are nominal.
REFERENCE_DEVICES: Dict[str, DeviceFacts] = {
    "h100": _ref(name="NVIDIA H100 80GB HBM3", capability=(9, 0), total_memory=80 * _GiB,
                 multiprocessor_count=132, arch_list=ARCH_LIST_CU130_X86, cpu_count=32),
    "h200": _ref(name="NVIDIA H200", capability=(9, 0), total_memory=140 * _GiB,
                 multiprocessor_count=132, arch_list=ARCH_LIST_CU130_X86, cpu_count=32),
    "a100": _ref(name="NVIDIA A100-SXM4-80GB", capability=(8, 0), total_memory=80 * _GiB,
                 multiprocessor_count=108, arch_list=ARCH_LIST_CU130_X86, cpu_count=32),
    "rtx4090": _ref(name="NVIDIA GeForce RTX 4090", capability=(8, 9), total_memory=24564 * _MiB,
                    multiprocessor_count=128, arch_list=ARCH_LIST_CU130_X86, cpu_count=16),
    "t4": _ref(name="Tesla T4", capability=(7, 5), total_memory=15360 * _MiB,
               multiprocessor_count=40, arch_list=ARCH_LIST_CU130_X86, cpu_count=8),
    "gb10": _ref(name="NVIDIA GB10", capability=(12, 1), total_memory=119 * _GiB, is_integrated=True,
                 multiprocessor_count=48, arch_list=ARCH_LIST_CU130_ARM, host_arch="aarch64",
                 cpu_count=20),
    "gh200": _ref(name="NVIDIA GH200 480GB", capability=(9, 0), total_memory=96 * _GiB,
                  multiprocessor_count=132, arch_list=ARCH_LIST_CU130_ARM, host_arch="aarch64",
                  cpu_count=72),
    "cpu": DeviceFacts(name="cpu", torch_version="2.13.0+cpu", has_scaled_mm=True, cpu_count=8),
}


def simulate_device(device: str, **changes: Any) -> DeviceFacts:
    """Facts of a reference machine, optionally changed (e.g. ``packages=frozenset({"torchao"})``)."""
    try:
        return dataclasses.replace(REFERENCE_DEVICES[device.lower()], **changes)
    except KeyError:
        raise ValueError(f"unknown device '{device}'; known: {', '.join(REFERENCE_DEVICES)}") from None


def main(argv: Optional[Iterable[str]] = None) -> None:
    """The command line: this machine's report, or a reference machine's (``--simulate``), as JSON."""
    parser = argparse.ArgumentParser(description="Print what the trainer detects and would pick.")
    parser.add_argument("--simulate", choices=sorted(REFERENCE_DEVICES),
                        help="show the answer for a reference machine instead of this one")
    args = parser.parse_args(list(argv) if argv is not None else None)
    facts = simulate_device(args.simulate) if args.simulate else None
    print(json.dumps(get_optimal_settings(facts), indent=2))


if __name__ == "__main__":
    main()
