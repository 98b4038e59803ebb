"""Z-Image's facts: pipeline, LoRA presets, refiner and joint blocks (no diffusers import)."""

from __future__ import annotations

from typing import Dict

from trainer.families.spec import BlockGroup, FamilySpec, TargetSpec, TextTokens

_ATTN = r"attention\.(to_q|to_k|to_v|to_out\.0)"
_MLP = r"feed_forward\.(w1|w2|w3)"
# noise_refiner: image tokens only; context_refiner: caption tokens only; layers: both, jointly.
_OUTER = r"all_x_embedder\.[^.]+|all_final_layer\.[^.]+\.linear|cap_embedder\.1|t_embedder\.mlp\.[02]"
# adaLN_modulation (blocks and final layer) is never a target.
Z_IMAGE_LORA_PRESETS: Dict[str, TargetSpec] = {
    # Attention that sees the image: the joint layers and the image refiner (as FLUX's preset).
    "attention": rf"(layers|noise_refiner)\.\d+\.{_ATTN}",
    "attention_mlp": rf"(layers|noise_refiner|context_refiner)\.\d+\.({_ATTN}|{_MLP})",
    "all_linear": rf"(layers|noise_refiner|context_refiner)\.\d+\.({_ATTN}|{_MLP})|{_OUTER}",
}

SPEC = FamilySpec(
    name="z_image",
    title="Z-Image",
    entry_script="train.py",
    pipelines=("ZImagePipeline",),
    transformer="ZImageTransformer2DModel",
    lora_presets=Z_IMAGE_LORA_PRESETS,
    # Execution order: the image refiner, the caption refiner, then the joint layers.
    blocks=(BlockGroup("noise_refiner", "image"), BlockGroup("context_refiner", "text"),
            BlockGroup("layers", "joint")),
    runtime="trainer.families.z_image.model:ZImageFamily",
    text=TextTokens(max_length=512),
    plannable=False,
)
