"""Kandinsky 5's own behaviour against Kandinsky5T2IPipeline (the shared contract is
test_family_contract.py): the fixed shift and t = 1000 * sigma, unmasked text of unequal lengths run
one sample at a time, the tiny model's template."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import torch
from diffusers import Kandinsky5T2IPipeline

from conftest import family_pipeline
from trainer.config import TrainConfig
from trainer.families import SPECS
from trainer.families.kandinsky5.family import Kandinsky5Family
from trainer.step.flow_matching import apply_shift
from trainer.families.kandinsky5.tiny import KANDINSKY5_TEMPLATE

PROMPT = "a red circle on a yellow background"


def record_transformer_calls(pipe: Kandinsky5T2IPipeline, **call: Any) -> List[Dict[str, Any]]:
    calls: List[Dict[str, Any]] = []
    handle = pipe.transformer.register_forward_hook(
        lambda module, args, kwargs, output: calls.append({**kwargs, "output": output.sample}), with_kwargs=True)
    try:
        pipe(prompt=PROMPT, height=64, width=64, generator=torch.Generator().manual_seed(0), output_type="latent",
             **call)
    finally:
        handle.remove()
    return calls


def test_shift_and_timestep_scale_give_the_pipelines_timesteps(tiny_kandinsky5: Path) -> None:
    steps = 4
    pipe = family_pipeline("kandinsky5", tiny_kandinsky5)
    assert (pipe.prompt_template, pipe.prompt_template_encode_start_idx) == (KANDINSKY5_TEMPLATE,
                                                                             SPECS["kandinsky5"].text.template)
    calls = record_transformer_calls(pipe, num_inference_steps=steps, guidance_scale=1.0)
    family = Kandinsky5Family(TrainConfig(family="kandinsky5", pretrained_model_name_or_path=str(tiny_kandinsky5)))
    # The pipeline's unshifted grid runs from 1 to the scheduler's sigma_min; the shift is fixed (3.0).
    unshifted = torch.linspace(1.0, float(pipe.scheduler.sigma_min), steps)
    ours = apply_shift(unshifted, "auto", family.image_seq_len((1, 16, 8, 8)), family.scheduler_config, 1.0)
    theirs = torch.stack([c["timestep"][0] for c in calls]) / 1000  # t = 1000 * sigma
    torch.testing.assert_close(ours, theirs.float(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours, unshifted), "the shift is applied"


def test_texts_of_unequal_lengths_run_one_sample_at_a_time(tiny_kandinsky5: Path) -> None:
    """A CFG step calls the transformer twice (prompt, then negative prompt, different text lengths):
    predict on the two as one batch returns both outputs."""
    pipe = family_pipeline("kandinsky5", tiny_kandinsky5)
    calls = record_transformer_calls(pipe, num_inference_steps=2, guidance_scale=4.0,
                                     negative_prompt="blurry, low quality, watermark")
    cond, uncond = calls[2], calls[3]  # second step
    family = Kandinsky5Family(TrainConfig(family="kandinsky5", pretrained_model_name_or_path=str(tiny_kandinsky5)))
    conds = [{"prompt_embeds_qwen": c["encoder_hidden_states"][0], "prompt_embeds_clip": c["pooled_projections"][0]}
             for c in (cond, uncond)]
    text = family.collate_text(conds, torch.device("cpu"), torch.float32)
    assert text["lengths"] is not None, "the two texts differ in length"
    latents = cond["hidden_states"][:, 0].permute(0, 3, 1, 2).expand(2, -1, -1, -1)  # (B, C, h, w)
    with torch.no_grad():
        ours = family.predict(pipe.transformer, latents, (cond["timestep"] / 1000).expand(2), text)
    theirs = torch.cat([cond["output"], uncond["output"]])[:, 0].permute(0, 3, 1, 2)
    torch.testing.assert_close(ours, theirs)
