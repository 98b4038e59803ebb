"""Qwen-Image-Edit's tiny test models: the published Edit (and, as ``qwen_image_edit_plus``, Edit-2509)
configs shrunk as Qwen-Image's, plus the ``processor/`` folder their vision tower reads references with.
Load with ``QwenImageEdit[Plus]Pipeline.from_pretrained(d, processor=load_qwen_vl_processor(d))``: without
torchvision the processor must be passed in like that (see ``utils/qwen_processor.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from trainer.families.qwen_image.tiny import qwen_components
from trainer.families.qwen_image_edit.spec import SPEC
from utils.qwen_processor import Qwen2VLImageTextProcessor, record_standard_processor, save_qwen_vl_processor
from utils.tiny_models.derive import pipeline_class, published, save_pipeline
from utils.tiny_models.tokenizers import QWEN_EDIT_PLUS_TEMPLATE, QWEN_EDIT_TEMPLATE

VARIANTS = {"qwen_image_edit_plus": "Qwen/Qwen-Image-Edit-2509"}  # tiny model name -> published checkpoint
# Factor 28 = patch 14 * merge 2 (must match the vision config). The real checkpoint allows up to 12.8 Mpx;
# here a reference image becomes 56x56..112x112 px, i.e. 4..16 `<|image_pad|>` tokens.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112


def build(out_dir: str | Path, seed: int = 0, checkpoint: Optional[str] = None) -> Path:
    """Build the tiny Edit pipeline of ``checkpoint`` (default ``Qwen/Qwen-Image-Edit``) into ``out_dir``."""
    configs = published(SPEC, checkpoint)
    components = qwen_components(configs, seed, drops={QWEN_EDIT_TEMPLATE: SPEC.text.template,
                                                       QWEN_EDIT_PLUS_TEMPLATE: SPEC.text.template})
    image_processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14,
                                               temporal_patch_size=2, merge_size=2)
    tokenizer = components["tokenizer"]
    processor = Qwen2VLImageTextProcessor(image_processor, tokenizer, chat_template=tokenizer.chat_template)
    # Written by hand below so model_index.json names the standard class, not the helper.
    out = save_pipeline(pipeline_class(configs)(**components, processor=None), out_dir)
    save_qwen_vl_processor(processor, out / "processor")
    record_standard_processor(out)
    return out
