"""FLUX.2's facts: two pipelines ([klein] base, [dev]), LoRA presets with FLUX.2's module names, double and
single blocks, the padded 512-token prompt and the published configs (no diffusers import).

Module names differ from FLUX.1's: the double block's MLPs are ``ff.linear_in`` / ``ff.linear_out`` (SwiGLU);
a single block holds two fused linears, ``attn.to_qkv_mlp_proj`` (q, k, v and the MLP's input) and
``attn.to_out`` (attention output and MLP output); modulation is shared by all blocks and lives outside
them (``double_stream_modulation_img/txt``, ``single_stream_modulation``). The double block's
``attn.to_out`` is a ModuleList (Linear, Dropout): a target must name ``to_out.0``.
"""

from __future__ import annotations

from typing import Any, Dict

from trainer.families.components import (FLUX2_VAE, FLUX_SCHEDULER, MISTRAL_SMALL_3_24B, QWEN3_4B, QWEN3_8B,
                                         model_index)
from trainer.facts.family_spec import (DUAL_STREAM_ATTENTION_LAYOUT, IMAGE_STREAM_ATTENTION, TEXT_STREAM_ATTENTION,
                                   BlockGroup, BlockLayout, FamilySpec, TargetSpec, TextTokens,
                                   double_single_targets, lora_presets, names_regex)

MAX_SEQUENCE_LENGTH = 512  # both pipelines pad every prompt to it and the transformer attends to the padding
KLEIN_TEXT_LAYERS = (9, 18, 27)  # Flux2KleinPipeline stacks these Qwen3 hidden states: 3 x hidden width
DEV_TEXT_LAYERS = (10, 20, 30)  # Flux2Pipeline stacks these Mistral-3 hidden states

_IMG_ATTN = names_regex("attn", IMAGE_STREAM_ATTENTION)
_TXT_ATTN = names_regex("attn", TEXT_STREAM_ATTENTION)
_DOUBLE_MLP = r"(ff|ff_context)\.(linear_in|linear_out)"
_SINGLE_IN = r"attn\.to_qkv_mlp_proj"  # q, k, v and the MLP input in one linear
_SINGLE_OUT = r"attn\.to_out"  # [attention, MLP] back to the hidden size (a Linear here, not a ModuleList)
# Outside the blocks. Left out: the guidance embedder (dev trains at one guidance value; a LoRA there can
# only learn a shift that distorts the others) and the shared modulation linears.
_OUTER = r"x_embedder|context_embedder|proj_out|time_guidance_embed\.timestep_embedder\.linear_[12]"

FLUX2_LORA_PRESETS: Dict[str, TargetSpec] = lora_presets(
    # Image-stream attention in the double blocks, the fused q/k/v(+MLP) projection in the single blocks.
    attention=double_single_targets(_IMG_ATTN, _SINGLE_IN),
    attention_mlp=double_single_targets(f"{_IMG_ATTN}|{_TXT_ATTN}|{_DOUBLE_MLP}", f"{_SINGLE_IN}|{_SINGLE_OUT}"),
    outer=_OUTER)

# The planner's maps of a Flux2TransformerBlock and a Flux2SingleTransformerBlock (no modulation inside).
_DOUBLE_LAYOUT: BlockLayout = {
    **DUAL_STREAM_ATTENTION_LAYOUT,
    "ff.linear_in": ("img", "mlp_in"), "ff.linear_out": ("img", "mlp_hidden"),
    "ff_context.linear_in": ("txt", "mlp_in"), "ff_context.linear_out": ("txt", "mlp_hidden"),
}
_SINGLE_LAYOUT: BlockLayout = {
    "attn.to_qkv_mlp_proj": ("joint", "attn_in"),
    "attn.to_out": ("joint", "proj_out_in"),  # reads cat([attention, MLP]): a new tensor
}


def _transformer(layers: int, single: int, heads: int, joint: int, guidance: bool) -> Dict[str, Any]:
    """A Flux2Transformer2DModel config: diffusers' defaults are FLUX.2 [dev]'s; klein differs in depth,
    width, text width (3 x its Qwen3's) and has no guidance embedding (musubi-tuner's Klein4B/9BParams)."""
    return {"_class_name": "Flux2Transformer2DModel", "patch_size": 1, "in_channels": 128, "num_layers": layers,
            "num_single_layers": single, "attention_head_dim": 128, "num_attention_heads": heads,
            "joint_attention_dim": joint, "timestep_guidance_channels": 256, "mlp_ratio": 3.0,
            "axes_dims_rope": [32, 32, 32, 32], "rope_theta": 2000, "eps": 1e-6, "guidance_embeds": guidance}


def _klein(layers: int, single: int, heads: int, encoder: Dict[str, Any], shards: int) -> Dict[str, Any]:
    """A FLUX.2 [klein] base checkpoint (4B or 9B). Every FLUX.2 checkpoint publishes FLUX.1's scheduler config
    (the pipelines replace mu with compute_empirical_mu at render time)."""
    index = model_index("Flux2KleinPipeline", scheduler="diffusers.FlowMatchEulerDiscreteScheduler",
                        text_encoder="transformers.Qwen3ForCausalLM", tokenizer="transformers.Qwen2TokenizerFast",
                        transformer="diffusers.Flux2Transformer2DModel", vae="diffusers.AutoencoderKLFlux2")
    return {"model_index.json": {**index, "is_distilled": False},
            "transformer/config.json": _transformer(layers, single, heads, 3 * encoder["hidden_size"], False),
            "text_encoder/config.json": encoder, "vae/config.json": FLUX2_VAE,
            "scheduler/scheduler_config.json": FLUX_SCHEDULER, "_shards": {"transformer": shards}}


_DEV: Dict[str, Any] = {
    "model_index.json": model_index(
        "Flux2Pipeline", scheduler="diffusers.FlowMatchEulerDiscreteScheduler",
        text_encoder="transformers.Mistral3ForConditionalGeneration", tokenizer="transformers.PixtralProcessor",
        transformer="diffusers.Flux2Transformer2DModel", vae="diffusers.AutoencoderKLFlux2"),
    "transformer/config.json": _transformer(8, 48, 48, 3 * 5120, True),
    "text_encoder/config.json": MISTRAL_SMALL_3_24B, "vae/config.json": FLUX2_VAE,
    "scheduler/scheduler_config.json": FLUX_SCHEDULER, "_shards": {"transformer": 7},
}

SPEC = FamilySpec(
    name="flux2",
    title="FLUX.2",
    entry_script="train_flux2_lora.py",
    lora_presets=FLUX2_LORA_PRESETS,
    blocks=(BlockGroup("transformer_blocks", "double", _DOUBLE_LAYOUT),
            BlockGroup("single_transformer_blocks", "single", _SINGLE_LAYOUT)),
    runtime="Flux2Family",
    # Both pipelines pad every prompt (chat template included) to 512 tokens and pass no attention mask.
    text=TextTokens(max_length=MAX_SEQUENCE_LENGTH, padded=True),
    text_encoder_head="not loaded",  # AutoModel: the bare Qwen3 / Mistral-3 (the hidden states are the same)
    outer_layout={"context_embedder": ("txt", "in"), "time_guidance_embed": ("img", "temb"),
                  "double_stream_modulation_img": ("img", "mod"), "double_stream_modulation_txt": ("txt", "mod"),
                  "single_stream_modulation": ("joint", "mod"), "norm_out": ("img", "mod")},
    hub_configs={"black-forest-labs/FLUX.2-klein-base-4B": _klein(5, 20, 24, QWEN3_4B, 1),
                 "black-forest-labs/FLUX.2-klein-base-9B": _klein(8, 24, 32, QWEN3_8B, 2),
                 "black-forest-labs/FLUX.2-dev": _DEV},
    comfyui_unsupported=(
        "ComfyUI loads FLUX.2 LoRAs under BFL's names (double_blocks.N.img_attn.qkv with q/k/v fused, "
        "single_blocks.N.linear1/linear2) and this export has not been checked against them; use the "
        "diffusers file (lora_export_formats: [diffusers])"),
)
