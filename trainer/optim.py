"""Optimizers and learning-rate schedules."""

from __future__ import annotations

from typing import Iterable

import torch
from diffusers.optimization import get_scheduler
from loguru import logger

from trainer.config import TrainConfig


def build_optimizer(cfg: TrainConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW, bitsandbytes' 8-bit AdamW (``adam8bit: true`` / ``optimizer: adamw8bit``) or Adafactor.

    Without bitsandbytes the 8-bit request falls back to plain AdamW with one warning.
    """
    params = list(params)
    if cfg.optimizer_name == "adafactor":
        # Factored second moments: a fraction of AdamW's state, for full fine-tuning on less memory.
        return torch.optim.Adafactor(params, lr=cfg.learning_rate, weight_decay=cfg.adam_weight_decay)
    kwargs = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                  weight_decay=cfg.adam_weight_decay, eps=cfg.adam_epsilon)
    if cfg.optimizer_name == "adamw8bit":
        try:
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(params, **kwargs)
        except (ImportError, RuntimeError) as exc:
            logger.warning(f"8-bit AdamW unavailable ({exc.__class__.__name__}: {exc}); using torch AdamW")
    return torch.optim.AdamW(params, **kwargs)


def build_lr_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, num_processes: int):
    """diffusers' ``get_scheduler``; step counts are scaled because accelerate steps it once per process."""
    return get_scheduler(
        cfg.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=cfg.lr_warmup_steps * num_processes,
        num_training_steps=cfg.max_train_steps * num_processes,
        num_cycles=cfg.lr_num_cycles,
        power=cfg.lr_power,
    )
