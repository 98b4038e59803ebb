"""Wan 2.x (``WanPipeline``): a UMT5 text encoder (prompts padded with zeros to 512 tokens, as the pipeline
does), the 3-D Wan VAE normalised per channel (``latents_mean`` / ``latents_std``), and one
``WanTransformer3DModel`` that takes ``(B, C, F, h, w)`` latents and the timestep ``sigma * 1000``.

Latents keep their frame axis everywhere: a clip of ``4k + 1`` frames is ``k + 1`` latent frames, a still image
one (Wan itself trains on images as one-frame clips)."""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch
from diffusers import (AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline,
                       WanTransformer3DModel)
from PIL import Image
from transformers import AutoTokenizer, CLIPImageProcessor, CLIPVisionModel, UMT5EncoderModel

from trainer.families.base import FamilyBase, FamilySpec, Tensors
from trainer.facts.family_spec import vae_scale_factor
from trainer.families.wan.experts import WanExperts, boundary_of, experts_to_train, sigma_range
from trainer.families.wan import image_condition as i2v
from trainer.families.wan.spec import SPEC
from utils.device_copy import to_device
from utils.errors import ConfigError


class WanStillRenders(WanPipeline):
    """``WanPipeline`` for validation renders: the engine saves a render's first frame as its PNG, so it renders
    one frame (a still) unless asked for more, as PIL frames. (Clips saved as .mp4 are not written yet.)"""

    def __call__(self, *args: Any, num_frames: int = 1, output_type: str = "pil", **kwargs: Any) -> Any:
        return super().__call__(*args, num_frames=num_frames, output_type=output_type, **kwargs)


class WanI2VRenders(WanImageToVideoPipeline):
    """``WanImageToVideoPipeline`` for validation renders (an I2V run's prompts carry their first frame as
    ``reference_images``): one frame unless asked for more, as PIL frames."""

    def __call__(self, *args: Any, num_frames: int = 1, output_type: str = "pil", **kwargs: Any) -> Any:
        return super().__call__(*args, num_frames=num_frames, output_type=output_type, **kwargs)


class WanFamily(FamilyBase):
    """Wan 2.1 text-to-video and Wan 2.2 TI2V-5B (``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` or a folder of the same
    layout): one transformer, text-to-video; Wan 2.2 T2V-A14B: two experts, one or both trained (``experts.py``).
    Still images train as one-frame clips."""

    spec: ClassVar[FamilySpec] = SPEC
    pipeline_class: ClassVar[type] = WanPipeline
    vae_class: ClassVar[type] = AutoencoderKLWan
    transformer_class: ClassVar[type] = WanTransformer3DModel
    # WanPipeline's guidance: cond + scale * (cond - uncond) above 1; its default is 5.
    cfg_argument: ClassVar[str] = "guidance_scale"
    default_cfg_scale: ClassVar[float] = 5.0

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        # Wan 2.2's VAE takes 2x2 pixel patches (16x); the config says so, Wan 2.1's (8x) predates the key.
        self.vae_scale_factor = int(self.vae_config.get("scale_factor_spatial", vae_scale_factor(self.vae_config)))
        self.pixel_multiple = 2 * self.vae_scale_factor  # the transformer's (1, 2, 2) patches
        self.temporal_compression = int(self.vae_config.get("scale_factor_temporal", self.spec.temporal_compression))
        # UniPC names its fixed shift flow_shift; the engine's timestep shift reads "shift".
        self.scheduler_config = {**self.scheduler_config, "shift": float(self.scheduler_config.get("flow_shift", 1.0))}
        # Two experts (Wan 2.2 A14B): which train, and the noise levels they see.
        self.boundary = boundary_of(self.model_index)
        self.experts = experts_to_train(getattr(cfg, "train_expert", None), self.boundary, self.model_path)
        self.sigma_range = sigma_range(self.experts, self.boundary)
        if self.boundary is not None:
            refuse_for_experts(cfg)
        # Image-to-video (image_condition.py): how the checkpoint takes the first frame, if the run uses it.
        self.pipeline_class = self.pipeline_named_by_checkpoint(WanPipeline, WanImageToVideoPipeline)
        self.transformer_config = self._load(WanTransformer3DModel.load_config, "transformer")
        self.condition = i2v.condition_kind(getattr(cfg, "task", None), self.transformer_config,
                                            int(self.vae_config["z_dim"]), self.expand_timesteps, self.model_path)
        self.conditions_on_first_frame = self.condition is not None
        self.image_encoder_pipe: Any = None  # Wan 2.1 I2V's CLIP vision tower, loaded with the VAE

    @property
    def expand_timesteps(self) -> bool:
        """TI2V-5B's per-token timesteps (its model_index.json)."""
        return bool(self.model_index.get("expand_timesteps", False))

    @property
    def takes_image_embeds(self) -> bool:
        """Wan 2.1 I2V: the transformer also cross-attends to the first frame's CLIP embeddings."""
        return self.transformer_config.get("image_dim") is not None

    # -- text -------------------------------------------------------------------------------------
    def load_text_encoder(self, device: torch.device, dtype: torch.dtype) -> None:
        encoder = self._load(UMT5EncoderModel.from_pretrained, "text_encoder", dtype=dtype)
        # The pipeline's own encode_prompt holds the prompt cleaning, the tokenizer call and the zero padding.
        self.text_pipe = WanPipeline(tokenizer=self._load(AutoTokenizer.from_pretrained, "tokenizer"),
                                     text_encoder=self._frozen_encoder(encoder, device), vae=None, scheduler=None)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], references: None = None) -> List[Tensors]:
        """Each prompt's UMT5 states without the zero rows the pipeline pads them with (``collate_text`` puts
        them back: the transformer sees exactly the pipeline's 512 rows)."""
        assert self.text_pipe is not None, "load_text_encoder() first"
        embeds, _ = self.text_pipe.encode_prompt(
            list(prompts), do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length,
            device=self.text_pipe.text_encoder.device)
        return [{"prompt_embeds": e[:nonzero_rows(e)]} for e in embeds]

    def collate_text(self, conds: Sequence[Tensors], device: torch.device, dtype: torch.dtype) -> Tensors:
        return {"prompt_embeds": to_device(self._padded([c["prompt_embeds"] for c in conds]), device, dtype)}

    def _padded(self, embeds: Sequence[torch.Tensor]) -> torch.Tensor:
        """``(B, max_sequence_length, D)``: each prompt's rows, then zeros, as the pipeline pads them."""
        out = embeds[0].new_zeros(len(embeds), self.max_sequence_length, embeds[0].shape[-1])
        for i, e in enumerate(embeds):
            out[i, : e.shape[0]] = e
        return out

    def render_kwargs(self, cond: Tensors, dtype: torch.dtype, device: torch.device) -> Dict[str, Any]:
        return {"prompt_embeds": self._padded([cond["prompt_embeds"]]).to(device, dtype)}

    def render_pipeline(self, transformer: torch.nn.Module) -> Any:
        """``WanStillRenders`` around the live transformer and VAE (the encoders left out: renders read cached
        conditions), with the checkpoint's scheduler and its per-token timesteps where it has them (TI2V-5B)."""
        scheduler = self._load(UniPCMultistepScheduler.from_pretrained, "scheduler")
        experts: Dict[str, Any] = {"transformer": transformer}
        if isinstance(transformer, WanExperts):
            # Both experts: switched at the boundary as the pipeline does. One expert trained alone renders the
            # whole schedule by itself (the other is not loaded: a 14B model's memory).
            both = len(transformer.experts()) == 2
            experts = dict(transformer=transformer.experts()[0], transformer_2=transformer.transformer_2 if both
                           else None, boundary_ratio=transformer.boundary if both else None)
        if self.conditions_on_first_frame:
            # The image encoder (Wan 2.1 I2V) is the cache pass's, loaded with the VAE.
            clip = self.image_encoder_pipe
            return WanI2VRenders(tokenizer=None, text_encoder=None, vae=self.vae, scheduler=scheduler,
                                 image_encoder=clip.image_encoder if clip else None,
                                 image_processor=clip.image_processor if clip else None,
                                 expand_timesteps=self.expand_timesteps, **experts)
        return WanStillRenders(tokenizer=None, text_encoder=None, vae=self.vae, scheduler=scheduler,
                               expand_timesteps=self.expand_timesteps, **experts)

    # -- the first frame's condition (image-to-video) ---------------------------------------------
    def load_vae(self, device: torch.device, dtype: torch.dtype) -> None:
        """The VAE; for Wan 2.1 I2V also the image encoder and its processor (the condition is encoded with the
        clip's latents, in the same cache pass)."""
        super().load_vae(device, dtype)
        if self.conditions_on_first_frame and self.takes_image_embeds:
            encoder = self._load(CLIPVisionModel.from_pretrained, "image_encoder", dtype=dtype)
            self.image_encoder_pipe = WanImageToVideoPipeline(
                tokenizer=None, text_encoder=None, vae=None, scheduler=None,
                image_processor=self._load(CLIPImageProcessor.from_pretrained, "image_processor"),
                image_encoder=encoder.requires_grad_(False).eval().to(device))

    def unload_vae(self) -> None:
        self.image_encoder_pipe = None
        super().unload_vae()

    @torch.no_grad()
    def encode_condition(self, pixels: torch.Tensor) -> List[torch.Tensor]:
        """The clips' first-frame condition as the pipeline builds it, one ``(B, ...)`` tensor per slot: the
        ``channels`` condition (mask and latents), then Wan 2.1 I2V's CLIP embeddings; TI2V's first frame's latents.
        ``pixels``: ``(B, 3, F, H, W)`` clips or ``(B, 3, H, W)`` stills in [-1, 1]. Empty for a TI2V still (it trains
        text-to-video: see image_condition.py)."""
        clips = pixels.unsqueeze(2) if pixels.ndim == 4 else pixels
        if self.condition == i2v.FIRST_FRAME:
            return [] if clips.shape[2] == 1 else [i2v.first_frame_latents(self.encode_images, clips)]
        slots = [i2v.channels_condition(self.encode_images, clips)]
        if self.takes_image_embeds:
            slots.append(self.encode_image_embeds(clips[:, :, 0]))
        return slots

    def encode_image_embeds(self, frames: torch.Tensor) -> torch.Tensor:
        """``(B, 257, 1280)``: the pipeline's ``encode_image`` of each first frame (``(B, 3, H, W)`` in [-1, 1], as
        the 8-bit image it was read from)."""
        assert self.image_encoder_pipe is not None, "load_vae() first"
        images = [Image.fromarray(f.add(1).mul(127.5).round().clamp(0, 255).byte().permute(1, 2, 0).cpu().numpy())
                  for f in frames.float()]
        return self.image_encoder_pipe.encode_image(images, device=self.image_encoder_pipe.image_encoder.device)

    def refuse_references(self, references: Sequence[torch.Tensor]) -> None:
        """An image-to-video run's references are its first-frame condition; otherwise there are none."""
        if not self.conditions_on_first_frame:
            super().refuse_references(references)

    def loss_mask(self, latents: torch.Tensor, references: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
        """TI2V image-to-video: the first latent frame is the condition (timestep 0, its prediction unused), so the
        loss leaves it out; None otherwise (every element counts)."""
        if self.condition == i2v.FIRST_FRAME and len(references):
            return i2v.loss_mask_without_first_frame(latents)
        return None

    # -- latents ----------------------------------------------------------------------------------
    def _statistics(self, like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        shape = (1, -1, 1, 1, 1)
        mean = torch.tensor(self.vae_config["latents_mean"]).view(shape)
        std = torch.tensor(self.vae_config["latents_std"]).view(shape)
        return mean.to(like.device, like.dtype), std.to(like.device, like.dtype)

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H, W)`` stills or ``(B, 3, F, H, W)`` clips in [-1, 1] -> ``(B, C, F', h, w)`` normalised
        latents (a still: one latent frame)."""
        assert self.vae is not None, "load_vae() first"
        pixels = pixels.to(self.vae.device, self.vae.dtype)
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2)
        # The distribution's mode, not a sample: a cached latent must be the same on every run.
        raw = self.vae.encode(pixels).latent_dist.mode()
        mean, std = self._statistics(raw)
        return (raw - mean) / std

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents -> ``(B, 3, F, H, W)`` frames in [-1, 1] (used by tests and previews)."""
        assert self.vae is not None, "load_vae() first"
        latents = latents.to(self.vae.device, self.vae.dtype)
        mean, std = self._statistics(latents)
        return self.vae.decode(latents * std + mean).sample

    def frames_of(self, clip_frames: int) -> int:
        """Latent frames of a clip of ``clip_frames`` frames (``4k + 1`` -> ``k + 1``)."""
        return (clip_frames - 1) // self.temporal_compression + 1

    # -- transformer ------------------------------------------------------------------------------
    def load_transformer(self, dtype: torch.dtype, device: torch.device = torch.device("cpu"),
                         subfolder: str = "transformer") -> torch.nn.Module:
        """The transformer; for a two-expert checkpoint the trained expert(s) as one ``WanExperts`` module."""
        if self.boundary is None:
            return super().load_transformer(dtype, device, subfolder)
        loaded = {name: FamilyBase.load_transformer(self, dtype, device, name) for name in self.experts}
        return WanExperts(self.boundary, **loaded)

    def blocks(self, transformer: torch.nn.Module) -> List[torch.nn.Module]:
        """The blocks of each trained expert, high noise first."""
        if isinstance(transformer, WanExperts):
            return [block for expert in transformer.experts() for block in FamilyBase.blocks(self, expert)]
        return super().blocks(transformer)

    def image_seq_len(self, latent_shape: Sequence[int]) -> int:
        """Video tokens: latent frames x (1, 2, 2) patches (a 4-D image shape is one frame)."""
        frames = latent_shape[-3] if len(latent_shape) == 5 else 1
        return frames * (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def velocity(self, transformer: torch.nn.Module, noisy_latents: torch.Tensor, sigmas: torch.Tensor, text: Tensors,
                 references: Sequence[torch.Tensor]) -> torch.Tensor:
        """The transformer's input as the pipeline builds it. Text-to-video: one timestep per sample (TI2V-5B's
        pipeline spreads it over every token: the same value everywhere, so the same prediction). Image-to-video:
        ``references`` is the first-frame condition (``encode_condition``'s slots)."""
        timestep = sigmas.to(noisy_latents.device) * 1000
        extra: Dict[str, Any] = {}
        hidden = noisy_latents
        if references and self.condition == i2v.CHANNELS:
            hidden = torch.cat([noisy_latents, references[0].to(noisy_latents.dtype)], dim=1)
            if len(references) > 1:
                extra["encoder_hidden_states_image"] = references[1]
        elif references and self.condition == i2v.FIRST_FRAME:
            hidden = i2v.replace_first_frame(noisy_latents, references[0])
            timestep = i2v.token_timesteps(timestep, noisy_latents.shape)
        return transformer(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text["prompt_embeds"],
                           return_dict=False, **extra)[0]


def refuse_for_experts(cfg: Any) -> None:
    """What two-expert training does not do yet, refused in one line before anything loads."""
    if getattr(cfg, "training_mode", "lora") == "full":
        raise ConfigError("key 'training_mode': value 'full' is not supported for a two-expert Wan 2.2 checkpoint "
                          "yet (its experts' pipeline folder is not written); use training_mode: lora")
    if getattr(cfg, "adapter_type", "lora") != "lora":
        raise ConfigError(f"key 'adapter_type': value '{cfg.adapter_type}' is not supported for a two-expert Wan 2.2 "
                          "checkpoint yet (one peft file per expert is not written); use adapter_type: lora")


def nonzero_rows(embeds: torch.Tensor) -> int:
    """Rows up to the last one that is not all zeros: the prompt's tokens before the pipeline's zero padding
    (padding added back with zeros gives the same tensor, so nothing is lost)."""
    rows = embeds.abs().sum(dim=-1).nonzero()
    return int(rows.max()) + 1 if len(rows) else 0

