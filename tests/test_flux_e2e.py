"""End to end on the tiny FLUX.1-dev model: the real train_flux_lora.py, the LoRA file in FluxPipeline,
learning, and the cache pass."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline
from safetensors import safe_open

from conftest import train_in_process, lora_keys_match, run_entry
from trainer.engine import Trainer
from trainer.families.flux.model import FluxFamily

pytestmark = pytest.mark.e2e
QUICKSTART = "train_configs/quickstart_flux_tiny.yaml"


def overrides(model: Path, data: Path, out: Path, *extra: str) -> List[str]:
    return [f"pretrained_model_name_or_path={model}", f"data_config.img_dir={data}", f"output_dir={out}",
            "report_to=none", *extra]


def metrics(out: Path) -> List[Dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_in_process(*override_list: str) -> Trainer:
    return train_in_process(QUICKSTART, "flux", *override_list)


def render(pipe: FluxPipeline) -> np.ndarray:
    image = pipe(prompt="a red circle on a yellow background", width=64, height=64, num_inference_steps=4,
                 generator=torch.Generator().manual_seed(0), output_type="np").images[0]
    return np.asarray(image, dtype=np.float64)


def test_train_flux_lora_end_to_end_lora_loads_in_flux_pipeline(tiny_flux: Path, sample_data: Path,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_entry("train_flux_lora.py", QUICKSTART, overrides(
        tiny_flux, sample_data, out, "max_train_steps=6", "checkpointing_steps=3", "learning_rate=1e-2",
        "lr_warmup_steps=0", "rank=4", "lora_alpha=8"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "family flux" in result.stderr
    log = metrics(out)
    assert [m["step"] for m in log] == list(range(1, 7))
    assert all(math.isfinite(m["loss"]) and m["loss"] > 0 for m in log)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]

    lora = out / "pytorch_lora_weights.safetensors"
    with safe_open(str(lora), "pt") as fh:
        keys = set(fh.keys())
        metadata = fh.metadata()
    assert keys and all(k.startswith("transformer.") for k in keys)
    assert not any(".norm" in k for k in keys), "modulation layers are not LoRA targets"
    assert not any(k.startswith("transformer.proj_out.") for k in keys), "nor is the final layer"
    assert any(k.startswith("transformer.single_transformer_blocks.") for k in keys)
    saved = json.loads(metadata["lora_adapter_metadata"])
    assert (saved["transformer.r"], saved["transformer.lora_alpha"]) == (4, 8)

    pipe = FluxPipeline.from_pretrained(tiny_flux)
    pipe.set_progress_bar_config(disable=True)
    base = render(pipe)
    noise = np.abs(render(pipe) - base).mean()  # the same render twice
    lora_keys_match(pipe, out, "trained")
    assert pipe.transformer.peft_config["trained"].lora_alpha == 8, "alpha survives the reload"
    change = np.abs(render(pipe) - base).mean()
    assert change > 1e-3 and change > 100 * noise, f"the LoRA changes the render ({change:.2e} vs {noise:.2e})"


def test_overfit_one_image_lowers_the_loss(tiny_flux: Path, sample_data: Path, tmp_path: Path) -> None:
    one = tmp_path / "one"
    one.mkdir()
    for name in ("img1.png", "img1.txt"):
        shutil.copy(sample_data / name, one / name)
    out = tmp_path / "overfit"
    # The real timestep sampler, so single losses are noisy: compare window means.
    run_in_process(*overrides(tiny_flux, one, out, "max_train_steps=120", "learning_rate=3e-3", "rank=16",
                              "lora_target=all_linear", "data_config.caption_dropout_rate=0",
                              "checkpointing_steps=1000"))
    losses = [m["loss"] for m in metrics(out)]
    first, last = np.mean(losses[:20]), np.mean(losses[-20:])
    assert last < 0.7 * first, f"loss did not fall: first 20 steps {first:.4f}, last 20 {last:.4f}"
    # The widest preset (embedders and timestep/text embedders included) reloads as cleanly.
    lora_keys_match(FluxPipeline.from_pretrained(tiny_flux), out, "overfit")


def test_cache_pass_encodes_each_caption_once(tiny_flux: Path, sample_data: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    calls: Dict[str, list] = {"text": [], "image": []}
    real_prompts, real_images = FluxFamily.encode_prompts, FluxFamily.encode_images

    def count_prompts(self, prompts, references=None):
        calls["text"] += list(prompts)
        return real_prompts(self, prompts)

    def count_images(self, pixels):
        calls["image"].append(pixels.shape[0])
        return real_images(self, pixels)

    monkeypatch.setattr(FluxFamily, "encode_prompts", count_prompts)
    monkeypatch.setattr(FluxFamily, "encode_images", count_images)
    cache = tmp_path / "cache"
    trainer = run_in_process(*overrides(tiny_flux, sample_data, tmp_path / "a", "max_train_steps=8",
                                        f"cache_dir={cache}", "data_config.caption_dropout_rate=0.5"))
    # Six captions plus the empty prompt for caption dropout, once each; six images; none in training.
    assert sorted(calls["text"]) == sorted([s.caption for s in trainer.samples] + [""])
    assert sum(calls["image"]) == 6
    assert trainer.family.text_pipe is None and trainer.family.vae is None, "T5/CLIP and VAE freed after caching"

    calls.update(text=[], image=[])
    run_in_process(*overrides(tiny_flux, sample_data, tmp_path / "b", "max_train_steps=2", f"cache_dir={cache}"))
    assert calls == {"text": [], "image": []}, "a second run reads the disk cache"
