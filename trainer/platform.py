"""The platform layer applied to one run: what ``utils/`` detects, turned into the run's settings.

Order matters: ``prepare_environment`` runs before the Accelerator (the CUDA allocator reads its
settings once, when CUDA starts); ``configure_device`` right after it; ``choose_attention`` once the
transformer is loaded. The config's explicit switches win over what is detected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
from loguru import logger

from trainer.config import TrainConfig
from utils.attention import AttentionChoice, apply_attention_backend, select_attention_backend
from utils.compat import show_compatibility_warnings
from utils.cuda_utils import enable_tf32, supports_feature
from utils.unified_memory import apply_memory_fraction, is_unified_memory_system, setup_unified_memory_env


@dataclass(frozen=True)
class RunPolicy:
    """Memory placement decisions for this run."""

    unified_memory: bool
    pin_memory: bool  # DataLoader pinned buffers (pointless on unified memory)
    keep_encoders: bool  # keep text encoder and VAE loaded after the cache pass


def prepare_environment(cfg: TrainConfig) -> RunPolicy:
    """Before CUDA starts: detect unified memory (or take ``unified_memory: true``) and set the
    allocator up for it (expandable segments)."""
    unified = cfg.unified_memory or is_unified_memory_system()
    if unified or cfg.expandable_segments:
        setup_unified_memory_env(memory_fraction=cfg.memory_fraction)
    if unified and not cfg.unified_memory:
        logger.info("unified-memory system detected: no pinned memory, encoders kept resident")
    return RunPolicy(
        unified_memory=unified,
        pin_memory=cfg.pin_memory and not unified and torch.cuda.is_available(),
        # Freeing and reloading buys nothing where CPU and GPU share one memory pool.
        keep_encoders=cfg.disable_cpu_offload or unified,
    )


def requested_features(cfg: TrainConfig) -> List[str]:
    """Optional features the config asks for (their packages and hardware are checked)."""
    wanted = {"flash_attention_3": cfg.cuda_features.enable_flash_attention_3 or cfg.attention_backend == "flash3",
              "fp8": cfg.cuda_features.enable_fp8_training, "adam8bit": cfg.optimizer_name == "adamw8bit",
              "fastsafetensors": cfg.use_fastsafetensors}
    return [name for name, on in wanted.items() if on]


def configure_device(cfg: TrainConfig, policy: RunPolicy) -> None:
    """After the Accelerator: compatibility messages (once), TF32, the unified-memory cap."""
    if torch.cuda.is_available():
        show_compatibility_warnings(requested_features(cfg))
        enable_tf32(cfg.cuda_features.enable_tf32_compute)
        if policy.unified_memory:
            apply_memory_fraction(cfg.memory_fraction)


def choose_attention(cfg: TrainConfig, transformer: torch.nn.Module) -> AttentionChoice:
    """The attention backend for the transformer; FA3 and cuDNN only when the config allows them."""
    features = cfg.cuda_features
    excluded = {"flash3"} if not (features.enable_flash_attention_3 or cfg.attention_backend == "flash3") else set()
    if not features.enable_cudnn_sdp and cfg.attention_backend != "cudnn":
        excluded.add("cudnn")
    return apply_attention_backend(transformer, select_attention_backend(cfg.attention_backend, exclude=excluded))


def maybe_fp8(cfg: TrainConfig, transformer: torch.nn.Module) -> bool:
    """torchao float8 training of the transformer's block linears where the GPU supports it.
    Returns whether it was applied; otherwise says why once."""
    if not cfg.cuda_features.enable_fp8_training:
        return False
    if not supports_feature("fp8_training"):
        logger.warning("cuda_features.enable_fp8_training: fp8 training needs an sm_89+ GPU with torchao "
                       "installed; training in the configured precision instead")
        return False
    from torchao.float8 import convert_to_float8_training

    def block_linear(module: torch.nn.Module, name: str) -> bool:
        # fp8 matmuls need both dimensions divisible by 16; keep embedders and the output in bf16.
        return (isinstance(module, torch.nn.Linear) and "transformer_blocks" in name
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    convert_to_float8_training(transformer, module_filter_fn=block_linear)
    logger.info("fp8 training: transformer block linears converted with torchao float8")
    return True
