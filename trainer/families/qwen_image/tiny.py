"""Qwen-Image's tiny test model: ``Qwen/Qwen-Image``'s published configs (``spec.py``) with the shrink
overrides below, built with the real classes (``python -m utils.tiny_models --family qwen_image``).

A family adds its tiny model the same way: a ``tiny.py`` beside its ``spec.py`` with ``build(out_dir, seed,
checkpoint=None)`` (``utils.tiny_models`` finds it by this path; ``VARIANTS`` names extra tiny models built
from other published checkpoints of the same family).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from trainer.families.qwen_image.spec import SPEC
from utils.tiny_models.derive import pipeline_class, published, published_scheduler, save_pipeline, shrunk_model
from utils.tiny_models.text_encoders import QWEN_WIDTH, tiny_text_encoder
from utils.tiny_models.tokenizers import QWEN_IMAGE_TEMPLATE, build_qwen_tokenizer

Z_DIM = 4  # VAE latent channels; the transformer packs 2x2 of them: in_channels 16
TRANSFORMER = dict(in_channels=4 * Z_DIM, out_channels=Z_DIM, num_layers=2, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=QWEN_WIDTH,
                   axes_dims_rope=(4, 6, 6))  # sums to attention_head_dim
VAE = dict(base_dim=8, z_dim=Z_DIM,
           dim_mult=[1, 2, 2, 2],  # the published [1, 2, 4, 4] triples the file size for nothing here
           num_res_blocks=1,
           # Not 0/1 so the pipelines' latent (de)normalisation is exercised.
           latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.5, 0.8, 1.2, 2.0])


def qwen_components(configs: Any, seed: int, drops: Optional[Mapping[str, int]] = None) -> dict[str, Any]:
    """The five components every Qwen-Image(-Edit) checkpoint shares, shrunk from ``configs``; ``drops``: the
    prompt templates' drop lengths the tokenizer must keep (default Qwen-Image's, from its spec)."""
    tokenizer = build_qwen_tokenizer(drops={QWEN_IMAGE_TEMPLATE: SPEC.text.template} if drops is None else drops)
    return {"transformer": shrunk_model(configs, "transformer", seed, **TRANSFORMER),
            "vae": shrunk_model(configs, "vae", seed, **VAE),
            "text_encoder": tiny_text_encoder(configs, "text_encoder", tokenizer, seed),
            "tokenizer": tokenizer, "scheduler": published_scheduler(configs)}


def build(out_dir: str | Path, seed: int = 0, checkpoint: Optional[str] = None) -> Path:
    """Build the tiny Qwen-Image pipeline into ``out_dir``; loads with ``QwenImagePipeline.from_pretrained``."""
    configs = published(SPEC, checkpoint)
    return save_pipeline(pipeline_class(configs)(**qwen_components(configs, seed)), out_dir)
