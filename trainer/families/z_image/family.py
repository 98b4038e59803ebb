"""Z-Image (``ZImagePipeline``): Qwen3 text encoder (second-to-last hidden state, padding dropped), the FLUX
VAE (shift and scale), a single-stream DiT that takes lists of ``(C, 1, h, w)`` latents and of
variable-length captions. Its clock runs the other way, ``t = 1 - sigma``, and it predicts
``x0 - noise``: the pipeline negates the output before the scheduler step, and so does ``predict``."""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Sequence

import torch
from diffusers import AutoencoderKL, ZImagePipeline, ZImageTransformer2DModel
from transformers import AutoModel, AutoTokenizer

from utils.device_copy import to_device
from trainer.families.base import FamilyBase, FamilySpec, RealRope, ShiftScaleLatents, Tensors, pad_sequences
from trainer.families.z_image.attention import Z_IMAGE_ROPE
from trainer.families.z_image.spec import SPEC


class ZImageFamily(ShiftScaleLatents, FamilyBase):
    """Z-Image text-to-image (``Tongyi-MAI/Z-Image-Turbo`` or a folder of the same layout)."""

    spec: ClassVar[FamilySpec] = SPEC
    pipeline_class: ClassVar[type] = ZImagePipeline
    # Z-Image adds scale * (cond - uncond) to cond: 0 is off. Off by default as Z-Image-Turbo
    # renders; set validation.cfg_scale for the undistilled base model.
    cfg_argument: ClassVar[str] = "guidance_scale"
    cfg_off_value: ClassVar[float] = 0.0
    default_cfg_scale: ClassVar[float] = 0.0
    vae_class: ClassVar[type] = AutoencoderKL
    transformer_class: ClassVar[type] = ZImageTransformer2DModel
    real_rope: ClassVar[RealRope] = Z_IMAGE_ROPE

    # -- text -------------------------------------------------------------------------------------
    def load_text_encoder(self, device: torch.device, dtype: torch.dtype) -> None:
        # AutoModel: the bare Qwen3 model whichever head the checkpoint names (no LM head to hold).
        encoder = self._load(AutoModel.from_pretrained, "text_encoder", dtype=dtype)
        # The pipeline's own encode_prompt holds the chat template and the hidden-state choice.
        self.text_pipe = ZImagePipeline(
            scheduler=None, vae=None, transformer=None,
            text_encoder=self._frozen_encoder(encoder, device),
            tokenizer=self._load(AutoTokenizer.from_pretrained, "tokenizer"))

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], references: None = None) -> List[Tensors]:
        assert self.text_pipe is not None, "load_text_encoder() first"
        # Already per prompt and unpadded (the pipeline keeps the masked tokens only).
        embeds, _ = self.text_pipe.encode_prompt(
            list(prompts), device=self.text_pipe.text_encoder.device, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length)
        return [{"prompt_embeds": e} for e in embeds]

    def collate_text(self, conds: Sequence[Tensors], device: torch.device, dtype: torch.dtype) -> Tensors:
        embeds, mask = pad_sequences([c["prompt_embeds"] for c in conds])
        return {"prompt_embeds": to_device(embeds, device, dtype), "lengths": mask.sum(dim=1)}

    def render_kwargs(self, cond: Tensors, dtype: torch.dtype, device: torch.device) -> Dict[str, Any]:
        """A cached condition as the pipeline's ``prompt_embeds`` (a list, one per prompt)."""
        return {"prompt_embeds": [cond["prompt_embeds"].to(device, dtype)]}

    # -- images -----------------------------------------------------------------------------------
    # -- transformer ------------------------------------------------------------------------------
    def velocity(self, transformer: torch.nn.Module, noisy_latents: torch.Tensor, sigmas: torch.Tensor, text: Tensors,
                 references: Sequence[torch.Tensor]) -> torch.Tensor:
        captions = [e[:n] for e, n in zip(text["prompt_embeds"], text["lengths"].tolist())]
        out = transformer(
            list(noisy_latents.unsqueeze(2).unbind(0)),  # one (C, 1, h, w) per sample
            (1 - sigmas).to(noisy_latents.device, torch.float32),  # the pipeline's (1000 - t) / 1000
            captions,
            return_dict=False,
        )[0]
        return -torch.stack(out).squeeze(2)  # x0 - noise -> the velocity noise - x0
