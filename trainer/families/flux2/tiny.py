"""FLUX.2's tiny test models: ``black-forest-labs/FLUX.2-klein-base-4B``'s published configs (``spec.py``)
with the shrink overrides below; ``build_tiny_flux2_dev`` shrinks ``FLUX.2-dev`` the same way (Mistral-3
encoder, guidance embedding). How a family adds its tiny model: ``trainer/families/qwen_image/tiny.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from trainer.families.flux2.spec import SPEC
from utils.tiny_models.derive import pipeline_class, published, published_scheduler, save_pipeline, shrunk_model
from utils.tiny_models.text_encoders import QWEN_WIDTH, tiny_text_encoder
from utils.tiny_models.tokenizers import MISTRAL_CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE, build_qwen_tokenizer

LATENT_CHANNELS = 4  # patchified 2x2 -> transformer in_channels 16
TRANSFORMER = dict(in_channels=4 * LATENT_CHANNELS, num_layers=1, num_single_layers=1, attention_head_dim=16,
                   num_attention_heads=2,
                   joint_attention_dim=3 * QWEN_WIDTH,  # the prompt embedding stacks three hidden states
                   timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4))  # sums to attention_head_dim
VAE = dict(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
           block_out_channels=(8, 16),  # 2 levels: the pipeline's vae_scale_factor is 2
           layers_per_block=1, norm_num_groups=8, latent_channels=LATENT_CHANNELS, sample_size=32)
KLEIN_TEXT_LAYERS = 28  # Flux2KleinPipeline reads hidden_states[27]
DEV_TEXT_LAYERS = 31  # Flux2Pipeline reads hidden_states[30]


def _seed_batch_norm(vae: Any) -> None:
    """Non-trivial BatchNorm statistics, so the latent normalisation is exercised (a fresh one is 0 / 1)."""
    vae.bn.running_mean.normal_(std=0.5)
    vae.bn.running_var.uniform_(0.5, 2.0)


def build(out_dir: str | Path, seed: int = 0, checkpoint: Optional[str] = None) -> Path:
    """Build the tiny FLUX.2 [klein] base pipeline into ``out_dir``; loads with ``Flux2KleinPipeline``."""
    configs = published(SPEC, checkpoint)
    tokenizer = build_qwen_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    pipe = pipeline_class(configs)(
        scheduler=published_scheduler(configs),
        vae=shrunk_model(configs, "vae", seed, seed_more=_seed_batch_norm, **VAE),
        text_encoder=tiny_text_encoder(configs, "text_encoder", tokenizer, seed, num_hidden_layers=KLEIN_TEXT_LAYERS,
                                       tie_word_embeddings=True),
        tokenizer=tokenizer, transformer=shrunk_model(configs, "transformer", seed, **TRANSFORMER),
        is_distilled=configs["model_index.json"]["is_distilled"])  # the base model: real CFG at render time
    return save_pipeline(pipe, out_dir)


def build_tiny_flux2_dev(out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny FLUX.2 [dev] pipeline (``Flux2Pipeline``). Its tokenizer is a plain tokenizer with a chat
    template: the real checkpoint's PixtralProcessor needs torchvision, and the prompt path uses only its
    tokenizer (what the family loads)."""
    configs = published(SPEC, "black-forest-labs/FLUX.2-dev")
    tokenizer = build_qwen_tokenizer()
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    pipe = pipeline_class(configs)(
        scheduler=published_scheduler(configs),
        vae=shrunk_model(configs, "vae", seed, seed_more=_seed_batch_norm, **VAE),
        text_encoder=tiny_text_encoder(configs, "text_encoder", tokenizer, seed, num_hidden_layers=DEV_TEXT_LAYERS),
        tokenizer=tokenizer, transformer=shrunk_model(configs, "transformer", seed, **TRANSFORMER))
    return save_pipeline(pipe, out_dir)
