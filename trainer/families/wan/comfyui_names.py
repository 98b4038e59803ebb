"""Wan's module names in ComfyUI: its native ``WanModel`` (comfy/ldm/wan/model.py) keeps the names of Wan's
original checkpoints, which diffusers' ``WanTransformer3DModel`` renamed (diffusers'
``scripts/convert_wan_to_diffusers.py``). A ComfyUI-format LoRA names modules ComfyUI's way, under
``diffusion_model.``; these renames take each LoRA target of ours there (``trainer.model.lora_formats``).
diffusers reads such a file back through ``_convert_non_diffusers_wan_lora_to_diffusers``
(tests/test_wan_media.py loads one into ``WanPipeline`` and gets the same clip)."""

from __future__ import annotations

from typing import Tuple

_ATTENTION = {"to_q": "q", "to_k": "k", "to_v": "v", r"to_out\.0": "o"}
_ATTENTIONS = {"attn1": "self_attn", "attn2": "cross_attn"}

# (regex full-matching a diffusers module name, its ComfyUI name): FamilySpec.comfyui_names.
COMFYUI_NAMES: Tuple[Tuple[str, str], ...] = (
    *[(rf"blocks\.(\d+)\.{ours}\.{projection}", rf"blocks.\1.{theirs}.{short}")
      for ours, theirs in _ATTENTIONS.items() for projection, short in _ATTENTION.items()],
    (r"blocks\.(\d+)\.attn2\.add_k_proj", r"blocks.\1.cross_attn.k_img"),  # I2V: the image's keys and values
    (r"blocks\.(\d+)\.attn2\.add_v_proj", r"blocks.\1.cross_attn.v_img"),
    (r"blocks\.(\d+)\.ffn\.net\.0\.proj", r"blocks.\1.ffn.0"),
    (r"blocks\.(\d+)\.ffn\.net\.2", r"blocks.\1.ffn.2"),
    # nn.Sequential(Linear, activation, Linear) there: its linears are items 0 and 2.
    *[(rf"condition_embedder\.{ours}_embedder\.linear_{n}", f"{ours}_embedding.{index}")
      for ours in ("text", "time") for n, index in ((1, 0), (2, 2))],
    (r"condition_embedder\.time_proj", "time_projection.1"),
    (r"proj_out", "head.head"),
)
