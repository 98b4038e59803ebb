"""Tiny FLUX.2 [klein] base pipeline: real diffusers/transformers classes (Qwen3 text encoder deep enough for
the 9/18/27 hidden states, FLUX.2's BatchNorm-normalised VAE, one double and one single block)."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
from transformers import Qwen3Config, Qwen3ForCausalLM

from ._common import init_model, save_pipeline
from .tokenizers import build_qwen_tokenizer
from .z_image import QWEN3_CHAT_TEMPLATE

TEXT_HIDDEN = 16  # Qwen3 width; the prompt embedding stacks three layers: joint_attention_dim 48
TEXT_LAYERS = 28  # Flux2KleinPipeline reads hidden_states[27]
LATENT_CHANNELS = 4  # patchified 2x2 -> transformer in_channels 16

# The FLUX.2 checkpoints' scheduler (trainer/families/flux2/spec.py holds the published copy).
FLUX2_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True,
                          "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}


def _vae() -> AutoencoderKLFlux2:
    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),  # 2 levels: the pipeline's vae_scale_factor is 2
        layers_per_block=1,
        norm_num_groups=8,
        latent_channels=LATENT_CHANNELS,
        sample_size=32,
    )
    # Non-trivial BatchNorm statistics, so the latent normalisation is exercised (a fresh one is 0 / 1).
    with torch.no_grad():
        vae.bn.running_mean.normal_(std=0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def _transformer(guidance_embeds: bool) -> Flux2Transformer2DModel:
    """The tiny FLUX.2 transformer of both builders (text width: three stacked hidden states)."""
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * TEXT_HIDDEN,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),  # sums to attention_head_dim
        guidance_embeds=guidance_embeds,
    )


def build_tiny_flux2(out_dir: str | Path, seed: int = 0) -> Path:
    """Build a tiny FLUX.2 [klein] base pipeline into `out_dir`; loads with `Flux2KleinPipeline`."""
    tokenizer = build_qwen_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    transformer = init_model(lambda: _transformer(guidance_embeds=False), seed, "transformer")  # klein: no guidance
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_HIDDEN,
        intermediate_size=32,
        num_hidden_layers=TEXT_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER_CONFIG),
        vae=init_model(_vae, seed, "vae"),
        text_encoder=init_model(lambda: Qwen3ForCausalLM(config), seed, "text_encoder"),
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=False,  # the base model: real CFG at render time
    )
    return save_pipeline(pipe, out_dir)


# A chat template for the tiny [dev] tokenizer: Flux2Pipeline sends [system, user] turns whose content is a
# list of {"type": "text"} parts (Mistral-Small-3's own template renders them with [SYSTEM_PROMPT] / [INST]).
MISTRAL_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}{% set parts = [message['content']] %}"
    "{% else %}{% set parts = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| list %}{% endif %}{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ parts | join('') }}[/SYSTEM_PROMPT]"
    "{% else %}[INST]{{ parts | join('') }}[/INST]{% endif %}{% endfor %}"
)


def build_tiny_flux2_dev(out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny FLUX.2 [dev]-style pipeline (``Flux2Pipeline``): a Mistral-3 text encoder deep enough for the
    10/20/30 hidden states and a guidance-embedding transformer, the klein builder's VAE. The tokenizer is a
    plain tokenizer with a chat template: the real checkpoint's PixtralProcessor needs torchvision, and the
    prompt path uses only its tokenizer (what the family loads)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    from diffusers import Flux2Pipeline

    tokenizer = build_qwen_tokenizer()
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    text = MistralConfig(vocab_size=len(tokenizer), hidden_size=TEXT_HIDDEN, intermediate_size=32, num_hidden_layers=31,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=8, patch_size=14, image_size=56)
    config = Mistral3Config(text_config=text, vision_config=vision, spatial_merge_size=2)
    transformer = init_model(lambda: _transformer(guidance_embeds=True), seed, "transformer")  # dev embeds it
    pipe = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER_CONFIG),
        vae=init_model(_vae, seed, "vae"),
        text_encoder=init_model(lambda: Mistral3ForConditionalGeneration(config), seed, "text_encoder"),
        tokenizer=tokenizer,
        transformer=transformer,
    )
    return save_pipeline(pipe, out_dir)
