"""Tiny Kandinsky 5 image pipeline (`Kandinsky5T2IPipeline`): Qwen2.5-VL + CLIP text encoders, the
16-channel FLUX-style VAE and the text/visual-block DiT, real classes with a few MB of random weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    Kandinsky5T2IPipeline,
    Kandinsky5Transformer3DModel,
)
from diffusers.utils import logging as diffusers_logging
from transformers import CLIPTextConfig, CLIPTextModel, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ._common import init_model, save_pipeline
from .qwen_image import TEXT_HIDDEN, tiny_qwen_vl_config
from .tokenizers import build_clip_tokenizer, build_qwen_tokenizer
from utils.qwen_processor import Qwen2VLImageTextProcessor, save_qwen_vl_processor

LATENT_CHANNELS = 16  # the FLUX VAE's, as in Kandinsky 5
CLIP_HIDDEN = 32  # == transformer in_text_dim2 (pooled CLIP)
# Kandinsky5T2IPipeline's Qwen template and the number of tokens it drops (copied from diffusers 0.42;
# the tests compare them with the loaded pipeline).
KANDINSKY5_TEMPLATES: dict[str, tuple[str, int]] = {
    "kandinsky5": (
        "<|im_start|>system\nYou are a prompt engineer. Describe the image by detailing the color, shape, size, "
        "texture, quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
        "<|im_start|>user\n{}<|im_end|>",
        40,
    )
}
# Kandinsky 5 T2I samples with scheduler_scale 3.0 and no resolution-dependent shift.
KANDINSKY5_SCHEDULER_CONFIG: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}


def _transformer() -> Kandinsky5Transformer3DModel:
    model = Kandinsky5Transformer3DModel(
        in_visual_dim=LATENT_CHANNELS,
        out_visual_dim=LATENT_CHANNELS,
        in_text_dim=TEXT_HIDDEN,
        in_text_dim2=CLIP_HIDDEN,
        time_dim=16,
        patch_size=(1, 2, 2),
        model_dim=32,
        ff_dim=64,
        num_text_blocks=1,
        num_visual_blocks=2,
        axes_dims=(4, 6, 6),  # head size 16: two heads
        visual_cond=False,  # the text-to-image model
    )
    # Modulation starts at zero (every gate shut, so attention and MLP would get no gradient): the real
    # checkpoint's are trained, give these seeded values.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "modulation" in name:
                param.normal_(std=0.2)
    return model


def build_tiny_kandinsky5(out_dir: str | Path, seed: int = 0) -> Path:
    """Build a tiny Kandinsky 5 T2I pipeline into `out_dir`.

    Its `tokenizer/` is a Qwen2-VL processor, as in the real checkpoint; without torchvision pass it in:
    `Kandinsky5T2IPipeline.from_pretrained(d, tokenizer=load_qwen_vl_processor(d, "tokenizer"))`.
    The pipeline snaps sizes to its `resolutions` list (1024-pixel class): set `pipe.resolutions` to
    render small images.
    """
    tokenizer = build_qwen_tokenizer(KANDINSKY5_TEMPLATES)
    processor = Qwen2VLImageTextProcessor(
        Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2, merge_size=2), tokenizer,
        chat_template=tokenizer.chat_template)
    clip_tokenizer = build_clip_tokenizer()
    clip_config = CLIPTextConfig(
        vocab_size=len(clip_tokenizer),
        hidden_size=CLIP_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        projection_dim=CLIP_HIDDEN,
        max_position_embeddings=clip_tokenizer.model_max_length,  # the pipeline pads CLIP input to 77
        bos_token_id=clip_tokenizer.bos_token_id,
        eos_token_id=clip_tokenizer.eos_token_id,
        pad_token_id=clip_tokenizer.pad_token_id,
    )
    vae = init_model(
        lambda: AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 16, 16),  # 4 levels: the pipeline's fixed 8x
            layers_per_block=1,
            norm_num_groups=8,
            latent_channels=LATENT_CHANNELS,
            sample_size=64,
            scaling_factor=0.3611,  # the FLUX VAE's values; Kandinsky uses the scale and not the shift
            shift_factor=0.1159,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ),
        seed,
        "vae",
    )
    components = dict(
        transformer=init_model(_transformer, seed, "transformer"),
        vae=vae,
        text_encoder=init_model(
            lambda: Qwen2_5_VLForConditionalGeneration(tiny_qwen_vl_config(tokenizer)), seed, "text_encoder"),
        text_encoder_2=init_model(lambda: CLIPTextModel(clip_config), seed, "text_encoder_2"),
        tokenizer_2=clip_tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(**KANDINSKY5_SCHEDULER_CONFIG),
    )
    # The processor is written by hand so model_index.json names the standard class, not the helper
    # (diffusers warns that tokenizer=None "cannot be saved": expected, hence the quieter logging).
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        out = save_pipeline(Kandinsky5T2IPipeline(**components, tokenizer=None), out_dir)
    finally:
        diffusers_logging.set_verbosity(verbosity)
    save_qwen_vl_processor(processor, out / "tokenizer")
    index = json.loads((out / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "Qwen2VLProcessor"]
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out
