"""Rectified-flow training maths: timestep sampling, shifting, noising, target and loss weights.

Convention (as in diffusers' flow-matching schedulers): ``x_t = (1 - sigma) * x_0 + sigma * noise``
with ``sigma`` in (0, 1]; the model predicts the velocity ``noise - x_0``; the transformer is
given ``timestep = sigma`` (the pipelines pass ``t / 1000`` with ``t = 1000 * sigma``).
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import torch
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3


def sample_sigmas(
    batch_size: int,
    scheme: str,
    generator: torch.Generator | None = None,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
    sigmoid_scale: float = 1.0,
) -> torch.Tensor:
    """Draw ``batch_size`` noise levels in (0, 1) on the CPU.

    ``uniform``, ``logit_normal`` (SD3's density), ``mode`` (SD3's mode sampling with heavy tails),
    ``cosmap`` (SD3's cosine-mapped density) or ``sigmoid`` (``sigmoid(scale * N(0, 1))``, as the
    FLUX trainers call it).
    """
    if scheme == "cosmap":
        x = torch.rand(batch_size, generator=generator)
        u = 1 - 1 / (torch.tan(math.pi / 2 * x) + 1)
    elif scheme == "sigmoid":
        u = torch.sigmoid(sigmoid_scale * torch.randn(batch_size, generator=generator))
    else:
        weighting = {"uniform": "none", "logit_normal": "logit_normal", "mode": "mode"}[scheme]
        u = compute_density_for_timestep_sampling(
            weighting, batch_size, logit_mean=logit_mean, logit_std=logit_std, mode_scale=mode_scale,
            device="cpu", generator=generator,
        )
    # Keep away from exactly 0 (no noise, nothing to learn) and 1 (time-shift divides by sigma).
    return u.clamp(1e-4, 1.0 - 1e-4)


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """The fixed shift of SD3/FLUX schedulers: ``shift * s / (1 + (shift - 1) * s)``."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def resolution_mu(image_seq_len: int, scheduler_config: Mapping) -> float:
    """The ``mu`` of the resolution-dependent shift, as the Qwen-Image and FLUX pipelines compute it."""
    base_len = scheduler_config.get("base_image_seq_len", 256)
    max_len = scheduler_config.get("max_image_seq_len", 4096)
    base_shift = scheduler_config.get("base_shift", 0.5)
    max_shift = scheduler_config.get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * slope + (base_shift - slope * base_len)


def time_shift(sigmas: torch.Tensor, mu: float, shift_type: str = "exponential") -> torch.Tensor:
    """The dynamic shift of ``FlowMatchEulerDiscreteScheduler`` (exponential or linear in ``mu``)."""
    # e / (e + 1/s - 1) with e = exp(mu) (or mu), multiplied through by s / e: s / (s (1 - k) + k)
    # with k = 1 / e, three small kernels instead of six.
    if shift_type not in ("exponential", "linear"):
        raise ValueError(f"unknown time_shift_type {shift_type!r}")
    k = math.exp(-mu) if shift_type == "exponential" else 1 / mu
    return sigmas / (sigmas * (1 - k) + k)


def apply_shift(
    sigmas: torch.Tensor, mode: str, image_seq_len: int, scheduler_config: Mapping, fixed_shift: float
) -> torch.Tensor:
    """Shift sampled sigmas towards noise: ``auto`` (resolution-dependent), ``fixed`` or ``none``."""
    if mode == "none":
        return sigmas
    if mode == "fixed":
        return shift_sigmas(sigmas, fixed_shift)
    if scheduler_config.get("use_dynamic_shifting", False):
        mu = resolution_mu(image_seq_len, scheduler_config)
        return time_shift(sigmas, mu, scheduler_config.get("time_shift_type", "exponential"))
    return shift_sigmas(sigmas, float(scheduler_config.get("shift", 1.0)))


def add_noise(latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """``(1 - sigma) * latents + sigma * noise`` with ``sigma`` broadcast over all but the batch axis."""
    s = sigmas.view(-1, *([1] * (latents.ndim - 1))).to(latents.dtype)
    return torch.lerp(latents, noise, s)  # one kernel; exact at sigma 0 and 1


def velocity_target(latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """What a rectified-flow model predicts: ``noise - latents``."""
    return noise - latents


def flow_matching_loss(
    prediction: torch.Tensor, target: torch.Tensor, sigmas: torch.Tensor, weighting: str = "none",
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Weighted mean-squared error in fp32, averaged per sample then over the batch. ``mask`` (0/1, broadcastable
    to the latents): only its ones count, each sample's mean taken over them (image-to-video's condition frame)."""
    if mask is None and weighting == "none":  # weights of one: the mean over all elements (samples equal in size)
        return torch.nn.functional.mse_loss(prediction.float(), target.float())
    squared = (prediction.float() - target.float()) ** 2
    if mask is None:
        per_sample = squared.flatten(1).mean(dim=1)
    else:
        kept = mask.to(squared.dtype).expand_as(squared)
        per_sample = (squared * kept).flatten(1).sum(dim=1) / kept.flatten(1).sum(dim=1)
    if weighting == "none":
        return per_sample.mean()
    weights = compute_loss_weighting_for_sd3(weighting, sigmas=sigmas.float()).view(-1)
    return (weights.to(per_sample.device) * per_sample).mean()
