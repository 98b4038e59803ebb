"""FLUX.1-dev's facts: pipeline, LoRA presets, double/single blocks, T5 length (no diffusers import)."""

from __future__ import annotations

from typing import Any, Dict

from trainer.families.components import CLIP_L_TEXT, FLUX_SCHEDULER, FLUX_VAE, T5_XXL_ENCODER, model_index
from trainer.facts.family_spec import (DUAL_STREAM_ATTENTION_LAYOUT, IMAGE_STREAM_ATTENTION, TEXT_STREAM_ATTENTION,
                                   BlockGroup, BlockLayout, FamilySpec, TargetSpec, TextTokens,
                                   double_single_targets, lora_presets, names_regex)

T5_MAX_LENGTH = 512  # FLUX.1-dev's T5 context: FluxPipeline's default and its upper limit

# Layer names inside a double-stream block (image + text streams) and a single-stream block (joint).
_IMG_ATTN = names_regex("attn", IMAGE_STREAM_ATTENTION)
_TXT_ATTN = names_regex("attn", TEXT_STREAM_ATTENTION)
_DOUBLE_MLP = r"(ff|ff_context)\.net\.(0\.proj|2)"
_SINGLE_ATTN = r"attn\.(to_q|to_k|to_v)"
# A single block's proj_out maps [attention, MLP] back to the hidden size: attention output and MLP
# down-projection in one layer, so it belongs with the MLP.
_SINGLE_MLP = r"proj_mlp|proj_out"
# Outside the blocks. The guidance embedder is left out: training sees one guidance value, so a LoRA
# there could only learn a shift that distorts every other value used at render time.
_OUTER = r"x_embedder|context_embedder|proj_out|time_text_embed\.(timestep_embedder|text_embedder)\.linear_[12]"

# Modulation (norm1.linear, norm1_context.linear, norm.linear, norm_out.linear) is never a target.
FLUX_LORA_PRESETS: Dict[str, TargetSpec] = lora_presets(
    # FlyMyAI's FLUX targets (to_q/to_k/to_v/to_out.0): image-stream attention in double blocks,
    # joint attention in single blocks.
    attention=double_single_targets(_IMG_ATTN, _SINGLE_ATTN),
    attention_mlp=double_single_targets(f"{_IMG_ATTN}|{_TXT_ATTN}|{_DOUBLE_MLP}", f"{_SINGLE_ATTN}|{_SINGLE_MLP}"),
    outer=_OUTER)

# The planner's maps of a FluxTransformerBlock and a FluxSingleTransformerBlock (trainer.families.spec.BlockLayout).
_DOUBLE_LAYOUT: BlockLayout = {
    **DUAL_STREAM_ATTENTION_LAYOUT,
    "ff.net.0.proj": ("img", "mlp_in"), "ff.net.2": ("img", "mlp_hidden"),
    "ff_context.net.0.proj": ("txt", "mlp_in"), "ff_context.net.2": ("txt", "mlp_hidden"),
    "norm1.linear": ("img", "mod"), "norm1_context.linear": ("txt", "mod"),
}
_SINGLE_LAYOUT: BlockLayout = {
    **{f"attn.{n}": ("joint", "attn_in") for n in ("to_q", "to_k", "to_v")},
    "proj_mlp": ("joint", "attn_in"),  # reads the same normalised input as q/k/v
    "proj_out": ("joint", "proj_out_in"),  # reads cat([attention, MLP]): a new tensor
    "norm.linear": ("joint", "mod"),
}

# black-forest-labs/FLUX.1-dev: model_index.json and transformer/config.json (3 weight files); CLIP-L, T5-XXL,
# the VAE and the scheduler from trainer.families.components.
_FLUX_DEV: Dict[str, Any] = {
    "model_index.json": model_index(
        "FluxPipeline", scheduler="diffusers.FlowMatchEulerDiscreteScheduler",
        text_encoder="transformers.CLIPTextModel", text_encoder_2="transformers.T5EncoderModel",
        tokenizer="transformers.CLIPTokenizer", tokenizer_2="transformers.T5TokenizerFast",
        transformer="diffusers.FluxTransformer2DModel", vae="diffusers.AutoencoderKL"),
    "transformer/config.json": {
        "_class_name": "FluxTransformer2DModel", "attention_head_dim": 128, "guidance_embeds": True, "in_channels": 64,
        "joint_attention_dim": 4096, "num_attention_heads": 24, "num_layers": 19, "num_single_layers": 38,
        "patch_size": 1, "pooled_projection_dim": 768, "axes_dims_rope": [16, 56, 56]},
    "text_encoder/config.json": CLIP_L_TEXT,
    "text_encoder_2/config.json": T5_XXL_ENCODER,
    "vae/config.json": FLUX_VAE,
    "scheduler/scheduler_config.json": FLUX_SCHEDULER,
    "_shards": {"transformer": 3},
}

SPEC = FamilySpec(
    compile_auto_off=("on an H200 (torch 2.11, CUDA 13) the compiled blocks' backward hit an illegal memory "
                      "access with flash and cuDNN attention alike (c7bf323, benchmarks/results/gpu-pass-2026-11-26); "
                      "eager until a GPU pass clears it"),
    name="flux",
    title="FLUX.1-dev",
    entry_script="train_flux_lora.py",
    lora_presets=FLUX_LORA_PRESETS,
    blocks=(BlockGroup("transformer_blocks", "double", _DOUBLE_LAYOUT),
            BlockGroup("single_transformer_blocks", "single", _SINGLE_LAYOUT)),
    runtime="FluxFamily",
    # FLUX pads every T5 prompt to max_sequence_length and attends to the padding; CLIP gives the
    # pooled embedding.
    text=TextTokens(max_length=T5_MAX_LENGTH, padded=True,
                    conditions={"prompt_embeds": ("joint_attention_dim", True),
                                "pooled_prompt_embeds": ("pooled_projection_dim", False)}),
    outer_layout={"context_embedder": ("txt", "in"), "time_text_embed": ("img", "temb"),
                  "norm_out": ("img", "mod")},
    hub_configs={"black-forest-labs/FLUX.1-dev": _FLUX_DEV},
)
