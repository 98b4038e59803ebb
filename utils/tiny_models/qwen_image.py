"""Tiny Qwen-Image pipeline: real diffusers/transformers classes, a few hundred kB of random weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from ._common import init_model, save_pipeline
from .tokenizers import build_qwen_tokenizer

TEXT_HIDDEN = 16  # text encoder width == transformer joint_attention_dim
Z_DIM = 4  # VAE latent channels; transformer in_channels = 4 * Z_DIM (2x2 packing)

# Qwen/Qwen-Image's scheduler/scheduler_config.json.
QWEN_IMAGE_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "invert_sigmas": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "stochastic_sampling": False,
}


def tiny_qwen_vl_config(tokenizer) -> Qwen2_5_VLConfig:
    """A 2-layer, 16-wide Qwen2.5-VL with a 1-block vision tower (used by the Edit pipelines)."""
    ids = {
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": TEXT_HIDDEN,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        # head_dim = 16 / 2 = 8 and mRoPE needs 2 * sum(mrope_section) == head_dim.
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [1, 1, 2]},
        **ids,  # the text model reads these from text_config, not from the top level
    }
    vision_config = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": TEXT_HIDDEN,  # the merger projects straight into the text embedding space
        "patch_size": 14,  # the image processor's patch/merge/temporal sizes must match these
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [0],
    }
    return Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        **ids,
    )


def qwen_image_components(seed: int = 0) -> dict[str, Any]:
    """The five components shared by Qwen-Image and Qwen-Image-Edit(-Plus), built deterministically."""
    tokenizer = build_qwen_tokenizer()
    transformer = init_model(
        lambda: QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=4 * Z_DIM,
            out_channels=Z_DIM,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=TEXT_HIDDEN,
            axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
        ),
        seed,
        "transformer",
    )
    vae = init_model(
        lambda: AutoencoderKLQwenImage(
            base_dim=8,
            z_dim=Z_DIM,
            dim_mult=[1, 2, 2, 2],  # the real [1, 2, 4, 4] triples the file size for nothing here
            num_res_blocks=1,
            temperal_downsample=[False, True, True],  # 3 downsamplings: 8x like the real VAE
            # Not 0/1 so the pipelines' latent (de)normalisation is exercised.
            latents_mean=[0.1, -0.2, 0.3, -0.4],
            latents_std=[1.5, 0.8, 1.2, 2.0],
        ),
        seed,
        "vae",
    )
    text_encoder = init_model(
        lambda: Qwen2_5_VLForConditionalGeneration(tiny_qwen_vl_config(tokenizer)), seed, "text_encoder"
    )
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG)
    return {
        "transformer": transformer,
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": scheduler,
    }


def build_tiny_qwen_image(out_dir: str | Path, seed: int = 0) -> Path:
    """Build a tiny Qwen-Image pipeline into `out_dir`; loads with `QwenImagePipeline.from_pretrained`."""
    return save_pipeline(QwenImagePipeline(**qwen_image_components(seed)), out_dir)
