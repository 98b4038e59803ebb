"""The optimizer's half of a training step, written once: the engine (``Trainer._backward`` /
``_clip_gradients`` / ``_step``) and the GPU harness (``benchmarks/harness.py``'s ``optimizer_step``) both call
these functions, so a GPU figure measures the step users run.

After the loss: ``backward``, ``clip_gradients`` (the norm stays on the device), then ``guarded_step``: the NaN
guard (on the device where the optimizer can skip a step itself, else after reading the step's numbers), the
optimizer and schedule step, the EMA, and clearing the gradients.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from trainer.step.async_step import arm_device_skip

Clip = Callable[[Iterable[torch.nn.Parameter], float], torch.Tensor]


def backward(loss: torch.Tensor, accelerator: Optional[Any] = None) -> None:
    """accelerate's backward where it adds something (a loss scaler, accumulation's division, DeepSpeed);
    torch's own where it would add nothing (``accelerator=None``)."""
    if accelerator is None:
        loss.backward()
    else:
        accelerator.backward(loss)


def clip_gradients(params: Iterable[torch.nn.Parameter], max_grad_norm: float,
                   clip: Clip = torch.nn.utils.clip_grad_norm_) -> Optional[torch.Tensor]:
    """Clip the gradients at ``max_grad_norm`` and return their norm before clipping, on the device (read with
    the loss); None when clipping is off (``max_grad_norm <= 0``). ``clip``: accelerate's where it must see it."""
    if max_grad_norm <= 0:
        return None
    return clip(params, max_grad_norm)


def step_optimizer(optimizer: torch.optim.Optimizer, scheduler: Optional[Any], ok: bool, ema: Optional[Any] = None,
                   params: Iterable[torch.nn.Parameter] = ()) -> None:
    """Step the optimizer, the learning-rate schedule and the EMA when ``ok``; clear the gradients either way."""
    if ok:
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if ema is not None:
            ema.step(params)
    optimizer.zero_grad(set_to_none=True)


def guarded_step(optimizer: torch.optim.Optimizer, scheduler: Optional[Any], values: torch.Tensor, on_device: bool,
                 read_finite: Callable[[], bool], ema: Optional[Any] = None,
                 params: Iterable[torch.nn.Parameter] = ()) -> None:
    """The step behind the NaN guard. ``on_device`` (an optimizer that skips by itself, ``skips_on_device``): the
    step is armed to be a no-op unless ``values`` (loss, gradient norm) are finite, and nothing is read; the
    schedule and EMA then advance on a skipped step too. Otherwise ``read_finite()`` (the host reads the step's
    numbers) decides whether it steps at all."""
    if on_device:
        arm_device_skip(optimizer, values)
        step_optimizer(optimizer, scheduler, True, ema, params)
    else:
        step_optimizer(optimizer, scheduler, read_finite(), ema, params)
