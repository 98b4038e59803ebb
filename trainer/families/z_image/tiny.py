"""Z-Image's tiny test model: ``Tongyi-MAI/Z-Image-Turbo``'s published configs (``spec.py``) with the
shrink overrides below. How a family adds its tiny model: ``trainer/families/qwen_image/tiny.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from trainer.families.z_image.spec import SPEC
from utils.tiny_models.derive import pipeline_class, published, published_scheduler, save_pipeline, shrunk_model
from utils.tiny_models.text_encoders import QWEN_WIDTH, tiny_text_encoder
from utils.tiny_models.tokenizers import QWEN3_CHAT_TEMPLATE, build_qwen_tokenizer

TRANSFORMER = dict(dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=QWEN_WIDTH,
                   axes_dims=[4, 6, 6],  # sums to the head size 32 / 2
                   axes_lens=[1024, 128, 128])
VAE = dict(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
           block_out_channels=(8, 8, 16, 16),  # 4 levels: 8x like the real VAE (the pipeline reads it)
           layers_per_block=1, norm_num_groups=8, sample_size=64)


def _seed_pad_tokens(model: Any) -> None:
    """The pad tokens start as torch.empty (garbage, sometimes NaN): give them seeded values."""
    model.x_pad_token.normal_(std=0.02)
    model.cap_pad_token.normal_(std=0.02)


def build(out_dir: str | Path, seed: int = 0, checkpoint: Optional[str] = None) -> Path:
    """Build the tiny Z-Image pipeline into ``out_dir``; loads with ``ZImagePipeline.from_pretrained``."""
    configs = published(SPEC, checkpoint)
    tokenizer = build_qwen_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    pipe = pipeline_class(configs)(
        scheduler=published_scheduler(configs), vae=shrunk_model(configs, "vae", seed, **VAE),
        text_encoder=tiny_text_encoder(configs, "text_encoder", tokenizer, seed,
                                       num_hidden_layers=2),  # the pipeline reads hidden_states[-2]
        tokenizer=tokenizer,
        transformer=shrunk_model(configs, "transformer", seed, seed_more=_seed_pad_tokens, **TRANSFORMER))
    return save_pipeline(pipe, out_dir)
