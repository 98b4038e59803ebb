"""Wan 2.x (``WanPipeline``): a UMT5 text encoder (prompts padded with zeros to 512 tokens, as the pipeline
does), the 3-D Wan VAE normalised per channel (``latents_mean`` / ``latents_std``), and one
``WanTransformer3DModel`` that takes ``(B, C, F, h, w)`` latents and the timestep ``sigma * 1000``.

Latents keep their frame axis everywhere: a clip of ``4k + 1`` frames is ``k + 1`` latent frames, a still image
one (Wan itself trains on images as one-frame clips)."""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Sequence, Tuple

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from transformers import AutoTokenizer, UMT5EncoderModel

from trainer.families.base import FamilyBase, FamilySpec, Tensors
from trainer.facts.family_spec import vae_scale_factor
from trainer.families.wan.experts import WanExperts, boundary_of, experts_to_train, sigma_range
from trainer.families.wan.spec import SPEC
from utils.device_copy import to_device
from utils.errors import ConfigError


class WanStillRenders(WanPipeline):
    """``WanPipeline`` for validation renders: the engine saves a render's first frame as its PNG, so it renders
    one frame (a still) unless asked for more, as PIL frames. (Clips saved as .mp4 are not written yet.)"""

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
        return WanStillRenders(tokenizer=None, text_encoder=None, vae=self.vae, scheduler=scheduler,
                               expand_timesteps=bool(self.model_index.get("expand_timesteps", False)), **experts)

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
        # One timestep per sample. TI2V-5B's pipeline spreads it over every token (expand_timesteps): the same
        # value everywhere for text-to-video, so the same prediction.
        return transformer(hidden_states=noisy_latents, timestep=sigmas.to(noisy_latents.device) * 1000,
                           encoder_hidden_states=text["prompt_embeds"], return_dict=False)[0]


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

