"""Kandinsky 5 image's facts: pipeline, LoRA presets, text then visual blocks (no diffusers import)."""

from __future__ import annotations

from typing import Any, Dict

from trainer.families.components import CLIP_L_TEXT, FLUX_VAE, QWEN2_5_VL_7B, model_index
from trainer.facts.family_spec import BlockGroup, FamilySpec, TargetSpec, TextTokens, lora_presets

_PROJ = r"(to_query|to_key|to_value|out_layer)"
_VISUAL_ATTN = rf"visual_transformer_blocks\.\d+\.(self_attention|cross_attention)\.{_PROJ}"
_TEXT_ATTN = rf"text_transformer_blocks\.\d+\.self_attention\.{_PROJ}"
_MLP = r"(text|visual)_transformer_blocks\.\d+\.feed_forward\.(in_layer|out_layer)"
_OUTER = r"(time|text|pooled_text|visual)_embeddings\.in_layer|time_embeddings\.out_layer|out_layer\.out_layer"
# Regexes (peft full-matches them): `out_layer` names attention, MLP, modulation and final layers alike.
# Modulation (text_modulation, visual_modulation, out_layer.modulation) is never a target.
KANDINSKY5_LORA_PRESETS: Dict[str, TargetSpec] = lora_presets(
    attention=_VISUAL_ATTN,  # the image stream: the visual blocks' self- and cross-attention
    attention_mlp=f"{_VISUAL_ATTN}|{_TEXT_ATTN}|{_MLP}", outer=_OUTER)

# kandinskylab/Kandinsky-5.0-T2I-Lite-sft-Diffusers: transformer/config.json as published (the values of a
# third-party review that compared that file key by key; they build 6.02B parameters, the model card's
# "6B"; in_text_dim 3584 and in_text_dim2 768 are Qwen2.5-VL-7B's and CLIP-L's widths). Text encoders:
# Qwen2.5-VL-7B-Instruct and CLIP-L; VAE: FLUX's (Kandinsky5T2IPipeline's docs; the family scales its
# latents without the shift). Its scheduler config is not reproduced here (not checked).
_T2I_LITE: Dict[str, Any] = {
    "model_index.json": model_index(
        "Kandinsky5T2IPipeline", scheduler="diffusers.FlowMatchEulerDiscreteScheduler",
        text_encoder="transformers.Qwen2_5_VLForConditionalGeneration", tokenizer="transformers.Qwen2VLProcessor",
        text_encoder_2="transformers.CLIPTextModel", tokenizer_2="transformers.CLIPTokenizer",
        transformer="diffusers.Kandinsky5Transformer3DModel", vae="diffusers.AutoencoderKL"),
    "transformer/config.json": {
        "_class_name": "Kandinsky5Transformer3DModel", "in_visual_dim": 16, "out_visual_dim": 16,
        "in_text_dim": 3584, "in_text_dim2": 768, "time_dim": 512, "patch_size": [1, 2, 2], "model_dim": 2560,
        "ff_dim": 10240, "num_text_blocks": 2, "num_visual_blocks": 50, "axes_dims": [32, 48, 48],
        "visual_cond": False, "attention_type": "regular"},
    "text_encoder/config.json": QWEN2_5_VL_7B,
    "text_encoder_2/config.json": CLIP_L_TEXT,
    "vae/config.json": FLUX_VAE,
}

SPEC = FamilySpec(
    name="kandinsky5",
    title="Kandinsky 5 image (T2I Lite)",
    entry_script="train.py",
    lora_presets=KANDINSKY5_LORA_PRESETS,
    # No layouts: the planner does not model the activations of these blocks yet (it refuses to plan).
    blocks=(BlockGroup("text_transformer_blocks", "text"), BlockGroup("visual_transformer_blocks", "visual")),
    runtime="Kandinsky5Family",
    # Kandinsky5T2IPipeline: a 40-token template prefix dropped (prompt_template_encode_start_idx),
    # then up to 512 caption tokens, unpadded; the family encodes one prompt at a time. CLIP gives the
    # pooled embedding.
    text=TextTokens(max_length=512, template=40, prompts_per_call=1,
                    conditions={"prompt_embeds_qwen": ("in_text_dim", True),
                                "prompt_embeds_clip": ("in_text_dim2", False)}),
    vl_processors=("tokenizer",),  # its "tokenizer" is a Qwen2-VL processor
    hub_configs={"kandinskylab/Kandinsky-5.0-T2I-Lite-sft-Diffusers": _T2I_LITE},
)
