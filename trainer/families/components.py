"""Published configs of components that several families share (text encoders, VAEs), as JSON data.

The family specs assemble their checkpoints' ``hub_configs`` from these, so the memory planner and
the GPU harness can build each component on the meta device without a download. Each comes from the
named repository's ``config.json`` (keys the libraries fill in with their defaults are left out).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

# Qwen/Qwen2.5-VL-7B-Instruct: the text encoder of every Qwen-Image checkpoint and of Kandinsky 5.
QWEN2_5_VL_7B: Dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_act": "silu",
    "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 128000, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
    "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645, "image_token_id": 151655,
    "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
}

# openai/clip-vit-large-patch14's text tower: FLUX.1-dev's text_encoder, Kandinsky 5's text_encoder_2.
CLIP_L_TEXT: Dict[str, Any] = {
    "architectures": ["CLIPTextModel"], "model_type": "clip_text_model", "hidden_act": "quick_gelu",
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "max_position_embeddings": 77, "vocab_size": 49408, "projection_dim": 768, "layer_norm_eps": 1e-05,
    "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1,
}

# google/t5-v1_1-xxl's encoder: FLUX.1-dev's text_encoder_2.
T5_XXL_ENCODER: Dict[str, Any] = {
    "architectures": ["T5EncoderModel"], "model_type": "t5", "d_ff": 10240, "d_kv": 64, "d_model": 4096,
    "num_heads": 64, "num_layers": 24, "num_decoder_layers": 24, "vocab_size": 32128,
    "feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu_new", "is_gated_act": True,
    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-06,
    "is_encoder_decoder": True, "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1,
    "decoder_start_token_id": 0,
}

# black-forest-labs/FLUX.1-dev vae/config.json: the 16-channel VAE of FLUX.1-dev, Kandinsky 5 image
# (scale without shift) and Z-Image (Tongyi-MAI/Z-Image vae/config.json has the same values).
FLUX_VAE: Dict[str, Any] = {
    "_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "in_channels": 3, "out_channels": 3, "latent_channels": 16, "layers_per_block": 2, "norm_num_groups": 32,
    "mid_block_add_attention": True, "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159,
    "force_upcast": True, "use_quant_conv": False, "use_post_quant_conv": False,
}

# black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json: the dynamic shift on; the FLUX.2 checkpoints
# publish the same values.
FLUX_SCHEDULER: Dict[str, Any] = {
    "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
    "base_image_seq_len": 256, "max_image_seq_len": 4096,
}

# Qwen/Qwen-Image vae/config.json (the rest are AutoencoderKLQwenImage's defaults): the VAE of every Qwen-Image
# checkpoint and of Krea 2 (musubi-tuner and ComfyUI: "the same VAE as Qwen-Image").
QWEN_IMAGE_VAE: Dict[str, Any] = {
    "_class_name": "AutoencoderKLQwenImage", "attn_scales": [], "base_dim": 96, "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0, "num_res_blocks": 2, "temperal_downsample": [False, True, True], "z_dim": 16,
}
# Qwen/Qwen-Image scheduler/scheduler_config.json: the Edit checkpoints' is taken to be the same, and
# Qwen-Image-2.1's (ai-toolkit: "matches scheduler/scheduler_config.json in the base repo").
QWEN_IMAGE_SCHEDULER: Dict[str, Any] = {
    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
    "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02,
    "time_shift_type": "exponential", "invert_sigmas": False, "use_karras_sigmas": False,
    "use_exponential_sigmas": False, "use_beta_sigmas": False, "stochastic_sampling": False,
}

# Qwen/Qwen3-4B (Tongyi-MAI/Z-Image(-Turbo) text_encoder/config.json: a Qwen3ForCausalLM checkpoint
# that model_index.json loads as the bare Qwen3Model).
QWEN3_4B: Dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu", "hidden_size": 2560,
    "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000, "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645,
}


def qwen3_vl(hidden: int, intermediate: int, tied: bool, vision_depth: int, vision_hidden: int,
             vision_intermediate: int, deepstack: Tuple[int, ...]) -> Dict[str, Any]:
    """A Qwen/Qwen3-VL-*-Instruct config.json (Krea 2's 4B, Qwen-Image-2.1's 8B text encoder): what differs
    between the sizes is given, what the family shares (36 layers, token ids, interleaved mRoPE, the vision
    tower's patching) is written once here."""
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
        "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "tie_word_embeddings": tied,
        "text_config": {"model_type": "qwen3_vl_text", "hidden_act": "silu", "hidden_size": hidden,
                        "intermediate_size": intermediate, "num_hidden_layers": 36, "num_attention_heads": 32,
                        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": tied,
                        "bos_token_id": 151643, "eos_token_id": 151645,
                        "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20],
                                         "mrope_interleaved": True},
                        "rope_theta": 5000000},
        "vision_config": {"model_type": "qwen3_vl", "depth": vision_depth, "hidden_size": vision_hidden,
                          "intermediate_size": vision_intermediate, "num_heads": 16, "out_hidden_size": hidden,
                          "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
                          "num_position_embeddings": 2304, "deepstack_visual_indexes": list(deepstack),
                          "hidden_act": "gelu_pytorch_tanh"},
    }


def model_index(pipeline: str, **components: str) -> Dict[str, Any]:
    """A ``model_index.json``: ``component="library.Class"`` for each component of ``pipeline``."""
    index: Dict[str, Any] = {"_class_name": pipeline}
    for name, where in components.items():
        library, _, cls = where.partition(".")
        index[name] = [library, cls]
    return index


# Qwen/Qwen3-8B: the text encoder of FLUX.2 [klein] 9B (the 4B model uses QWEN3_4B).
QWEN3_8B: Dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000, "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
}

# mistralai/Mistral-Small-3.2-24B-Instruct-2506: FLUX.2 [dev]'s text encoder (Mistral3ForConditionalGeneration:
# a 40-layer Mistral language model of width 5120 and a Pixtral vision tower the prompt path never runs).
MISTRAL_SMALL_3_24B: Dict[str, Any] = {
    "architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
    "image_token_index": 10, "multimodal_projector_bias": False, "projector_hidden_act": "gelu",
    "spatial_merge_size": 2, "vision_feature_layer": -1,
    "text_config": {"model_type": "mistral", "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 32768,
                    "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                    "vocab_size": 131072, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
                    "rope_theta": 1000000000.0, "tie_word_embeddings": False},
    "vision_config": {"model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096,
                      "num_hidden_layers": 24, "num_attention_heads": 16, "head_dim": 64, "patch_size": 14,
                      "image_size": 1540, "num_channels": 3, "rope_theta": 10000.0, "hidden_act": "silu"},
}

# black-forest-labs/FLUX.2-dev vae/config.json (the klein checkpoints ship the same VAE):
# AutoencoderKLFlux2, 32 latent channels, 2x2 patchified to 128 and normalised by its BatchNorm statistics.
FLUX2_VAE: Dict[str, Any] = {
    "_class_name": "AutoencoderKLFlux2", "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "in_channels": 3, "out_channels": 3, "latent_channels": 32, "layers_per_block": 2, "norm_num_groups": 32,
    "mid_block_add_attention": True, "sample_size": 1024, "use_quant_conv": True, "use_post_quant_conv": True,
    "batch_norm_eps": 0.0001, "batch_norm_momentum": 0.1, "patch_size": [2, 2],
}

# Peak activation of a VAE pass (inference, no grad) per input pixel, in units of (first-level channels x
# bytes per element), for the memory planner: class -> (encode, decode). Traced on fake tensors at 512^2 and
# 1024^2 (the ratio is constant; docs/MEMORY_PLANNER.md). AutoencoderKLFlux2 runs diffusers' same Encoder
# and Decoder as AutoencoderKL (its BatchNorm acts on the small latents): the same factors.
VAE_ACTIVATION_FACTORS: Dict[str, Tuple[float, float]] = {
    "AutoencoderKLQwenImage": (10.1, 18.0),
    "AutoencoderKLQwenImage21": (11.1, 33.5),  # RGBA in and out, five levels, a 144-wide decoder
    "AutoencoderKL": (5.0, 6.0),
    "AutoencoderKLFlux2": (5.0, 6.0),
    # Wan's causal video VAE, per frame of the 4 it handles per step (the planner multiplies by them): traced on
    # fake tensors (Wan 2.1's, bf16), encode 81 frames at 128^2 peaked at 41.3 x base_dim x a per pixel (4 x 10.5),
    # decode 5 latent frames at 256^2 at 53.3 (4 x 13.4). Wan 2.2's 16x VAE traced lower (encode 12.9).
    "AutoencoderKLWan": (10.5, 13.4),
}


# Wan-AI/Wan2.1-*-Diffusers vae/config.json: the 16-channel Wan 2.1 VAE (8x spatial, 4x temporal: a clip of 4k+1
# frames becomes k+1 latent frames), its per-channel statistics as AutoencoderKLWan's defaults hold them.
WAN21_VAE: Dict[str, Any] = {
    "_class_name": "AutoencoderKLWan", "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0,
    "latents_mean": [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517,
                     -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
    "latents_std": [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
                    1.6382, 1.1253, 2.8251, 1.9160],
}

# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json: the 48-channel Wan 2.2 VAE (2x2 pixel patches in, 16x
# spatial, 4x temporal), as diffusers' scripts/convert_wan_to_diffusers.py writes it (less its clip_output: False,
# which diffusers 0.42's AutoencoderKLWan does not take).
WAN22_VAE: Dict[str, Any] = {
    "_class_name": "AutoencoderKLWan", "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48,
    "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [], "temperal_downsample": [False, True, True],
    "dropout": 0.0, "is_residual": True, "in_channels": 12, "out_channels": 12, "patch_size": 2,
    "scale_factor_temporal": 4, "scale_factor_spatial": 16,
    "latents_mean": [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813,
                     0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108,
                     -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313,
                     -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944,
                     0.3573, -0.0548, -0.1681, -0.0667],
    "latents_std": [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
                    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
                    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744],
}
