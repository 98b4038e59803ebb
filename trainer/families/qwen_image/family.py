"""Qwen-Image: Qwen2.5-VL text encoder, Wan-style 3-D VAE (mean/std normalised), MMDiT transformer."""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Sequence

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from utils.device_copy import to_device
from trainer.families.base import (
    FamilyBase,
    FamilySpec,
    RealRope,
    Tensors,
    from_pretrained,
    pad_sequences,
    unpack_latents,
)
from trainer.families.qwen_image.attention import QWEN_IMAGE_ROPE
from trainer.families.qwen_image.spec import SPEC


class QwenImageFamily(FamilyBase):
    """Qwen-Image text-to-image (``Qwen/Qwen-Image`` or a folder of the same layout)."""

    spec: ClassVar[FamilySpec] = SPEC
    pipeline_class: ClassVar[type] = QwenImagePipeline
    default_cfg_scale: ClassVar[float] = 4.0  # QwenImagePipeline's true_cfg_scale
    vae_class: ClassVar[type] = AutoencoderKLQwenImage
    transformer_class: ClassVar[type] = QwenImageTransformer2DModel
    real_rope: ClassVar[RealRope] = QWEN_IMAGE_ROPE  # Edit inherits it: the same transformer

    # -- text -------------------------------------------------------------------------------------
    def load_text_encoder(self, device: torch.device, dtype: torch.dtype) -> None:
        tokenizer = from_pretrained(Qwen2Tokenizer.from_pretrained, self.model_path, "tokenizer",
                                    revision=self.revision)
        encoder = self._load_encoder(device, dtype)
        # The pipeline's own encode_prompt holds the template and the token drop: reuse, don't copy.
        self.text_pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=encoder,
                                           tokenizer=tokenizer, transformer=None)

    def _load_encoder(self, device: torch.device, dtype: torch.dtype) -> Qwen2_5_VLForConditionalGeneration:
        encoder = from_pretrained(Qwen2_5_VLForConditionalGeneration.from_pretrained, self.model_path,
                                  "text_encoder", revision=self.revision, dtype=dtype)
        return self._frozen_encoder(encoder, device)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], references: None = None) -> List[Tensors]:
        assert self.text_pipe is not None, "load_text_encoder() first"
        device = self.text_pipe.text_encoder.device
        embeds, mask = self.text_pipe.encode_prompt(
            list(prompts), device=device, max_sequence_length=self.max_sequence_length)
        lengths = mask.sum(dim=1).tolist() if mask is not None else [embeds.shape[1]] * len(prompts)
        return [{"prompt_embeds": embeds[i, : int(n)]} for i, n in enumerate(lengths)]

    def collate_text(self, conds: Sequence[Tensors], device: torch.device, dtype: torch.dtype) -> Tensors:
        seqs = [c["prompt_embeds"] for c in conds]
        # Equal lengths (always, for one sample): no padding and no mask, as the pipeline passes
        # none, so fast unmasked attention runs (and the step builds no mask to find that out).
        embeds, mask = (torch.stack(seqs), None) if len({s.shape[0] for s in seqs}) == 1 else pad_sequences(seqs)
        return {
            "prompt_embeds": to_device(embeds, device, dtype),
            "prompt_embeds_mask": None if mask is None else to_device(mask, device),
        }

    def render_kwargs(self, cond: Tensors, dtype: torch.dtype, device: torch.device) -> Dict[str, Any]:
        """A cached condition as the pipeline's ``prompt_embeds`` arguments."""
        embeds = cond["prompt_embeds"].to(device, dtype)[None]
        return {"prompt_embeds": embeds, "prompt_embeds_mask": torch.ones(embeds.shape[:2], dtype=torch.long,
                                                                          device=device)}

    # -- images -----------------------------------------------------------------------------------
    def _latent_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, self.vae_config["z_dim"], 1, 1)
        mean = torch.tensor(self.vae_config["latents_mean"]).view(shape)
        std = torch.tensor(self.vae_config["latents_std"]).view(shape)
        return mean.to(like.device, like.dtype), std.to(like.device, like.dtype)

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        assert self.vae is not None, "load_vae() first"
        pixels = pixels.to(self.vae.device, self.vae.dtype).unsqueeze(2)  # (B, 3, 1, H, W): one frame
        # The distribution's mode, not a sample: a cached latent must be the same on every run.
        latents = self.vae.encode(pixels).latent_dist.mode()[:, :, 0]
        mean, std = self._latent_stats(latents)
        return (latents - mean) / std

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents -> images in [-1, 1] (used by tests and previews)."""
        assert self.vae is not None, "load_vae() first"
        latents = latents.to(self.vae.device, self.vae.dtype)
        mean, std = self._latent_stats(latents)
        return self.vae.decode((latents * std + mean).unsqueeze(2)).sample[:, :, 0]

    # -- transformer ------------------------------------------------------------------------------
    def unused_modules(self, transformer: torch.nn.Module) -> List[str]:
        """The last block's text stream goes nowhere: its text output projection and text MLP."""
        last = f"transformer_blocks.{len(transformer.transformer_blocks) - 1}"
        return [f"{last}.attn.to_add_out", f"{last}.txt_mlp"]

    def velocity(self, transformer: torch.nn.Module, noisy_latents: torch.Tensor, sigmas: torch.Tensor, text: Tensors,
                 references: Sequence[torch.Tensor]) -> torch.Tensor:
        b, c, h, w = noisy_latents.shape
        # Edit: reference latents follow the noisy target in the image sequence, each listed in
        # img_shapes; only the target's tokens are the prediction.
        latents = [noisy_latents, *[r.to(noisy_latents.dtype) for r in references]]
        packed = [QwenImagePipeline._pack_latents(x, b, c, *x.shape[-2:]) for x in latents]
        packed = packed[0] if len(packed) == 1 else torch.cat(packed, dim=1)
        out = transformer(
            hidden_states=packed,
            timestep=sigmas.to(packed.device, packed.dtype),  # the pipeline's t / 1000
            encoder_hidden_states=text["prompt_embeds"],
            encoder_hidden_states_mask=text["prompt_embeds_mask"],
            img_shapes=[[(1, x.shape[-2] // 2, x.shape[-1] // 2) for x in latents]] * b,
            return_dict=False,
        )[0]
        if references:  # (a slice of the whole would still cost a zero-filled copy in backward)
            out = out[:, : (h // 2) * (w // 2)]
        return unpack_latents(out, c, h, w)

