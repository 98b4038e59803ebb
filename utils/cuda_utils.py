"""The CUDA utilities under the name the project's CUDA 13 plan gave its users.

    python -c "from utils.cuda_utils import get_optimal_settings; print(get_optimal_settings())"

Everything here lives elsewhere and is only re-exported: the machine's facts and feature rules in
``utils.device_facts`` (``get_cuda_version``, ``supports_feature``, ``enable_tf32``, ...), the summary
of what the trainer picks and the reference machines in ``utils.device_report``
(``get_optimal_settings``, ``simulate_device``). ``device_report`` needs ``utils.attention``, which
builds on ``device_facts``; this module imports both and nothing imports it, so the old name makes
no import cycle. The project's own code imports from where things live.
"""

from __future__ import annotations

from .device_facts import (
    CPU_CAPABILITY,
    FEATURE_ALIASES,
    FEATURE_RULES,
    KNOWN_FEATURES,
    OPTIONAL_PACKAGES,
    SDPA_MAX_CAPABILITY,
    Capability,
    DeviceFacts,
    FeatureRule,
    arch_support_mode,
    canonical_feature,
    compare_versions,
    enable_tf32,
    feature_rule,
    get_architecture_name,
    get_cuda_version,
    get_device_capability,
    get_features,
    get_recommended_dtype,
    get_recommended_mixed_precision,
    is_ampere_or_newer,
    is_hopper_or_newer,
    parse_version,
    read_device_facts,
    refresh_device_facts,
    supports_feature,
    torch_supports_arch,
    version_at_least,
)
from .device_report import REFERENCE_DEVICES, get_optimal_settings, simulate_device

__all__ = [
    "CPU_CAPABILITY", "FEATURE_ALIASES", "FEATURE_RULES", "KNOWN_FEATURES", "OPTIONAL_PACKAGES",
    "REFERENCE_DEVICES", "SDPA_MAX_CAPABILITY", "Capability", "DeviceFacts", "FeatureRule",
    "arch_support_mode", "canonical_feature", "compare_versions", "enable_tf32", "feature_rule",
    "get_architecture_name", "get_cuda_version", "get_device_capability", "get_features",
    "get_optimal_settings", "get_recommended_dtype", "get_recommended_mixed_precision",
    "is_ampere_or_newer", "is_hopper_or_newer", "parse_version", "read_device_facts",
    "refresh_device_facts", "simulate_device", "supports_feature", "torch_supports_arch",
    "version_at_least",
]
