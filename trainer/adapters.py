"""Trainable parameters: LoRA through peft (full fine-tuning joins here in a later issue)."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

import torch
from loguru import logger
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from trainer.config import TrainConfig
from trainer.errors import ConfigError

# A preset is either a list of module-name suffixes (peft's list form) or one regex (peft's str form,
# matched against the full module name) where a suffix would also hit layers outside the blocks.
TargetSpec = List[str] | str


def resolve_lora_targets(cfg: TrainConfig, presets: Mapping[str, TargetSpec]) -> TargetSpec:
    """The target modules for this run: the explicit list if given, else the family's preset."""
    if cfg.lora_target_modules:
        return list(cfg.lora_target_modules)
    if cfg.lora_target not in presets:
        raise ConfigError(f"key 'lora_target': preset '{cfg.lora_target}' is not defined for family "
                          f"'{cfg.family}' (choices: {', '.join(presets)})")
    return presets[cfg.lora_target]


def lora_config(cfg: TrainConfig, targets: TargetSpec) -> LoraConfig:
    """The peft config from the training config; alpha defaults to the rank (scale 1)."""
    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.lora_alpha if cfg.lora_alpha is not None else cfg.rank,
        lora_dropout=cfg.lora_dropout,
        init_lora_weights="gaussian" if cfg.lora_init == "gaussian" else True,
        target_modules=targets,
    )


def add_lora(transformer: torch.nn.Module, cfg: TrainConfig, presets: Mapping[str, TargetSpec]) -> int:
    """Freeze the transformer, attach a LoRA adapter, keep LoRA weights in fp32. Returns #trainable."""
    targets = resolve_lora_targets(cfg, presets)
    transformer.requires_grad_(False)
    try:
        transformer.add_adapter(lora_config(cfg, targets))
    except ValueError as exc:  # peft: "Target modules ... not found in the base model"
        raise ConfigError(f"LoRA targets {targets} match no layer of the transformer: {exc}") from None
    trainable = [p for p in transformer.parameters() if p.requires_grad]
    for param in trainable:
        # fp32 master copy of the small LoRA weights, even when the base is bf16/fp16.
        param.data = param.data.float()
    count = sum(p.numel() for p in trainable)
    logger.info(f"LoRA rank {cfg.rank}, alpha {transformer.peft_config['default'].lora_alpha}: "
                f"{count / 1e6:.3f}M trainable parameters")
    return count


def lora_state_dict(transformer: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The adapter weights in peft's naming (what diffusers' ``save_lora_weights`` expects)."""
    return get_peft_model_state_dict(transformer)


def lora_metadata(transformer: torch.nn.Module) -> Dict[str, Any]:
    """The adapter config saved with the weights so alpha and targets survive a reload."""
    return transformer.peft_config["default"].to_dict()
