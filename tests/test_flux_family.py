"""FLUX.1-dev's own behaviour against FluxPipeline (the shared contract is test_family_contract.py): the
resolution-dependent shift, image position ids built once per bucket, the T5 length."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline

from conftest import family_pipeline
from trainer.config import TrainConfig
from trainer.families.flux.family import FluxFamily, _image_ids
from trainer.step.flow_matching import apply_shift

PROMPT = "a red circle on a yellow background"


def family_for(model: Path) -> FluxFamily:
    return FluxFamily(TrainConfig(family="flux", pretrained_model_name_or_path=str(model)))


@pytest.mark.parametrize("height, width", [(64, 64), (40, 64), (128, 96)])
def test_auto_shift_gives_the_pipelines_sigmas(tiny_flux: Path, height: int, width: int) -> None:
    """The engine's shift from the family's scheduler config, at the family's image_seq_len, equals
    the timesteps FluxPipeline passes to the transformer at that resolution."""
    pipe, steps = family_pipeline("flux", tiny_flux), 6
    calls: List[Dict[str, Any]] = []
    handle = pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append(kw), with_kwargs=True)
    try:
        pipe(prompt=PROMPT, height=height, width=width, num_inference_steps=steps, max_sequence_length=16,
             generator=torch.Generator().manual_seed(0), output_type="latent")
    finally:
        handle.remove()
    family = family_for(tiny_flux)
    latent_shape = (1, 16, height * 2 // family.pixel_multiple, width * 2 // family.pixel_multiple)
    seq_len = family.image_seq_len(latent_shape)
    assert seq_len == calls[0]["hidden_states"].shape[1]
    unshifted = torch.from_numpy(np.linspace(1.0, 1 / steps, steps)).float()  # the pipeline's sigmas
    ours = apply_shift(unshifted, "auto", seq_len, family.scheduler_config, fixed_shift=3.0)
    theirs = torch.stack([c["timestep"][0] for c in calls])  # already t / 1000
    torch.testing.assert_close(ours, theirs.float(), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(ours, unshifted), "the shift is applied"


def test_image_position_ids_are_built_once_per_bucket() -> None:
    """The pipeline builds them on the host; moved to a GPU every step, they synchronized the stream."""
    cpu = torch.device("cpu")
    ids = _image_ids(5, 8, cpu, torch.bfloat16)
    assert torch.equal(ids, FluxPipeline._prepare_latent_image_ids(1, 5, 8, cpu, torch.bfloat16))
    assert _image_ids(5, 8, cpu, torch.bfloat16) is ids
    other = _image_ids(8, 5, cpu, torch.bfloat16)
    assert other.shape == ids.shape and not torch.equal(other, ids)


def test_t5_length_is_512_or_a_shorter_tokenizer_limit(tiny_flux: Path, tmp_path: Path) -> None:
    assert family_for(tiny_flux).max_sequence_length == 512, "FLUX.1-dev's T5 length where the tokenizer allows it"
    model = tmp_path / "short-t5"
    shutil.copytree(tiny_flux, model)
    config_file = model / "tokenizer_2" / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "model_max_length": 128}))
    family = family_for(model)
    assert family.max_sequence_length == 128
    family.load_text_encoder(torch.device("cpu"), torch.float32)
    assert family.encode_prompts([PROMPT])[0]["prompt_embeds"].shape == (128, 32)
