"""Qwen-Image-2.1's own behaviour (the entry script and the LoRA file in QwenImage21Pipeline are in
test_family_e2e.py): the training step is the pipeline's transformer call (references first, target last, the
slots of image_pad_mask), every fact read from the checkpoint's own configs (a tiny model with other VAE
statistics and shift settings than the published ones trains as its pipeline renders), samples of different text
layouts in one batch, 1-3 references, validation rendered from the cache equal to the pipeline's own render,
exact resume, and the mistakes that must fail before anything heavy loads."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import (ROOT, assert_cli_refuses_other_family, assert_resume_is_bit_equal, family_pipeline,
                      lora_keys_match, read_losses, train_in_process)
from trainer.config import TrainConfig, load_config
from trainer.config.schema import DataConfig
from trainer.families import check_pipeline
from trainer.families.base import load_family
from trainer.step.flow_matching import apply_shift
from utils.errors import ConfigError

QUICKSTART = "train_configs/quickstart_qwen_image21_tiny.yaml"
CPU = torch.device("cpu")
AREA = 64 * 64  # the tiny runs' reference area
VAE, SCHEDULER = "vae/config.json", "scheduler/scheduler_config.json"


def family_for(model: Path, area: int = AREA, **data: Any) -> Any:
    return load_family(TrainConfig(family="qwen_image21", pretrained_model_name_or_path=str(model),
                                   data_config=DataConfig(reference_vae_area=area, **data)))


def variant(tiny: Path, tmp_path: Path, name: str, files: Dict[str, Dict[str, Any]]) -> Path:
    """A copy of the tiny folder with keys of its JSON files changed (``files``: file -> changes)."""
    folder = tmp_path / name
    shutil.copytree(tiny, folder)
    for file, changes in files.items():
        path = folder / file
        data = json.loads(path.read_text())
        data.update(changes)
        path.write_text(json.dumps(data))
    return folder


def reference(seed: int, width: int = 48, height: int = 80) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8))


def first_call(pipe: Any, **call: Any) -> Dict[str, Any]:
    """The transformer's first call in an uncached render (its inputs and output)."""
    calls: List[Dict[str, Any]] = []
    handle = pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append({**kw, "out": out[0]}),
                                                    with_kwargs=True)
    try:
        pipe(generator=torch.Generator().manual_seed(0), output_type="latent", use_kv_cache=False, **call)
    finally:
        handle.remove()
    return calls[0]


def ready(family: Any) -> Any:
    family.load_text_encoder(CPU, torch.float32)
    family.load_vae(CPU, torch.float32)
    return family


# Not the published values (nor the tiny model's): a steeper shift, other latent statistics.
OTHER_SCHEDULER = {"base_shift": 0.2, "max_shift": 2.0, "base_image_seq_len": 4, "max_image_seq_len": 64}
OTHER_VAE = {"latents_mean": [0.3, -0.6, 0.1, 0.0, 0.9, -0.2, 0.4, -1.0],
             "latents_std": [2.0, 0.5, 1.0, 3.0, 0.7, 1.5, 2.5, 0.9]}


@pytest.mark.parametrize("refs", [0, 1, 3])
def test_the_training_step_is_the_pipelines_transformer_call(tiny_qwen_image21: Path, tmp_path: Path,
                                                             refs: int) -> None:
    """With 0, 1 and 3 references, on a checkpoint with other VAE statistics: the cached condition is the
    pipeline's encode_prompt (embeddings and slots), the reference latents its VAE encoding of the same pixels
    (RGBA, the file's statistics), and predict on the pipeline's noisy target equals the target rows of its
    transformer output."""
    folder = variant(tiny_qwen_image21, tmp_path, "other", {VAE: OTHER_VAE})
    family, pipe = ready(family_for(folder)), family_pipeline("qwen_image21", folder)
    images = [reference(i, 48 + 16 * i, 80 - 16 * i) for i in range(refs)]
    call = first_call(pipe, prompt="make it blue", image=images or None, height=64, width=96, num_inference_steps=2,
                      output_resolution=int(math.isqrt(AREA)))
    cond = family.encode_prompts(["make it blue"], [images])[0]
    length = cond["prompt_embeds"].shape[0]
    assert torch.equal(cond["prompt_embeds"], call["encoder_hidden_states"][0])
    assert torch.equal(cond["image_pad_mask"], call["img_mask"][0, :length])
    assert int(cond["image_pad_mask"].sum()) == sum(w * h // 1024 for w, h in map(lambda i: family.reference_size(
        *i.size), images)), "one slot per 32x32 px of each reference"

    latents, start = [], 0
    for image in images:
        width, height = family.reference_size(*image.size)
        pixels = pipe.image_processor.preprocess(image.convert("RGBA"), width=width, height=height)
        assert float(pixels[:, 3].min()) == 1.0, "the pipeline's opaque alpha, which encode_images appends"
        z = family.encode_images(pixels[:, :3])
        n = z.shape[-2] * z.shape[-1]
        torch.testing.assert_close(z.flatten(2).transpose(1, 2), call["hidden_states"][:, start:start + n],
                                   atol=1e-6, rtol=1e-6)
        latents.append(z)
        start += n
    target = call["hidden_states"][:, start:].transpose(1, 2).reshape(1, 8, 64 // 16, 96 // 16)
    with torch.no_grad():
        ours = family.predict(pipe.transformer, target, call["timestep"],
                              family.collate_text([cond], CPU, torch.float32), latents)
    torch.testing.assert_close(ours.flatten(2).transpose(1, 2), call["out"][:, -target[0, 0].numel():],
                               atol=1e-6, rtol=1e-6)
    mean = torch.tensor(OTHER_VAE["latents_mean"]).view(1, 8, 1, 1)
    std = torch.tensor(OTHER_VAE["latents_std"]).view(1, 8, 1, 1)
    raw = pipe.vae.encode(torch.cat([torch.zeros(1, 3, 32, 32), torch.ones(1, 1, 32, 32)], 1)[:, :, None])
    torch.testing.assert_close(family.encode_images(torch.zeros(1, 3, 32, 32)),
                               (raw.latent_dist.mode()[:, :, 0] - mean) / std)


def test_the_shift_comes_from_the_scheduler_config(tiny_qwen_image21: Path, tmp_path: Path) -> None:
    """The engine's auto shift at the target's token count (unpatched: h * w) is the pipeline's sigmas."""
    folder = variant(tiny_qwen_image21, tmp_path, "other", {SCHEDULER: OTHER_SCHEDULER})
    family, pipe = family_for(folder), family_pipeline("qwen_image21", folder)
    steps = 6
    pipe(prompt="a red circle", height=64, width=96, num_inference_steps=steps, output_type="latent")
    tokens = family.image_seq_len((1, 8, 64 // 16, 96 // 16))
    assert tokens == 4 * 6
    grid = torch.linspace(1.0, 1 / steps, steps)
    ours = apply_shift(grid, "auto", tokens, family.scheduler_config, fixed_shift=1.0)
    mu = 0.2 + (2.0 - 0.2) / (64 - 4) * (tokens - 4)
    torch.testing.assert_close(ours, math.exp(mu) / (math.exp(mu) + (1 / grid - 1)))
    # The scheduler then stretches to shift_terminal (inference only): compare before that stretch.
    pipe.scheduler.register_to_config(shift_terminal=None)
    pipe(prompt="a red circle", height=64, width=96, num_inference_steps=steps, output_type="latent")
    torch.testing.assert_close(ours, pipe.scheduler.sigmas[:-1].float(), atol=1e-6, rtol=1e-5)


def test_samples_of_different_text_layouts_in_one_batch(tiny_qwen_image21: Path) -> None:
    """Captions of unequal length (text positions are sequence indices, so padding would move the target): each
    sample's prediction in the batch equals its prediction alone, exactly as run alone."""
    family, pipe = ready(family_for(tiny_qwen_image21)), family_pipeline("qwen_image21", tiny_qwen_image21)
    images = [reference(0, 64, 64)]
    conds = family.encode_prompts(["a cat", "a photo of a red chair with a dog", "a cat"], [images] * 3)
    assert conds[0]["prompt_embeds"].shape[0] < conds[1]["prompt_embeds"].shape[0]
    batch = family.collate_text(conds, CPU, torch.float32)
    assert batch["layout"].tolist() == [0, 1, 0]
    latents = torch.randn(3, 8, 4, 6, generator=torch.Generator().manual_seed(0))
    refs = [torch.randn(3, 8, 4, 4, generator=torch.Generator().manual_seed(1))]
    sigmas = torch.tensor([0.3, 0.8, 0.5])
    with torch.no_grad():
        both = family.predict(pipe.transformer, latents, sigmas, batch, refs)
        alone = [family.predict(pipe.transformer, latents[i:i + 1], sigmas[i:i + 1],
                                family.collate_text([conds[i]], CPU, torch.float32), [refs[0][i:i + 1]])
                 for i in range(3)]
    for i in range(3):
        torch.testing.assert_close(both[i], alone[i][0], atol=1e-6, rtol=1e-5)


def test_a_render_from_the_cache_equals_the_pipelines_render(tiny_qwen_image21: Path) -> None:
    """Validation's pipeline (the family's render_pipeline) given the cached condition, its slots and the
    reference renders the image QwenImage21Pipeline renders from the prompt and the reference."""
    family, pipe = ready(family_for(tiny_qwen_image21)), family_pipeline("qwen_image21", tiny_qwen_image21)
    images = [reference(0), reference(1, 64, 64)]
    call = dict(image=images, height=64, width=64, num_inference_steps=3, output_type="np")
    want = pipe(prompt="make it blue", generator=torch.Generator().manual_seed(1), output_resolution=64,
                **call).images
    render = family.render_pipeline(pipe.transformer)
    assert type(render).__name__ == "QwenImage21RenderPipeline" and render.text_encoder is None
    cond = family.encode_prompts(["make it blue"], [images])[0]
    got = render(**family.render_kwargs(cond, torch.float32, CPU), generator=torch.Generator().manual_seed(1),
                 **call).images
    assert np.abs(want - got).max() == 0.0


@pytest.mark.e2e
def test_a_checkpoint_with_other_facts_trains_with_three_references(tiny_qwen_image21: Path,
                                                                    tmp_path: Path) -> None:
    """Other VAE statistics and shift, three reference folders, batches of two, validation prompts with their own
    references rendered from the cache."""
    from image_datasets.sample_data import make_edit_dataset

    data = make_edit_dataset(tmp_path / "edit3", size=64, count=4, references=3)
    refs = [sorted((data.parent / f"control_{i}").iterdir())[0] for i in range(3)]
    folder = variant(tiny_qwen_image21, tmp_path, "other", {VAE: OTHER_VAE, SCHEDULER: OTHER_SCHEDULER})
    out = tmp_path / "run"
    train_in_process(QUICKSTART, "qwen_image21", f"pretrained_model_name_or_path={folder}",
                     f"data_config.img_dir={data}", f"output_dir={out}", "report_to=none", "max_train_steps=3",
                     "data_config.train_batch_size=2", "checkpointing_steps=100", "validation.every_n_steps=3",
                     "validation.steps=2", "validation.width=64", "validation.height=64",
                     f"validation.prompts=[{{prompt: make it red, reference_images: [{refs[0]}, {refs[2]}]}}, "
                     f"a blue square]")
    losses = read_losses(out)
    assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses)
    samples = sorted((out / "samples" / "step-000003").glob("prompt-*.png"))
    assert len(samples) == 2 and all(Image.open(p).size == (64, 64) for p in samples)


def test_the_distilled_checkpoint_warns(tiny_qwen_image21: Path, tmp_path: Path,
                                        logs: List[Dict[str, Any]]) -> None:
    folder = variant(tiny_qwen_image21, tmp_path, "turbo", {"model_index.json": {"sample_sigmas": [1.0, 0.8, 0.4]}})
    family = family_for(folder)
    assert family.distilled and family.default_cfg_scale == family.cfg_off_value == 1.0
    assert any("sample_sigmas" in r["message"] and "Qwen/Qwen-Image-2.1" in r["message"] for r in logs)
    assert not family_for(tiny_qwen_image21).distilled


def test_configs_that_cannot_work_are_refused_before_loading(tiny_qwen_image21: Path, tmp_path: Path) -> None:
    """A VAE that is not 16x, a transformer that does not read its latents, a reference area outside the
    processor's bounds, a separate condition area, four references: each named."""
    folder = variant(tiny_qwen_image21, tmp_path, "8x", {VAE: {"temperal_downsample": [False, True, True]}})
    with pytest.raises(ConfigError, match=r"vae/config\.json: temperal_downsample .* 8x VAE, but "
                                          r"QwenImage21Pipeline works at 16x"):
        family_for(folder)
    folder = variant(tiny_qwen_image21, tmp_path, "z16", {VAE: {"z_dim": 16}})
    with pytest.raises(ConfigError, match=r"transformer/config\.json: in_channels 8 .* z_dim 16"):
        family_for(folder)
    family = family_for(tiny_qwen_image21, area=2048 * 2048)
    family.check_references(0)  # text-to-image: the area does not matter
    with pytest.raises(ConfigError, match=r"key 'data_config\.reference_vae_area': 4194304 px .* outside the "
                                          r"1024\.\.1048576 px .*preprocessor_config\.json"):
        family.check_references(1)
    with pytest.raises(ConfigError, match=r"reference_condition_area.*resizes each reference once"):
        family_for(tiny_qwen_image21, reference_condition_area=128 * 128)
    with pytest.raises(ConfigError, match=r"at most 3 reference images per sample, but 4 control folders"):
        family_for(tiny_qwen_image21).check_references(4)


def test_a_checkpoint_of_another_family_fails_before_loading(tiny_qwen_image21: Path, tiny_qwen_image_edit: Path,
                                                             sample_data: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    """Both ways round, naming both pipeline classes and the entry script to use."""
    with pytest.raises(ConfigError, match=r"QwenImageEditPipeline checkpoint.*'qwen_image21'.*trains "
                                          r"QwenImage21Pipeline; train it with train_qwen_edit_lora\.py"):
        check_pipeline("qwen_image21", str(tiny_qwen_image_edit))
    for family, profile, model, named in (
            ("qwen_image21", QUICKSTART, tiny_qwen_image_edit, "train_qwen_edit_lora.py"),
            ("qwen_image_edit", "train_configs/quickstart_edit_tiny.yaml", tiny_qwen_image21,
             "train_qwen_image21_lora.py")):
        assert_cli_refuses_other_family(family, profile, model, named, ["QwenImage21Pipeline", "QwenImageEditPipeline"],
                                        sample_data, tmp_path / family, capsys)


def test_comfyui_export_is_refused(sample_data: Path) -> None:
    with pytest.raises(ConfigError, match=r"lora_export_formats.*img_mlp\.gate_up"):
        load_config(ROOT / QUICKSTART, [f"data_config.img_dir={sample_data}",
                                        "lora_export_formats=[diffusers,comfyui]"], default_family="qwen_image21")


@pytest.mark.e2e
@pytest.mark.parametrize("adapter, saved", [("lora", "pytorch_lora_weights.safetensors"),
                                            ("lokr", "adapter_model.safetensors")])
def test_resume_is_bit_equal(adapter: str, saved: str, tiny_qwen_image21: Path, edit_data: Path,
                             tmp_path: Path) -> None:
    """Four steps straight, and two steps then a resume to four: the same adapter (LoRA or LoKr) and EMA, bit
    for bit (caption and adapter dropout draw from every random stream; batches of two samples with a reference
    and captions of different lengths, so the layout groups are in play)."""
    assert_resume_is_bit_equal(QUICKSTART, "qwen_image21", tiny_qwen_image21, edit_data, tmp_path, adapter,
                               saved)


@pytest.mark.e2e
def test_lora_with_references_loads_in_the_pipeline_and_changes_its_render(tiny_qwen_image21: Path, edit_data: Path,
                                                                           tmp_path: Path) -> None:
    """Trained with one reference: QwenImage21Pipeline.load_lora_weights takes the file with no unexpected or
    missing keys and alpha kept, and the LoRA changes a render with a reference."""
    out = tmp_path / "run"
    train_in_process(QUICKSTART, "qwen_image21", f"pretrained_model_name_or_path={tiny_qwen_image21}",
                     f"data_config.img_dir={edit_data}", f"output_dir={out}", "report_to=none",
                     "learning_rate=5e-2", "rank=4", "lora_alpha=2", "checkpointing_steps=100", "max_train_steps=6",
                     "lora_target=all_linear")
    pipe = family_pipeline("qwen_image21", tiny_qwen_image21)
    image = Image.open(sorted((edit_data.parent / "control").iterdir())[0])
    call = dict(prompt="make it blue", image=image, height=64, width=64, num_inference_steps=2, output_resolution=64,
                output_type="np")
    base = pipe(generator=torch.Generator().manual_seed(0), **call).images
    lora_keys_match(pipe, out, "trained")
    assert pipe.transformer.peft_config["trained"].lora_alpha == 2
    assert {m.scaling["trained"] for m in pipe.transformer.modules() if hasattr(m, "scaling")} == {0.5}
    changed = pipe(generator=torch.Generator().manual_seed(0), **call).images
    assert np.abs(changed - base).mean() > 1e-3


@pytest.mark.parametrize("preset", ["attention", "attention_mlp", "all_linear"])
def test_the_planners_block_formula_matches_the_saved_tensors(preset: str) -> None:
    """A real QwenImage21TransformerBlock (small width, bf16 autocast, LoRA): the bytes autograd saves in one
    block forward over the joint sequence equal the planner's per-block formula (SavedActivations in spec.py)."""
    import diffusers
    from peft import LoraConfig

    import trainer.planner as mp
    from test_memory_planner import saved_block_bytes, train_config
    from trainer.model.block_swap import inner_tensors
    from trainer.families import SPECS
    from trainer.planner.model import _build, _transformer_spec

    torch.manual_seed(0)
    config = {"_class_name": "QwenImage21Transformer2DModel", "patch_size": 1, "in_channels": 16,
              "out_channels": 16, "num_layers": 1, "attention_head_dim": 64, "num_attention_heads": 2,
              "context_in_dim": 32, "axes_dims_rope": [16, 24, 24]}
    model = diffusers.QwenImage21Transformer2DModel.from_config(config).to(torch.bfloat16).requires_grad_(False)
    model.add_adapter(LoraConfig(r=8, lora_alpha=8, target_modules=SPECS["qwen_image21"].lora_presets[preset]))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    n_img, n_txt = 256, 32
    seen: Dict[str, Any] = {}
    handle = model.transformer_blocks[0].register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    with torch.no_grad():
        model(hidden_states=torch.randn(1, n_img, 16, dtype=torch.bfloat16),
              encoder_hidden_states=torch.randn(1, n_txt, 32, dtype=torch.bfloat16), timestep=torch.rand(1),
              img_shapes=[[(1, 16, 16)]], img_mask=torch.cat([torch.zeros(1, n_txt, dtype=torch.bool),
                                                              torch.ones(1, n_img // 4, dtype=torch.bool)], 1),
              return_dict=False)
    handle.remove()
    kwargs = {**seen, "hidden_states": seen["hidden_states"].detach().requires_grad_(True),
              # a LoRA on the timestep embedder gives the shared modulation a gradient
              "modulation": seen["modulation"].detach().requires_grad_(preset == "all_linear")}
    exclude = [*model.parameters(), *(t for p in model.parameters() for t in inner_tensors(p)), *model.buffers(),
               *(t for t in seen.values() if isinstance(t, torch.Tensor) and t is not seen["hidden_states"]
                 and t is not seen["modulation"])]
    measured = saved_block_bytes(model.transformer_blocks[0], kwargs, exclude, True)

    tspec = _transformer_spec(_build(["diffusers", config["_class_name"]], config), SPECS["qwen_image21"])
    spec = mp.ModelSizes("small", "test", "", tspec, (), None, 0)
    cfg = train_config("qwen_image21", mixed_precision="bf16", rank=8, lora_target=preset, data_img_size=256)
    s = mp.resolve_settings(cfg, spec, text_tokens=n_txt, device="cpu")
    planned = mp.estimate_activations(tspec, mp.lora_layout(tspec, s.lora_targets), s).per_block[0]
    assert planned == pytest.approx(measured, rel=0.03), f"saved {measured}, planned {planned}"


def test_published_sizes_and_the_profiles_plans() -> None:
    """Qwen/Qwen-Image-2.1's published configs (built in): a 7.1B transformer of 32 blocks, the 8.8B Qwen3-VL-8B
    encoder, the RGBA VAE at 16x; the 24 GB profile plans inside 24 GiB at 1024^2 (text-to-image without a
    dataset), and a reference adds its latents as image tokens (not its slots as text)."""
    import dataclasses

    import trainer.planner as mp
    from trainer.config import load_config as load

    sizes = mp.model_sizes("Qwen/Qwen-Image-2.1")
    assert sizes.transformer.params == 7_115_124_736 and {k.prefix: k.count for k in sizes.transformer.blocks} == \
        {"transformer_blocks": 32}
    assert sizes.text_encoders[0].params == 8_767_123_696 and sizes.vae.scale_factor == 16
    cfg = load(ROOT / "train_configs/train_qwen_image21_lora_24gb.yaml", ["data_config.img_dir=train_configs"],
               default_family="qwen_image21")
    plan = mp.plan_memory(cfg, 24.0)
    assert plan.fits and plan.settings.image_tokens == 4096 and plan.settings.references == 0, plan.format()
    with_ref = mp.plan_memory(dataclasses.replace(cfg, data_config=dataclasses.replace(
        cfg.data_config, control_dir="train_configs")), 24.0)
    assert with_ref.settings.references == 1 and with_ref.settings.image_tokens == 2 * 4096
    assert with_ref.settings.text_tokens == plan.settings.text_tokens + 8, "the markers, not 1024 slots"


def test_a_changed_reference_area_encodes_the_text_again(tiny_qwen_image21: Path, edit_data: Path,
                                                         tmp_path: Path) -> None:
    """The text condition holds the reference's slots, whose count follows the reference area: the cached
    condition of another area is not reused (its slots would not match the latents)."""
    from trainer.data.features import FeatureStore

    def key(area: int) -> str:
        cfg = load_config(ROOT / QUICKSTART, [f"pretrained_model_name_or_path={tiny_qwen_image21}",
                                              f"data_config.img_dir={edit_data}", f"output_dir={tmp_path / 'o'}",
                                              f"data_config.reference_vae_area={area}"], default_family="qwen_image21")
        store = FeatureStore.__new__(FeatureStore)  # only the key's inputs: no cache folder, no accelerator
        store.cfg, store.family, store.dtype, store.hashes = cfg, family_for(tiny_qwen_image21, area), "fp32", {}
        return store.text_key("a cat", (sorted((edit_data.parent / "control").iterdir())[0],))

    assert key(64 * 64) == key(64 * 64) != key(128 * 128)


@pytest.mark.e2e
def test_text_to_image_and_reference_datasets_in_one_run(tiny_qwen_image21: Path, sample_data: Path,
                                                         edit_data: Path, tmp_path: Path) -> None:
    """A dataset without control folders (text-to-image) beside one with references: both train in one run,
    each dataset's loss logged."""
    import yaml

    profile = tmp_path / "mixed.yaml"
    profile.write_text("# mixed\n#   accelerate launch train_qwen_image21_lora.py --config mixed.yaml\n" + yaml.safe_dump({
        "family": "qwen_image21", "pretrained_model_name_or_path": str(tiny_qwen_image21),
        "data_config": {"img_size": 64, "train_batch_size": 2, "num_workers": 0, "reference_vae_area": AREA},
        "datasets": [{"name": "plain", "img_dir": str(sample_data)}, {"name": "edit", "img_dir": str(edit_data)}],
        "output_dir": str(tmp_path / "run"), "max_train_steps": 6, "learning_rate": 1e-3, "mixed_precision": "no",
        "rank": 4, "checkpointing_steps": 100, "report_to": "none"}))
    train_in_process(profile, "qwen_image21")
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and all(math.isfinite(m["loss"]) for m in lines)
    assert {"loss/plain", "loss/edit"} <= {k for m in lines for k in m}
