"""Qwen-Image's facts: pipeline, LoRA presets, blocks, text tokens (no diffusers import)."""

from __future__ import annotations

from typing import Dict

from trainer.families.spec import BlockGroup, FamilySpec, TargetSpec, TextTokens

_IMG_ATTN = ["to_q", "to_k", "to_v", "to_out.0"]
_TXT_ATTN = ["add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
_MLP = ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]
# Modulation layers (img_mod.1, txt_mod.1, norm_out.linear) hold a third of the weights; peers leave
# them out of LoRA, and so does every preset here.
QWEN_LORA_PRESETS: Dict[str, TargetSpec] = {
    "attention": _IMG_ATTN,  # what FlyMyAI and diffusers' Qwen-Image example train
    "attention_mlp": _IMG_ATTN + _TXT_ATTN + _MLP,
    "all_linear": _IMG_ATTN + _TXT_ATTN + _MLP
    + ["img_in", "txt_in", "proj_out", "timestep_embedder.linear_1", "timestep_embedder.linear_2"],
}

QWEN_TRANSFORMER = "QwenImageTransformer2DModel"
QWEN_BLOCKS = (BlockGroup("transformer_blocks", "double"),)

SPEC = FamilySpec(
    name="qwen_image",
    title="Qwen-Image",
    entry_script="train.py",
    pipelines=("QwenImagePipeline",),
    transformer=QWEN_TRANSFORMER,
    lora_presets=QWEN_LORA_PRESETS,
    blocks=QWEN_BLOCKS,
    runtime="trainer.families.qwen_image.model:QwenImageFamily",
    # The pipeline encodes a 34-token template prefix with every prompt and drops it.
    text=TextTokens(max_length=512, template=34),
)
