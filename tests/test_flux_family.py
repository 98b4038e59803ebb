"""The FLUX family against FluxPipeline itself: LoRA presets, the timestep shift, text conditions,
packing / position ids / guidance / t/1000, VAE normalisation, the T5 length."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel

from trainer.adapters import add_lora
from trainer.config import TrainConfig
from trainer.families.flux.model import FluxFamily
from trainer.families.flux.spec import FLUX_LORA_PRESETS
from trainer.flow_matching import apply_shift

PROMPT = "a red circle on a yellow background"
MODULATION = ("norm1.linear", "norm1_context.linear", "norm.linear", "norm_out.linear")


def family_for(model: Path, **kw: Any) -> FluxFamily:
    cfg = TrainConfig(family="flux", pretrained_model_name_or_path=str(model))
    for key, value in kw.items():
        setattr(cfg, key, value)
    return FluxFamily(cfg)


@pytest.fixture(scope="module")
def pipe(tiny_flux: Path) -> FluxPipeline:
    pipe = FluxPipeline.from_pretrained(tiny_flux)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def record_transformer_calls(pipe: FluxPipeline, **call: Any) -> List[Dict[str, Any]]:
    """Run the pipeline and return each transformer call's keyword inputs and its output."""
    calls: List[Dict[str, Any]] = []

    def hook(module: torch.nn.Module, args: tuple, kwargs: Dict[str, Any], output: Any) -> None:
        calls.append({**kwargs, "output": output[0]})

    handle = pipe.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(0), output_type="latent", **call)
    finally:
        handle.remove()
    return calls


# -- LoRA presets -----------------------------------------------------------------------------------
def tiny_transformer() -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))


def lora_layers(model: torch.nn.Module) -> set:
    return {name for name, module in model.named_modules() if hasattr(module, "lora_A") and len(module.lora_A)}


IMG_ATTN = {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"}
TXT_ATTN = {"attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"}
MLP = {"ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"}
SINGLE_ATTN = {"attn.to_q", "attn.to_k", "attn.to_v"}
OUTER = {"x_embedder", "context_embedder", "proj_out", "time_text_embed.timestep_embedder.linear_1",
         "time_text_embed.timestep_embedder.linear_2", "time_text_embed.text_embedder.linear_1",
         "time_text_embed.text_embedder.linear_2"}
EXPECTED = {  # preset -> (double-block layers, single-block layers, layers outside the blocks)
    "attention": (IMG_ATTN, SINGLE_ATTN, set()),
    "attention_mlp": (IMG_ATTN | TXT_ATTN | MLP, SINGLE_ATTN | {"proj_mlp", "proj_out"}, set()),
    "all_linear": (IMG_ATTN | TXT_ATTN | MLP, SINGLE_ATTN | {"proj_mlp", "proj_out"}, OUTER),
}


@pytest.mark.parametrize("preset", list(EXPECTED))
def test_presets_hit_the_intended_layers_and_never_modulation(preset: str) -> None:
    model = tiny_transformer()
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    add_lora(model, TrainConfig(family="flux", lora_target=preset), FLUX_LORA_PRESETS)
    double, single, outer = EXPECTED[preset]
    expected = {f"{blocks}.{i}.{layer}" for i in range(2)
                for blocks, layers in (("transformer_blocks", double), ("single_transformer_blocks", single))
                for layer in layers} | outer
    assert lora_layers(model) == expected
    assert not any(name.endswith(MODULATION) for name in lora_layers(model)), "modulation is never a target"
    assert ("proj_out" in lora_layers(model)) == (preset == "all_linear"), "the final layer only in all_linear"
    if preset == "all_linear":  # every linear layer but modulation and the guidance embedder
        left = {n for n in linears - expected if not n.endswith(MODULATION)}
        assert left == {"time_text_embed.guidance_embedder.linear_1", "time_text_embed.guidance_embedder.linear_2"}


# -- the timestep shift, packing, ids, guidance, t/1000 ---------------------------------------------
@pytest.mark.parametrize("height, width", [(64, 64), (40, 64), (128, 96)])
def test_auto_shift_gives_the_pipelines_sigmas(pipe: FluxPipeline, tiny_flux: Path, height: int, width: int) -> None:
    """The engine's shift from the family's scheduler config, at the family's image_seq_len, equals
    the timesteps FluxPipeline passes to the transformer at that resolution."""
    steps = 6
    calls = record_transformer_calls(pipe, height=height, width=width, num_inference_steps=steps,
                                     max_sequence_length=16)
    family = family_for(tiny_flux)
    latent_shape = (1, 16, height * 2 // family.pixel_multiple, width * 2 // family.pixel_multiple)
    seq_len = family.image_seq_len(latent_shape)
    assert seq_len == calls[0]["hidden_states"].shape[1]
    unshifted = torch.from_numpy(np.linspace(1.0, 1 / steps, steps)).float()  # the pipeline's sigmas
    ours = apply_shift(unshifted, "auto", seq_len, family.scheduler_config, fixed_shift=3.0)
    theirs = torch.stack([c["timestep"][0] for c in calls])  # already t / 1000
    torch.testing.assert_close(ours, theirs.float(), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(ours, unshifted), "the shift is applied"


def test_predict_is_the_pipelines_transformer_call(pipe: FluxPipeline, tiny_flux: Path) -> None:
    """Packing, position ids, guidance embedding and t/1000 as FluxPipeline does them."""
    height, width = 40, 64
    calls = record_transformer_calls(pipe, height=height, width=width, num_inference_steps=2,
                                     guidance_scale=2.5, max_sequence_length=16)
    family = family_for(tiny_flux, guidance_scale=2.5)
    call = calls[1]
    unpack = lambda x: FluxPipeline._unpack_latents(x, height, width, pipe.vae_scale_factor)  # noqa: E731
    text = {"prompt_embeds": call["encoder_hidden_states"], "pooled_prompt_embeds": call["pooled_projections"]}
    with torch.no_grad():
        ours = family.predict(pipe.transformer, unpack(call["hidden_states"]), call["timestep"], text)
    torch.testing.assert_close(ours, unpack(call["output"]))
    with pytest.raises(ValueError):
        family.predict(pipe.transformer, unpack(call["hidden_states"]), call["timestep"], text,
                       [unpack(call["hidden_states"])])



def test_image_position_ids_are_built_once_per_bucket() -> None:
    """The pipeline builds them on the host; moved to a GPU every step, they synchronized the stream."""
    from trainer.families.flux.model import _image_ids

    cpu = torch.device("cpu")
    ids = _image_ids(5, 8, cpu, torch.bfloat16)
    assert torch.equal(ids, FluxPipeline._prepare_latent_image_ids(1, 5, 8, cpu, torch.bfloat16))
    assert _image_ids(5, 8, cpu, torch.bfloat16) is ids
    other = _image_ids(8, 5, cpu, torch.bfloat16)
    assert other.shape == ids.shape and not torch.equal(other, ids)

# -- text and images --------------------------------------------------------------------------------
def test_text_conditions_match_the_pipeline(pipe: FluxPipeline, tiny_flux: Path) -> None:
    family = family_for(tiny_flux)
    assert family.max_sequence_length == 512, "FLUX.1-dev's T5 length where the tokenizer allows it"
    family.load_text_encoder(torch.device("cpu"), torch.float32)
    conds = family.encode_prompts([PROMPT, ""])
    embeds, pooled, _ = pipe.encode_prompt([PROMPT, ""], prompt_2=None, max_sequence_length=512)
    for i, cond in enumerate(conds):  # same maths; CPU kernels may sum in another order
        torch.testing.assert_close(cond["prompt_embeds"], embeds[i], atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(cond["pooled_prompt_embeds"], pooled[i], atol=1e-4, rtol=1e-3)
    batch = family.collate_text(conds, torch.device("cpu"), torch.bfloat16)
    assert batch["prompt_embeds"].shape == (2, 512, 32) and batch["pooled_prompt_embeds"].shape == (2, 32)
    assert batch["prompt_embeds"].dtype == torch.bfloat16
    family.unload_text_encoder()
    assert family.text_pipe is None


def test_t5_length_follows_a_shorter_tokenizer_limit(tiny_flux: Path, tmp_path: Path) -> None:
    model = tmp_path / "short-t5"
    shutil.copytree(tiny_flux, model)
    config_file = model / "tokenizer_2" / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "model_max_length": 128}))
    family = family_for(model)
    assert family.max_sequence_length == 128
    family.load_text_encoder(torch.device("cpu"), torch.float32)
    assert family.encode_prompts([PROMPT])[0]["prompt_embeds"].shape == (128, 32)


def test_latents_are_normalised_with_the_vae_shift_and_scale(pipe: FluxPipeline, tiny_flux: Path) -> None:
    family = family_for(tiny_flux)
    family.load_vae(torch.device("cpu"), torch.float32)
    pixels = torch.rand(1, 3, 40, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = family.encode_images(pixels)
    assert latents.shape == (1, 16, 20, 32)
    raw = pipe.vae.encode(pixels).latent_dist.mode()
    torch.testing.assert_close(latents, (raw - 0.1159) * 0.3611)
    # Decoding is the pipeline's: latents / scaling_factor + shift_factor into the VAE decoder.
    torch.testing.assert_close(family.decode_latents(latents), pipe.vae.decode(raw).sample, atol=1e-5, rtol=1e-4)
