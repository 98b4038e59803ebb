"""Tiny text encoders, one builder per transformers class a ``model_index.json`` names (not per family).

A family whose checkpoint uses one of these classes gets its tiny encoder here; its ``tiny.py`` passes
only what its pipeline needs deeper or different (FLUX.2 [klein] reads hidden state 27: 28 layers).
Each builder sizes the vocabulary and the special-token ids from the tiny tokenizer it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLModel,
    T5Config,
    T5EncoderModel,
)

from ._common import init_model

QWEN_WIDTH = 16  # the Qwen encoders' hidden size: a tiny transformer's text input width
CLIP_WIDTH = 32  # CLIP-L's pooled embedding width, tiny
T5_WIDTH = 32  # T5's hidden size, tiny


def _qwen_ids(tokenizer: Any) -> dict[str, int]:
    return {"bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"), "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}


def tiny_qwen_vl_config(tokenizer: Any) -> Qwen2_5_VLConfig:
    """A 2-layer, 16-wide Qwen2.5-VL with a 1-block vision tower (Qwen-Image(-Edit), Kandinsky 5, captioner)."""
    ids = _qwen_ids(tokenizer)
    text_config = {
        "vocab_size": len(tokenizer), "hidden_size": QWEN_WIDTH, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 4096,
        # head_dim = 16 / 2 = 8 and mRoPE needs 2 * sum(mrope_section) == head_dim.
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [1, 1, 2]},
        **ids,  # the text model reads these from text_config, not from the top level
    }
    vision_config = {
        "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
        "out_hidden_size": QWEN_WIDTH,  # the merger projects straight into the text embedding space
        "patch_size": 14,  # the image processor's patch/merge/temporal sizes must match these
        "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [0],
    }
    return Qwen2_5_VLConfig(
        text_config=text_config, vision_config=vision_config,
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"), **ids)


def _qwen3_config(tokenizer: Any, **overrides: Any) -> Qwen3Config:
    config = dict(vocab_size=len(tokenizer), hidden_size=QWEN_WIDTH, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
                  **_qwen_ids(tokenizer))
    return Qwen3Config(**{**config, **overrides})


def _qwen3_vl_config(tokenizer: Any, **text_overrides: Any) -> Qwen3VLConfig:
    """A 2-layer, 16-wide Qwen3-VL (Krea 2, Qwen-Image-2.1) with a 1-block vision tower; ``text_overrides`` on
    its text config (Krea 2 taps deeper layers)."""
    ids = _qwen_ids(tokenizer)
    text = dict(vocab_size=len(tokenizer), hidden_size=QWEN_WIDTH, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=4096,
                # interleaved mRoPE: 2 * sum(mrope_section) == head_dim
                rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True}, **ids)
    tie = text_overrides.pop("tie_word_embeddings", True)
    return Qwen3VLConfig(
        text_config={**text, **text_overrides},
        # patch 16, merge 2, temporal 2: the Qwen3-VL image processor's sizes
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=QWEN_WIDTH,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0]),
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"), tie_word_embeddings=tie, **ids)


def _clip_config(tokenizer: Any, **overrides: Any) -> CLIPTextConfig:
    config = dict(vocab_size=len(tokenizer), hidden_size=CLIP_WIDTH, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, projection_dim=CLIP_WIDTH,
                  max_position_embeddings=tokenizer.model_max_length,  # the pipelines pad CLIP input to 77
                  bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id,  # pooling looks for this id (not 2, the legacy argmax path)
                  pad_token_id=tokenizer.pad_token_id)
    return CLIPTextConfig(**{**config, **overrides})


def _t5_config(tokenizer: Any, **overrides: Any) -> T5Config:
    config = dict(vocab_size=len(tokenizer), d_model=T5_WIDTH, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                  relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",  # T5 v1.1, as FLUX's
                  is_encoder_decoder=False, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id)
    return T5Config(**{**config, **overrides})


def _umt5(tokenizer: Any, **overrides: Any) -> Any:
    """UMT5 (Wan's text encoder): T5's tiny shape in UMT5's class (a relative attention bias in every layer)."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = {**_t5_config(tokenizer).to_dict(), "model_type": "umt5", **overrides}
    return UMT5EncoderModel(UMT5Config(**{k: v for k, v in config.items() if k != "transformers_version"}))


def _mistral3(tokenizer: Any, **overrides: Any) -> Any:
    """Mistral-3 (FLUX.2 [dev]): a Mistral language model and a Pixtral vision tower the prompt path never runs."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    text = MistralConfig(**{**dict(vocab_size=len(tokenizer), hidden_size=QWEN_WIDTH, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                   max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
                                   eos_token_id=tokenizer.eos_token_id), **overrides})
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=8, patch_size=14, image_size=56)
    return Mistral3ForConditionalGeneration(Mistral3Config(text_config=text, vision_config=vision,
                                                           spatial_merge_size=2))


# transformers class (as model_index.json names it) -> (tokenizer, overrides) -> a fresh model
BUILDERS: dict[str, Callable[..., Any]] = {
    "Qwen2_5_VLForConditionalGeneration": lambda tok, **kw: Qwen2_5_VLForConditionalGeneration(tiny_qwen_vl_config(tok)),
    "Qwen3Model": lambda tok, **kw: Qwen3Model(_qwen3_config(tok, **kw)),
    "Qwen3ForCausalLM": lambda tok, **kw: Qwen3ForCausalLM(_qwen3_config(tok, **kw)),
    "CLIPTextModel": lambda tok, **kw: CLIPTextModel(_clip_config(tok, **kw)),
    "T5EncoderModel": lambda tok, **kw: T5EncoderModel(_t5_config(tok, **kw)),
    "Mistral3ForConditionalGeneration": _mistral3,
    "UMT5EncoderModel": _umt5,
    "Qwen3VLModel": lambda tok, **kw: Qwen3VLModel(_qwen3_vl_config(tok, **kw)),
    "Qwen3VLForConditionalGeneration": lambda tok, **kw: Qwen3VLForConditionalGeneration(_qwen3_vl_config(tok, **kw)),
}


def tiny_text_encoder(configs: Any, component: str, tokenizer: Any, seed: int, **overrides: Any) -> Any:
    """The tiny text encoder of ``component`` ("text_encoder", "text_encoder_2"): the class the published
    ``model_index.json`` names, sized for ``tokenizer``, with ``overrides`` on its config."""
    cls = configs["model_index.json"][component][1]
    if cls not in BUILDERS:
        raise ValueError(f"no tiny builder for text encoder class {cls}; add one to utils/tiny_models/text_encoders.py")
    return init_model(lambda: BUILDERS[cls](tokenizer, **overrides), seed, component)
