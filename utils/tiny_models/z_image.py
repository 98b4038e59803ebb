"""Tiny Z-Image pipeline: real diffusers/transformers classes (Qwen3 text encoder, 16-channel VAE,
single-stream DiT), a few MB of random weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from transformers import Qwen3Config, Qwen3Model

from ._common import init_model, save_pipeline
from .tokenizers import build_qwen_tokenizer

TEXT_HIDDEN = 16  # Qwen3 width == transformer cap_feat_dim
LATENT_CHANNELS = 16  # as the FLUX VAE Z-Image uses

# Tongyi-MAI/Z-Image-Turbo scheduler/scheduler_config.json: a fixed shift, no resolution dependence.
Z_IMAGE_SCHEDULER_CONFIG: dict[str, Any] = {"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 3.0}

# Qwen3's chat template reduced to what ZImagePipeline uses: one user turn, the generation prompt, and the
# empty think block that `enable_thinking=False` adds (the pipeline passes True: no block).
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def _transformer() -> ZImageTransformer2DModel:
    model = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=LATENT_CHANNELS,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=TEXT_HIDDEN,
        axes_dims=[4, 6, 6],  # sums to the head size 32 / 2
        axes_lens=[1024, 128, 128],
    )
    # The pad tokens start as torch.empty (garbage, sometimes NaN): give them seeded values.
    with torch.no_grad():
        model.x_pad_token.normal_(std=0.02)
        model.cap_pad_token.normal_(std=0.02)
    return model


def build_tiny_z_image(out_dir: str | Path, seed: int = 0) -> Path:
    """Build a tiny Z-Image pipeline into `out_dir`; loads with `ZImagePipeline.from_pretrained`."""
    tokenizer = build_qwen_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    vae = init_model(
        lambda: AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 16, 16),  # 4 levels: 8x like the real VAE (the pipeline reads it)
            layers_per_block=1,
            norm_num_groups=8,
            latent_channels=LATENT_CHANNELS,
            sample_size=64,
            scaling_factor=0.3611,  # the FLUX VAE's values, so the (de)normalisation is exercised
            shift_factor=0.1159,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ),
        seed,
        "vae",
    )
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_HIDDEN,
        intermediate_size=32,
        num_hidden_layers=2,  # the pipeline reads hidden_states[-2]
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**Z_IMAGE_SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=init_model(lambda: Qwen3Model(config), seed, "text_encoder"),
        tokenizer=tokenizer,
        transformer=init_model(_transformer, seed, "transformer"),
    )
    return save_pipeline(pipe, out_dir)
