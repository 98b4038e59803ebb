"""Qwen-Image-Edit's facts: Qwen-Image's transformer and presets, reference images (no diffusers import)."""

from __future__ import annotations

from trainer.families.qwen_image.spec import (
    QWEN_BLOCKS,
    QWEN_LORA_PRESETS,
    QWEN_OUTER_LAYOUT,
    qwen_checkpoint,
)
from trainer.facts.family_spec import FamilySpec, ReferenceTokens, TextTokens

SPEC = FamilySpec(
    name="qwen_image_edit",
    title="Qwen-Image-Edit",  # and Edit-2509/2511
    entry_script="train_qwen_edit_lora.py",
    # Edit takes one reference; Edit-Plus (2509, 2511) takes 1-3.
    lora_presets=QWEN_LORA_PRESETS,
    blocks=QWEN_BLOCKS,
    runtime="QwenImageEditFamily",
    # The Edit template prefix (64 tokens) is encoded with every prompt and dropped; Edit encodes one
    # prompt (with its references) at a time.
    text=TextTokens(max_length=512, template=64, prompts_per_call=1),
    # diffusers' pipeline_qwenimage_edit(_plus).py: Edit shows the vision tower the reference at the VAE's
    # 1024^2 area, with <|vision_start|>/<|vision_end|>; Edit-Plus at CONDITION_IMAGE_SIZE (384^2), with
    # "Picture N: " as well. Both take the reference latents at VAE_IMAGE_SIZE (1024^2).
    references={
        "QwenImageEditPipeline": ReferenceTokens(max_references=1, condition_area=1024 * 1024, markers=2),
        "QwenImageEditPlusPipeline": ReferenceTokens(max_references=3, condition_area=384 * 384, markers=6),
    },
    outer_layout=QWEN_OUTER_LAYOUT,
    vl_processors=("processor",),
    hub_configs={
        "Qwen/Qwen-Image-Edit": qwen_checkpoint("QwenImageEditPipeline"),
        "Qwen/Qwen-Image-Edit-2509": qwen_checkpoint("QwenImageEditPlusPipeline"),
        "Qwen/Qwen-Image-Edit-2511": qwen_checkpoint("QwenImageEditPlusPipeline", zero_cond_t=True),
    },
)
