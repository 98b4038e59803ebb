"""Z-Image's facts: pipeline, LoRA presets, refiner and joint blocks (no diffusers import)."""

from __future__ import annotations

from typing import Any, Dict

from trainer.families.components import FLUX_VAE, QWEN3_4B, model_index
from trainer.facts.family_spec import BlockGroup, FamilySpec, TargetSpec, TextTokens, lora_presets

_ATTN = r"attention\.(to_q|to_k|to_v|to_out\.0)"
_MLP = r"feed_forward\.(w1|w2|w3)"
# noise_refiner: image tokens only; context_refiner: caption tokens only; layers: both, jointly.
_OUTER = r"all_x_embedder\.[^.]+|all_final_layer\.[^.]+\.linear|cap_embedder\.1|t_embedder\.mlp\.[02]"
# adaLN_modulation (blocks and final layer) is never a target.
Z_IMAGE_LORA_PRESETS: Dict[str, TargetSpec] = lora_presets(
    # Attention that sees the image: the joint layers and the image refiner (as FLUX's preset).
    attention=rf"(layers|noise_refiner)\.\d+\.{_ATTN}",
    attention_mlp=rf"(layers|noise_refiner|context_refiner)\.\d+\.({_ATTN}|{_MLP})", outer=_OUTER)


def _checkpoint(shift: float, shards: int) -> Dict[str, Any]:
    """Tongyi-MAI/Z-Image(-Turbo): both publish the same transformer/config.json (dim 3840, 30 layers
    + 2 refiner layers each side, 30 heads, caption width 2560: ZImageTransformer2DModel's defaults in
    diffusers 0.42), Qwen3-4B as text encoder and the FLUX VAE; they differ in the scheduler's fixed
    shift (Turbo 3.0, base 6.0) and the transformer's weight files (Turbo 3, base 2). From the
    checkpoints' model_index.json, config files and model cards."""
    return {
        "model_index.json": model_index(
            "ZImagePipeline", scheduler="diffusers.FlowMatchEulerDiscreteScheduler",
            text_encoder="transformers.Qwen3Model", tokenizer="transformers.Qwen2Tokenizer",
            transformer="diffusers.ZImageTransformer2DModel", vae="diffusers.AutoencoderKL"),
        "transformer/config.json": {
            "_class_name": "ZImageTransformer2DModel", "all_patch_size": [2], "all_f_patch_size": [1],
            "in_channels": 16, "dim": 3840, "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30,
            "norm_eps": 1e-05, "qk_norm": True, "cap_feat_dim": 2560, "rope_theta": 256.0, "t_scale": 1000.0,
            "axes_dims": [32, 48, 48], "axes_lens": [1024, 512, 512]},
        "text_encoder/config.json": QWEN3_4B,
        "vae/config.json": FLUX_VAE,
        "scheduler/scheduler_config.json": {"num_train_timesteps": 1000, "use_dynamic_shifting": False,
                                            "shift": shift},
        "_shards": {"transformer": shards},
    }


SPEC = FamilySpec(
    name="z_image",
    title="Z-Image",
    entry_script="train.py",
    lora_presets=Z_IMAGE_LORA_PRESETS,
    # Execution order: the image refiner, the caption refiner, then the joint layers.
    # No layouts: the planner does not model the activations of these blocks yet (it refuses to plan).
    blocks=(BlockGroup("noise_refiner", "image"), BlockGroup("context_refiner", "text"),
            BlockGroup("layers", "joint")),
    runtime="ZImageFamily",
    # ZImagePipeline applies Qwen3's chat template and keeps every unpadded token (template included:
    # a few tokens more than the caption), up to 512.
    text=TextTokens(max_length=512, conditions={"prompt_embeds": ("cap_feat_dim", True)}),
    hub_configs={"Tongyi-MAI/Z-Image-Turbo": _checkpoint(shift=3.0, shards=3),
                 "Tongyi-MAI/Z-Image": _checkpoint(shift=6.0, shards=2)},
)
