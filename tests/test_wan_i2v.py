"""Wan image-to-video: the clip's first frame as the condition, as ``WanImageToVideoPipeline`` builds it.

Tiny ``wan22_i2v_a14b`` (two experts taking 2 * 4 + 4 channels, no image encoder), ``wan21_i2v`` (one transformer
with CLIP image embeddings from a tiny CLIP vision tower) and ``wan22_ti2v`` with ``task: i2v`` (the first latent
frame replaced by the image's, its tokens at timestep 0, left out of the loss). What training feeds the transformer
is checked against the pipeline's own ``prepare_latents`` / ``encode_image`` / per-token timesteps on the same
frames; the LoRA files load into ``WanImageToVideoPipeline`` with no unexpected key; ``inference.py --image``
renders a clip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline
from PIL import Image
from safetensors.torch import load_file

from conftest import ROOT, family_pipeline, run_entry, train_in_process
from image_datasets.dataset import open_rgb, pixels_at, read_clip
from trainer.config import TrainConfig, config_problems
from trainer.data.features import FeatureStore
from trainer.families.base import load_family
from trainer.families.wan import image_condition as i2v
from trainer.families.wan.experts import HIGH_NOISE_FILE, LOW_NOISE_FILE
from trainer.step.flow_matching import flow_matching_loss
from utils.errors import ConfigError

QUICKSTART = "train_configs/quickstart_wan_tiny.yaml"
CPU = torch.device("cpu")


def _family(model: Path, **keys: object):
    return load_family(TrainConfig(family="wan", pretrained_model_name_or_path=str(model), **keys))


def _clip(frames: int = 9, size: int = 64, seed: int = 0) -> torch.Tensor:
    """``(1, 3, F, H, W)`` in [-1, 1] on 8-bit levels (as decoded frames are)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (1, 3, frames, size, size), generator=gen).float() / 127.5 - 1


def _pipeline_condition(pipe: WanImageToVideoPipeline, first: torch.Tensor, frames: int) -> Any:
    """The pipeline's own ``prepare_latents`` for the image ``first`` (``(B, 3, H, W)`` in [-1, 1], as its
    ``video_processor`` hands it over) and a clip of ``frames`` frames."""
    return pipe.prepare_latents(first, first.shape[0], pipe.vae.config.z_dim, first.shape[-2], first.shape[-1], frames,
                                torch.float32, CPU, torch.Generator().manual_seed(0))


def test_the_task_follows_the_checkpoint_and_is_checked(tiny_wan: Path, tiny_wan22_ti2v: Path,
                                                         tiny_wan22_i2v_a14b: Path) -> None:
    """An I2V checkpoint is image-to-video without the key; TI2V-5B is text-to-video unless ``task: i2v``; a task the
    checkpoint cannot do is one line naming the key, the value and the checkpoint."""
    assert _family(tiny_wan22_i2v_a14b).condition == i2v.CHANNELS
    assert _family(tiny_wan22_i2v_a14b, task="i2v").condition == i2v.CHANNELS
    assert _family(tiny_wan22_ti2v).condition is None and not _family(tiny_wan22_ti2v).conditions_on_first_frame
    assert _family(tiny_wan22_ti2v, task="i2v").condition == i2v.FIRST_FRAME
    assert _family(tiny_wan, task="t2v").condition is None
    for model, task in ((tiny_wan22_i2v_a14b, "t2v"), (tiny_wan, "i2v")):
        with pytest.raises(ConfigError, match=f"key 'task': value '{task}'") as err:
            _family(model, task=task)
        assert str(model) in str(err.value) and "\n" not in str(err.value)
    problems = config_problems(TrainConfig(family="wan", pretrained_model_name_or_path="x", task="v2v"))
    assert "key 'task': value 'v2v' is not one of t2v, i2v" in problems


@pytest.mark.parametrize("frames", [9, 1])
def test_the_channels_condition_is_the_pipelines(tiny_wan22_i2v_a14b: Path, frames: int) -> None:
    """Wan 2.2 I2V-A14B: the mask and the latents of ``[first frame, zeros...]`` equal ``prepare_latents``'
    condition for the same first frame, for a clip and for a still (its own first frame, ``num_frames=1``)."""
    family = _family(tiny_wan22_i2v_a14b)
    family.load_vae(CPU, torch.float32)
    clip = _clip(frames)
    got = family.encode_condition(clip if frames > 1 else clip[:, :, 0])
    assert len(got) == 1 and got[0].shape == (1, 8, 1 + (frames - 1) // 4, 8, 8)
    pipe = family_pipeline("wan", tiny_wan22_i2v_a14b)
    _, want = _pipeline_condition(pipe, clip[:, :, 0], frames)
    torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)
    assert float(got[0][:, :4, 0].min()) == 1 and float(got[0][:, :4, 1:].abs().sum()) == 0  # the mask
    # Not the clip's own latents after the first frame: the later frames are the VAE's code of zeros.
    if frames > 1:
        latents = family.encode_images(clip)
        torch.testing.assert_close(got[0][:, 4:, :1], latents[:, :, :1], atol=1e-5, rtol=1e-5)
        assert (got[0][:, 4:, 1:] - latents[:, :, 1:]).abs().mean() > 1e-3


def test_ti2v_feeds_the_first_frame_at_timestep_zero_and_leaves_it_out_of_the_loss(tiny_wan22_ti2v: Path) -> None:
    """TI2V-5B with ``task: i2v``: the condition is the first frame's latents alone (``prepare_latents``'
    ``latent_condition``), the transformer gets the noisy latents with their first frame replaced by it
    (``(1 - mask) * condition + mask * latents``) and the pipeline's per-token timesteps (0 on the first frame's
    tokens); the loss is the same whatever is predicted there, and changes with any other frame."""
    family = _family(tiny_wan22_ti2v, task="i2v")
    family.load_vae(CPU, torch.float32)
    clip = _clip(9)
    (condition,) = family.encode_condition(clip)
    t2v = family_pipeline("wan", tiny_wan22_ti2v)  # TI2V-5B's published pipeline class is WanPipeline
    pipe = WanImageToVideoPipeline(tokenizer=t2v.tokenizer, text_encoder=t2v.text_encoder, vae=t2v.vae,
                                   scheduler=t2v.scheduler, transformer=t2v.transformer, expand_timesteps=True)
    noisy, want_condition, mask = _pipeline_condition(pipe, clip[:, :, 0], 9)
    torch.testing.assert_close(condition, want_condition, atol=1e-5, rtol=1e-5)
    assert family.encode_condition(clip[:, :, 0]) == [], "a still trains text-to-video"

    seen: Dict[str, torch.Tensor] = {}

    def transformer(hidden_states, timestep, **kwargs):
        seen.update(hidden=hidden_states, timestep=timestep)
        return (torch.zeros_like(hidden_states),)

    t = torch.tensor([0.7])
    family.velocity(transformer, noisy, t, {"prompt_embeds": torch.zeros(1, 512, 8)}, [condition])
    torch.testing.assert_close(seen["hidden"], (1 - mask) * want_condition + mask * noisy)
    want_ts = (mask[0][0][:, ::2, ::2] * 700.0).flatten().unsqueeze(0)
    torch.testing.assert_close(seen["timestep"], want_ts)
    assert float(seen["timestep"][0, 0]) == 0 and float(seen["timestep"][0, -1]) == pytest.approx(700.0)

    latents = family.encode_images(clip)
    target, prediction = torch.randn_like(latents), torch.randn_like(latents)
    loss_mask = family.loss_mask(latents, [condition])
    base = flow_matching_loss(prediction, target, t, "none", loss_mask)
    first, later = prediction.clone(), prediction.clone()
    first[:, :, 0] += 10
    later[:, :, 1] += 10
    assert float(flow_matching_loss(first, target, t, "none", loss_mask)) == pytest.approx(float(base))
    assert float(flow_matching_loss(later, target, t, "none", loss_mask)) > float(base) + 1
    expected = ((prediction - target)[:, :, 1:] ** 2).mean()
    assert float(base) == pytest.approx(float(expected), rel=1e-5)
    assert family.loss_mask(latents, []) is None and _family(tiny_wan22_ti2v).loss_mask(latents, [condition]) is None


def _record_references(monkeypatch: pytest.MonkeyPatch) -> List[Dict[str, Any]]:
    """Every batch's references as the training step gets them, with the batch's sample indices."""
    seen: List[Dict[str, Any]] = []
    original = FeatureStore.batch_references

    def recording(self, batch):
        refs = original(self, batch)
        seen.append({"index": list(batch["index"]), "references": [r.detach().clone() for r in refs]})
        return refs

    monkeypatch.setattr(FeatureStore, "batch_references", recording)
    return seen


def _first_frame(sample) -> torch.Tensor:
    """The sample's first frame as training decodes it, ``(1, 3, H, W)`` in [-1, 1]."""
    if sample.frames:
        return read_clip(sample.image_path, sample.frames, sample.size, sample.frame_positions)[None, :, 0]
    return pixels_at(open_rgb(sample.image_path), sample.size)[None]


def _assert_loads_in_the_i2v_pipeline(model: Path, out: Path, files: Dict[str, str]) -> None:
    """Each LoRA file loads into its component of ``WanImageToVideoPipeline`` (the low-noise one with
    ``load_into_transformer_2=True``) with no unexpected or missing key, and changes its output."""
    pipe = family_pipeline("wan", model)
    assert isinstance(pipe, WanImageToVideoPipeline)
    for name, component in files.items():
        saved = load_file(str(out / name))
        assert saved and all(k.startswith("transformer.blocks.") for k in saved), name
        assert max(float(v.abs().max()) for k, v in saved.items() if "lora_B" in k) > 0, f"{name}: never trained"
        pipe.load_lora_weights(str(out), weight_name=name, adapter_name=component,
                               **({"load_into_transformer_2": True} if component == "transformer_2" else {}))
        module = getattr(pipe, component)
        created = {f"transformer.{n}".replace(f".{component}.weight", ".weight")
                   for n, _ in module.named_parameters() if "lora_" in n}
        assert created == set(saved), f"{name}: missing or unexpected keys"


def test_i2v_a14b_trains_through_the_entry_script_and_loads_in_the_i2v_pipeline(
        tiny_wan22_i2v_a14b: Path, sample_data: Path, sample_videos: Path, tmp_path: Path) -> None:
    """train_wan_lora.py on clips and stills with both experts and a validation render from a first frame: the
    two LoRA files load into the I2V pipeline's two experts; the render is a clip; inference.py renders a clip
    from ``--image`` with and without the LoRA."""
    out = tmp_path / "run"
    image = sorted(sample_data.glob("*.png"))[0]
    result = run_entry("train_wan_lora.py", QUICKSTART, [
        f"pretrained_model_name_or_path={tiny_wan22_i2v_a14b}", f"data_config.img_dir={sample_data}",
        f"data_config.video_dir={sample_videos}", f"output_dir={out}", "max_train_steps=4", "checkpointing_steps=4",
        "report_to=none", "timestep_sampling=uniform", "learning_rate=1e-2", "lr_warmup_steps=0",
        "validation.every_n_steps=4", "validation.prompts=[a red circle]", f"validation.reference_images=[{image}]",
        "validation.width=64", "validation.height=64", "validation.steps=2", "validation.num_frames=5"])
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert (out / "samples" / "step-000004" / "prompt-0.mp4").is_file()
    _assert_loads_in_the_i2v_pipeline(tiny_wan22_i2v_a14b, out,
                                      {HIGH_NOISE_FILE: "transformer", LOW_NOISE_FILE: "transformer_2"})

    clip, base = tmp_path / "lora.mp4", tmp_path / "base.mp4"
    rendered = subprocess.run(
        [sys.executable, str(ROOT / "inference.py"), "--model", str(tiny_wan22_i2v_a14b), "--lora", str(out),
         "--image", str(image), "--prompt", "a red circle", "--out", str(clip), "--base-out", str(base), "--width",
         "64", "--height", "64", "--num-frames", "5", "--steps", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert rendered.returncode == 0, rendered.stderr[-3000:]
    lines = [json.loads(line) for line in rendered.stdout.splitlines() if line.startswith("{")]
    assert [(r["frames"], r["lora"]) for r in lines] == [(5, False), (5, True)]
    assert clip.stat().st_size > 0 and base.stat().st_size > 0


def test_wan21_i2v_feeds_the_pipelines_condition_and_image_embeds(tiny_wan21_i2v: Path, sample_data: Path,
                                                                  sample_videos: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Wan 2.1 I2V in the engine: each batch's cached condition (mask + latents) and CLIP image embeddings equal
    the pipeline's ``prepare_latents`` and ``encode_image`` for the first frame training decoded (clips and
    stills); the LoRA loads into ``WanImageToVideoPipeline`` with no unexpected key."""
    seen = _record_references(monkeypatch)
    trainer = train_in_process(QUICKSTART, "wan", f"pretrained_model_name_or_path={tiny_wan21_i2v}",
                               f"data_config.img_dir={sample_data}", f"data_config.video_dir={sample_videos}",
                               f"output_dir={tmp_path / 'run'}", "max_train_steps=4", "report_to=none",
                               "learning_rate=1e-2", "lr_warmup_steps=0", "data_config.caption_dropout_rate=0")
    pipe = family_pipeline("wan", tiny_wan21_i2v)
    kinds = set()
    for record in seen:
        sample = trainer.samples[record["index"][0]]
        kinds.add(sample.frames > 0)
        first = _first_frame(sample)
        _, want = _pipeline_condition(pipe, first, sample.frames or 1)
        condition, embeds = record["references"]
        torch.testing.assert_close(condition[:1].float(), want, atol=1e-5, rtol=1e-5)
        image = Image.fromarray(((first[0] + 1) * 127.5).round().byte().permute(1, 2, 0).numpy())
        torch.testing.assert_close(embeds[:1].float(), pipe.encode_image(image, CPU), atol=1e-5, rtol=1e-5)
    assert kinds == {True, False}, "clips and stills both reached the step"
    _assert_loads_in_the_i2v_pipeline(tiny_wan21_i2v, tmp_path / "run", {HIGH_NOISE_FILE: "transformer"})


def test_ti2v_i2v_trains_with_the_first_frame_cached_under_its_own_key(tiny_wan22_ti2v: Path, sample_data: Path,
                                                                      sample_videos: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """TI2V-5B with ``task: i2v`` in the engine: each clip's batch carries its first frame's latents (the clip's
    own first latent frame: the VAE is causal), a still carries none (it trains text-to-video); the latents'
    cache key of an i2v run differs from a t2v run's (never read across), and a t2v run's keys are unchanged."""
    seen = _record_references(monkeypatch)
    trainer = train_in_process(QUICKSTART, "wan", f"pretrained_model_name_or_path={tiny_wan22_ti2v}", "task=i2v",
                               f"data_config.img_dir={sample_data}", f"data_config.video_dir={sample_videos}",
                               f"output_dir={tmp_path / 'run'}", "max_train_steps=4", "report_to=none")
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and all(np.isfinite(losses))
    family, kinds = trainer.family, set()
    family.load_vae(CPU, torch.float32)
    for record in seen:
        sample = trainer.samples[record["index"][0]]
        kinds.add(sample.frames > 0)
        if not sample.frames:
            assert record["references"] == [], "a still trains text-to-video"
            continue
        (condition,) = record["references"]
        clip = read_clip(sample.image_path, sample.frames, sample.size, sample.frame_positions)[None]
        assert condition.shape[2] == 1
        torch.testing.assert_close(condition[:1].float(), family.encode_images(clip)[:, :, :1], atol=1e-5, rtol=1e-5)
    assert kinds == {True, False}, "clips and stills both reached the step"

    sample, keys, stores = next(s for s in trainer.samples if s.frames), {}, {}
    for task in ("i2v", "t2v"):
        stores[task] = FeatureStore(trainer.cfg, _family(tiny_wan22_ti2v, task=task), [sample],
                                    SimpleNamespace(device=CPU), torch.float32, keep_encoders=False)
        keys[task] = stores[task].image_key(sample.image_path, sample.size, sample.frames, sample.frame_positions)
    assert keys["i2v"] != keys["t2v"]
    # The tag is all that differs: a text-to-video clip keeps the key it had before (caches on disk stay valid).
    stores["i2v"].family.conditions_on_first_frame = False
    assert stores["i2v"].image_key(sample.image_path, sample.size, sample.frames, sample.frame_positions) == keys["t2v"]


def test_an_i2v_run_renders_only_from_one_first_frame(tiny_wan22_i2v_a14b: Path, sample_data: Path,
                                                      tmp_path: Path) -> None:
    """Validation on, no first frame (or two): refused in one line naming the key; off: nothing to check."""
    from trainer.config.schema import ValidationConfig
    from trainer.evaluation.validation import ValidationRenderer

    image = str(sorted(sample_data.glob("*.png"))[0])
    family = _family(tiny_wan22_i2v_a14b)
    for images in ([], [image, image]):
        cfg = TrainConfig(family="wan", pretrained_model_name_or_path=str(tiny_wan22_i2v_a14b),
                          validation=ValidationConfig(every_n_steps=2, prompts=["x"], reference_images=images))
        with pytest.raises(ConfigError, match=f"key 'validation.reference_images': .* not {len(images)}$"):
            ValidationRenderer(cfg, family, tmp_path, [])
    for validation in (ValidationConfig(every_n_steps=0, prompts=["x"]),
                       ValidationConfig(every_n_steps=2, prompts=["x"], reference_images=[image])):
        cfg = TrainConfig(family="wan", pretrained_model_name_or_path=str(tiny_wan22_i2v_a14b), validation=validation)
        assert ValidationRenderer(cfg, family, tmp_path, []).renders[0].references == \
            ((Path(image),) if validation.reference_images else ())


def test_the_condition_encoded_live_trains_as_the_cached_one(tiny_wan21_i2v: Path, sample_data: Path,
                                                             sample_videos: Path, tmp_path: Path) -> None:
    """``precompute_image_embeddings: false`` encodes the first-frame condition (and CLIP embeddings) with each batch:
    the same losses as the cached run, step by step."""
    losses = {}
    for cached in ("true", "false"):
        out = tmp_path / f"cached-{cached}"
        train_in_process(QUICKSTART, "wan", f"pretrained_model_name_or_path={tiny_wan21_i2v}",
                         f"data_config.img_dir={sample_data}", f"data_config.video_dir={sample_videos}",
                         f"output_dir={out}", "max_train_steps=3", "report_to=none", "learning_rate=1e-2",
                         "lr_warmup_steps=0", f"precompute_image_embeddings={cached}")
        losses[cached] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["true"]) == 3 and len(set(losses["true"])) > 1
    np.testing.assert_allclose(losses["false"], losses["true"], rtol=1e-4)
