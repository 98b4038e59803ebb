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

from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch
from loguru import logger
from torch.utils.checkpoint import checkpoint

from utils.errors import ConfigError

CheckpointFunc = Callable[..., Any]


def offloads_block_inputs(cfg: Any, unified_memory: bool) -> bool:
    """Whether checkpointed block inputs go to host memory: ``gradient_checkpointing_cpu_offload``,
    except on unified memory, where host and GPU share one pool (the memory planner asks this too)."""
    return bool(cfg.gradient_checkpointing_cpu_offload) and not unified_memory


def checkpointed_blocks(cfg: Any, total: int) -> int:
    """How many of the ``total`` blocks are checkpointed: ``gradient_checkpointing`` true (all), false (none)
    or a number, which may not exceed the blocks there are (the memory planner asks this too)."""
    wanted = cfg.gradient_checkpointing
    if wanted is True or wanted is False:
        return total if wanted else 0
    if not 0 <= wanted <= total:
        raise ConfigError(f"key 'gradient_checkpointing': value {wanted} is more than the transformer's {total} blocks "
                          "(true checkpoints them all)")
    return wanted


def checkpointed_indices(count: int, total: int) -> range:
    """Which ``count`` of ``total`` blocks (execution order) are checkpointed: the first ones. Any ``count``
    blocks cost the same recomputation, but backward reaches the first blocks last, once the blocks that
    kept their activations have freed them: the peak is the larger of (the kept activations + the
    checkpointed inputs) and (those inputs + one recomputed block). Checkpointing the last blocks instead
    would recompute them while every kept activation is alive, one block's activations more, so that one
    checkpointed block would save nothing. Block swap swaps the last blocks, and a swapped block saves
    memory only when it is checkpointed: swap goes with every block checkpointed (as auto_fit sets it)."""
    return range(count)


def checkpointing_func(cfg: Any, unified_memory: bool,
                       blocks: Sequence[torch.nn.Module] = ()) -> Optional[CheckpointFunc]:
    """What to hand ``enable_gradient_checkpointing``: None (diffusers' default) when every block is
    checkpointed in place; else a function that checkpoints the chosen ``blocks`` (keeping their inputs in
    host memory with ``gradient_checkpointing_cpu_offload``) and runs the others directly. A module that is
    none of ``blocks`` is checkpointed, as diffusers would."""
    count = checkpointed_blocks(cfg, len(blocks)) if blocks else None
    offload = offloads_block_inputs(cfg, unified_memory)
    if cfg.gradient_checkpointing_cpu_offload and not offload:
        logger.warning("gradient_checkpointing_cpu_offload ignored: host and GPU share one memory here")
    if offload:
        logger.info("gradient checkpointing keeps the block inputs in host memory (gradient_checkpointing_cpu_offload)")
    if count is None or count == len(blocks):
        return offloading_checkpoint() if offload else None
    logger.info(f"gradient checkpointing: the first {count} of {len(blocks)} blocks; the others keep their activations")
    unsaved = min(cfg.blocks_to_swap, len(blocks) - count)
    if unsaved:
        logger.warning(f"blocks_to_swap: {unsaved} of the {cfg.blocks_to_swap} swapped blocks (the last ones) are not "
                       f"checkpointed (gradient_checkpointing: {count}, the first ones) and save no memory")
    chosen = set(checkpointed_indices(count, len(blocks)))
    direct = [block for index, block in enumerate(blocks) if index not in chosen]
    return selective_checkpoint(direct, offloading_checkpoint() if offload else plain_checkpoint)


def plain_checkpoint(module: torch.nn.Module, *args: Any) -> Any:
    """diffusers' default ``gradient_checkpointing_func``: torch's non-reentrant checkpoint."""
    return checkpoint(module, *args, use_reentrant=False)


def selective_checkpoint(direct: Sequence[torch.nn.Module], checkpointed: CheckpointFunc) -> CheckpointFunc:
    """A ``gradient_checkpointing_func`` that runs the modules of ``direct`` as they are (their activations
    stay for backward, nothing is recomputed) and hands every other one to ``checkpointed``."""
    plain = {id(module) for module in direct}

    def run(module: torch.nn.Module, *args: Any) -> Any:
        if id(module) in plain:
            return module(*args)
        return checkpointed(module, *args)

    return run


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
