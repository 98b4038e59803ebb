"""Tiny FLUX.1-dev pipeline: real diffusers/transformers classes, under 1 MB of random weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from ._common import init_model, save_pipeline
from .tokenizers import build_clip_tokenizer, build_t5_tokenizer

LATENT_CHANNELS = 16  # as FLUX's VAE; transformer in_channels = 4 * 16 (2x2 packing)
CLIP_HIDDEN = 32  # == transformer pooled_projection_dim
T5_HIDDEN = 32  # == transformer joint_attention_dim

# black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json.
FLUX_DEV_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


def build_tiny_flux(out_dir: str | Path, seed: int = 0) -> Path:
    """Build a tiny FLUX.1-dev-style pipeline (guidance-distilled) into `out_dir`; loads with `FluxPipeline`."""
    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_t5_tokenizer()
    transformer = init_model(
        lambda: FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * LATENT_CHANNELS,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=T5_HIDDEN,
            pooled_projection_dim=CLIP_HIDDEN,
            guidance_embeds=True,  # FLUX.1-dev takes the guidance scale as an input
            axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
        ),
        seed,
        "transformer",
    )
    vae = init_model(
        lambda: AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(8, 16),  # 2 levels: the pipeline's vae_scale_factor is 2
            layers_per_block=1,
            norm_num_groups=8,
            latent_channels=LATENT_CHANNELS,
            sample_size=32,
            scaling_factor=0.3611,  # FLUX's VAE values, so the (de)normalisation is exercised
            shift_factor=0.1159,
            use_quant_conv=False,  # FLUX's VAE has neither
            use_post_quant_conv=False,
        ),
        seed,
        "vae",
    )
    clip_config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=CLIP_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        projection_dim=CLIP_HIDDEN,
        max_position_embeddings=tokenizer.model_max_length,  # the pipeline pads CLIP input to 77
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,  # pooling looks for this id (not 2, the legacy argmax path)
        pad_token_id=tokenizer.pad_token_id,
    )
    text_encoder = init_model(lambda: CLIPTextModel(clip_config), seed, "text_encoder")
    t5_config = T5Config(
        vocab_size=len(tokenizer_2),
        d_model=T5_HIDDEN,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",  # T5 v1.1, as in FLUX's text_encoder_2
        is_encoder_decoder=False,
        pad_token_id=tokenizer_2.pad_token_id,
        eos_token_id=tokenizer_2.eos_token_id,
        decoder_start_token_id=tokenizer_2.pad_token_id,
    )
    text_encoder_2 = init_model(lambda: T5EncoderModel(t5_config), seed, "text_encoder_2")
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    return save_pipeline(pipe, out_dir)
