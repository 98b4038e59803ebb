"""End to end on the tiny FLUX.1-dev model: learning and the cache pass (train_flux_lora.py and the LoRA
file in FluxPipeline: test_family_e2e.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
from diffusers import FluxPipeline

from conftest import lora_keys_match, train_in_process
from trainer.engine import Trainer
from trainer.families.flux.family import FluxFamily

pytestmark = pytest.mark.e2e
QUICKSTART = "train_configs/quickstart_flux_tiny.yaml"


def overrides(model: Path, data: Path, out: Path, *extra: str) -> List[str]:
    return [f"pretrained_model_name_or_path={model}", f"data_config.img_dir={data}", f"output_dir={out}",
            "report_to=none", *extra]


def metrics(out: Path) -> List[Dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_in_process(*override_list: str) -> Trainer:
    return train_in_process(QUICKSTART, "flux", *override_list)


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
