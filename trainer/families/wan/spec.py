"""Wan's facts: pipeline, LoRA presets, its one list of blocks, the frames its VAE folds together (no diffusers
import). Wan 2.1 T2V and Wan 2.2 TI2V-5B are one transformer each (``WanTransformer3DModel``); the two-expert
A14B checkpoints hold two (``transformer_2``); the I2V checkpoints (``WanImageToVideoPipeline``) take the clip's first
frame as a condition (``model.py``)."""

from __future__ import annotations

from typing import Any, Dict, Optional

from trainer.families.components import WAN21_VAE, WAN22_VAE, model_index
from trainer.families.wan.comfyui_names import COMFYUI_NAMES
from trainer.facts.family_spec import BlockGroup, BlockLayout, FamilySpec, SavedActivations, TargetSpec, TextTokens, \
    lora_presets

# Self-attention over the video, cross-attention to the text; Wan 2.1 I2V's cross-attention also projects the first
# frame's CLIP embeddings (add_k_proj / add_v_proj: diffusers' loader adds zero LoRA there for a file without them).
_ATTN = r"(attn[12]\.(to_q|to_k|to_v|to_out\.0)|attn2\.add_[kv]_proj)"
_MLP = r"ffn\.net\.(0\.proj|2)"
# The text and timestep embedders and the output layer. condition_embedder.time_proj is the modulation (it
# makes every block's shift/scale/gate), and the per-block scale_shift_table is a parameter: neither is a target.
_OUTER = r"condition_embedder\.(time_embedder|text_embedder)\.linear_[12]|proj_out"
WAN_LORA_PRESETS: Dict[str, TargetSpec] = lora_presets(
    # Both attentions see the video: their queries are the video tokens.
    attention=rf"blocks\.\d+\.{_ATTN}", attention_mlp=rf"blocks\.\d+\.({_ATTN}|{_MLP})", outer=_OUTER)

# The planner's map of a block's linears, (stream, input group): self-attention and the FFN read the video tokens,
# cross-attention's queries too, its keys and values the 512 text tokens (two linears reading one input share it).
_BLOCK_LAYOUT: BlockLayout = {
    **{f"attn1.{n}": ("img", "attn_in") for n in ("to_q", "to_k", "to_v")}, "attn1.to_out.0": ("img", "attn_out"),
    "attn2.to_q": ("img", "cross_q"), "attn2.to_k": ("txt", "cross_kv"), "attn2.to_v": ("txt", "cross_kv"),
    "attn2.to_out.0": ("img", "attn_out"),  # the attention output, which attention already keeps
    "ffn.net.0.proj": ("img", "mlp_in"), "ffn.net.2": ("img", "mlp_out"),
}
# What a WanTransformerBlock keeps for backward, counted with saved-tensor hooks on the real block in bf16
# (tests/test_wan_plan.py checks it within 3% for each preset): per video token 12 tensors of the hidden width in
# bf16 (self-attention's q/k before and after their norms, its q/k/v/output, cross-attention's q before and after
# its norm and its output, ...), the three FP32LayerNorms' fp32 inputs, the GELU's input of the FFN width; per text
# token cross-attention's k and v; 7 more half-width tensors per token when the modulation trains (LoRA on the
# timestep embedder: the scale/shift/gate multiplies keep their fp32 operands).
_BLOCK_SAVED = SavedActivations(half_hidden=12, fp32_hidden=3, half_mlp=1, modulated_hidden=7, text_hidden=2)
_OUTER_LAYOUT: BlockLayout = {"condition_embedder.text_embedder": ("txt", "in"),
                              "condition_embedder.time_embedder": ("img", "temb"),
                              "condition_embedder.time_proj": ("img", "mod")}

# UMT5-XXL's encoder (google/umt5-xxl), the text encoder of every Wan 2.x checkpoint.
UMT5_XXL_ENCODER: Dict[str, Any] = {
    "architectures": ["UMT5EncoderModel"], "model_type": "umt5", "d_ff": 10240, "d_kv": 64, "d_model": 4096,
    "num_heads": 64, "num_layers": 24, "vocab_size": 256384, "feed_forward_proj": "gated-gelu",
    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-06,
    "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0,
}


def _transformer(heads: int, ffn: int, layers: int, channels: int, i2v: bool = False,
                 image_dim: Optional[int] = None) -> Dict[str, Any]:
    """A ``WanTransformer3DModel`` config: 128-wide heads, (1, 2, 2) patches, UMT5's 4096-wide text. ``i2v``: it
    takes the noisy latents, 4 mask channels and the first frame's latents (``2 * channels + 4`` in); ``image_dim``:
    CLIP image embeddings too (Wan 2.1 I2V), through added key/value projections of the hidden width."""
    return {"_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2], "num_attention_heads": heads,
            "attention_head_dim": 128, "in_channels": 2 * channels + 4 if i2v else channels,
            "out_channels": channels, "text_dim": 4096,
            "freq_dim": 256, "ffn_dim": ffn, "num_layers": layers, "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads", "eps": 1e-06, "image_dim": image_dim,
            "added_kv_proj_dim": heads * 128 if image_dim else None, "rope_max_seq_len": 1024}


# The CLIP ViT-H/14 vision tower Wan 2.1 I2V reads the first frame with (open-clip's, as transformers'
# CLIPVisionModel): the transformer takes its penultimate layer's 257 tokens of width 1280.
CLIP_VIT_H_14: Dict[str, Any] = {
    "architectures": ["CLIPVisionModel"], "model_type": "clip_vision_model", "hidden_size": 1280,
    "intermediate_size": 5120, "num_attention_heads": 16, "num_hidden_layers": 32, "image_size": 224,
    "patch_size": 14, "projection_dim": 1024, "hidden_act": "gelu", "layer_norm_eps": 1e-05, "num_channels": 3,
}


def _checkpoint(transformer: Dict[str, Any], vae: Dict[str, Any], flow_shift: float, shards: int,
                expand_timesteps: bool, boundary_ratio: Optional[float] = None,
                pipeline: str = "WanPipeline") -> Dict[str, Any]:
    """One Wan checkpoint in diffusers layout: UniPC with flow sigmas (the pipeline's sampler), UMT5. The values
    are those diffusers' ``scripts/convert_wan_to_diffusers.py`` writes for these checkpoints. With
    ``boundary_ratio``: two experts of the same config (``transformer`` high noise, ``transformer_2`` low).
    ``WanImageToVideoPipeline``: the image encoder and its processor where the transformer takes CLIP embeddings."""
    index = model_index(pipeline, scheduler="diffusers.UniPCMultistepScheduler",
                        text_encoder="transformers.UMT5EncoderModel", tokenizer="transformers.T5TokenizerFast",
                        transformer="diffusers.WanTransformer3DModel", vae="diffusers.AutoencoderKLWan")
    two = boundary_ratio is not None
    index.update(transformer_2=["diffusers", "WanTransformer3DModel"] if two else [None, None],
                 boundary_ratio=boundary_ratio, expand_timesteps=expand_timesteps)
    clip = transformer["image_dim"] is not None
    if pipeline == "WanImageToVideoPipeline":
        index.update(image_encoder=["transformers", "CLIPVisionModel"] if clip else [None, None],
                     image_processor=["transformers", "CLIPImageProcessor"] if clip else [None, None])
    return {
        "model_index.json": index,
        "transformer/config.json": transformer,
        **({"transformer_2/config.json": transformer} if two else {}),
        "text_encoder/config.json": UMT5_XXL_ENCODER,
        **({"image_encoder/config.json": CLIP_VIT_H_14} if clip else {}),
        "vae/config.json": vae,
        "scheduler/scheduler_config.json": {"num_train_timesteps": 1000, "prediction_type": "flow_prediction",
                                            "use_flow_sigmas": True, "flow_shift": flow_shift},
        "_shards": {"transformer": shards, **({"transformer_2": shards} if two else {})},
    }


SPEC = FamilySpec(
    name="wan",
    title="Wan 2.x",
    entry_script="train_wan_lora.py",
    lora_presets=WAN_LORA_PRESETS,
    # "video": one stream of video tokens that cross-attends to the text (the planner's formulas of a joint stream)
    blocks=(BlockGroup("blocks", "video", _BLOCK_LAYOUT, _BLOCK_SAVED),),
    outer_layout=_OUTER_LAYOUT,
    runtime="WanFamily",
    # WanPipeline pads every prompt with zeros to 512 tokens and the transformer attends to all of them.
    text=TextTokens(max_length=512, padded=True, conditions={"prompt_embeds": ("text_dim", True)}),
    hub_configs={
        # Wan-AI/Wan2.1-T2V-1.3B-Diffusers: 12 heads x 128, 30 blocks, the 16-channel 8x Wan 2.1 VAE, 480p's shift 3.
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": _checkpoint(_transformer(12, 8960, 30, 16), WAN21_VAE, 3.0, 1, False),
        # Wan-AI/Wan2.1-T2V-14B-Diffusers: 40 heads x 128, 40 blocks (the transformer each A14B expert repeats), the
        # Wan 2.1 VAE, 480p's shift 3 (diffusers' conversion gives 720p checkpoints 5); 12 shards as the A14B's.
        "Wan-AI/Wan2.1-T2V-14B-Diffusers": _checkpoint(_transformer(40, 13824, 40, 16), WAN21_VAE, 3.0, 12, False),
        # Wan-AI/Wan2.2-TI2V-5B-Diffusers: 24 heads x 128, 30 blocks, the 48-channel 16x Wan 2.2 VAE; its pipeline
        # gives each token its own timestep (expand_timesteps), the same value everywhere for text-to-video.
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers": _checkpoint(_transformer(24, 14336, 30, 48), WAN22_VAE, 5.0, 3, True),
        # Wan-AI/Wan2.2-T2V-A14B-Diffusers: two 14B experts (40 heads x 128, 40 blocks) on the Wan 2.1 VAE; the
        # pipeline runs `transformer` while t >= 0.875 * 1000, then `transformer_2`.
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers": _checkpoint(_transformer(40, 13824, 40, 16), WAN21_VAE, 3.0, 12, False,
                                                        boundary_ratio=0.875),
        # Wan-AI/Wan2.2-I2V-A14B-Diffusers: two 14B experts taking 36 channels (16 noisy + 4 mask + 16 of the first
        # frame), no image encoder; switched at 0.9. Shift 5 as recalled from Wan 2.2's i2v config (not checked
        # against the published scheduler file).
        "Wan-AI/Wan2.2-I2V-A14B-Diffusers": _checkpoint(_transformer(40, 13824, 40, 16, i2v=True), WAN21_VAE, 5.0, 12,
                                                        False, boundary_ratio=0.9, pipeline="WanImageToVideoPipeline"),
        # Wan-AI/Wan2.1-I2V-14B-480P-Diffusers: the 14B with 36 input channels and CLIP ViT-H/14 image embeddings
        # (image_dim 1280, added k/v projections of 5120), diffusers' convert script's config; 480p's shift 3.
        "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": _checkpoint(_transformer(40, 13824, 40, 16, i2v=True, image_dim=1280),
                                                            WAN21_VAE, 3.0, 14, False,
                                                            pipeline="WanImageToVideoPipeline"),
    },
    temporal_compression=4,
    # Wan 2.1 and the A14B experts were trained at 16 fps; TI2V-5B (its residual 48-channel VAE) at 24 fps.
    default_frame_rate=16.0,
    frame_rates=(("is_residual", 24.0),),
    comfyui_names=COMFYUI_NAMES,  # ComfyUI's WanModel keeps the original checkpoints' names
    compile_auto_off="its blocks have not been measured compiled on a GPU yet",
)
