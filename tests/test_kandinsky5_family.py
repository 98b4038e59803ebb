"""The Kandinsky 5 family against Kandinsky5T2IPipeline itself: LoRA presets, the shift, t = 1000 * sigma,
channel-last latents and rope positions, unmasked text (one sample at a time), VAE scale without shift."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
from diffusers import Kandinsky5T2IPipeline, Kandinsky5Transformer3DModel

from trainer.adapters import add_lora
from trainer.config import TrainConfig
from trainer.families.kandinsky5.model import Kandinsky5Family
from trainer.families.kandinsky5.spec import KANDINSKY5_LORA_PRESETS
from trainer.flow_matching import apply_shift
from utils.qwen_processor import load_qwen_vl_processor
from utils.tiny_models.kandinsky5 import KANDINSKY5_TEMPLATES

PROMPT = "a red circle on a yellow background"


def family_for(model: Path, **kw: Any) -> Kandinsky5Family:
    cfg = TrainConfig(family="kandinsky5", pretrained_model_name_or_path=str(model))
    for key, value in kw.items():
        setattr(cfg, key, value)
    return Kandinsky5Family(cfg)


@pytest.fixture(scope="module")
def pipe(tiny_kandinsky5: Path) -> Kandinsky5T2IPipeline:
    pipe = Kandinsky5T2IPipeline.from_pretrained(tiny_kandinsky5,
                                                 tokenizer=load_qwen_vl_processor(tiny_kandinsky5, "tokenizer"))
    pipe.set_progress_bar_config(disable=True)
    pipe.resolutions = [(64, 64), (64, 48)]  # (width, height); it snaps any other size to its ~1 Mpx list
    return pipe


def record_transformer_calls(pipe: Kandinsky5T2IPipeline, **call: Any) -> List[Dict[str, Any]]:
    calls: List[Dict[str, Any]] = []

    def hook(module: torch.nn.Module, args: tuple, kwargs: Dict[str, Any], output: Any) -> None:
        calls.append({**kwargs, "output": output.sample})

    handle = pipe.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(0), output_type="latent", **call)
    finally:
        handle.remove()
    return calls


def lora_layers(model: torch.nn.Module) -> set:
    return {name for name, module in model.named_modules() if hasattr(module, "lora_A") and len(module.lora_A)}


PROJ = ("to_query", "to_key", "to_value", "out_layer")
VISUAL_ATTN = {f"{a}.{p}" for a in ("self_attention", "cross_attention") for p in PROJ}
TEXT_ATTN = {f"self_attention.{p}" for p in PROJ}
MLP = {"feed_forward.in_layer", "feed_forward.out_layer"}
OUTER = {"time_embeddings.in_layer", "time_embeddings.out_layer", "text_embeddings.in_layer",
         "pooled_text_embeddings.in_layer", "visual_embeddings.in_layer", "out_layer.out_layer"}
EXPECTED = {  # preset -> (visual-block layers, text-block layers, layers outside the blocks)
    "attention": (VISUAL_ATTN, set(), set()),
    "attention_mlp": (VISUAL_ATTN | MLP, TEXT_ATTN | MLP, set()),
    "all_linear": (VISUAL_ATTN | MLP, TEXT_ATTN | MLP, OUTER),
}


@pytest.mark.parametrize("preset", list(EXPECTED))
def test_presets_hit_the_intended_layers_and_never_modulation(tiny_kandinsky5: Path, preset: str) -> None:
    model = Kandinsky5Transformer3DModel.from_pretrained(tiny_kandinsky5, subfolder="transformer")
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    add_lora(model, TrainConfig(family="kandinsky5", lora_target=preset), KANDINSKY5_LORA_PRESETS)
    visual, text, outer = EXPECTED[preset]
    expected = {f"visual_transformer_blocks.{i}.{layer}" for i in range(2) for layer in visual} | \
        {f"text_transformer_blocks.0.{layer}" for layer in text} | outer
    assert lora_layers(model) == expected
    assert not any("modulation" in name for name in lora_layers(model)), "modulation is never a target"
    if preset == "all_linear":  # every linear layer but modulation
        assert {n for n in linears - expected if "modulation" not in n} == set()


def test_shift_and_timestep_scale_give_the_pipelines_timesteps(pipe: Kandinsky5T2IPipeline,
                                                               tiny_kandinsky5: Path) -> None:
    steps = 4
    calls = record_transformer_calls(pipe, height=64, width=64, num_inference_steps=steps, guidance_scale=1.0)
    family = family_for(tiny_kandinsky5)
    # The pipeline's unshifted grid runs from 1 to the scheduler's sigma_min; the shift is fixed (3.0).
    unshifted = torch.linspace(1.0, float(pipe.scheduler.sigma_min), steps)
    ours = apply_shift(unshifted, "auto", family.image_seq_len((1, 16, 8, 8)), family.scheduler_config, 1.0)
    theirs = torch.stack([c["timestep"][0] for c in calls]) / 1000  # t = 1000 * sigma
    torch.testing.assert_close(ours, theirs.float(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours, unshifted), "the shift is applied"


def test_predict_is_the_pipelines_transformer_call(pipe: Kandinsky5T2IPipeline, tiny_kandinsky5: Path) -> None:
    """A CFG step calls the transformer twice (prompt, then negative prompt, different text lengths): predict
    on the two as one batch returns both outputs."""
    height, width = 48, 64
    calls = record_transformer_calls(pipe, height=height, width=width, num_inference_steps=2, guidance_scale=4.0,
                                     negative_prompt="blurry, low quality, watermark")
    cond, uncond = calls[2], calls[3]  # second step
    family = family_for(tiny_kandinsky5)
    conds = [{"prompt_embeds_qwen": c["encoder_hidden_states"][0], "prompt_embeds_clip": c["pooled_projections"][0]}
             for c in (cond, uncond)]
    text = family.collate_text(conds, torch.device("cpu"), torch.float32)
    assert text["lengths"] is not None, "the two texts differ in length"
    latents = cond["hidden_states"][:, 0].permute(0, 3, 1, 2).expand(2, -1, -1, -1)  # (B, C, h, w)
    with torch.no_grad():
        ours = family.predict(pipe.transformer, latents, (cond["timestep"] / 1000).expand(2), text)
    theirs = torch.cat([cond["output"], uncond["output"]])[:, 0].permute(0, 3, 1, 2)
    assert ours.shape == (2, 16, height // 8, width // 8)
    torch.testing.assert_close(ours, theirs)
    with torch.no_grad():  # equal lengths: one call for the batch
        single = family.predict(pipe.transformer, latents[:1], cond["timestep"] / 1000,
                                family.collate_text(conds[:1], torch.device("cpu"), torch.float32))
    torch.testing.assert_close(single, theirs[:1])


def test_text_conditions_match_the_pipeline(pipe: Kandinsky5T2IPipeline, tiny_kandinsky5: Path) -> None:
    assert (pipe.prompt_template, pipe.prompt_template_encode_start_idx) == KANDINSKY5_TEMPLATES["kandinsky5"]
    family = family_for(tiny_kandinsky5)
    family.load_text_encoder(torch.device("cpu"), torch.float32)
    conds = family.encode_prompts([PROMPT, ""])
    for prompt, cond in zip([PROMPT, ""], conds):
        qwen, clip, cu_seqlens = pipe.encode_prompt([prompt])
        assert cond["prompt_embeds_qwen"].shape[0] == int(cu_seqlens[1]) == qwen.shape[1]
        torch.testing.assert_close(cond["prompt_embeds_qwen"], qwen[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(cond["prompt_embeds_clip"], clip[0], atol=1e-5, rtol=1e-4)
    family.unload_text_encoder()
    assert family.text_pipe is None


def test_latents_are_scaled_but_not_shifted(pipe: Kandinsky5T2IPipeline, tiny_kandinsky5: Path) -> None:
    family = family_for(tiny_kandinsky5)
    family.load_vae(torch.device("cpu"), torch.float32)
    pixels = torch.rand(1, 3, 48, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = family.encode_images(pixels)
    assert latents.shape == (1, 16, 6, 8) and family.pixel_multiple == 16
    raw = pipe.vae.encode(pixels).latent_dist.mode()
    assert pipe.vae.config.shift_factor != 0, "the VAE has a shift, and Kandinsky ignores it"
    torch.testing.assert_close(latents, raw * 0.3611)
    torch.testing.assert_close(family.decode_latents(latents), pipe.vae.decode(raw).sample, atol=1e-5, rtol=1e-4)


def test_validation_renders_from_cached_embeddings_without_cfg(pipe: Kandinsky5T2IPipeline,
                                                               tiny_kandinsky5: Path) -> None:
    family = family_for(tiny_kandinsky5)
    family.load_text_encoder(torch.device("cpu"), torch.float32)
    kwargs = family.render_kwargs(family.encode_prompts([PROMPT])[0], torch.float32, torch.device("cpu"))
    common = dict(height=64, width=64, num_inference_steps=2, output_type="np")
    ours = pipe(**kwargs, guidance_scale=1.0, **common, generator=torch.Generator().manual_seed(0)).image
    theirs = pipe(prompt=PROMPT, guidance_scale=1.0, **common, generator=torch.Generator().manual_seed(0)).image
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
