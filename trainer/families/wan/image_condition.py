"""Wan image-to-video: the clip's first frame as the condition, built as ``WanImageToVideoPipeline`` builds it.

Two ways, as the checkpoint's transformer takes it:

- ``channels`` (Wan 2.1 I2V, Wan 2.2 I2V-A14B: ``in_channels = 2 * z + 4``): ``[first frame, zeros...]`` (the clip's
  length) through the VAE, normalised, after a 4-channel mask that is one on the first latent frame; the
  transformer reads ``[noisy latents, mask, condition]`` along the channels (``prepare_latents``, non-expand branch).
  Wan 2.1 I2V also takes the first frame's CLIP embeddings (``encoder_hidden_states_image``: the image encoder's
  penultimate hidden states, ``encode_image``).
- ``first_frame`` (Wan 2.2 TI2V-5B, ``expand_timesteps``, with ``task: i2v``): the first frame alone through the VAE
  replaces the first latent frame of the noisy latents, and its tokens get timestep 0 (the pipeline's
  ``first_frame_mask``); the prediction there is never used, so training leaves it out of the loss.

The condition is cached with the clip's latents (one decode of the clip), as one more tensor in the cache entry; the
engine hands it to the family among the sample's ``references``. A still image in an I2V run is a one-frame clip
and its own first frame, as the pipeline builds it for ``num_frames=1`` (with ``channels``: the model sees the
answer in its condition, but that is what the pipeline would feed it; with ``first_frame``: every token would be
the condition and nothing would be left to learn, so TI2V's stills train text-to-video, which the same checkpoint
also does).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch

from utils.errors import ConfigError

CHANNELS, FIRST_FRAME = "channels", "first_frame"
MASK_CHANNELS = 4  # the pipeline folds the first frame's mask 4 times (the VAE's temporal compression) into channels


def condition_kind(task: Optional[str], transformer_config: Mapping[str, Any], z_dim: int,
                   expand_timesteps: bool, model_path: str) -> Optional[str]:
    """How the checkpoint takes an image condition for ``task`` (the config's ``task``; None: the checkpoint's own):
    ``channels``, ``first_frame`` or None (text-to-video). One-line errors for a task the checkpoint cannot do."""
    takes_channels = int(transformer_config.get("in_channels", z_dim)) == 2 * z_dim + MASK_CHANNELS
    if takes_channels:
        if task == "t2v":
            raise ConfigError(f"key 'task': value 't2v' does not fit '{model_path}': its transformer takes the first "
                              "frame's latents (an image-to-video checkpoint); remove the key or use task: i2v")
        return CHANNELS
    if task != "i2v":
        return None
    if expand_timesteps:
        return FIRST_FRAME
    raise ConfigError(f"key 'task': value 'i2v' needs an image-to-video checkpoint (Wan 2.1 / 2.2 I2V, or TI2V-5B); "
                      f"'{model_path}' is text-to-video only: remove the key or use task: t2v")


def first_frame_mask(latents_like: torch.Tensor) -> torch.Tensor:
    """``(B, 4, F', h, w)``: ones on the first latent frame, zeros after (the pipeline's ``mask_lat_size``: the
    first pixel frame's mask repeated 4 times and folded into channels with the next frames' zeros)."""
    b, _, frames, h, w = latents_like.shape
    mask = latents_like.new_zeros(b, MASK_CHANNELS, frames, h, w)
    mask[:, :, 0] = 1
    return mask


def channels_condition(encode: Callable[[torch.Tensor], torch.Tensor], clips: torch.Tensor) -> torch.Tensor:
    """``(B, 4 + C, F', h, w)``: the mask, then the normalised latents of ``[first frame, zeros...]`` as long as the
    clip (``clips``: ``(B, 3, F, H, W)`` in [-1, 1]; ``encode``: the family's normalised VAE encode)."""
    video = torch.zeros_like(clips)
    video[:, :, 0] = clips[:, :, 0]
    latents = encode(video)
    return torch.cat([first_frame_mask(latents).to(latents.dtype), latents], dim=1)


def first_frame_latents(encode: Callable[[torch.Tensor], torch.Tensor], clips: torch.Tensor) -> torch.Tensor:
    """``(B, C, 1, h, w)``: the first frame alone through the VAE, normalised (TI2V's ``latent_condition``)."""
    return encode(clips[:, :, :1])


def replace_first_frame(noisy: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
    """The noisy latents with their first latent frame replaced by the condition's
    (``(1 - first_frame_mask) * condition + first_frame_mask * latents``)."""
    return torch.cat([condition.to(noisy.dtype), noisy[:, :, 1:]], dim=2)


def token_timesteps(timesteps: torch.Tensor, latent_shape: torch.Size, patch: int = 2) -> torch.Tensor:
    """``(B, F' * h/2 * w/2)``: each sample's timestep on every token but the first latent frame's, which get 0
    (the pipeline's ``first_frame_mask[0][0][:, ::2, ::2] * t``, flattened frame-major as the patches are)."""
    _, _, frames, h, w = latent_shape
    per_frame = (h // patch) * (w // patch)
    out = timesteps[:, None].expand(-1, frames * per_frame).clone()
    out[:, :per_frame] = 0
    return out


def loss_mask_without_first_frame(latents: torch.Tensor) -> torch.Tensor:
    """``(B, 1, F', 1, 1)``: 0 on the first latent frame (the condition's, whose prediction the pipeline drops),
    1 elsewhere."""
    mask = latents.new_ones(latents.shape[0], 1, latents.shape[2], 1, 1)
    mask[:, :, 0] = 0
    return mask
