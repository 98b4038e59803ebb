"""Z-Image's own behaviour against ZImagePipeline (the shared contract is test_family_contract.py): the
reversed clock (t = 1 - sigma) with the fixed shift, captions of different lengths in one batch, and the
sign of the velocity a trained model must predict."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import torch
from diffusers import ZImagePipeline

from conftest import family_pipeline
from trainer.config import TrainConfig
from trainer.families.base import pad_sequences
from trainer.families.z_image.family import ZImageFamily
from trainer.step.flow_matching import add_noise, apply_shift, velocity_target

PROMPT = "a red circle on a yellow background"


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


def family_for(model: Path) -> ZImageFamily:
    return ZImageFamily(TrainConfig(family="z_image", pretrained_model_name_or_path=str(model)))


def test_shift_and_reversed_clock_give_the_pipelines_timesteps(tiny_z_image: Path) -> None:
    """The engine's sigma after the family's shift is 1 - the transformer's t, step by step."""
    steps = 4
    calls = record_transformer_calls(family_pipeline("z_image", tiny_z_image), height=64, width=64,
                                     num_inference_steps=steps, guidance_scale=0.0)
    family = family_for(tiny_z_image)
    unshifted = torch.linspace(1.0, 1 / steps, steps)  # the pipeline's default sigmas
    ours = apply_shift(unshifted, "auto", family.image_seq_len((1, 16, 8, 8)), family.scheduler_config, 1.0)
    torch.testing.assert_close(ours, 1 - torch.stack([c["t"][0] for c in calls]), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(ours, unshifted), "the checkpoint's shift (3.0) is applied"


def test_captions_of_different_lengths_in_one_batch(tiny_z_image: Path) -> None:
    """A CFG step batches the prompt and the negative prompt (different caption lengths): predict on
    that batch returns what the pipeline hands its scheduler, -output."""
    pipe = family_pipeline("z_image", tiny_z_image)
    call = record_transformer_calls(pipe, height=64, width=48, num_inference_steps=2, guidance_scale=3.0,
                                    negative_prompt="blurry")[1]
    assert len({c.shape[0] for c in call["caps"]}) == 2, "the two captions differ in length"
    embeds, mask = pad_sequences(call["caps"])
    with torch.no_grad():
        ours = family_for(tiny_z_image).predict(pipe.transformer, torch.stack(call["x"]).squeeze(2), 1 - call["t"],
                                                {"prompt_embeds": embeds, "lengths": mask.sum(dim=1)})
    torch.testing.assert_close(ours, -torch.stack(call["output"]).squeeze(2), atol=1e-5, rtol=1e-4)


def test_an_euler_step_with_the_target_velocity_lands_on_the_clean_latents(tiny_z_image: Path) -> None:
    """The sign check: the pipeline's scheduler, stepped with the engine's training target noise - x0
    from sigma to 0, returns x0 (so a model trained on it denoises under ZImagePipeline)."""
    pipe = family_pipeline("z_image", tiny_z_image)
    x0, noise = torch.randn(1, 16, 8, 8), torch.randn(1, 16, 8, 8)
    scheduler = pipe.scheduler.__class__.from_config(pipe.scheduler.config)
    scheduler.set_timesteps(sigmas=[0.7], device="cpu")
    sigma = scheduler.sigmas[0]
    x_t = add_noise(x0, noise, sigma.view(1))
    stepped = scheduler.step(velocity_target(x0, noise), scheduler.timesteps[0], x_t, return_dict=False)[0]
    torch.testing.assert_close(stepped, x0, atol=1e-5, rtol=1e-5)
