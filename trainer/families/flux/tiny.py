"""FLUX.1-dev's tiny test model: ``black-forest-labs/FLUX.1-dev``'s published configs (``spec.py``) with
the shrink overrides below (guidance embedding, scheduler and VAE scaling stay the published ones).
How a family adds its tiny model: ``trainer/families/qwen_image/tiny.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from trainer.families.flux.spec import SPEC
from utils.tiny_models.derive import pipeline_class, published, published_scheduler, save_pipeline, shrunk_model
from utils.tiny_models.text_encoders import CLIP_WIDTH, T5_WIDTH, tiny_text_encoder
from utils.tiny_models.tokenizers import build_clip_tokenizer, build_t5_tokenizer

TRANSFORMER = dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                   joint_attention_dim=T5_WIDTH, pooled_projection_dim=CLIP_WIDTH,
                   axes_dims_rope=(4, 6, 6))  # sums to attention_head_dim
VAE = dict(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
           block_out_channels=(8, 16),  # 2 levels: the pipeline's vae_scale_factor is 2
           layers_per_block=1, norm_num_groups=8, sample_size=32)


def build(out_dir: str | Path, seed: int = 0, checkpoint: Optional[str] = None) -> Path:
    """Build the tiny FLUX.1-dev pipeline into ``out_dir``; loads with ``FluxPipeline.from_pretrained``."""
    configs = published(SPEC, checkpoint)
    tokenizer, tokenizer_2 = build_clip_tokenizer(), build_t5_tokenizer()
    pipe = pipeline_class(configs)(
        scheduler=published_scheduler(configs),
        vae=shrunk_model(configs, "vae", seed, **VAE),
        text_encoder=tiny_text_encoder(configs, "text_encoder", tokenizer, seed), tokenizer=tokenizer,
        text_encoder_2=tiny_text_encoder(configs, "text_encoder_2", tokenizer_2, seed), tokenizer_2=tokenizer_2,
        transformer=shrunk_model(configs, "transformer", seed, **TRANSFORMER))
    return save_pipeline(pipe, out_dir)
