"""Qwen-Image-2.1's facts: ``QwenImage21Pipeline``, LoRA presets, blocks, text and reference tokens, published
configs (no diffusers import).

A 7B single-stream, block-causal DiT (``QwenImage21Transformer2DModel``: 32 ``transformer_blocks`` of attention
and a SwiGLU, modulated by one shared ``modulation.1``), a 16x VAE with 64 latent channels that reads RGBA
(``AutoencoderKLQwenImage21``), and a Qwen3-VL-8B text encoder whose prompt reserves ``<|image_pad|>`` slots for
the reference images. The transformer writes each reference's latents (unpatched, one token per latent pixel)
into those slots, 4 latent tokens per slot, and the target's tokens go last: one joint sequence.
"""

from __future__ import annotations

from typing import Any, Dict, List

from trainer.families.components import QWEN_IMAGE_SCHEDULER, model_index, qwen3_vl
from trainer.facts.family_spec import (BlockGroup, BlockLayout, FamilySpec, ReferenceTokens, SavedActivations,
                                   TargetSpec, TextTokens, lora_presets)

_ATTN: List[str] = ["to_q", "to_k", "to_v", "to_out.0"]
_MLP: List[str] = ["img_mlp.proj", "img_mlp.gate_layer", "img_mlp.out"]  # never a bare "out"
# The shared modulation (modulation.1, 67M parameters, feeding every block) and norm_out.linear are never a
# preset's target, as with the house's other families. The attention names occur only inside the blocks.
QWEN21_LORA_PRESETS: Dict[str, TargetSpec] = lora_presets(
    attention=_ATTN, attention_mlp=_ATTN + _MLP,
    outer=["img_in", "txt_in.in_layer", "txt_in.out_layer", "proj_out", "timestep_embedder.linear_1",
           "timestep_embedder.linear_2"])

# The planner's map of a QwenImage21TransformerBlock: one joint stream, no modulation of its own (the shared
# modulation.1 feeds it per sample).
_BLOCK_LAYOUT: BlockLayout = {
    **{f"attn.{n}": ("joint", "attn_in") for n in ("to_q", "to_k", "to_v")},
    "attn.to_out.0": ("joint", "attn_out"),
    "img_mlp.proj": ("joint", "mlp_in"), "img_mlp.gate_layer": ("joint", "mlp_in"),
    "img_mlp.out": ("joint", "mlp_hidden"),
}
# What a QwenImage21TransformerBlock keeps for backward per token, counted with saved-tensor hooks on the real block
# (bf16 autocast; tests/test_qwen_image21_family.py): 12 tensors of the hidden width in bf16 (the two modulated
# norms' outputs and gates, q/k after their norms and rotary, q/k/v as the segment-wise attention keeps them, its
# output, the residual branches), norm_q/norm_k's fp32 copies of q and k, and the SwiGLU's three of the MLP width.
_BLOCK_SAVED = SavedActivations(half_hidden=12, fp32_hidden=0, half_mlp=3, fp32_outputs=("attn.to_q", "attn.to_k"),
                                modulated_hidden=4)
_OUTER_LAYOUT: BlockLayout = {"txt_in": ("txt", "in"), "time_text_embed": ("img", "temb"),
                              "modulation": ("joint", "mod"), "norm_out": ("img", "mod")}

# QwenImage21Transformer2DModel's defaults in diffusers 0.42.1: the published 7B model (32 layers of 32 heads of
# 128, a Qwen3-VL-8B context of width 4096, unpatched 64-channel latents).
_TRANSFORMER: Dict[str, Any] = {
    "_class_name": "QwenImage21Transformer2DModel", "patch_size": 1, "in_channels": 64, "out_channels": 64,
    "num_layers": 32, "attention_head_dim": 128, "num_attention_heads": 32, "context_in_dim": 4096, "mlp_ratio": 3,
    "axes_dims_rope": [16, 56, 56], "eps": 1e-6, "causal_condition": True,
}
# AutoencoderKLQwenImage21's defaults (the published VAE; its 64 latents_mean/latents_std are the class
# defaults, which a checkpoint's own vae/config.json overrides).
_VAE: Dict[str, Any] = {
    "_class_name": "AutoencoderKLQwenImage21", "base_dim": 96, "decoder_base_dim": 144, "z_dim": 64,
    "dim_mult": [1, 2, 4, 8, 8], "num_res_blocks": 2, "attn_scales": [],
    "temperal_downsample": [False, True, True, True], "dropout": 0.0, "in_channels": 4, "out_channels": 4,
    "scale_factor_temporal": 8, "scale_factor_spatial": 16,
}
# Qwen/Qwen3-VL-8B-Instruct config.json (Qwen3VLForConditionalGeneration: the LM head is loaded, only the last
# decoder layer's hidden states are read).
QWEN3_VL_8B: Dict[str, Any] = qwen3_vl(4096, 12288, False, 27, 1152, 4304, (8, 16, 24))
# Qwen3-VL's released preprocessor_config.json: 16-px patches merged 2x2 (one <|image_pad|> per 32x32 px),
# images kept between 256^2 and 4096^2 px.
PROCESSOR: Dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor", "patch_size": 16,
    "temporal_patch_size": 2, "merge_size": 2, "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}
REFERENCE_AREA = 1024 * 1024  # the pipeline's output_resolution default, squared: each reference's area


def _checkpoint(sample_sigmas: Any = None) -> Dict[str, Any]:
    """Qwen/Qwen-Image-2.1's configs (``sample_sigmas`` null: the base model; a distilled Turbo folder sets it,
    which is diffusers' modular loader's test for a distilled checkpoint)."""
    index = model_index("QwenImage21Pipeline", scheduler="diffusers.FlowMatchEulerDiscreteScheduler",
                        text_encoder="transformers.Qwen3VLForConditionalGeneration",
                        processor="transformers.Qwen3VLProcessor",
                        transformer="diffusers.QwenImage21Transformer2DModel", vae="diffusers.AutoencoderKLQwenImage21")
    return {"model_index.json": {**index, "sample_sigmas": sample_sigmas},
            "transformer/config.json": _TRANSFORMER, "text_encoder/config.json": QWEN3_VL_8B,
            "vae/config.json": _VAE, "scheduler/scheduler_config.json": QWEN_IMAGE_SCHEDULER,
            "processor/preprocessor_config.json": PROCESSOR, "_shards": {"transformer": 3}}


SPEC = FamilySpec(
    name="qwen_image21",
    title="Qwen-Image-2.1",
    entry_script="train_qwen_image21_lora.py",
    lora_presets=QWEN21_LORA_PRESETS,
    blocks=(BlockGroup("transformer_blocks", "single", _BLOCK_LAYOUT, _BLOCK_SAVED),),
    runtime="QwenImage21Family",
    # [system turn (dropped, ~13 tokens) | "<|im_start|>user\n" caption "<|im_end|>\n<|im_start|>assistant\n"]:
    # 8 template tokens kept; the caption is not padded (the cache holds each prompt's own rows). The pipeline
    # encodes one prompt with its references at a time; image_pad_mask marks the reference slots (no width).
    text=TextTokens(max_length=1024, template=13, kept=8, prompts_per_call=1,
                    conditions={"prompt_embeds": ("context_in_dim", True), "image_pad_mask": ("", True)}),
    # Up to 3 references (as Qwen-Image-Edit-2509); each is resized once to the reference area and feeds both the
    # vision tower and the VAE. The transformer writes its latents into its slots (4 per slot): in the DiT the
    # slots are the reference's image tokens, the markers around them ("<imageN><|vision_start|>", ...) text.
    references={"QwenImage21Pipeline": ReferenceTokens(max_references=3, condition_area=REFERENCE_AREA,
                                                       markers=8, vae_area=REFERENCE_AREA, pixels_per_token=32,
                                                       slots_hold_latents=True)},
    references_optional=True,  # a dataset without control/ folders trains text-to-image
    text_encoder_head="dropped",  # only hidden states are read; the pipeline needs the ForConditionalGeneration class
    outer_layout=_OUTER_LAYOUT,
    vl_processors=("processor",),
    hub_configs={"Qwen/Qwen-Image-2.1": _checkpoint()},
    comfyui_unsupported=(
        "ComfyUI's Qwen-Image-2.1 model fuses the MLP input (img_mlp.gate_up) and its LoRA loader for 2.1 could "
        "not be checked; this export would write img_mlp.gate_layer / img_mlp.proj, which ComfyUI may ignore. Use "
        "the diffusers file (lora_export_formats: [diffusers])"),
    compile_auto_off=(
        "the transformer's segments and image shapes are Python values that change with each caption length and "
        "reference layout (a recompile each); not measured on a GPU yet"),
)
