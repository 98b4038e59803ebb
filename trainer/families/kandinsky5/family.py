"""Kandinsky 5 image (``Kandinsky5T2IPipeline``): Qwen2.5-VL (last hidden state, template dropped) and CLIP
(pooled) text encoders, the FLUX VAE scaled but not shifted, a DiT of text blocks then visual blocks that
patches channel-last ``(B, 1, h, w, C)`` latents itself and takes ``t = 1000 * sigma``."""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Sequence

import torch
from diffusers import (
    AutoencoderKL,
    Kandinsky5T2IPipeline,
    Kandinsky5Transformer3DModel,
)
from transformers import CLIPTextModel, CLIPTokenizer, Qwen2_5_VLForConditionalGeneration

from utils.device_copy import to_device
from trainer.families.base import FamilyBase, FamilySpec, Tensors, pad_sequences
from trainer.families.kandinsky5.spec import SPEC
from utils.qwen_processor import load_qwen_vl_processor


class Kandinsky5Family(FamilyBase):
    """Kandinsky 5 text-to-image (``kandinskylab/Kandinsky-5.0-T2I-Lite-sft-Diffusers`` or the same layout)."""

    spec: ClassVar[FamilySpec] = SPEC
    pipeline_class: ClassVar[type] = Kandinsky5T2IPipeline
    cfg_argument: ClassVar[str] = "guidance_scale"
    default_cfg_scale: ClassVar[float] = 3.5  # the pipeline's default
    vae_class: ClassVar[type] = AutoencoderKL
    transformer_class: ClassVar[type] = Kandinsky5Transformer3DModel

    # -- text -------------------------------------------------------------------------------------
    def load_text_encoder(self, device: torch.device, dtype: torch.dtype) -> None:
        qwen = self._load(Qwen2_5_VLForConditionalGeneration.from_pretrained, "text_encoder", dtype=dtype)
        clip = self._load(CLIPTextModel.from_pretrained, "text_encoder_2", dtype=dtype)
        # The pipeline's own encode_prompt holds the template, the token drop and CLIP pooling.
        self.text_pipe = Kandinsky5T2IPipeline(
            transformer=None, vae=None, scheduler=None,
            text_encoder=self._frozen_encoder(qwen, device),
            tokenizer=self._load(load_qwen_vl_processor, "tokenizer"),  # a Qwen2-VL processor
            text_encoder_2=self._frozen_encoder(clip, device, quantize=False),
            tokenizer_2=self._load(CLIPTokenizer.from_pretrained, "tokenizer_2"),
        )

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], references: None = None) -> List[Tensors]:
        assert self.text_pipe is not None, "load_text_encoder() first"
        out = []
        # One at a time, as the pipeline renders: it pads a batch and gives neither encoder the mask.
        for prompt in prompts:
            qwen, clip, cu_seqlens = self.text_pipe.encode_prompt(
                [prompt], max_sequence_length=self.max_sequence_length, device=self.text_pipe.text_encoder.device)
            out.append({"prompt_embeds_qwen": qwen[0, : int(cu_seqlens[1])], "prompt_embeds_clip": clip[0]})
        return out

    def collate_text(self, conds: Sequence[Tensors], device: torch.device, dtype: torch.dtype) -> Tensors:
        qwen, mask = pad_sequences([c["prompt_embeds_qwen"] for c in conds])
        return {
            "prompt_embeds_qwen": to_device(qwen, device, dtype),
            "prompt_embeds_clip": to_device(torch.stack([c["prompt_embeds_clip"] for c in conds]), device, dtype),
            # The transformer takes no text mask: unequal lengths run one sample at a time in predict.
            "lengths": None if bool(mask.all()) else mask.sum(dim=1),
        }

    def render_kwargs(self, cond: Tensors, dtype: torch.dtype, device: torch.device) -> Dict[str, Any]:
        """A cached condition as the pipeline's ``prompt_embeds`` arguments."""
        qwen = cond["prompt_embeds_qwen"].to(device, dtype)[None]
        return {"prompt_embeds_qwen": qwen, "prompt_embeds_clip": cond["prompt_embeds_clip"].to(device, dtype)[None],
                "prompt_cu_seqlens": torch.tensor([0, qwen.shape[1]], dtype=torch.int32, device=device)}

    # -- images -----------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        assert self.vae is not None, "load_vae() first"
        # The mode, so a cached latent is the same on every run. Kandinsky scales and does not shift.
        latents = self.vae.encode(pixels.to(self.vae.device, self.vae.dtype)).latent_dist.mode()
        return latents * self.vae_config["scaling_factor"]

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents -> images in [-1, 1] (used by tests and previews)."""
        assert self.vae is not None, "load_vae() first"
        return self.vae.decode(latents.to(self.vae.device, self.vae.dtype) / self.vae_config["scaling_factor"]).sample

    # -- transformer ------------------------------------------------------------------------------
    def velocity(self, transformer: torch.nn.Module, noisy_latents: torch.Tensor, sigmas: torch.Tensor, text: Tensors,
                 references: Sequence[torch.Tensor]) -> torch.Tensor:
        _, _, h, w = noisy_latents.shape
        device, dtype = noisy_latents.device, noisy_latents.dtype
        latents = noisy_latents.permute(0, 2, 3, 1).unsqueeze(1)  # (B, 1, h, w, C): one frame, channels last
        # The pipeline passes the scheduler's timestep (1000 * sigma) in the transformer's dtype.
        timesteps = (sigmas * self.scheduler_config.get("num_train_timesteps", 1000)).to(device, dtype)
        visual_rope_pos = [torch.arange(size, device=device) for size in (1, h // 2, w // 2)]  # frame, 2x2 grid
        qwen, clip, lengths = text["prompt_embeds_qwen"], text["prompt_embeds_clip"], text["lengths"]
        spans = [(slice(None), qwen.shape[1])] if lengths is None else \
            [(slice(i, i + 1), int(n)) for i, n in enumerate(lengths)]
        out = torch.cat([transformer(
            hidden_states=latents[rows],
            encoder_hidden_states=qwen[rows, :n],
            pooled_projections=clip[rows],
            timestep=timesteps[rows],
            visual_rope_pos=visual_rope_pos,
            text_rope_pos=torch.arange(n, device=device),
            scale_factor=[1.0, 1.0, 1.0],
            sparse_params=None,
            return_dict=False,  # returns the tensor itself
        ) for rows, n in spans])
        return out[:, 0].permute(0, 3, 1, 2)
