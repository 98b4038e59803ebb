"""Tiny Krea 2 pipeline: real diffusers/transformers classes (Qwen3-VL text encoder tapped at several layers,
Qwen-Image's VAE, Krea 2's single-stream DiT with GQA and text fusion), about a megabyte of random weights.

Its facts differ on purpose from the published model's (taps ``(1, 2, 3)`` of 3 layers, not 12 of 36; a 4-channel
VAE with its own latent statistics), so a family that reads a constant instead of the checkpoint's config fails
the tests; the scheduler is the published one (the shift tests check the real model's)."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline, Krea2Transformer2DModel
from transformers import Qwen3VLConfig, Qwen3VLModel

from ._common import init_model, save_pipeline
from .tokenizers import build_qwen_tokenizer

TEXT_HIDDEN = 16  # Qwen3-VL width == transformer text_hidden_dim
TEXT_TAPS = (1, 2, 3)  # hidden states stacked per token (0 is the embedding output)
Z_DIM = 4  # VAE latent channels; transformer in_channels = 4 * Z_DIM (2x2 packing)
# The published scheduler's shift settings (trainer/families/krea2/spec.py; a test holds them equal).
KREA2_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "use_dynamic_shifting": True, "base_shift": 0.5,
                          "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 6400}


def tiny_qwen3_vl_config(tokenizer, layers: int) -> Qwen3VLConfig:
    """A ``layers``-layer, 16-wide Qwen3-VL with a 1-block vision tower (never run for text)."""
    ids = {"bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"), "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    special = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    return Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=TEXT_HIDDEN, intermediate_size=32,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=4096,
                         # interleaved mRoPE: 2 * sum(mrope_section) == head_dim
                         rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                          "mrope_section": [2, 1, 1], "mrope_interleaved": True}, **ids),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT_HIDDEN,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0]),
        tie_word_embeddings=True, **special, **ids)


def _transformer() -> Krea2Transformer2DModel:
    model = Krea2Transformer2DModel(
        in_channels=4 * Z_DIM, num_layers=2, attention_head_dim=16, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=32, timestep_embed_dim=16, text_hidden_dim=TEXT_HIDDEN, num_text_layers=len(TEXT_TAPS),
        text_num_attention_heads=2, text_num_key_value_heads=1, text_intermediate_size=32,
        num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 6, 6), rope_theta=1000.0)
    # Krea 2 zero-initialises every modulation table and norm weight: random ones, so tests see them act.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "scale_shift_table" in name or "norm" in name.rsplit(".", 2)[-2]:
                param.normal_(std=0.1)
    return model


def build_tiny_krea2(out_dir: str | Path, seed: int = 0, distilled: bool = False) -> Path:
    """Build a tiny Krea 2 pipeline into ``out_dir``; loads with ``Krea2Pipeline.from_pretrained``.
    ``distilled``: a Turbo-like checkpoint (``is_distilled: true`` in model_index.json)."""
    tokenizer = build_qwen_tokenizer()  # its Qwen-Image template is Krea 2's 34-token prefix
    vae = init_model(lambda: AutoencoderKLQwenImage(
        base_dim=8, z_dim=Z_DIM, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True],
        # not 0/1, and not Qwen-Image's tiny values: the normalisation must come from this file
        latents_mean=[-0.3, 0.25, 0.05, -0.15], latents_std=[0.7, 1.9, 1.1, 1.4]), seed, "vae")
    pipe = Krea2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**KREA2_SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=init_model(lambda: Qwen3VLModel(tiny_qwen3_vl_config(tokenizer, max(TEXT_TAPS))), seed,
                                "text_encoder"),
        tokenizer=tokenizer,
        transformer=init_model(_transformer, seed, "transformer"),
        text_encoder_select_layers=TEXT_TAPS,
        is_distilled=distilled,
    )
    return save_pipeline(pipe, out_dir)
