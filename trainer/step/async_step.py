"""What keeps a training step free of host syncs, so the host queues step N+1 while the GPU runs step N.

Two things made the host wait for the GPU inside a step:

- **Host-to-device copies from pageable memory.** A blocking ``tensor.to("cuda")`` synchronizes the
  stream before it copies (CUDA's documented behaviour for pageable memory): every latent, noise or
  text tensor moved that way drained the GPU's queue. ``to_device`` copies from pinned memory,
  non-blocking; torch's pinned-memory allocator keeps the source alive until the copy has run.
- **Reading the loss for the NaN guard.** The host had to know whether the loss and gradient norm
  were finite before it could step. Now the optimizer skips a non-finite step by itself (fused
  AdamW's ``found_inf``, the flag GradScaler uses: ``arm_device_skip``), and ``StepReadout(lag=1)``
  brings the step's values to the host one step late, once the next step has been queued.

Both paths run on every device; on the CPU the copies are plain and the read waits for nothing.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Optional, Tuple

import torch

from utils.device_copy import to_device  # noqa: F401  (its home is utils/: the families use it too)

Known = Tuple[int, int, float]  # what the host knows of a step when it is queued: step, epoch, lr


def device_skip_supported(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` skips its own step when ``found_inf`` is set: torch's fused Adam/AdamW.
    (Other optimizers reject or ignore the flag, so the engine reads the loss before stepping them.)"""
    fused = all(group.get("fused") for group in optimizer.param_groups)
    return isinstance(optimizer, torch.optim.Adam) and fused  # AdamW subclasses Adam


def skips_on_device(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Whether the NaN guard runs on the device: where ``optimizer`` can skip a step itself and reading
    the loss first would make the host wait for the device. Not on the CPU: there the read waits for
    nothing, while an armed optimizer pays a foreach over its step counters every step."""
    return torch.device(device).type != "cpu" and device_skip_supported(optimizer)


def step_values(loss: torch.Tensor, grad_norm: Optional[torch.Tensor]) -> torch.Tensor:
    """``[loss, grad_norm]`` (or ``[loss]`` without clipping) as one fp32 tensor on the loss's device."""
    values = [loss.float()]
    if grad_norm is not None:
        values.append(torch.as_tensor(grad_norm, device=loss.device).float())
    return torch.stack(values)


def arm_device_skip(optimizer: torch.optim.Optimizer, values: torch.Tensor) -> None:
    """Make ``optimizer``'s next step a no-op (weights, moments and step count) unless every value
    (loss, gradient norm) is finite: decided on the device, nothing read back."""
    optimizer.found_inf = (~torch.isfinite(values).all()).float()


def copy_to_host(values: torch.Tensor, cuda: bool) -> Tuple[torch.Tensor, Optional[torch.cuda.Event]]:
    """A host copy of ``values``: on CUDA a non-blocking copy into pinned memory, readable once the
    returned event has completed; elsewhere a plain copy (and no event)."""
    if not cuda:
        return values.detach().clone(), None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step's numbers, on the host: its loss and gradient norm, and the epoch and
    learning rate it ran with."""

    step: int
    epoch: int
    lr: float
    loss: float
    grad_norm: Optional[float]

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and (self.grad_norm is None or math.isfinite(self.grad_norm))


class StepReadout:
    """Copies each step's ``step_values`` to the host, ``lag`` steps late.

    ``lag=0``: ``push`` returns the step's own record (the host waits for its backward). ``lag=1``
    (CUDA, with the optimizer skipping on the device): ``push`` queues a non-blocking copy into pinned
    memory and returns the *previous* step's record, whose copy has finished on the GPU's queue unless
    the host ran more than a step ahead; ``flush`` returns what is still pending.
    """

    def __init__(self, device: torch.device, lag: int):
        self.cuda = torch.device(device).type == "cuda"
        self.lag = lag
        self.pending: Deque[Tuple[Known, torch.Tensor, Optional[torch.cuda.Event]]] = deque()

    def push(self, values: torch.Tensor, step: int, epoch: int, lr: float) -> List[StepRecord]:
        """Hand over a step's ``step_values``; returns the records now readable, oldest first."""
        if self.lag == 0 and not self.cuda:  # read at once: nothing can change it first, no copy
            return [_record((step, epoch, lr), values.tolist())]
        host, event = copy_to_host(values, self.cuda)
        self.pending.append(((step, epoch, lr), host, event))
        return self._read(keep=self.lag)

    def flush(self) -> List[StepRecord]:
        """Every record still pending (waits for the GPU to finish them)."""
        return self._read(keep=0)

    def _read(self, keep: int) -> List[StepRecord]:
        records = []
        while len(self.pending) > keep:
            known, host, event = self.pending.popleft()
            if event is not None:
                event.synchronize()
            records.append(_record(known, host.tolist()))
        return records


def _record(known: Known, values: List[float]) -> StepRecord:
    return StepRecord(*known, loss=values[0], grad_norm=values[1] if len(values) > 1 else None)
