"""Tiny Qwen-Image-Edit / Edit-Plus pipelines: the Qwen-Image components plus a `processor/` folder."""

from __future__ import annotations

from pathlib import Path

from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from diffusers.utils import logging as diffusers_logging
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ._common import save_pipeline
from .qwen_image import qwen_image_components
from utils.qwen_processor import Qwen2VLImageTextProcessor, record_standard_processor, save_qwen_vl_processor

# Factor 28 = patch 14 * merge 2 (must match the vision config). The real checkpoint allows up to 12.8 Mpx;
# here a reference image becomes 56x56..112x112 px, i.e. 4..16 `<|image_pad|>` tokens.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112


def build_tiny_qwen_image_edit(out_dir: str | Path, seed: int = 0, plus: bool = False) -> Path:
    """Build a tiny Qwen-Image-Edit (or Edit-Plus with `plus=True`) pipeline into `out_dir`.

    Load it with `QwenImageEdit[Plus]Pipeline.from_pretrained(out_dir, processor=load_qwen_vl_processor(out_dir))`;
    without torchvision the processor must be passed in like that (see utils/qwen_processor.py).
    """
    components = qwen_image_components(seed)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    tokenizer = components["tokenizer"]
    processor = Qwen2VLImageTextProcessor(image_processor, tokenizer, chat_template=tokenizer.chat_template)
    pipeline_cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    # The processor is written by hand below so model_index.json names the standard class, not the helper.
    # (diffusers warns that processor=None "cannot be saved": expected, hence the quieter logging.)
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        out = save_pipeline(pipeline_cls(**components, processor=None), out_dir)
    finally:
        diffusers_logging.set_verbosity(verbosity)
    save_qwen_vl_processor(processor, out / "processor")
    record_standard_processor(out)
    return out
