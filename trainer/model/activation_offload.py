"""Gradient checkpointing whose kept block inputs live in host memory (``gradient_checkpointing_cpu_offload``).

With checkpointing, what stays on the GPU between forward and backward is each block's input: for
Qwen-Image at 1024x1024 that is 60 x 4224 tokens x 3072 x 2 bytes = 1.45 GiB, the largest activation
item of the 24 GB profile. torch's (non-reentrant) checkpoint keeps a block's inputs as autograd
saved tensors, and nothing else: what the block itself saves goes through checkpoint's own hooks,
which sit inside the ones installed here. So ``saved_tensors_hooks`` around the checkpoint call see
exactly the block inputs: each one that carries gradient is copied into pinned host memory on a side
stream (overlapping the next blocks' compute) and the device copy is freed; backward's recompute
copies it back, without a host sync. Gradients never leave the device: the graph is untouched.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from loguru import logger
from torch.utils.checkpoint import checkpoint

CheckpointFunc = Callable[..., Any]


def offloads_block_inputs(cfg: Any, unified_memory: bool) -> bool:
    """Whether checkpointed block inputs go to host memory: ``gradient_checkpointing_cpu_offload``,
    except on unified memory, where host and GPU share one pool (the memory planner asks this too)."""
    return bool(cfg.gradient_checkpointing_cpu_offload) and not unified_memory


def checkpointing_func(cfg: Any, unified_memory: bool) -> Optional[CheckpointFunc]:
    """What to hand ``enable_gradient_checkpointing``: the offloading checkpoint when
    ``gradient_checkpointing_cpu_offload`` is on, else None (diffusers' default)."""
    if not offloads_block_inputs(cfg, unified_memory):
        if cfg.gradient_checkpointing_cpu_offload:
            logger.warning("gradient_checkpointing_cpu_offload ignored: host and GPU share one memory here")
        return None
    logger.info("gradient checkpointing keeps the block inputs in host memory (gradient_checkpointing_cpu_offload)")
    return offloading_checkpoint()


def offloading_checkpoint(host: torch.device = torch.device("cpu")) -> CheckpointFunc:
    """A ``gradient_checkpointing_func`` for diffusers' ``enable_gradient_checkpointing`` that keeps
    the block inputs that carry gradient in ``host`` memory."""
    offloader = _Offloader(torch.device(host))

    def checkpointed(module: torch.nn.Module, *args: Any) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
            return checkpoint(module, *args, use_reentrant=False)

    return checkpointed


Packed = Tuple[torch.device, torch.Tensor, Optional[torch.cuda.Event]]


class _Offloader:
    """Pack a block input into host memory, unpack it back onto its device."""

    def __init__(self, host: torch.device):
        self.host = host
        self.streams: Dict[torch.device, torch.cuda.Stream] = {}

    def pack(self, tensor: torch.Tensor) -> Union[torch.Tensor, Packed]:
        if not _offloaded(tensor):
            return tensor
        if tensor.device.type != "cuda":  # a real copy all the same, so the CPU runs what a GPU runs
            return tensor.device, tensor.detach().to(self.host, copy=True), None
        compute = torch.cuda.current_stream(tensor.device)
        stream = self.streams.setdefault(tensor.device, torch.cuda.Stream(tensor.device))
        stream.wait_stream(compute)  # the block input is complete
        with torch.cuda.stream(stream):
            host = torch.empty_like(tensor, device=self.host, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        tensor.record_stream(stream)  # its memory is not reused before the copy has read it
        return tensor.device, host, copied

    @staticmethod
    def unpack(packed: Union[torch.Tensor, Packed]) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, copied = packed
        if copied is None:
            return host.to(device)
        torch.cuda.current_stream(device).wait_event(copied)
        return host.to(device, non_blocking=True)


def _offloaded(arg: Any) -> bool:
    # Inputs that carry gradient are the activations flowing through the blocks; constants shared by
    # every block (rotary tables, masks, the timestep embedding) would only be copied once per block.
    return isinstance(arg, torch.Tensor) and arg.requires_grad and arg.is_floating_point()
