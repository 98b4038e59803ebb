"""Qwen-Image-Edit's facts: Qwen-Image's transformer and presets, reference images (no diffusers import)."""

from __future__ import annotations

from trainer.families.qwen_image.spec import QWEN_BLOCKS, QWEN_LORA_PRESETS, QWEN_TRANSFORMER
from trainer.families.spec import FamilySpec, TextTokens

SPEC = FamilySpec(
    name="qwen_image_edit",
    title="Qwen-Image-Edit (2509/2511: 1-3 references)",
    entry_script="train_qwen_edit_lora.py",
    # Edit takes one reference; Edit-Plus (2509, 2511) takes 1-3.
    pipelines=("QwenImageEditPipeline", "QwenImageEditPlusPipeline"),
    transformer=QWEN_TRANSFORMER,
    lora_presets=QWEN_LORA_PRESETS,
    blocks=QWEN_BLOCKS,
    runtime="trainer.families.qwen_image_edit.model:QwenImageEditFamily",
    # The Edit template prefix (64 tokens) is encoded with every prompt and dropped.
    text=TextTokens(max_length=512, template=64),
    uses_references=True,
)
