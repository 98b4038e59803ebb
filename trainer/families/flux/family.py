"""FLUX.1-dev: CLIP-L (pooled) + T5 text encoders, 16-channel VAE (shift/scale normalised),
MMDiT transformer with 2x2 packing, position ids and the distilled-guidance embedding."""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Dict, List, Optional, Sequence

import torch
from accelerate.utils import extract_model_from_parallel
from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

from utils.device_copy import to_device
from trainer.config import TrainConfig
from trainer.families.base import (
    FamilyBase,
    FamilySpec,
    ShiftScaleLatents,
    Tensors,
    from_pretrained,
    unpack_latents,
)
from trainer.families.flux.spec import SPEC, T5_MAX_LENGTH


@functools.lru_cache(maxsize=32)
def _image_ids(rows: int, cols: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The pipeline's image position ids, built once per bucket and device: the pipeline builds them
    on the host, and copying them to the GPU every step synchronized the stream."""
    return FluxPipeline._prepare_latent_image_ids(1, rows, cols, device, dtype)


class FluxFamily(ShiftScaleLatents, FamilyBase):
    """FLUX.1-dev text-to-image (``black-forest-labs/FLUX.1-dev`` or a folder of the same layout)."""

    spec: ClassVar[FamilySpec] = SPEC
    pipeline_class: ClassVar[type] = FluxPipeline
    distilled_guidance: ClassVar[bool] = True  # validation.guidance is FLUX.1-dev's guidance_scale
    vae_class: ClassVar[type] = AutoencoderKL
    transformer_class: ClassVar[type] = FluxTransformer2DModel

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        self.guidance = cfg.guidance_scale  # the distilled-guidance input; peers train dev at 1.0
        # Tokenizers are small and fix the T5 length, which must equal the render-time length: the
        # pipeline pads T5 input to it and FLUX attends to the padding (no mask), so it shapes the
        # conditioning. 512 for FLUX.1-dev; less only where the checkpoint's tokenizer says so.
        self.tokenizer: CLIPTokenizer = from_pretrained(
            CLIPTokenizer.from_pretrained, self.model_path, "tokenizer", revision=self.revision)
        self.tokenizer_2: T5TokenizerFast = from_pretrained(
            T5TokenizerFast.from_pretrained, self.model_path, "tokenizer_2", revision=self.revision)
        self.max_sequence_length: int = min(T5_MAX_LENGTH, self.tokenizer_2.model_max_length)
        self.text_pipe: Optional[FluxPipeline] = None
        self.vae: Optional[AutoencoderKL] = None

    # -- text -------------------------------------------------------------------------------------
    def load_text_encoder(self, device: torch.device, dtype: torch.dtype) -> None:
        clip = self._load(CLIPTextModel.from_pretrained, "text_encoder", dtype=dtype)
        t5 = self._load(T5EncoderModel.from_pretrained, "text_encoder_2", dtype=dtype)
        # The pipeline's own encode_prompt holds CLIP pooling and T5 padding: reuse, don't copy. T5-XXL
        # (4.7B) is the one quantize_text_encoder quantizes; CLIP-L (0.12B) stays as it is.
        self.text_pipe = FluxPipeline(
            scheduler=None, vae=None, transformer=None,
            text_encoder=self._frozen_encoder(clip, device, quantize=False), tokenizer=self.tokenizer,
            text_encoder_2=self._frozen_encoder(t5, device),
            tokenizer_2=self.tokenizer_2,
        )

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], references: None = None) -> List[Tensors]:
        assert self.text_pipe is not None, "load_text_encoder() first"
        embeds, pooled, _ = self.text_pipe.encode_prompt(
            list(prompts), prompt_2=None, device=self.text_pipe.text_encoder.device,
            max_sequence_length=self.max_sequence_length)
        # Padding is kept: FLUX sees the padded T5 sequence at render time too.
        return [{"prompt_embeds": embeds[i], "pooled_prompt_embeds": pooled[i]} for i in range(len(prompts))]

    def collate_text(self, conds: Sequence[Tensors], device: torch.device, dtype: torch.dtype) -> Tensors:
        # Every T5 sequence is max_sequence_length long, so the batch stacks without a mask.
        return {key: to_device(torch.stack([c[key] for c in conds]), device, dtype)
                for key in ("prompt_embeds", "pooled_prompt_embeds")}

    def render_kwargs(self, cond: Tensors, dtype: torch.dtype, device: torch.device) -> Dict[str, Any]:
        """A cached condition as the pipeline's ``prompt_embeds`` arguments."""
        return {key: cond[key].to(device, dtype)[None] for key in ("prompt_embeds", "pooled_prompt_embeds")}

    # -- images -----------------------------------------------------------------------------------
    # -- transformer ------------------------------------------------------------------------------
    def velocity(self, transformer: torch.nn.Module, noisy_latents: torch.Tensor, sigmas: torch.Tensor, text: Tensors,
                 references: Sequence[torch.Tensor]) -> torch.Tensor:
        b, c, h, w = noisy_latents.shape
        device, dtype = noisy_latents.device, noisy_latents.dtype
        packed = FluxPipeline._pack_latents(noisy_latents, b, c, h, w)
        # FLUX.1-dev embeds the guidance value (the transformer scales it by 1000 as it does t);
        # schnell-like checkpoints have no guidance embedding and take None.
        guidance = torch.full((b,), self.guidance, device=device, dtype=torch.float32) \
            if extract_model_from_parallel(transformer).config.guidance_embeds else None
        out = transformer(
            hidden_states=packed,
            timestep=sigmas.to(device, dtype),  # the pipeline's t / 1000
            guidance=guidance,
            pooled_projections=text["pooled_prompt_embeds"],
            encoder_hidden_states=text["prompt_embeds"],
            # Text tokens sit at position 0; image tokens at their (row, column) in the packed grid.
            txt_ids=torch.zeros(text["prompt_embeds"].shape[1], 3, device=device, dtype=dtype),
            img_ids=_image_ids(h // 2, w // 2, device, dtype),
            return_dict=False,
        )[0]
        return unpack_latents(out, c, h, w)
