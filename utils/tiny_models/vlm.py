"""Tiny, randomly initialised vision-language models for the captioner's tests: the real Qwen2.5-VL /
Qwen3-VL classes at a few hundred kB, saved in the layout of their hub repositories (config, weights,
tokenizer, ``preprocessor_config.json``, ``video_preprocessor_config.json``, chat template), so
``AutoModelForImageTextToText`` and ``AutoProcessor`` load them like the real ``*-Instruct`` models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict

from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from utils.qwen_processor import Qwen2VLImageTextProcessor, save_qwen_vl_processor

from ._common import init_model
from .text_encoders import tiny_qwen_vl_config
from .tokenizers import build_qwen_tokenizer

# Images of 64-128 px become 4-16 vision tokens: enough to exercise the vision tower, fast on a CPU.
MIN_PIXELS, MAX_PIXELS = 32 * 32, 128 * 128


def _token_ids(tokenizer) -> Dict[str, int]:
    return {"bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"), "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}


def tiny_qwen3_vl_config(tokenizer) -> Qwen3VLConfig:
    """A 2-layer, 16-wide Qwen3-VL with a 2-block vision tower (one deepstack layer)."""
    ids = _token_ids(tokenizer)
    return Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=4096,
                         # interleaved mRoPE: 2 * sum(mrope_section) == head_dim
                         rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                          "mrope_section": [2, 1, 1], "mrope_interleaved": True}, **ids),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0]),
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        **ids,
    )


# architecture -> (model factory, vision patch size, the processor classes its hub repository names)
ARCHITECTURES: Dict[str, tuple[Callable[[Any], Any], int, str, str]] = {
    "qwen2_5_vl": (lambda tok: Qwen2_5_VLForConditionalGeneration(tiny_qwen_vl_config(tok)), 14,
                   "Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor"),
    "qwen3_vl": (lambda tok: Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(tok)), 16,
                 "Qwen3VLProcessor", "Qwen3VLVideoProcessor"),
}


def build_tiny_vlm(out_dir: str | Path, seed: int = 0, architecture: str = "qwen3_vl") -> Path:
    """Build a tiny ``architecture`` (a key of ARCHITECTURES) vision-language model into ``out_dir``."""
    factory, patch, processor_class, video_class = ARCHITECTURES[architecture]
    out = Path(out_dir)
    tokenizer = build_qwen_tokenizer()
    model = init_model(lambda: factory(tokenizer), seed, f"vlm-{architecture}")
    model.save_pretrained(out)
    image_processor = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, temporal_patch_size=2,
                                               min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    save_qwen_vl_processor(Qwen2VLImageTextProcessor(image_processor, tokenizer, chat_template=tokenizer.chat_template),
                           out)
    for name, kind in (("preprocessor_config.json", None), ("video_preprocessor_config.json", video_class)):
        config = json.loads((out / name).read_text())
        config["processor_class"] = processor_class
        if kind:
            config["video_processor_type"] = kind
        (out / name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
