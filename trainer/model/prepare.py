"""The loaded transformer made ready to train, in one order that the engine and the GPU harness share.

    place (quantize block by block; swapped blocks stay in host memory) -> gradient checkpointing
    -> attention backend (timed on a GPU) -> compile decision -> fp8 -> what trains (LoRA or full)
    -> trainable weights onto the device -> block swap hooks -> compile the blocks

Compilation comes last: peft's LoRA layers and the swap hooks must exist before the blocks are
traced, and only ``forward`` is compiled, so the hooks run eagerly around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from loguru import logger

from trainer.families.base import ModelFamily
from trainer.model.activation_offload import checkpointed_blocks, checkpointing_func
from trainer.model.adapters import TrainedWeights, skip_lora_input_upcast
from trainer.model.block_swap import BlockSwapper
from trainer.config import TrainConfig
from utils.errors import ConfigError
from trainer.platform import attention_shape, choose_attention, compile_decision, compile_for_training, maybe_fp8
from trainer.quantization.frozen_weights import place, quantization_choice, resolve_auto
from utils.attention import AttentionChoice


@dataclass
class TrainableTransformer:
    """The transformer set up for training, with what was decided on the way."""

    module: torch.nn.Module
    blocks: List[torch.nn.Module]
    attention: AttentionChoice
    swapper: BlockSwapper
    compiled: bool
    fp8: bool
    trainable: int  # trained parameters


def prepare_transformer(cfg: TrainConfig, family: ModelFamily, transformer: torch.nn.Module, weights: TrainedWeights,
                        device: torch.device, compute_dtype: torch.dtype, *, unified_memory: bool = False,
                        attention_tokens: Optional[int] = None) -> TrainableTransformer:
    """Set up ``transformer`` (as loaded, on the host or already on ``device``) for training.

    ``weights`` is the run's ``trained_weights`` strategy (LoRA or full); ``attention_tokens`` the
    joint sequence length the attention kernels are timed at (None: no timing).
    """
    spec = resolve_auto(quantization_choice(cfg), device)
    blocks = family.blocks(transformer)
    if cfg.blocks_to_swap > len(blocks):
        raise ConfigError(f"key 'blocks_to_swap': value {cfg.blocks_to_swap} is more than the "
                          f"transformer's {len(blocks)} blocks")
    place(transformer, device, spec, blocks, "transformer", host_blocks=cfg.blocks_to_swap)
    if checkpointed_blocks(cfg, len(blocks)):
        transformer.enable_gradient_checkpointing(checkpointing_func(cfg, unified_memory, blocks))
    batch = cfg.data_config.train_batch_size
    shape = attention_shape(transformer, attention_tokens, batch) if attention_tokens else None
    attention = choose_attention(cfg, transformer, shape, device, compute_dtype)
    compiled, why = compile_decision(cfg, device, spec, family.spec)
    fp8 = maybe_fp8(cfg, transformer, family.spec, compiled)
    trainable = weights.attach(transformer) - freeze(transformer, family.unused_modules(transformer), compute_dtype)
    if trainable == 0:
        raise ConfigError("nothing trains: every trained weight is in a module whose output goes nowhere "
                          f"({', '.join(family.unused_modules(transformer))})")
    if compute_dtype != torch.float32:  # the forward runs under autocast
        skip_lora_input_upcast(transformer)
    trainable_to(transformer, device)  # frozen weights are where `place` put them
    swapper = BlockSwapper(blocks, cfg.blocks_to_swap, device)
    logger.info(f"torch.compile of the blocks: {why}")
    if compiled:
        compile_for_training(cfg, transformer, blocks)
    return TrainableTransformer(transformer, blocks, attention, swapper, compiled, fp8, trainable)


def freeze(model: torch.nn.Module, modules: List[str], dtype: torch.dtype) -> int:
    """Freeze the trainable weights under ``modules`` (they never get a gradient: an optimizer would
    hold no state for them, and a sharded checkpoint could not be restored); returns their count.
    They join the other frozen weights in ``dtype``, so a step under autocast copies none of them."""
    frozen = 0
    for prefix in modules:
        try:
            module = model.get_submodule(prefix)
        except AttributeError:  # a pipeline stage: another stage holds that block
            continue
        for param in module.parameters():
            if param.requires_grad:
                frozen += param.numel()
                param.data = param.data.to(dtype) if param.is_floating_point() else param.data
            param.requires_grad_(False)
    if frozen:
        logger.info(f"frozen {frozen} parameters that get no gradient ({', '.join(modules)})")
    return frozen


def trainable_to(model: torch.nn.Module, device: torch.device) -> None:
    """Move only the trainable weights (LoRA's are created on the CPU for swapped blocks)."""
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.to(device)


def transformer_load_device(cfg: TrainConfig, device: torch.device) -> torch.device:
    """Where the transformer's weights are read to: straight onto ``device`` when nothing happens
    block by block on the way (fastsafetensors' fast path to a GPU), else the host, from which
    ``place`` quantizes block by block or leaves the swapped blocks."""
    direct = quantization_choice(cfg) is None and cfg.blocks_to_swap == 0
    return device if direct else torch.device("cpu")
