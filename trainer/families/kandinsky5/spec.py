"""Kandinsky 5 image's facts: pipeline, LoRA presets, text then visual blocks (no diffusers import)."""

from __future__ import annotations

from typing import Dict

from trainer.families.spec import BlockGroup, FamilySpec, TargetSpec, TextTokens

_PROJ = r"(to_query|to_key|to_value|out_layer)"
_VISUAL_ATTN = rf"visual_transformer_blocks\.\d+\.(self_attention|cross_attention)\.{_PROJ}"
_TEXT_ATTN = rf"text_transformer_blocks\.\d+\.self_attention\.{_PROJ}"
_MLP = r"(text|visual)_transformer_blocks\.\d+\.feed_forward\.(in_layer|out_layer)"
_OUTER = r"(time|text|pooled_text|visual)_embeddings\.in_layer|time_embeddings\.out_layer|out_layer\.out_layer"
# Regexes (peft full-matches them): `out_layer` names attention, MLP, modulation and final layers alike.
# Modulation (text_modulation, visual_modulation, out_layer.modulation) is never a target.
KANDINSKY5_LORA_PRESETS: Dict[str, TargetSpec] = {
    "attention": _VISUAL_ATTN,  # the image stream: the visual blocks' self- and cross-attention
    "attention_mlp": f"{_VISUAL_ATTN}|{_TEXT_ATTN}|{_MLP}",
    "all_linear": f"{_VISUAL_ATTN}|{_TEXT_ATTN}|{_MLP}|{_OUTER}",
}

SPEC = FamilySpec(
    name="kandinsky5",
    title="Kandinsky 5 image (T2I Lite)",
    entry_script="train.py",
    pipelines=("Kandinsky5T2IPipeline",),
    transformer="Kandinsky5Transformer3DModel",
    lora_presets=KANDINSKY5_LORA_PRESETS,
    blocks=(BlockGroup("text_transformer_blocks", "text"), BlockGroup("visual_transformer_blocks", "visual")),
    runtime="trainer.families.kandinsky5.model:Kandinsky5Family",
    text=TextTokens(max_length=512),
    plannable=False,
)
