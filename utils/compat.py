"""Environment checks: messages about the torch build, CUDA, the GPU and missing optional packages.

Each message says what is wrong and what to do. ``show_compatibility_warnings()`` logs each
message once per process at start-up; ``check_requirements`` / ``get_deprecation_warnings`` only
return them. All take the same injectable ``DeviceFacts`` as ``utils.device_facts``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, List, Optional, Set

from loguru import logger

from .device_facts import (
    DeviceFacts,
    arch_support_mode,
    feature_rule,
    get_architecture_name,
    parse_version,
    read_device_facts,
    supports_feature,
    version_at_least,
)

MINIMUM_CUDA_VERSION = "12.0"
RECOMMENDED_CUDA_VERSION = "13.0"
MINIMUM_TORCH_VERSION = "2.5"  # requirements.txt
TORCH_INDEX = "https://download.pytorch.org/whl"

_shown: Set[str] = set()


@dataclass(frozen=True)
class _Need:
    """An optional feature: its package, the hardware rule it also needs, and what to do."""

    label: str
    package: str  # import name
    install: str
    meanwhile: str
    rule: Optional[str] = None  # device_facts feature rule for the hardware/torch side


_NEEDS = {
    "flash_attention_3": _Need(
        "FlashAttention-3", "flash_attn_interface",
        "it is not on PyPI: build it from the hopper/ folder of Dao-AILab/flash-attention "
        "(`cd hopper && python setup.py install`, on the sm_90 machine, with a CUDA 12.3+ toolkit)",
        "attention uses the best available torch SDPA kernel", "flash_attention_3"),
    "flash_attention_2": _Need(
        "FlashAttention-2", "flash_attn", "`pip install flash-attn --no-build-isolation`",
        "attention uses torch's built-in flash SDPA kernel (no package needed)", "flash_attention_2"),
    "fp8": _Need(
        "fp8 training", "torchao", "`pip install torchao`",
        "training keeps its bf16/fp16 mixed precision", "fp8"),
    "adam8bit": _Need(
        "The 8-bit AdamW optimizer", "bitsandbytes", "`pip install bitsandbytes`",
        "training cannot start with optimizer adamw8bit"),
    "quantize": _Need(
        "Quantization (quantize: true)", "optimum.quanto", "`pip install optimum-quanto`",
        "the transformer cannot be quantized"),
    "fastsafetensors": _Need(
        "fastsafetensors loading", "fastsafetensors", "`pip install fastsafetensors`",
        "weights load with safetensors"),
}
_ALIASES = {
    "flash3": "flash_attention_3", "fa3": "flash_attention_3",
    "flash_attn": "flash_attention_2", "fa2": "flash_attention_2",
    "fp8_training": "fp8", "fp8_native": "fp8", "torchao": "fp8",
    "adamw8bit": "adam8bit", "bitsandbytes": "adam8bit", "quanto": "quantize",
}
REQUESTABLE_FEATURES = tuple(_NEEDS) + tuple(_ALIASES)


def _facts(facts: Optional[DeviceFacts]) -> DeviceFacts:
    return read_device_facts() if facts is None else facts


def _describe(facts: DeviceFacts) -> str:
    if not facts.has_gpu:
        return "a machine without a CUDA GPU"
    return f"{facts.name} ({facts.sm}, {get_architecture_name(facts.capability)})"


def torch_install_hint(facts: Optional[DeviceFacts] = None) -> str:
    """What to install to get a torch whose CUDA build fits this machine."""
    facts = _facts(facts)
    if facts.has_gpu and facts.capability < (7, 5):
        return (f"CUDA 13 builds no longer include {facts.sm}: install a CUDA 12.6 build, "
                f"`pip install torch --index-url {TORCH_INDEX}/cu126`")
    hint = (f"install a CUDA 13 build first, `pip install torch --index-url {TORCH_INDEX}/cu130` "
            "(needs NVIDIA driver 580+; use cu128 for older drivers), then `pip install -r requirements.txt`")
    if facts.host_arch == "aarch64":
        hint += (" (the cu130 aarch64 wheels include sm_120, which runs on GB10's sm_121; NVIDIA's "
                 "NGC PyTorch container, nvcr.io/nvidia/pytorch, is the other route on DGX Spark)")
    return hint


def _no_gpu_messages(facts: DeviceFacts) -> List[str]:
    if facts.cuda_version is None and facts.driver_present:
        return [f"An NVIDIA driver is loaded but torch {facts.torch_version} is a CPU-only build, so "
                f"the GPU is unused: {torch_install_hint(facts)}."]
    if facts.cuda_version is not None and facts.driver_present:
        return [f"torch is built for CUDA {facts.cuda_version} but sees no GPU although an NVIDIA driver "
                "is loaded: check `nvidia-smi`, CUDA_VISIBLE_DEVICES, and that the driver is new enough "
                "for this CUDA (CUDA 13 needs driver 580+, CUDA 12 needs 525+)."]
    if facts.cuda_version is not None:
        return [f"torch is built for CUDA {facts.cuda_version} but no NVIDIA driver is loaded: training "
                "runs on the CPU. Install the NVIDIA driver to use a GPU."]
    return ["No CUDA GPU: training runs on the CPU, which suits the tiny test models only."]


def _cuda_version_messages(facts: DeviceFacts) -> List[str]:
    if version_at_least(facts.cuda_version, MINIMUM_CUDA_VERSION):
        return []
    return [f"torch is built for CUDA {facts.cuda_version}, older than {MINIMUM_CUDA_VERSION}: fp8, "
            f"FlashAttention-3 and cuDNN attention are unavailable and newer GPUs are unsupported; "
            f"{torch_install_hint(facts)}."]


def _arch_messages(facts: DeviceFacts) -> List[str]:
    if facts.capability < (7, 0):
        return [f"{_describe(facts)} is not supported: the trainer needs sm_70 or newer (sm_80+ for "
                "bf16). Train on a newer GPU."]
    mode = arch_support_mode(facts=facts)
    built = ", ".join(facts.arch_list) or "none"
    if mode == "unsupported":
        return [f"torch {facts.torch_version} (CUDA {facts.cuda_version}) has no kernels for "
                f"{_describe(facts)}; it was built for {built}. GPU training will fail: "
                f"{torch_install_hint(facts)}."]
    if mode == "ptx":
        return [f"torch {facts.torch_version} has no {facts.sm} binaries for {facts.name} (built for "
                f"{built}): its kernels are JIT-compiled from PTX at first use (slow start, possibly "
                f"slower kernels). For native kernels, {torch_install_hint(facts)}."]
    if mode == "compatible" and facts.capability == (12, 1):
        # GB10 only: the one GPU where users meet torch builds without its sm and doubt them.
        return [f"note: torch {facts.torch_version} has no native {facts.sm} kernels for {facts.name} "
                f"(built for {built}) and runs the binary-compatible ones of the same architecture; "
                "this works. torch may warn that it 'does not include kernels for this GPU': expected "
                f"here. Native {facts.sm} kernels need a build that lists {facts.sm} (e.g. NVIDIA's NGC "
                "PyTorch container or a source build with TORCH_CUDA_ARCH_LIST)."]
    return []


def _canonical_request(name: str) -> str:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _NEEDS:
        raise ValueError(f"unknown feature '{name}'; known: {', '.join(REQUESTABLE_FEATURES)}")
    return key


def _feature_message(key: str, facts: DeviceFacts) -> Optional[str]:
    need = _NEEDS[key]
    installed = need.package in facts.packages
    if need.rule is not None:
        # The hardware/torch side of the rule, judged as if the package were installed.
        with_package = dataclasses.replace(facts, packages=facts.packages | {need.package})
        if not supports_feature(need.rule, with_package):
            return (f"{need.label} needs {feature_rule(need.rule)}; this is {_describe(facts)}, CUDA "
                    f"{facts.cuda_version or 'none'}, torch {facts.torch_version}. Meanwhile "
                    f"{need.meanwhile}.")
    if installed:
        return None
    return (f"{need.label} needs the '{need.package}' package, which is not installed: {need.install}. "
            f"Meanwhile {need.meanwhile}.")


def check_requirements(requested_features: Iterable[str] = (),
                       facts: Optional[DeviceFacts] = None) -> List[str]:
    """Problems with this environment, each with what to do: torch build vs GPU, CUDA version,
    GPU support, and what each requested feature (``flash_attention_3``, ``fp8``, ``adam8bit``,
    ``quantize``, ``fastsafetensors``, ...) still lacks. Empty when all is well."""
    facts = _facts(facts)
    keys = list(dict.fromkeys(_canonical_request(name) for name in requested_features))
    messages = _no_gpu_messages(facts) if not facts.has_gpu else (
        _cuda_version_messages(facts) + _arch_messages(facts))
    messages += [m for m in (_feature_message(key, facts) for key in keys) if m]
    return messages


def get_deprecation_warnings(facts: Optional[DeviceFacts] = None) -> List[str]:
    """Things that work today but are on their way out: Volta/Turing GPUs, an old torch."""
    facts = _facts(facts)
    warnings: List[str] = []
    if facts.torch_version and parse_version(facts.torch_version) is not None \
            and not version_at_least(facts.torch_version, MINIMUM_TORCH_VERSION):
        warnings.append(f"torch {facts.torch_version} is older than {MINIMUM_TORCH_VERSION}, the minimum "
                        f"of requirements.txt: {torch_install_hint(facts)}.")
    if facts.capability[0] == 7:
        arch = get_architecture_name(facts.capability)
        dropped = " CUDA 13 and torch's cu13 builds have dropped it;" if facts.capability < (7, 5) else ""
        warnings.append(f"{arch} GPUs ({facts.name}, {facts.sm}) are deprecated here:{dropped} there is "
                        "no bf16 (training uses fp16 with loss scaling) and no flash or cuDNN attention "
                        "(the memory-efficient kernel is used). Prefer an Ampere or newer GPU.")
    return warnings


def show_compatibility_warnings(requested_features: Iterable[str] = (),
                                facts: Optional[DeviceFacts] = None) -> List[str]:
    """Log every requirement and deprecation message through loguru, each once per process.
    Returns the messages logged by this call."""
    messages = check_requirements(requested_features, facts) + get_deprecation_warnings(facts)
    fresh = [m for m in dict.fromkeys(messages) if m not in _shown]
    for message in fresh:
        _shown.add(message)
        (logger.info if message.startswith("note:") else logger.warning)(message)
    return fresh
