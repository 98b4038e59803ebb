"""Qwen-Image-Edit (one reference) and Edit-2509/2511 (``QwenImageEditPlusPipeline``, 1-3 references).

Same transformer and VAE as Qwen-Image. What differs: the prompt is encoded together with the
reference image(s) through the text encoder's vision tower, with the pipeline's own template (we call
the pipeline's ``encode_prompt``), and the reference latents are appended after the noisy target
latents (``QwenImageFamily.predict`` does that for any ``references``).
"""

from __future__ import annotations

from typing import ClassVar, List, Optional, Sequence, Tuple

import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
    CONDITION_IMAGE_SIZE,
    VAE_IMAGE_SIZE,
    calculate_dimensions,
)
from PIL import Image

from trainer.config import TrainConfig
from utils.errors import ConfigError
from trainer.families.base import FamilySpec, Tensors, from_pretrained
from trainer.families.qwen_image.family import QwenImageFamily
from trainer.families.qwen_image_edit.spec import SPEC
from utils.qwen_processor import load_qwen_vl_processor


class QwenImageEditFamily(QwenImageFamily):
    """Qwen-Image-Edit(-2509/-2511): the checkpoint's ``model_index.json`` says which pipeline."""

    spec: ClassVar[FamilySpec] = SPEC

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        self.pipeline_class = self.pipeline_named_by_checkpoint(QwenImageEditPipeline, QwenImageEditPlusPipeline)
        self.plus = self.pipeline_class is QwenImageEditPlusPipeline
        self.max_references = self.spec.references[self.pipeline_class.__name__].max_references
        d = cfg.data_config
        # Edit feeds the same 1024^2-area image to both; Edit-Plus a 384^2 one to the vision tower.
        self.condition_area = d.reference_condition_area or (CONDITION_IMAGE_SIZE if self.plus else VAE_IMAGE_SIZE)
        self.vae_area = d.reference_vae_area or VAE_IMAGE_SIZE

    def check_references(self, count: int) -> None:
        """Refuse more reference folders than the checkpoint's pipeline takes."""
        if count > self.max_references:
            raise ConfigError(
                f"{self.pipeline_class.__name__} takes at most {self.max_references} reference image(s) per "
                f"sample, but {count} control folders are configured"
                + ("" if self.plus else " (multi-reference needs Qwen-Image-Edit-2509/2511)"))

    def reference_size(self, width: int, height: int) -> Tuple[int, int]:
        """The VAE size of a reference image, as the pipeline computes it (area kept, sides /32)."""
        return _area_size(self.vae_area, width, height)

    # -- text -------------------------------------------------------------------------------------
    def load_text_encoder(self, device: torch.device, dtype: torch.dtype) -> None:
        encoder = self._load_encoder(device, dtype)
        processor = from_pretrained(load_qwen_vl_processor, self.model_path, "processor", revision=self.revision)
        self.text_pipe = self.pipeline_class(scheduler=None, vae=None, text_encoder=encoder,
                                             tokenizer=processor.tokenizer, processor=processor, transformer=None)

    @torch.no_grad()
    def encode_prompts(
        self, prompts: Sequence[str], references: Optional[Sequence[Sequence[Image.Image]]] = None
    ) -> List[Tensors]:
        assert self.text_pipe is not None, "load_text_encoder() first"
        if references is None or len(references) != len(prompts):
            raise ValueError("Qwen-Image-Edit encodes each prompt with its reference image(s)")
        device = self.text_pipe.text_encoder.device
        out = []
        for prompt, images in zip(prompts, references):  # one at a time: Edit-Plus takes batch 1
            conditioned = [self._condition_image(img) for img in images]
            embeds, _ = self.text_pipe.encode_prompt(
                [prompt], image=conditioned if self.plus else conditioned[0], device=device,
                max_sequence_length=self.max_sequence_length)
            out.append({"prompt_embeds": embeds[0]})
        return out

    def _condition_image(self, image: Image.Image) -> Image.Image:
        width, height = _area_size(self.condition_area, *image.size)
        return self.text_pipe.image_processor.resize(image, height, width)


def _area_size(area: int, width: int, height: int) -> Tuple[int, int]:
    size = calculate_dimensions(area, width / height)
    return int(size[0]), int(size[1])
