"""Wan's tiny test model: ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``'s published configs (``spec.py``) with the shrink
overrides below (``python -m utils.tiny_models --family wan``). How a family adds its tiny model:
``trainer/families/qwen_image/tiny.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Mapping, Optional

import torch
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

from trainer.families.wan.spec import SPEC
from utils.tiny_models.derive import pipeline_class, published, published_scheduler, save_pipeline, shrunk_model
from utils.tiny_models.text_encoders import T5_WIDTH, tiny_text_encoder
from utils.tiny_models.tokenizers import build_t5_tokenizer

Z_DIM = 4  # VAE latent channels (the transformer's in and out channels)
TRANSFORMER = dict(num_attention_heads=2, attention_head_dim=16,  # RoPE splits 16 as 8 (frames) + 4 + 4
                   in_channels=Z_DIM, out_channels=Z_DIM, text_dim=T5_WIDTH, freq_dim=32, ffn_dim=32, num_layers=2)
VAE = dict(base_dim=8, z_dim=Z_DIM,
           dim_mult=[1, 2, 2, 2],  # 3 downsamplings: 8x like the published VAE; the last two also 2x in time
           num_res_blocks=1,
           # Not 0/1 so the pipeline's latent (de)normalisation is exercised.
           latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.5, 0.8, 1.2, 2.0])
# Wan 2.2's VAE keeps its layout (2x2 pixel patches in, residual blocks): 3 downsamplings x the patch = 16x.
VAE22 = dict(base_dim=8, decoder_base_dim=8, z_dim=Z_DIM, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
             latents_mean=VAE["latents_mean"], latents_std=VAE["latents_std"])
# tiny name -> the published checkpoint it shrinks (``utils.tiny_models``): TI2V-5B's VAE and per-token timesteps.
# Wan 2.2 T2V-A14B: two experts (``transformer`` high noise, ``transformer_2`` low) switched at its boundary_ratio.
# Image-to-video (WanImageToVideoPipeline): Wan 2.2 I2V-A14B's two experts taking 2 * 4 + 4 channels (noisy, mask,
# first frame), and Wan 2.1 I2V with a tiny CLIP vision tower (its image embeddings' width is the transformer's
# image_dim).
VARIANTS = {"wan22_ti2v": "Wan-AI/Wan2.2-TI2V-5B-Diffusers", "wan22_a14b": "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
            "wan22_i2v_a14b": "Wan-AI/Wan2.2-I2V-A14B-Diffusers", "wan21_i2v": "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"}
CLIP_WIDTH = 16
# CLIP ViT-H/14's layout shrunk: 14-pixel patches of a 28-pixel crop -> 4 patches + the class token.
CLIP = dict(hidden_size=CLIP_WIDTH, intermediate_size=32, num_attention_heads=2, num_hidden_layers=2, image_size=28,
            patch_size=14, projection_dim=8)


def build(out_dir: str | Path, seed: int = 0, checkpoint: Optional[str] = None) -> Path:
    """Build the tiny Wan pipeline into ``out_dir``; loads with ``WanPipeline.from_pretrained``."""
    configs = published(SPEC, checkpoint)
    tokenizer = build_t5_tokenizer()
    index = configs["model_index.json"]
    vae = VAE22 if configs["vae/config.json"].get("is_residual") else VAE
    transformer = dict(TRANSFORMER)
    published_transformer = configs["transformer/config.json"]
    if published_transformer["in_channels"] != published_transformer["out_channels"]:  # I2V: noisy + mask + frame
        transformer["in_channels"] = 2 * Z_DIM + published_transformer["in_channels"] - 2 * published_transformer[
            "out_channels"]
    extra = {}
    if published_transformer.get("image_dim"):  # Wan 2.1 I2V: CLIP image embeddings through added k/v projections
        transformer.update(image_dim=CLIP_WIDTH, added_kv_proj_dim=TRANSFORMER["num_attention_heads"]
                           * TRANSFORMER["attention_head_dim"])
        extra = tiny_image_encoder(configs, seed)
    if "image_encoder" in index:  # WanImageToVideoPipeline's optional components, recorded as absent where so
        extra.setdefault("image_encoder", None)
        extra.setdefault("image_processor", None)
    pipe = pipeline_class(configs)(
        scheduler=published_scheduler(configs), vae=shrunk_model(configs, "vae", seed, **vae),
        text_encoder=tiny_text_encoder(configs, "text_encoder", tokenizer, seed), tokenizer=tokenizer,
        transformer=shrunk_model(configs, "transformer", seed, **transformer),
        # The second expert from another seed: the two predict differently, as the published ones do.
        **({"transformer_2": shrunk_model(configs, "transformer_2", seed + 1, **transformer),
            "boundary_ratio": index["boundary_ratio"]} if "transformer_2/config.json" in configs else {}),
        expand_timesteps=index["expand_timesteps"], **extra)
    return save_pipeline(pipe, out_dir)


def tiny_image_encoder(configs: Mapping[str, Any], seed: int) -> Dict[str, Any]:
    """Wan 2.1 I2V's ``image_encoder`` (CLIP ViT-H/14's config shrunk, random, built offline) and its
    ``image_processor`` (CLIP's resize, centre crop and normalisation at the tiny crop)."""
    config = {k: v for k, v in configs["image_encoder/config.json"].items() if k not in ("architectures",)}
    torch.manual_seed(seed + 2)
    encoder = CLIPVisionModel(CLIPVisionConfig(**{**config, **CLIP}))
    processor = CLIPImageProcessor(size={"shortest_edge": CLIP["image_size"]},
                                   crop_size={"height": CLIP["image_size"], "width": CLIP["image_size"]})
    return {"image_encoder": encoder.eval(), "image_processor": processor}
