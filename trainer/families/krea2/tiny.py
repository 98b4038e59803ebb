"""Krea 2's tiny test model: ``krea/Krea-2-Raw``'s published configs (``spec.py``) with the shrink overrides
below (``python -m utils.tiny_models --family krea2``). ``VARIANTS`` adds the Turbo-like one.

Its facts differ on purpose from the published model's: taps ``(1, 2, 3)`` of a 3-layer encoder (not 12 of
36), a 4-channel VAE with its own latent statistics; a family that read a constant instead of the checkpoint's
configs would fail the tests. The scheduler is the published one (the shift tests check the real model's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from trainer.families.krea2.spec import SPEC
from utils.tiny_models.derive import pipeline_class, published, published_scheduler, save_pipeline, shrunk_model
from utils.tiny_models.text_encoders import QWEN_WIDTH, tiny_text_encoder
from utils.tiny_models.tokenizers import QWEN_IMAGE_TEMPLATE, build_qwen_tokenizer

VARIANTS = {"krea2_turbo": "krea/Krea-2-Turbo"}  # is_distilled: true
TEXT_TAPS = (1, 2, 3)  # hidden states stacked per token (0 is the embedding output)
Z_DIM = 4  # VAE latent channels; the transformer packs 2x2 of them: in_channels 16
TRANSFORMER = dict(in_channels=4 * Z_DIM, num_layers=2, attention_head_dim=16, num_attention_heads=2,
                   num_key_value_heads=1,  # GQA, as the published 48 / 12 heads
                   intermediate_size=32, timestep_embed_dim=16, text_hidden_dim=QWEN_WIDTH,
                   num_text_layers=len(TEXT_TAPS), text_num_attention_heads=2, text_num_key_value_heads=1,
                   text_intermediate_size=32, num_layerwise_text_blocks=1, num_refiner_text_blocks=1,
                   axes_dims_rope=(4, 6, 6))  # sums to attention_head_dim
VAE = dict(base_dim=8, z_dim=Z_DIM, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
           # not 0/1, and not the Qwen-Image tiny model's: the normalisation must come from this file
           latents_mean=[-0.3, 0.25, 0.05, -0.15], latents_std=[0.7, 1.9, 1.1, 1.4])


def _randomise_modulation(model: Any) -> None:
    """Krea 2 zero-initialises every modulation table and norm weight: random ones, so tests see them act."""
    for name, param in model.named_parameters():
        if "scale_shift_table" in name or "norm" in name.rsplit(".", 2)[-2]:
            param.normal_(std=0.1)


def build(out_dir: str | Path, seed: int = 0, checkpoint: Optional[str] = None) -> Path:
    """Build the tiny Krea 2 pipeline into ``out_dir``; loads with ``Krea2Pipeline.from_pretrained``."""
    configs = published(SPEC, checkpoint)
    # Krea 2's system prefix is Qwen-Image's template's (its spec's drop length).
    tokenizer = build_qwen_tokenizer(drops={QWEN_IMAGE_TEMPLATE: SPEC.text.template})
    index = configs["model_index.json"]
    pipe = pipeline_class(configs)(
        scheduler=published_scheduler(configs), vae=shrunk_model(configs, "vae", seed, **VAE),
        text_encoder=tiny_text_encoder(configs, "text_encoder", tokenizer, seed, num_hidden_layers=max(TEXT_TAPS)),
        tokenizer=tokenizer,
        transformer=shrunk_model(configs, "transformer", seed, seed_more=_randomise_modulation, **TRANSFORMER),
        text_encoder_select_layers=TEXT_TAPS, is_distilled=index["is_distilled"], patch_size=index["patch_size"])
    return save_pipeline(pipe, out_dir)
