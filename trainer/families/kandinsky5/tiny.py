"""Kandinsky 5 image's tiny test model: ``Kandinsky-5.0-T2I-Lite``'s published configs (``spec.py``) with
the shrink overrides below. Its ``tokenizer/`` is a Qwen2-VL processor, as in the real checkpoint; without
torchvision pass it in: ``Kandinsky5T2IPipeline.from_pretrained(d, tokenizer=load_qwen_vl_processor(d,
"tokenizer"))``. The pipeline snaps sizes to its ``resolutions`` list (1024-pixel class): set
``pipe.resolutions`` to render small images. How a family adds its tiny model:
``trainer/families/qwen_image/tiny.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from trainer.families.kandinsky5.spec import SPEC
from utils.qwen_processor import Qwen2VLImageTextProcessor, record_standard_processor, save_qwen_vl_processor
from utils.tiny_models.derive import pipeline_class, published, published_scheduler, save_pipeline, shrunk_model
from utils.tiny_models.text_encoders import CLIP_WIDTH, QWEN_WIDTH, tiny_text_encoder
from utils.tiny_models.tokenizers import build_clip_tokenizer, build_qwen_tokenizer

# Kandinsky5T2IPipeline's Qwen template (copied from diffusers 0.42; the tests compare it with the loaded
# pipeline). The tokens it drops are the spec's (`TextTokens.template`).
KANDINSKY5_TEMPLATE = (
    "<|im_start|>system\nYou are a prompt engineer. Describe the image by detailing the color, shape, size, "
    "texture, quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>")
# The spec holds no published scheduler config for this checkpoint: T2I samples with scheduler_scale 3.0
# and no resolution-dependent shift.
SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}
TRANSFORMER = dict(in_text_dim=QWEN_WIDTH, in_text_dim2=CLIP_WIDTH, time_dim=16, model_dim=32, ff_dim=64,
                   num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 6, 6))  # head size 16: two heads
VAE = dict(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
           block_out_channels=(8, 8, 16, 16),  # 4 levels: the pipeline's fixed 8x
           layers_per_block=1, norm_num_groups=8, sample_size=64)


def _seed_modulation(model: Any) -> None:
    """Modulation starts at zero (every gate shut, so attention and MLP would get no gradient): the real
    checkpoint's are trained, give these seeded values."""
    for name, param in model.named_parameters():
        if "modulation" in name:
            param.normal_(std=0.2)


def build(out_dir: str | Path, seed: int = 0, checkpoint: Optional[str] = None) -> Path:
    """Build the tiny Kandinsky 5 T2I pipeline into ``out_dir``."""
    configs = published(SPEC, checkpoint)
    tokenizer = build_qwen_tokenizer((KANDINSKY5_TEMPLATE,), drops={KANDINSKY5_TEMPLATE: SPEC.text.template})
    processor = Qwen2VLImageTextProcessor(
        Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2, merge_size=2), tokenizer,
        chat_template=tokenizer.chat_template)
    clip_tokenizer = build_clip_tokenizer()
    pipe = pipeline_class(configs)(
        transformer=shrunk_model(configs, "transformer", seed, seed_more=_seed_modulation, **TRANSFORMER),
        vae=shrunk_model(configs, "vae", seed, **VAE),
        text_encoder=tiny_text_encoder(configs, "text_encoder", tokenizer, seed),
        text_encoder_2=tiny_text_encoder(configs, "text_encoder_2", clip_tokenizer, seed),
        tokenizer=None,  # the processor is written by hand below, so model_index.json names the standard class
        tokenizer_2=clip_tokenizer, scheduler=published_scheduler(configs, **SCHEDULER))
    out = save_pipeline(pipe, out_dir)
    save_qwen_vl_processor(processor, out / "tokenizer")
    record_standard_processor(out, "tokenizer")
    return out
