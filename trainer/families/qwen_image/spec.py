"""Qwen-Image's facts: pipeline, LoRA presets, blocks, text tokens, published configs (no diffusers import)."""

from __future__ import annotations

from typing import Any, Dict

from trainer.families.components import QWEN2_5_VL_7B, QWEN_IMAGE_SCHEDULER, QWEN_IMAGE_VAE, model_index
from trainer.facts.family_spec import (DUAL_STREAM_ATTENTION_LAYOUT, IMAGE_STREAM_ATTENTION, TEXT_STREAM_ATTENTION,
                                   BlockGroup, BlockLayout, FamilySpec, TargetSpec, TextTokens, lora_presets)

_MLP = ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]
# Modulation layers (img_mod.1, txt_mod.1, norm_out.linear) hold a third of the weights.
QWEN_LORA_PRESETS: Dict[str, TargetSpec] = lora_presets(
    attention=list(IMAGE_STREAM_ATTENTION),  # what FlyMyAI and diffusers' Qwen-Image example train
    attention_mlp=[*IMAGE_STREAM_ATTENTION, *TEXT_STREAM_ATTENTION, *_MLP],
    outer=["img_in", "txt_in", "proj_out", "timestep_embedder.linear_1", "timestep_embedder.linear_2"])

# The planner's map of a QwenImageTransformerBlock (see trainer.families.spec.BlockLayout).
_DOUBLE_LAYOUT: BlockLayout = {
    **DUAL_STREAM_ATTENTION_LAYOUT,
    "img_mlp.net.0.proj": ("img", "mlp_in"), "img_mlp.net.2": ("img", "mlp_hidden"),
    "txt_mlp.net.0.proj": ("txt", "mlp_in"), "txt_mlp.net.2": ("txt", "mlp_hidden"),
    "img_mod.1": ("img", "mod"), "txt_mod.1": ("txt", "mod"),
}
QWEN_TRANSFORMER = "QwenImageTransformer2DModel"
QWEN_BLOCKS = (BlockGroup("transformer_blocks", "double", _DOUBLE_LAYOUT),)
QWEN_OUTER_LAYOUT: BlockLayout = {"txt_in": ("txt", "in"), "time_text_embed": ("img", "temb"),
                                  "norm_out": ("img", "mod")}

# Qwen/Qwen-Image transformer/config.json (every Edit checkpoint has the same transformer).
_TRANSFORMER: Dict[str, Any] = {
    "_class_name": QWEN_TRANSFORMER, "attention_head_dim": 128, "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": False, "in_channels": 64, "joint_attention_dim": 3584, "num_attention_heads": 24,
    "num_layers": 60, "out_channels": 16, "patch_size": 2,
}


def qwen_checkpoint(pipeline: str, zero_cond_t: bool = False) -> Dict[str, Any]:
    """The configs of a Qwen-Image(-Edit) checkpoint: its pipeline around the shared components (the
    transformer in 9 weight files); Edit-2511 adds ``zero_cond_t`` to the transformer."""
    return {
        "model_index.json": model_index(
            pipeline, scheduler="diffusers.FlowMatchEulerDiscreteScheduler",
            text_encoder="transformers.Qwen2_5_VLForConditionalGeneration",
            transformer=f"diffusers.{QWEN_TRANSFORMER}", vae="diffusers.AutoencoderKLQwenImage"),
        "transformer/config.json": {**_TRANSFORMER, **({"zero_cond_t": True} if zero_cond_t else {})},
        "text_encoder/config.json": QWEN2_5_VL_7B, "vae/config.json": QWEN_IMAGE_VAE,
        "scheduler/scheduler_config.json": QWEN_IMAGE_SCHEDULER, "_shards": {"transformer": 9},
    }


SPEC = FamilySpec(
    name="qwen_image",
    title="Qwen-Image",
    entry_script="train.py",
    lora_presets=QWEN_LORA_PRESETS,
    blocks=QWEN_BLOCKS,
    runtime="QwenImageFamily",
    # The pipeline encodes a 34-token template prefix with every prompt and drops it.
    text=TextTokens(max_length=512, template=34),
    outer_layout=QWEN_OUTER_LAYOUT,
    # Qwen-Image-2512 is the same DiT, text encoder and VAE under a new repository id (the field review,
    # section 1b); its own scheduler file, read from the checkpoint, sets the shift when training.
    hub_configs={"Qwen/Qwen-Image": qwen_checkpoint("QwenImagePipeline"),
                 "Qwen/Qwen-Image-2512": qwen_checkpoint("QwenImagePipeline")},
)
