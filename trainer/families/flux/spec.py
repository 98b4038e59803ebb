"""FLUX.1-dev's facts: pipeline, LoRA presets, double/single blocks, T5 length (no diffusers import)."""

from __future__ import annotations

from typing import Dict

from trainer.families.spec import BlockGroup, FamilySpec, TargetSpec, TextTokens

T5_MAX_LENGTH = 512  # FLUX.1-dev's T5 context: FluxPipeline's default and its upper limit

# Layer names inside a double-stream block (image + text streams) and a single-stream block (joint).
_IMG_ATTN = r"attn\.(to_q|to_k|to_v|to_out\.0)"
_TXT_ATTN = r"attn\.(add_q_proj|add_k_proj|add_v_proj|to_add_out)"
_DOUBLE_MLP = r"(ff|ff_context)\.net\.(0\.proj|2)"
_SINGLE_ATTN = r"attn\.(to_q|to_k|to_v)"
# A single block's proj_out maps [attention, MLP] back to the hidden size: attention output and MLP
# down-projection in one layer, so it belongs with the MLP.
_SINGLE_MLP = r"proj_mlp|proj_out"
# Outside the blocks. The guidance embedder is left out: training sees one guidance value, so a LoRA
# there could only learn a shift that distorts every other value used at render time.
_OUTER = r"x_embedder|context_embedder|proj_out|time_text_embed\.(timestep_embedder|text_embedder)\.linear_[12]"


def _blocks(double: str, single: str, outer: str = "") -> str:
    """One regex that peft full-matches against module names. Block layers are anchored to their
    block: a bare ``proj_out`` suffix would also hit the model's final output layer."""
    pattern = rf"transformer_blocks\.\d+\.({double})|single_transformer_blocks\.\d+\.({single})"
    return f"{pattern}|{outer}" if outer else pattern


# Modulation (norm1.linear, norm1_context.linear, norm.linear, norm_out.linear) is never a target.
FLUX_LORA_PRESETS: Dict[str, TargetSpec] = {
    # FlyMyAI's FLUX targets (to_q/to_k/to_v/to_out.0): image-stream attention in double blocks,
    # joint attention in single blocks.
    "attention": _blocks(_IMG_ATTN, _SINGLE_ATTN),
    "attention_mlp": _blocks(f"{_IMG_ATTN}|{_TXT_ATTN}|{_DOUBLE_MLP}", f"{_SINGLE_ATTN}|{_SINGLE_MLP}"),
    "all_linear": _blocks(f"{_IMG_ATTN}|{_TXT_ATTN}|{_DOUBLE_MLP}", f"{_SINGLE_ATTN}|{_SINGLE_MLP}", _OUTER),
}

SPEC = FamilySpec(
    name="flux",
    title="FLUX.1-dev",
    entry_script="train_flux_lora.py",
    pipelines=("FluxPipeline",),
    transformer="FluxTransformer2DModel",
    lora_presets=FLUX_LORA_PRESETS,
    blocks=(BlockGroup("transformer_blocks", "double"), BlockGroup("single_transformer_blocks", "single")),
    runtime="trainer.families.flux.model:FluxFamily",
    # FLUX pads every T5 prompt to max_sequence_length and attends to the padding.
    text=TextTokens(max_length=T5_MAX_LENGTH, padded=True),
)
