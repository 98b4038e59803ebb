"""Krea 2's facts: ``Krea2Pipeline`` (Raw and Turbo), LoRA presets, blocks, text taps, published configs (no
diffusers import).

A 12B single-stream DiT (``Krea2Transformer2DModel``: 28 ``transformer_blocks`` of gated GQA attention and a
SwiGLU, modulated by one shared ``time_mod_proj`` plus a per-block ``scale_shift_table``), Qwen-Image's VAE and a
Qwen3-VL-4B text encoder whose hidden states are tapped at several layers (``text_encoder_select_layers`` in the
checkpoint's ``model_index.json``) and fused by the transformer's own ``text_fusion`` blocks. Text position ids
are all zero, so right-padded text of unequal lengths is exact with a mask, and unpadded text is cached.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Tuple

from trainer.families.components import QWEN_IMAGE_VAE, model_index, qwen3_vl
from trainer.facts.family_spec import (BlockGroup, BlockLayout, FamilySpec, SavedActivations, TargetSpec, TextTokens,
                                   lora_presets)

# Krea2Pipeline's default taps (its __init__, for a model_index.json without the key): 12 of Qwen3-VL-4B's 37
# hidden states. The checkpoint's own model_index.json wins.
PUBLISHED_TEXT_TAPS: Tuple[int, ...] = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)
# Krea2Pipeline.__call__'s shift when the scheduler config leaves a key out (pipeline_krea2.py: 256 / 6400 /
# 0.5 / 1.15), and the fixed mu of the distilled (Turbo) checkpoint.
SHIFT_DEFAULTS: Dict[str, Any] = {"base_image_seq_len": 256, "max_image_seq_len": 6400, "base_shift": 0.5,
                                  "max_shift": 1.15}
DISTILLED_MU = 1.15

_ATTN = r"attn\.(to_q|to_k|to_v|to_gate|to_out\.0)"
_FF = r"ff\.(gate|up|down)"
# Outside the blocks: the embedders, the text MLP, the output layer. Never a preset's target: time_mod_proj (the
# shared modulation, 227M parameters; presets leave modulation alone) and the text fusion blocks (the memory
# planner does not model their activations: each of the 12 taps of every caption token runs through them).
# The Krea authors' example list has both: name them in lora_target_modules when a style needs them.
_OUTER = r"img_in|final_layer\.linear|time_embed\.linear_[12]|txt_in\.linear_[12]"
KREA2_LORA_PRESETS: Dict[str, TargetSpec] = lora_presets(
    # Anchored to the main blocks: the bare names would also hit the text fusion blocks.
    attention=rf"transformer_blocks\.\d+\.{_ATTN}", attention_mlp=rf"transformer_blocks\.\d+\.({_ATTN}|{_FF})",
    outer=_OUTER)

# The planner's map of a Krea2TransformerBlock: one joint stream (text and image tokens together).
_BLOCK_LAYOUT: BlockLayout = {
    **{f"attn.{n}": ("joint", "attn_in") for n in ("to_q", "to_k", "to_v", "to_gate")},
    "attn.to_out.0": ("joint", "attn_out"),
    "ff.gate": ("joint", "mlp_in"), "ff.up": ("joint", "mlp_in"), "ff.down": ("joint", "mlp_hidden"),
}
# What a Krea2TransformerBlock saves per token, counted on the real block (bf16, saved-tensor hooks; the
# planner test traces it): 5 tensors of the hidden width in bf16 (linear inputs, attention), norm1 and norm2's
# fp32 upcasts, SwiGLU's 3 of the MLP width, norm_q / norm_k's fp32 copies of q and k (k at the key-value
# width under GQA); with a gradient into the modulation (LoRA on time_embed) its four multiplies keep their
# token-sized operands.
_BLOCK_SAVED = SavedActivations(half_hidden=5, fp32_hidden=2, half_mlp=3, fp32_outputs=("attn.to_q", "attn.to_k"),
                                modulated_hidden=4)
_OUTER_LAYOUT: BlockLayout = {"txt_in": ("txt", "in"), "text_fusion": ("txt", "in"),
                              "time_embed": ("img", "temb"), "time_mod_proj": ("joint", "mod")}

# Krea2Transformer2DModel's defaults in diffusers 0.42.1, which are ComfyUI's SingleStreamDiT defaults and the
# published 12B model (28 layers, 48 query / 12 key-value heads of 128, text fusion over 12 taps of width 2560).
_TRANSFORMER: Dict[str, Any] = {
    "_class_name": "Krea2Transformer2DModel", "in_channels": 64, "num_layers": 28, "attention_head_dim": 128,
    "num_attention_heads": 48, "num_key_value_heads": 12, "intermediate_size": 16384, "timestep_embed_dim": 256,
    "text_hidden_dim": 2560, "num_text_layers": 12, "text_num_attention_heads": 20, "text_num_key_value_heads": 20,
    "text_intermediate_size": 6912, "num_layerwise_text_blocks": 2, "num_refiner_text_blocks": 2,
    "axes_dims_rope": [32, 48, 48], "rope_theta": 1000.0, "norm_eps": 1e-5,
}
# Qwen/Qwen3-VL-4B-Instruct config.json, loaded as the bare Qwen3VLModel (no LM head; the vision tower is
# loaded but never runs for text).
QWEN3_VL_4B: Dict[str, Any] = qwen3_vl(2560, 9728, True, 24, 1024, 4096, (5, 11, 17))
# The scheduler's shift settings as Krea2Pipeline's docstring gives them (other keys: the class defaults).
_SCHEDULER: Dict[str, Any] = {"num_train_timesteps": 1000, "use_dynamic_shifting": True, "base_shift": 0.5,
                              "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 6400}


# ComfyUI's names (comfy/ldm/krea2/model.py, SingleStreamDiT): blocks.N.attn.{wq,wk,wv,gate,wo},
# blocks.N.mlp.*, txtfusion.*, first, tmlp.0/2, txtmlp.1/3, tproj.1, last.linear. The rename is the exact
# inverse of diffusers' _convert_non_diffusers_krea2_lora_to_diffusers (a test reads the file back through it).
_COMFY_ATTN = {"to_q": "wq", "to_k": "wk", "to_v": "wv", "to_gate": "gate", "to_out.0": "wo"}
COMFYUI_NAMES: Tuple[Tuple[str, str], ...] = (
    *((rf"transformer_blocks\.(\d+)\.attn\.{re.escape(ours)}", rf"blocks.\1.attn.{theirs}")
      for ours, theirs in _COMFY_ATTN.items()),
    (r"transformer_blocks\.(\d+)\.ff\.(gate|up|down)", r"blocks.\1.mlp.\2"),
    *((rf"text_fusion\.(layerwise|refiner)_blocks\.(\d+)\.attn\.{re.escape(ours)}",
       rf"txtfusion.\1_blocks.\2.attn.{theirs}") for ours, theirs in _COMFY_ATTN.items()),
    (r"text_fusion\.(layerwise|refiner)_blocks\.(\d+)\.ff\.(gate|up|down)", r"txtfusion.\1_blocks.\2.mlp.\3"),
    (r"text_fusion\.projector", "txtfusion.projector"), (r"img_in", "first"), (r"final_layer\.linear", "last.linear"),
    (r"time_embed\.linear_1", "tmlp.0"), (r"time_embed\.linear_2", "tmlp.2"), (r"time_mod_proj", "tproj.1"),
    (r"txt_in\.linear_1", "txtmlp.1"), (r"txt_in\.linear_2", "txtmlp.3"),
)


def _checkpoint(distilled: bool) -> Dict[str, Any]:
    """krea/Krea-2-Raw (base) or krea/Krea-2-Turbo (distilled): the same components and configs; Turbo's
    model_index.json says ``is_distilled: true`` (a fixed shift, 8 steps without CFG)."""
    index = model_index("Krea2Pipeline", scheduler="diffusers.FlowMatchEulerDiscreteScheduler",
                        text_encoder="transformers.Qwen3VLModel", tokenizer="transformers.Qwen2Tokenizer",
                        transformer="diffusers.Krea2Transformer2DModel", vae="diffusers.AutoencoderKLQwenImage")
    return {"model_index.json": {**index, "text_encoder_select_layers": list(PUBLISHED_TEXT_TAPS),
                                 "is_distilled": distilled, "patch_size": 2},
            "transformer/config.json": _TRANSFORMER, "text_encoder/config.json": QWEN3_VL_4B,
            "vae/config.json": QWEN_IMAGE_VAE, "scheduler/scheduler_config.json": _SCHEDULER,
            "_shards": {"transformer": 6}}


SPEC = FamilySpec(
    name="krea2",
    title="Krea 2",
    entry_script="train_krea2_lora.py",
    lora_presets=KREA2_LORA_PRESETS,
    # text_fusion's blocks are not a direct attribute: they stay unquantized and resident (343M parameters).
    blocks=(BlockGroup("transformer_blocks", "single", _BLOCK_LAYOUT, _BLOCK_SAVED),),
    runtime="Krea2Family",
    # [34-token system prefix | caption | PAD | 5-token suffix]; the prefix is dropped, the suffix kept. The
    # cache holds the unpadded rows (exact: text positions are all zero); each token holds every tap.
    text=TextTokens(max_length=512, template=34, kept=5,
                    conditions={"prompt_embeds": ("text_hidden_dim", True)}, stacked="num_text_layers"),
    outer_layout=_OUTER_LAYOUT,
    hub_configs={"krea/Krea-2-Raw": _checkpoint(False), "krea/Krea-2-Turbo": _checkpoint(True)},
    comfyui_names=COMFYUI_NAMES,
)
