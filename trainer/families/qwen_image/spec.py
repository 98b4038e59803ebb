"""Qwen-Image's facts: pipeline, LoRA presets, blocks, text tokens, published configs (no diffusers import)."""

from __future__ import annotations

from typing import Any, Dict

from trainer.families.components import QWEN2_5_VL_7B, model_index
from trainer.families.spec import BlockGroup, BlockLayout, FamilySpec, TargetSpec, TextTokens

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

# The planner's map of a QwenImageTransformerBlock (see trainer.families.spec.BlockLayout).
_DOUBLE_LAYOUT: BlockLayout = {
    **{f"attn.{n}": ("img", "attn_in") for n in ("to_q", "to_k", "to_v")},
    **{f"attn.{n}": ("txt", "attn_in") for n in ("add_q_proj", "add_k_proj", "add_v_proj")},
    "attn.to_out.0": ("img", "attn_out"), "attn.to_add_out": ("txt", "attn_out"),
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
# Qwen/Qwen-Image vae/config.json (the rest are AutoencoderKLQwenImage's defaults).
_VAE: Dict[str, Any] = {"_class_name": "AutoencoderKLQwenImage", "attn_scales": [], "base_dim": 96,
                        "dim_mult": [1, 2, 4, 4], "dropout": 0.0, "num_res_blocks": 2,
                        "temperal_downsample": [False, True, True], "z_dim": 16}
# Qwen/Qwen-Image scheduler/scheduler_config.json (the Edit checkpoints' is taken to be the same).
_SCHEDULER: Dict[str, Any] = {
    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
    "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02,
    "time_shift_type": "exponential", "invert_sigmas": False, "use_karras_sigmas": False,
    "use_exponential_sigmas": False, "use_beta_sigmas": False, "stochastic_sampling": False,
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
        "text_encoder/config.json": QWEN2_5_VL_7B, "vae/config.json": _VAE,
        "scheduler/scheduler_config.json": _SCHEDULER, "_shards": {"transformer": 9},
    }


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
    outer_layout=QWEN_OUTER_LAYOUT,
    # Qwen-Image-2512 is the same DiT, text encoder and VAE under a new repository id (the field review,
    # section 1b); its own scheduler file, read from the checkpoint, sets the shift when training.
    hub_configs={"Qwen/Qwen-Image": qwen_checkpoint("QwenImagePipeline"),
                 "Qwen/Qwen-Image-2512": qwen_checkpoint("QwenImagePipeline")},
)
