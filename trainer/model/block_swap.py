"""Block swap: the frozen weights of the last N transformer blocks live in host memory and are copied
to the GPU just before each block runs (forward, and the recomputation in backward), then dropped.

Only frozen tensors move: LoRA weights, their gradients and optimizer state stay on the GPU, and the
host copy is the master (frozen weights never change), so nothing is copied back. On CUDA the next
swapped block is prefetched on a side stream while the current one computes; on the CPU the
"device" and the host are one, and the swap reduces to bookkeeping (so it is testable here).

A swap replaces the block's parameter objects instead of assigning ``param.data``: a quantized weight
(quanto, torchao) keeps its data and scales as inner tensors of a Python subclass, which ``.data =``
does not move (on an H100 the swapped block's int8/fp8 data stayed on the CPU: ``mat2 is on cpu``).
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from loguru import logger
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from utils.fast_loading import assign_tensor


class BlockSwapper:
    """Swap the frozen weights of ``blocks[-count:]`` between host and ``device``."""

    def __init__(self, blocks: Sequence[torch.nn.Module], count: int, device: torch.device):
        self.blocks = list(blocks)[len(blocks) - count:] if count else []
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.host: List[Dict[str, torch.Tensor]] = [self._host_copy(b) for b in self.blocks]
        self.ready: Dict[int, Optional[torch.cuda.Event]] = {}
        self.loads = 0  # how many times a block was brought in (tests and logs)
        self.last = -1  # the block that ran last, to tell forward from backward recomputation
        self.handles = []
        for index, block in enumerate(self.blocks):
            self._release(index)
            self.handles.append(block.register_forward_pre_hook(lambda m, a, i=index: self._before(i)))
            self.handles.append(block.register_forward_hook(lambda m, a, o, i=index: self._after(i)))
        if self.blocks:
            logger.info(f"block swap: {len(self.blocks)} of {len(blocks)} blocks kept in host memory")

    def _host_copy(self, block: torch.nn.Module) -> Dict[str, torch.Tensor]:
        host = {n: t.detach().to("cpu") for n, t in _frozen_tensors(block)}
        if self.cuda:  # pinned host memory makes the copies asynchronous
            host = {n: map_inner(t, torch.Tensor.pin_memory) for n, t in host.items()}
        return host

    def _assign(self, index: int, tensors: Dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            assign_tensor(self.blocks[index], name, tensor)

    def _fetch(self, index: int) -> None:
        """Start copying block ``index`` to the device (on the side stream on CUDA)."""
        if index in self.ready or index >= len(self.blocks):
            return
        if not self.cuda:
            self._assign(index, {n: t.to(self.device) for n, t in self.host[index].items()})
            self.ready[index] = None
            return
        with torch.cuda.stream(self.stream):
            self._assign(index, {n: t.to(self.device, non_blocking=True) for n, t in self.host[index].items()})
            event = torch.cuda.Event()
            event.record(self.stream)
        self.ready[index] = event

    def _before(self, index: int) -> None:
        self._fetch(index)
        event = self.ready[index]
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            # Copied on the side stream, used on this one: the memory must not be reused by the
            # next prefetch before this stream's kernels that read it have run.
            for _, tensor in _frozen_tensors(self.blocks[index]):
                for inner in stream_tensors(tensor):
                    inner.record_stream(stream)
        self.loads += 1
        # Overlap the next block's copy with this block's compute. Gradient checkpointing recomputes
        # the blocks in reverse during backward: then "next" is the one before.
        step = 1 if index > self.last else -1
        self.last = index
        if 0 <= index + step < len(self.blocks):
            self._fetch(index + step)
        # Non-reentrant checkpointing may stop a recomputation before a block's forward hook runs.
        for other in [i for i in self.ready if i not in (index, index + step)]:
            self._release(other)

    def release_all(self) -> None:
        """After backward: every swapped block back to its host copy."""
        for index in list(self.ready):
            self._release(index)

    def _after(self, index: int) -> None:
        self._release(index)

    def _release(self, index: int) -> None:
        """Point the block back at the host copies; the device copies are freed once unused."""
        self._assign(index, self.host[index])
        self.ready.pop(index, None)

    def remove(self) -> None:
        """Detach the hooks and leave every block on the device."""
        for handle in self.handles:
            handle.remove()
        for index in range(len(self.blocks)):
            self._fetch(index)
        if self.cuda:
            torch.cuda.synchronize(self.device)


def _frozen_tensors(block: torch.nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    for name, param in block.named_parameters():
        if not param.requires_grad:
            yield name, param
    for name, buffer in block.named_buffers():
        yield name, buffer


def inner_tensors(tensor: torch.Tensor) -> List[torch.Tensor]:
    """The plain tensors holding ``tensor``'s data: itself, or a quantized tensor's data, scales, ..."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [t for name in names for t in inner_tensors(getattr(tensor, name))]


def stream_tensors(tensor: torch.Tensor) -> List[torch.Tensor]:
    """Every plain tensor a kernel can reach through ``tensor``: its inner tensors and, for a tensor
    subclass, the tensors it keeps as attributes outside ``__tensor_flatten__``. quanto's fp8 Marlin
    weight keeps the GEMM's workspace (lock counters the kernel writes) that way; it is allocated on
    the swap's side stream when the weight arrives, so without ``record_stream`` the next prefetch
    could be handed that memory while the block's GEMMs still use it."""
    found = inner_tensors(tensor)
    if is_traceable_wrapper_subclass(tensor):
        for value in vars(tensor).values():
            if isinstance(value, torch.Tensor):
                found += [t for t in stream_tensors(value) if all(t is not f for f in found)]
    return found


def map_inner(tensor: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``tensor`` rebuilt with ``fn`` applied to each of its plain inner tensors (e.g. pinning)."""
    if not is_traceable_wrapper_subclass(tensor):
        return fn(tensor)
    names, context = tensor.__tensor_flatten__()
    inner = {name: map_inner(getattr(tensor, name), fn) for name in names}
    return type(tensor).__tensor_unflatten__(inner, context, tensor.size(), tensor.stride())
