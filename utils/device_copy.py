"""Host-to-device copies that do not make the host wait for the GPU.

A blocking ``tensor.to("cuda")`` from pageable memory synchronizes the stream before it copies (CUDA's
documented behaviour), draining the GPU's queue; ``to_device`` copies from pinned memory, non-blocking, and
torch's pinned-memory allocator keeps the source alive until the copy has run. It lives in ``utils/`` (the
platform floor) because both the families (their conditioning tensors) and the training step use it
(``trainer/step/async_step.py`` says why a step must stay free of host syncs).
"""

from __future__ import annotations

from typing import Optional

import torch


def to_device(tensor: torch.Tensor, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``tensor.to(device, dtype)`` without a host sync: a host tensor bound for a CUDA device is cast
    on the host (a smaller copy), pinned, and copied non-blocking."""
    device = torch.device(device)
    if tensor.device.type != "cpu" or device.type != "cuda":
        return tensor.to(device, dtype)
    if dtype is not None:
        tensor = tensor.to(dtype)
    return tensor.pin_memory().to(device, non_blocking=True)
