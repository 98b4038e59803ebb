"""Gradient checkpointing whose kept block inputs live in host memory (``gradient_checkpointing_cpu_offload``).

With checkpointing, what stays on the GPU between forward and backward is each block's input: for
Qwen-Image at 1024x1024 that is 60 x 4224 tokens x 3072 x 2 bytes = 1.45 GiB, the largest activation
item of the 24 GB profile. Here each input that carries gradient is handed to torch's own
(non-reentrant) checkpoint as a host copy, and copied back to the device inside the checkpointed
function, so the copy back happens again when backward recomputes the block. Both copies are
differentiable ``Tensor.to`` calls, so gradients flow through them unchanged; RNG state and autocast
are handled by ``torch.utils.checkpoint`` as usual. The cost is the PCIe traffic: about four copies
of the kept activations per step (inputs out and back, their gradients out and back).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from loguru import logger
from torch.utils.checkpoint import checkpoint

CheckpointFunc = Callable[..., Any]


def checkpointing_func(cfg: Any, unified_memory: bool) -> Optional[CheckpointFunc]:
    """What to hand ``enable_gradient_checkpointing``: the offloading checkpoint when
    ``gradient_checkpointing_cpu_offload`` is on, else None (diffusers' default)."""
    if not cfg.gradient_checkpointing_cpu_offload:
        return None
    if unified_memory:
        logger.warning("gradient_checkpointing_cpu_offload ignored: host and GPU share one memory here")
        return None
    logger.info("gradient checkpointing keeps the block inputs in host memory (gradient_checkpointing_cpu_offload)")
    return offloading_checkpoint()


def offloading_checkpoint(host: torch.device = torch.device("cpu")) -> CheckpointFunc:
    """A ``gradient_checkpointing_func`` for diffusers' ``enable_gradient_checkpointing`` that keeps
    the block inputs that carry gradient in ``host`` memory."""

    def checkpointed(module: torch.nn.Module, *args: Any) -> Any:
        devices = [a.device if _offloaded(a) else None for a in args]
        stored = [a.to(host) if device is not None else a for a, device in zip(args, devices)]
        # checkpoint stashes the RNG state of the devices its arguments are on (dropout must draw
        # the same numbers when backward recomputes): keep the device among them.
        anchor = next((d for d in devices if d is not None), None)
        anchors = [torch.empty(0, device=anchor)] if anchor is not None else []

        def run(*inner: Any) -> Any:
            inner = inner[:len(args)]
            return module(*[a.to(device) if device is not None else a for a, device in zip(inner, devices)])

        return checkpoint(run, *stored, *anchors, use_reentrant=False)

    return checkpointed


def _offloaded(arg: Any) -> bool:
    # Inputs that carry gradient are the activations flowing through the blocks; constants shared by
    # every block (rotary tables, masks, the timestep embedding) would only be copied once per block.
    return isinstance(arg, torch.Tensor) and arg.requires_grad and arg.is_floating_point()
