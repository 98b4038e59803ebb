"""One training step's maths, shared by the engine and the GPU harness: tensors in, loss out.

The step's randomness comes from a generator the caller seeds (``step_seed``), so a resumed run
draws the same noise and noise levels; ``seed_global_rngs`` re-seeds what draws from the global
generators inside the forward (LoRA dropout).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Callable, ContextManager, Dict, Optional, Sequence, Tuple

import torch

from trainer.families.base import ModelFamily
from trainer.step.async_step import to_device
from trainer.config import TrainConfig
from trainer.step.flow_matching import add_noise, apply_shift, flow_matching_loss, sample_sigmas, velocity_target


def step_seed(seed: int, epoch: int, micro_step: int, rank: int) -> int:
    """A 63-bit seed unique to (seed, epoch, micro-batch, process)."""
    digest = hashlib.sha256(f"{seed}/{epoch}/{micro_step}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_global_rngs(seed: int, device: torch.device) -> None:
    """``torch.manual_seed(seed)`` for the host and the training device only. (``torch.manual_seed``
    also queues a seed for CUDA when it is not started, formatting a stack trace each call: a
    measurable share of a small model's step.)"""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    elif device.type != "cpu":
        torch.manual_seed(seed)


def draw_sigmas(cfg: TrainConfig, family: ModelFamily, latent_shape: Sequence[int], gen: torch.Generator) -> torch.Tensor:
    """The run's noise levels for a batch (on the host): the configured sampler, then the shift, then the
    family's ``sigma_range`` (an expert trained alone sees only its part of the schedule: the distribution is
    squeezed into it, keeping its shape)."""
    sigmas = sample_sigmas(latent_shape[0], cfg.timestep_sampling, gen, cfg.logit_mean, cfg.logit_std,
                           cfg.mode_scale, cfg.sigmoid_scale)
    sigmas = apply_shift(sigmas, cfg.timestep_shift, family.image_seq_len(latent_shape), family.scheduler_config,
                         cfg.shift)
    low, high = getattr(family, "sigma_range", (0.0, 1.0))
    return sigmas if (low, high) == (0.0, 1.0) else low + (high - low) * sigmas


def flow_matching_step(
    cfg: TrainConfig,
    family: ModelFamily,
    transformer: torch.nn.Module,
    latents: torch.Tensor,
    text: Dict[str, Any],
    references: Sequence[torch.Tensor],
    gen: torch.Generator,
    compute_dtype: torch.dtype,
    autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
    noise: Optional[torch.Tensor] = None,
    sigmas: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The flow-matching loss of one micro-batch of normalised ``latents`` (on the device) with its
    collated ``text`` and reference latents: noise, then noise levels drawn from ``gen`` (unless
    given), the noisy latents in ``compute_dtype``, the family's prediction under ``autocast``, and
    the weighted mean-squared error against the velocity."""
    noisy, sigmas, target = noisy_inputs(cfg, family, latents, gen, compute_dtype, noise, sigmas)
    with autocast():
        prediction = family.predict(transformer, noisy, sigmas, text, references)
    return flow_matching_loss(prediction, target, sigmas, cfg.loss_weighting, family.loss_mask(latents, references))


def noisy_inputs(cfg: TrainConfig, family: ModelFamily, latents: torch.Tensor, gen: torch.Generator,
                 compute_dtype: torch.dtype, noise: Optional[torch.Tensor] = None,
                 sigmas: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noisy latents in ``compute_dtype``, noise levels, velocity target) of one micro-batch: the noise,
    then the noise levels drawn from ``gen`` (unless given). Shared by the one-process step and the
    pipeline stages (``trainer/stage_training.py``), so both draw alike."""
    if noise is None:
        noise = to_device(torch.randn(latents.shape, generator=gen), latents.device)
    if sigmas is None:
        sigmas = to_device(draw_sigmas(cfg, family, latents.shape, gen), latents.device)
    return add_noise(latents, noise, sigmas).to(compute_dtype), sigmas, velocity_target(latents, noise)
