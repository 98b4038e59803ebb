"""What users watch and steer: reports, tensorboard scalars, exports, LoRA variants, captions, samplers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import lora_keys_match, train_in_process
from image_datasets.dataset import shuffle_tags
from trainer.config import load_config
from trainer.engine import Trainer
from trainer.step.flow_matching import sample_sigmas
from trainer.model.lora_formats import from_comfyui

QUICKSTART = Path("train_configs/quickstart_tiny.yaml")


def train(model: Path, data: Path, out: Path, *extra: str) -> Trainer:
    return train_in_process(QUICKSTART, "qwen_image", f"pretrained_model_name_or_path={model}",
                            f"data_config.img_dir={data}", f"output_dir={out}", *extra)


@pytest.mark.e2e
def test_reports_tensorboard_and_comfyui_export(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    trainer = train(tiny_qwen_image, sample_data, out, "max_train_steps=12", "report_to=tensorboard", "rank=4",
                    "lora_alpha=8", "use_rslora=true", "lora_export_formats=[diffusers,comfyui]")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 12 and math.isfinite(summary["final_loss"])
    assert summary["peak_memory_gib"]["host_peak_rss_gib"] > 0.1
    with Image.open(out / "loss_curve.png") as png:
        assert png.size == (800, 400) and png.format == "PNG"
    with Image.open(out / "timestep_density.png") as png:
        assert png.size == (600, 300) and np.asarray(png.convert("L")).min() < 128, "bars were drawn"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((out / "logs").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "loss_smoothed", "lr", "grad_norm", "step_time_s", "samples_per_s"} <= tags
    assert [e.step for e in events.Scalars("loss")] == list(range(1, 13))

    # ComfyUI file: every key maps to a module of the model, alpha stored per module (rsLoRA folded in).
    comfy = load_file(str(out / "pytorch_lora_weights_comfyui.safetensors"))
    modules = dict(trainer.accelerator.unwrap_model(trainer.transformer).named_modules())
    groups = from_comfyui(comfy)
    assert groups and all(name in modules for name in groups)
    for name, parts in groups.items():
        base = modules[name].base_layer
        assert parts["lora_A"].shape == (4, base.in_features) and parts["lora_B"].shape == (base.out_features, 4)
        assert float(parts["alpha"]) == pytest.approx(8 * 2.0), "alpha / rank in ComfyUI == alpha / sqrt(rank)"
    with safe_open(str(out / "pytorch_lora_weights_comfyui.safetensors"), "pt") as fh:
        assert fh.metadata()["lora_scale"] == "1.0"


@pytest.mark.e2e
def test_dora_round_trips_through_diffusers(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "dora"
    train(tiny_qwen_image, sample_data, out, "max_train_steps=3", "report_to=none", "use_dora=true")
    keys = set(load_file(str(out / "pytorch_lora_weights.safetensors")))
    assert any("lora_magnitude_vector" in k for k in keys)
    pipe = QwenImagePipeline.from_pretrained(tiny_qwen_image)
    lora_keys_match(pipe, out, "dora")
    assert pipe.transformer.peft_config["dora"].use_dora


@pytest.mark.e2e
def test_trigger_word_reaches_the_cached_embedding(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    plain = train(tiny_qwen_image, sample_data, tmp_path / "a", "max_train_steps=1", "report_to=none",
                  "save_cache_on_disk=false")
    triggered = train(tiny_qwen_image, sample_data, tmp_path / "b", "max_train_steps=1", "report_to=none",
                      "save_cache_on_disk=false", "data_config.trigger_word=ohwx")
    assert all(s.caption.startswith("ohwx, ") for s in triggered.samples)
    key_a = plain.features.text_key(plain.samples[0].caption)
    key_b = triggered.features.text_key(triggered.samples[0].caption)
    assert key_a != key_b
    emb_a = plain.features.text.get(key_a)["prompt_embeds"]
    emb_b = triggered.features.text.get(key_b)["prompt_embeds"]
    assert emb_b.shape[0] > emb_a.shape[0], "the trigger's tokens are in the cached embedding"


def test_tag_shuffle_keeps_the_trigger_first() -> None:
    import random

    caption = "ohwx, red, circle, yellow background, flat"
    seen = {shuffle_tags(caption, random.Random(i), keep=1) for i in range(20)}
    assert len(seen) > 3 and all(s.startswith("ohwx, ") for s in seen)
    assert all(sorted(s.split(", ")) == sorted(caption.split(", ")) for s in seen)


@pytest.mark.parametrize("scheme, mean, std", [
    ("uniform", 0.5, math.sqrt(1 / 12)),
    ("cosmap", 0.5, None),
    ("sigmoid", 0.5, None),
])
def test_sampler_moments(scheme: str, mean: float, std: float | None) -> None:
    s = sample_sigmas(100_000, scheme, torch.Generator().manual_seed(0), sigmoid_scale=2.0)
    assert abs(s.mean().item() - mean) < 0.01
    if std is not None:
        assert abs(s.std().item() - std) < 0.01
    if scheme == "sigmoid":  # logit of the sample is N(0, scale)
        logits = torch.log(s / (1 - s))
        assert abs(logits.std().item() - 2.0) < 0.05
    if scheme == "cosmap":  # SD3's cosmap puts less mass at the ends than uniform
        assert ((s < 0.1) | (s > 0.9)).float().mean().item() < 0.2 - 0.03
    assert np.isfinite(s.numpy()).all()


@pytest.mark.e2e
def test_validation_samples_change_and_make_a_contact_sheet(tiny_qwen_image: Path, sample_data: Path,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "val"
    trainer = train(tiny_qwen_image, sample_data, out, "max_train_steps=12", "report_to=tensorboard",
                    "learning_rate=5e-3", "validation.prompts=[a red circle,a blue square]",
                    "validation.every_n_steps=5", "validation.width=64", "validation.height=48", "validation.steps=3")
    steps = sorted(p.name for p in (out / "samples").glob("step-*"))
    assert steps == ["step-000000", "step-000005", "step-000010", "step-000012"], "every 5 steps and the last"
    first = np.asarray(Image.open(out / "samples/step-000000/prompt-0.png"), dtype=float)
    last = np.asarray(Image.open(out / "samples/step-000012/prompt-0.png"), dtype=float)
    assert first.shape == (48, 64, 3) and np.abs(last - first).mean() > 0.5, "samples follow the training"
    with Image.open(out / "samples/contact_sheet.png") as sheet:
        assert sheet.size == (64 * 4, 48 * 2)
    assert trainer.family.text_pipe is None, "prompts came from the cache: no text encoder kept"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((out / "logs").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    assert "validation/prompt-0" in events.Tags()["images"]


def test_flymyai_sampling_keys_drive_validation(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    cfg = load_config(None, ["pretrained_model_name_or_path=x/y", f"data_config.img_dir={tmp_path / 'd'}",
                             "disable_sampling=false", "sample_every=50", "sample_width=512", "sample_height=768",
                             "sample_steps=12"])
    v = cfg.validation
    assert (v.every_n_steps, v.width, v.height, v.steps) == (50, 512, 768, 12)


@pytest.mark.e2e
def test_area_buckets_multi_resolution_batches(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    trainer = train(tiny_qwen_image, sample_data, tmp_path / "b", "max_train_steps=6", "report_to=none",
                    "data_config.bucket_mode=area", "data_config.resolutions=[32,64]", "data_config.train_batch_size=2")
    assert len(trainer.samples) == 12
    trainer.sampler.set_epoch(0)
    batches = list(trainer.sampler)
    assert sorted(i for b in batches for i in b) == list(range(12))
    assert all(len({trainer.samples[i].size for i in b}) == 1 for b in batches), "one size per batch, no padding"
    losses = [json.loads(x)["loss"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)


@pytest.mark.e2e
def test_ema_weights_are_saved_beside_and_resume(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "ema"
    args = ("report_to=none", "ema_decay=0.8", "learning_rate=5e-3", "checkpointing_steps=3",
            "overwrite_output_dir=false")
    train(tiny_qwen_image, sample_data, out, "max_train_steps=3", *args)
    assert (out / "checkpoint-3" / "ema_weights.safetensors").is_file()
    trainer = train(tiny_qwen_image, sample_data, out, "max_train_steps=6", "resume_from_checkpoint=latest", *args)
    final = load_file(str(out / "pytorch_lora_weights.safetensors"))
    ema = load_file(str(out / "ema" / "pytorch_lora_weights.safetensors"))
    assert final.keys() == ema.keys()
    # B matrices start at zero; those that trained (the last block's text side gets no gradient) differ.
    trained = [k for k in final if "lora_B" in k and final[k].abs().sum() > 0]
    assert len(trained) > 10
    assert all(not torch.equal(final[k], ema[k]) for k in trained), "the average lags the last weights"
    assert all(ema[k].abs().sum() > 0 for k in trained), "the average carried over the resume"
    lora_keys_match(QwenImagePipeline.from_pretrained(tiny_qwen_image), out / "ema", "ema")
    assert trainer.ema is not None


@pytest.mark.e2e
@pytest.mark.parametrize("adapter", ["lokr", "loha"])
def test_lokr_and_loha_train_and_reload_through_peft(adapter: str, tiny_qwen_image: Path, sample_data: Path,
                                                     tmp_path: Path) -> None:
    from diffusers import QwenImageTransformer2DModel
    from peft import PeftConfig
    from peft.utils import set_peft_model_state_dict

    out = tmp_path / adapter
    trainer = train(tiny_qwen_image, sample_data, out, "max_train_steps=4", "report_to=none", f"adapter_type={adapter}",
                    "rank=4", "learning_rate=5e-3")
    trained = trainer.accelerator.unwrap_model(trainer.transformer).eval()
    config = PeftConfig.from_pretrained(str(out))
    assert config.peft_type.value.lower() == adapter and config.r == 4
    fresh = QwenImageTransformer2DModel.from_pretrained(tiny_qwen_image, subfolder="transformer").eval()
    fresh.add_adapter(config)
    result = set_peft_model_state_dict(fresh, load_file(str(out / "adapter_model.safetensors")))
    assert not result.unexpected_keys
    args = dict(hidden_states=torch.randn(1, 16, 16), timestep=torch.tensor([0.5]),
                encoder_hidden_states=torch.randn(1, 5, 16), encoder_hidden_states_mask=None,
                img_shapes=[[(1, 4, 4)]], return_dict=False)
    with torch.no_grad():
        assert torch.allclose(fresh(**args)[0], trained(**args)[0], atol=1e-5), "the reloaded adapter is the trained one"
