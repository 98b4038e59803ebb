"""Krea 2's own behaviour (the shared contract is test_family_contract.py, the entry script and the LoRA file in
Krea2Pipeline test_family_e2e.py): every fact read from the checkpoint's own configs (a tiny model with other
taps, VAE statistics and shift settings than the published ones trains as its pipeline renders), Turbo's fixed
shift, captions of different lengths in one batch, exact resume, and the mistakes that must fail before anything
heavy loads (a checkpoint of another family, taps that do not fit the transformer, a ComfyUI export, references)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from safetensors.torch import load_file

from conftest import (ROOT, assert_cli_refuses_other_family, assert_resume_is_bit_equal, family_pipeline, read_losses,
                      train_in_process)
from trainer.config import TrainConfig, load_config
from trainer.families import check_pipeline
from trainer.families.base import load_family
from trainer.step.flow_matching import apply_shift
from utils.errors import ConfigError

QUICKSTART = "train_configs/quickstart_krea2_tiny.yaml"
CPU = torch.device("cpu")


def family_for(model: Path) -> Any:
    return load_family(TrainConfig(family="krea2", pretrained_model_name_or_path=str(model)))


def variant(tiny: Path, tmp_path: Path, name: str, index: Dict[str, Any] | None = None,
            scheduler: Dict[str, Any] | None = None, vae: Dict[str, Any] | None = None) -> Path:
    """A copy of the tiny Krea 2 folder with keys of model_index.json / the scheduler / the VAE config changed."""
    folder = tmp_path / name
    shutil.copytree(tiny, folder)
    for file, changes in (("model_index.json", index), ("scheduler/scheduler_config.json", scheduler),
                          ("vae/config.json", vae)):
        if changes:
            data = json.loads((folder / file).read_text())
            data.update(changes)
            (folder / file).write_text(json.dumps(data))
    return folder


def transformer_calls(pipe: Any, **call: Any) -> List[Dict[str, Any]]:
    calls: List[Dict[str, Any]] = []
    handle = pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append({**kw, "out": out[0]}),
                                                    with_kwargs=True)
    try:
        pipe(generator=torch.Generator().manual_seed(0), output_type="latent", **call)
    finally:
        handle.remove()
    return calls


# Not the published values: taps (0, 2, 3) of 3 layers, a steeper shift, other latent statistics.
OTHER_INDEX = {"text_encoder_select_layers": [0, 2, 3]}
OTHER_SCHEDULER = {"base_shift": 0.2, "max_shift": 2.0, "base_image_seq_len": 4, "max_image_seq_len": 64}
OTHER_VAE = {"latents_mean": [0.5, -0.5, 0.25, 0.0], "latents_std": [2.0, 0.5, 1.0, 3.0]}


def test_facts_come_from_the_checkpoints_configs(tiny_krea2: Path, tmp_path: Path) -> None:
    """A checkpoint whose taps, shift and VAE statistics differ from the published model's: the cached text is
    the pipeline's encoding with its taps, the shift the pipeline's sigmas at its token count, the latents its
    VAE normalisation, and it trains."""
    folder = variant(tiny_krea2, tmp_path, "other", OTHER_INDEX, OTHER_SCHEDULER, OTHER_VAE)
    family, pipe = family_for(folder), family_pipeline("krea2", folder)
    assert family.text_layers == (0, 2, 3) == pipe.text_encoder_select_layers
    family.load_text_encoder(CPU, torch.float32)
    ours = family.encode_prompts(["a red circle"])[0]["prompt_embeds"]
    theirs, mask = pipe.encode_prompt(["a red circle"])
    torch.testing.assert_close(ours, theirs[0][mask[0]])
    published, _ = family_pipeline("krea2", tiny_krea2).encode_prompt(["a red circle"])
    assert not torch.allclose(ours, published[0][mask[0]]), "other taps, other features"

    # The shift: the pipeline's scheduler sigmas at 64x96 (6 steps) are the engine's auto shift of its grid.
    steps = 6
    pipe(prompt="a red circle", height=64, width=96, num_inference_steps=steps, guidance_scale=0.0,
         output_type="latent")
    tokens = family.image_seq_len((1, 4, 64 // 8, 96 // 8))
    assert tokens == (64 // 16) * (96 // 16)
    grid = torch.linspace(1.0, 1 / steps, steps)
    ours = apply_shift(grid, "auto", tokens, family.scheduler_config, fixed_shift=1.0)
    torch.testing.assert_close(ours, pipe.scheduler.sigmas[:-1].float(), atol=1e-6, rtol=1e-5)
    mu = 0.2 + (2.0 - 0.2) / (64 - 4) * (tokens - 4)
    torch.testing.assert_close(ours, math.exp(mu) / (math.exp(mu) + (1 / grid - 1)))

    family.load_vae(CPU, torch.float32)
    pixels = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        raw = pipe.vae.encode(pixels[:, :, None]).latent_dist.mode()[:, :, 0]
    mean, std = torch.tensor(OTHER_VAE["latents_mean"]).view(1, 4, 1, 1), torch.tensor(OTHER_VAE["latents_std"])
    torch.testing.assert_close(family.encode_images(pixels), (raw - mean) / std.view(1, 4, 1, 1))


@pytest.mark.e2e
def test_a_checkpoint_with_other_facts_trains(tiny_krea2: Path, sample_data: Path, tmp_path: Path) -> None:
    folder = variant(tiny_krea2, tmp_path, "other", OTHER_INDEX, OTHER_SCHEDULER, OTHER_VAE)
    out = tmp_path / "run"
    train_in_process(QUICKSTART, "krea2", f"pretrained_model_name_or_path={folder}",
                     f"data_config.img_dir={sample_data}",
                     f"output_dir={out}", "report_to=none", "max_train_steps=3", "data_config.train_batch_size=2",
                     "checkpointing_steps=100")
    losses = read_losses(out)
    assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses)


def test_turbo_has_the_fixed_shift_and_renders_without_cfg(tiny_krea2: Path, tiny_krea2_turbo: Path,
                                                           logs: List[Dict[str, Any]]) -> None:
    """is_distilled (model_index.json; the tiny model of krea/Krea-2-Turbo's configs): mu = 1.15 at every
    resolution, as Krea2Pipeline renders it; CFG off; a warning to train Raw."""
    folder = tiny_krea2_turbo
    family, pipe = family_for(folder), family_pipeline("krea2", folder)
    assert family.default_cfg_scale == 0.0
    assert any("is_distilled" in r["message"] and "Krea-2-Raw" in r["message"] for r in logs)
    grid = torch.linspace(1.0, 0.25, 4)
    for height, width in ((64, 64), (128, 96)):
        pipe(prompt="x", height=height, width=width, num_inference_steps=4, guidance_scale=0.0, output_type="latent")
        tokens = family.image_seq_len((1, 4, height // 8, width // 8))
        ours = apply_shift(grid, "auto", tokens, family.scheduler_config, fixed_shift=1.0)
        torch.testing.assert_close(ours, pipe.scheduler.sigmas[:-1].float(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(ours, math.exp(1.15) / (math.exp(1.15) + (1 / grid - 1)))
    raw = family_for(tiny_krea2)
    assert raw.default_cfg_scale == 4.5
    assert apply_shift(grid, "auto", 16, raw.scheduler_config, 1.0)[1] != ours[1], "Raw's shift follows the size"


def test_captions_of_different_lengths_in_one_batch(tiny_krea2: Path) -> None:
    """Cached captions of unequal length, right-padded with a bool mask: each sample's prediction equals its
    prediction alone (text position ids are zero, so the padding changes nothing)."""
    family, pipe = family_for(tiny_krea2), family_pipeline("krea2", tiny_krea2)
    family.load_text_encoder(CPU, torch.float32)
    conds = family.encode_prompts(["a cat", "a photo of a red chair with a small dog sitting on it"])
    assert conds[0]["prompt_embeds"].shape[0] < conds[1]["prompt_embeds"].shape[0]
    assert conds[0]["prompt_embeds"].shape[1:] == (3, 16), "(tokens, taps, width)"
    latents = torch.randn(2, 4, 8, 12, generator=torch.Generator().manual_seed(0))
    sigmas = torch.tensor([0.3, 0.8])
    batch = family.collate_text(conds, CPU, torch.float32)
    assert batch["prompt_embeds_mask"].dtype == torch.bool
    with torch.no_grad():
        both = family.predict(pipe.transformer, latents, sigmas, batch)
        alone = [family.predict(pipe.transformer, latents[i:i + 1], sigmas[i:i + 1],
                                family.collate_text([conds[i]], CPU, torch.float32)) for i in range(2)]
    assert family.collate_text([conds[0]], CPU, torch.float32)["prompt_embeds_mask"] is None, "unmasked alone"
    for i in range(2):
        torch.testing.assert_close(both[i], alone[i][0], atol=1e-5, rtol=1e-4)


def test_taps_that_do_not_fit_the_transformer_are_named(tiny_krea2: Path, tmp_path: Path) -> None:
    folder = variant(tiny_krea2, tmp_path, "four-taps", {"text_encoder_select_layers": [0, 1, 2, 3]})
    with pytest.raises(ConfigError, match=r"model_index\.json: text_encoder_select_layers has 4 layers .* "
                                          r"num_text_layers 3"):
        family_for(folder)
    folder = variant(tiny_krea2, tmp_path, "deep-taps", {"text_encoder_select_layers": [1, 2, 9]})
    with pytest.raises(ConfigError, match=r"taps hidden state 9, but the text encoder has 3 layers"):
        family_for(folder).load_text_encoder(CPU, torch.float32)


def test_a_checkpoint_of_another_family_fails_before_loading(tiny_krea2: Path, tiny_qwen_image: Path,
                                                             sample_data: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    """Both ways round, naming both pipeline classes and the entry script to use."""
    with pytest.raises(ConfigError, match=r"QwenImagePipeline checkpoint.*'krea2'.*trains Krea2Pipeline; train it "
                                          r"with train\.py \(family: qwen_image\)"):
        check_pipeline("krea2", str(tiny_qwen_image))
    for family, profile, model, named in (
            ("krea2", QUICKSTART, tiny_qwen_image, "train.py"),
            ("qwen_image", "train_configs/quickstart_tiny.yaml", tiny_krea2, "train_krea2_lora.py")):
        assert_cli_refuses_other_family(family, profile, model, named, ["Krea2Pipeline", "QwenImagePipeline"],
                                        sample_data, tmp_path / family, capsys)


def test_config_refuses_reference_images(sample_data: Path) -> None:
    """diffusers has no Krea 2 edit pipeline: a reference folder is an error, not silently ignored."""
    with pytest.raises(ConfigError, match=r"key 'data_config\.control_dir': reference images are only used by"):
        load_config(ROOT / QUICKSTART, [f"data_config.img_dir={sample_data}",
                                        f"data_config.control_dir={sample_data}"], default_family="krea2")


# Every linear of the transformer, the text fusion and the shared modulation included: every rename is used.
EVERY_LINEAR = ["to_q", "to_k", "to_v", "to_gate", "to_out.0", "ff.gate", "ff.up", "ff.down", "img_in",
                "final_layer.linear", "time_embed.linear_1", "time_embed.linear_2", "time_mod_proj", "txt_in.linear_1",
                "txt_in.linear_2", "projector"]


@pytest.mark.e2e
def test_comfyui_file_has_comfyuis_names_and_reads_back(tiny_krea2: Path, sample_data: Path, tmp_path: Path) -> None:
    """The ComfyUI file names ComfyUI's modules (comfy/ldm/krea2/model.py: blocks.N.attn.wq, mlp, txtfusion,
    first, tmlp, txtmlp, tproj, last) with alpha per module; diffusers' own converter for such files
    (Krea2Pipeline.lora_state_dict) turns it back into our diffusers file exactly."""
    from diffusers import Krea2Pipeline

    out = tmp_path / "run"
    train_in_process(QUICKSTART, "krea2", f"pretrained_model_name_or_path={tiny_krea2}",
                     f"data_config.img_dir={sample_data}", f"output_dir={out}", "report_to=none", "max_train_steps=2",
                     "checkpointing_steps=100", "rank=4", "lora_alpha=8", "lora_export_formats=[diffusers,comfyui]",
                     f"lora_target_modules=[{','.join(EVERY_LINEAR)}]")
    ours = load_file(str(out / "pytorch_lora_weights.safetensors"))
    comfy = load_file(str(out / "pytorch_lora_weights_comfyui.safetensors"))
    modules = {k.removeprefix("diffusion_model.").rsplit(".lora_", 1)[0] for k in comfy if ".lora_" in k}
    assert all(k.startswith("diffusion_model.") for k in comfy)
    assert {m.split(".")[0] for m in modules} == {"blocks", "txtfusion", "first", "last", "tmlp", "txtmlp", "tproj"}
    assert "blocks.1.attn.wq" in modules and "txtfusion.refiner_blocks.0.mlp.down" in modules
    assert not any(word in k for k in comfy for word in ("transformer_blocks", "text_fusion", "to_q", ".ff."))
    alphas = {k: v for k, v in comfy.items() if k.endswith(".alpha")}
    assert len(alphas) == len(modules) == len(ours) // 2 and all(float(v) == 8.0 for v in alphas.values())
    back = Krea2Pipeline.lora_state_dict({k: v for k, v in comfy.items() if not k.endswith(".alpha")})
    back = back[0] if isinstance(back, tuple) else back
    assert set(back) == set(ours) and all(torch.equal(back[k], ours[k]) for k in ours)


@pytest.mark.e2e
@pytest.mark.parametrize("adapter, saved", [("lora", "pytorch_lora_weights.safetensors"),
                                            ("lokr", "adapter_model.safetensors")])
def test_resume_is_bit_equal(adapter: str, saved: str, tiny_krea2: Path, sample_data: Path, tmp_path: Path) -> None:
    """Four steps straight, and two steps then a resume to four: the same adapter (LoRA or LoKr) and EMA, bit
    for bit (caption and adapter dropout draw from every random stream; batches of two captions of different
    lengths, so the text mask is in play)."""
    assert_resume_is_bit_equal(QUICKSTART, "krea2", tiny_krea2, sample_data, tmp_path, adapter, saved)
