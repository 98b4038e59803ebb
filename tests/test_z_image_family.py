"""The Z-Image family against ZImagePipeline itself: LoRA presets, the reversed clock (t = 1 - sigma) and
negated output, the fixed shift, variable-length captions, VAE shift and scale."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
from diffusers import ZImagePipeline, ZImageTransformer2DModel

from trainer.adapters import add_lora
from trainer.config import TrainConfig
from trainer.families.base import pad_sequences
from trainer.families.z_image.model import ZImageFamily
from trainer.families.z_image.spec import Z_IMAGE_LORA_PRESETS
from trainer.flow_matching import add_noise, apply_shift, velocity_target

PROMPT = "a red circle on a yellow background"


def family_for(model: Path, **kw: Any) -> ZImageFamily:
    cfg = TrainConfig(family="z_image", pretrained_model_name_or_path=str(model))
    for key, value in kw.items():
        setattr(cfg, key, value)
    return ZImageFamily(cfg)


@pytest.fixture(scope="module")
def pipe(tiny_z_image: Path) -> ZImagePipeline:
    pipe = ZImagePipeline.from_pretrained(tiny_z_image)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def record_transformer_calls(pipe: ZImagePipeline, **call: Any) -> List[Dict[str, Any]]:
    """Run the pipeline; each transformer call's inputs (positional: latents, t, captions) and output."""
    calls: List[Dict[str, Any]] = []

    def hook(module: torch.nn.Module, args: tuple, kwargs: Dict[str, Any], output: Any) -> None:
        x, t, caps = args
        calls.append({"x": [i.clone() for i in x], "t": t.clone(), "caps": caps, "output": output[0]})

    handle = pipe.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(0), output_type="latent", **call)
    finally:
        handle.remove()
    return calls


def lora_layers(model: torch.nn.Module) -> set:
    return {name for name, module in model.named_modules() if hasattr(module, "lora_A") and len(module.lora_A)}


ATTN = {"attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0"}
MLP = {"feed_forward.w1", "feed_forward.w2", "feed_forward.w3"}
OUTER = {"all_x_embedder.2-1", "all_final_layer.2-1.linear", "cap_embedder.1", "t_embedder.mlp.0", "t_embedder.mlp.2"}
EXPECTED = {  # preset -> (layers in noise_refiner and layers, in context_refiner, outside the blocks)
    "attention": (ATTN, set(), set()),
    "attention_mlp": (ATTN | MLP, ATTN | MLP, set()),
    "all_linear": (ATTN | MLP, ATTN | MLP, OUTER),
}


@pytest.mark.parametrize("preset", list(EXPECTED))
def test_presets_hit_the_intended_layers_and_never_modulation(tiny_z_image: Path, preset: str) -> None:
    model = ZImageTransformer2DModel.from_pretrained(tiny_z_image, subfolder="transformer")
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    add_lora(model, TrainConfig(family="z_image", lora_target=preset), Z_IMAGE_LORA_PRESETS)
    image_side, caption_side, outer = EXPECTED[preset]
    expected = {f"{blocks}.{i}.{layer}" for blocks, n in (("noise_refiner", 1), ("layers", 2)) for i in range(n)
                for layer in image_side} | {f"context_refiner.0.{layer}" for layer in caption_side} | outer
    assert lora_layers(model) == expected
    assert not any("adaLN_modulation" in name for name in lora_layers(model)), "modulation is never a target"
    if preset == "all_linear":  # every linear layer but modulation
        assert {n for n in linears - expected if "adaLN_modulation" not in n} == set()


def test_shift_and_reversed_clock_give_the_pipelines_timesteps(pipe: ZImagePipeline, tiny_z_image: Path) -> None:
    """The engine's sigma after the family's shift is 1 - the transformer's t, step by step."""
    steps = 4
    calls = record_transformer_calls(pipe, height=64, width=64, num_inference_steps=steps, guidance_scale=0.0)
    family = family_for(tiny_z_image)
    unshifted = torch.linspace(1.0, 1 / steps, steps)  # the pipeline's default sigmas
    ours = apply_shift(unshifted, "auto", family.image_seq_len((1, 16, 8, 8)), family.scheduler_config, 1.0)
    torch.testing.assert_close(ours, 1 - torch.stack([c["t"][0] for c in calls]), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(ours, unshifted), "the checkpoint's shift (3.0) is applied"


def test_predict_is_the_pipelines_transformer_call_negated(pipe: ZImagePipeline, tiny_z_image: Path) -> None:
    """A CFG step batches the prompt and the negative prompt (different caption lengths): predict on
    that batch returns what the pipeline hands its scheduler, -output."""
    calls = record_transformer_calls(pipe, height=64, width=48, num_inference_steps=2, guidance_scale=3.0,
                                     negative_prompt="blurry")
    call = calls[1]
    assert len({c.shape[0] for c in call["caps"]}) == 2, "the two captions differ in length"
    family = family_for(tiny_z_image)
    embeds, mask = pad_sequences(call["caps"])
    latents = torch.stack(call["x"]).squeeze(2)
    with torch.no_grad():
        ours = family.predict(pipe.transformer, latents, 1 - call["t"], {"prompt_embeds": embeds,
                                                                         "lengths": mask.sum(dim=1)})
    torch.testing.assert_close(ours, -torch.stack(call["output"]).squeeze(2), atol=1e-5, rtol=1e-4)


def test_an_euler_step_with_the_target_velocity_lands_on_the_clean_latents(pipe: ZImagePipeline) -> None:
    """The sign check: the pipeline's scheduler, stepped with the engine's training target noise - x0
    from sigma to 0, returns x0 (so a model trained on it denoises under ZImagePipeline)."""
    x0, noise = torch.randn(1, 16, 8, 8), torch.randn(1, 16, 8, 8)
    scheduler = pipe.scheduler.__class__.from_config(pipe.scheduler.config)
    scheduler.set_timesteps(sigmas=[0.7], device="cpu")
    sigma = scheduler.sigmas[0]
    x_t = add_noise(x0, noise, sigma.view(1))
    stepped = scheduler.step(velocity_target(x0, noise), scheduler.timesteps[0], x_t, return_dict=False)[0]
    torch.testing.assert_close(stepped, x0, atol=1e-5, rtol=1e-5)


def test_text_conditions_match_the_pipeline(pipe: ZImagePipeline, tiny_z_image: Path) -> None:
    family = family_for(tiny_z_image)
    family.load_text_encoder(torch.device("cpu"), torch.float32)
    conds = family.encode_prompts([PROMPT, ""])
    theirs, _ = pipe.encode_prompt([PROMPT, ""], do_classifier_free_guidance=False)
    for cond, embeds in zip(conds, theirs):
        torch.testing.assert_close(cond["prompt_embeds"], embeds, atol=1e-5, rtol=1e-4)
    batch = family.collate_text(conds, torch.device("cpu"), torch.bfloat16)
    assert batch["prompt_embeds"].dtype == torch.bfloat16
    assert batch["lengths"].tolist() == [len(theirs[0]), len(theirs[1])]
    family.unload_text_encoder()
    assert family.text_pipe is None


def test_latents_are_normalised_with_the_vae_shift_and_scale(pipe: ZImagePipeline, tiny_z_image: Path) -> None:
    family = family_for(tiny_z_image)
    family.load_vae(torch.device("cpu"), torch.float32)
    pixels = torch.rand(1, 3, 48, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = family.encode_images(pixels)
    assert latents.shape == (1, 16, 6, 8) and family.pixel_multiple == 16
    raw = pipe.vae.encode(pixels).latent_dist.mode()
    torch.testing.assert_close(latents, (raw - 0.1159) * 0.3611)
    torch.testing.assert_close(family.decode_latents(latents), pipe.vae.decode(raw).sample, atol=1e-5, rtol=1e-4)


def test_validation_renders_from_cached_embeddings_without_cfg(pipe: ZImagePipeline, tiny_z_image: Path) -> None:
    family = family_for(tiny_z_image)
    family.load_text_encoder(torch.device("cpu"), torch.float32)
    cond = family.encode_prompts([PROMPT])[0]
    kwargs = family.render_kwargs(cond, torch.float32, torch.device("cpu"))
    ours = pipe(**kwargs, guidance_scale=0.0, height=64, width=64, num_inference_steps=2, output_type="np",
                generator=torch.Generator().manual_seed(0)).images
    theirs = pipe(prompt=PROMPT, guidance_scale=0.0, height=64, width=64, num_inference_steps=2, output_type="np",
                  generator=torch.Generator().manual_seed(0)).images
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
