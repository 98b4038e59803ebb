"""Qwen-Image-2.1's tiny test model: ``Qwen/Qwen-Image-2.1``'s published configs (``spec.py``) with the shrink
overrides below (``python -m utils.tiny_models --family qwen_image21``), and the ``processor/`` folder of a
Qwen3-VL processor written in the real layout (load it with ``utils.qwen_processor.load_qwen_vl_processor``:
without torchvision the pipeline needs it passed in).

Its facts differ on purpose from the published model's: 8 latent channels (not 64) with their own statistics, a
16-wide encoder; a family that read a constant instead of the checkpoint's configs would fail the tests. The
VAE stays 16x and RGBA (the pipeline hardcodes 16x); the scheduler is the published one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from trainer.families.qwen_image21.spec import PROCESSOR, SPEC
from utils.qwen_processor import Qwen3VLImageTextProcessor, record_standard_processor, save_qwen_vl_processor
from utils.tiny_models.derive import pipeline_class, published, published_scheduler, save_pipeline, shrunk_model
from utils.tiny_models.text_encoders import QWEN_WIDTH, tiny_text_encoder
from utils.tiny_models.tokenizers import build_qwen_tokenizer

Z_DIM = 8  # VAE latent channels == the transformer's in/out channels (unpatched)
TRANSFORMER = dict(in_channels=Z_DIM, out_channels=Z_DIM, num_layers=2, attention_head_dim=16, num_attention_heads=2,
                   context_in_dim=QWEN_WIDTH, axes_dims_rope=(4, 6, 6))  # sums to attention_head_dim
VAE = dict(base_dim=8, decoder_base_dim=12, z_dim=Z_DIM,
           dim_mult=[1, 1, 2, 2, 2],  # five levels, four downsamplings: the 16x the pipeline assumes
           num_res_blocks=1,
           # not 0/1, and not the published ones: the normalisation must come from this file
           latents_mean=[0.1 * (i - 4) for i in range(Z_DIM)], latents_std=[0.5 + 0.25 * i for i in range(Z_DIM)])
# One <|image_pad|> per 32x32 px, as published; references of 32^2..1024^2 px pass the processor unchanged (the
# pipeline's default output_resolution sizes them at 1024^2).
IMAGE_SIZE = {"shortest_edge": 32 * 32, "longest_edge": 1024 * 1024}


def build(out_dir: str | Path, seed: int = 0, checkpoint: Optional[str] = None) -> Path:
    """Build the tiny Qwen-Image-2.1 pipeline into ``out_dir``; loads with ``QwenImage21Pipeline.from_pretrained(d,
    processor=load_qwen_vl_processor(d))``."""
    configs = published(SPEC, checkpoint)
    tokenizer = build_qwen_tokenizer()
    published_processor = {k: v for k, v in PROCESSOR.items() if k in ("patch_size", "temporal_patch_size",
                                                                      "merge_size", "image_mean", "image_std")}
    processor = Qwen3VLImageTextProcessor(Qwen2VLImageProcessorPil(size=IMAGE_SIZE, **published_processor),
                                          tokenizer, chat_template=tokenizer.chat_template)
    pipe = pipeline_class(configs)(
        scheduler=published_scheduler(configs), vae=shrunk_model(configs, "vae", seed, **VAE),
        text_encoder=tiny_text_encoder(configs, "text_encoder", tokenizer, seed, tie_word_embeddings=False),
        processor=processor, transformer=shrunk_model(configs, "transformer", seed, **TRANSFORMER),
        sample_sigmas=configs["model_index.json"].get("sample_sigmas"))
    out = save_pipeline(pipe, out_dir)
    # Written again by hand so the folder and model_index.json name the standard Qwen3VLProcessor, not the helper.
    save_qwen_vl_processor(processor, out / "processor")
    record_standard_processor(out, name="Qwen3VLProcessor")
    return out
