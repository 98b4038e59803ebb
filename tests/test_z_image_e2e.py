"""End to end on the tiny Z-Image model: the real train.py with the shipped profile, the LoRA file in
ZImagePipeline (no missing or unexpected keys), and a changed render."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import ZImagePipeline
from safetensors import safe_open

from conftest import lora_keys_match, run_entry

pytestmark = pytest.mark.e2e
PROFILE = "train_configs/train_z_image_lora.yaml"


def render(pipe: ZImagePipeline) -> np.ndarray:
    image = pipe(prompt="a red circle on a yellow background", width=64, height=64, num_inference_steps=4,
                 guidance_scale=0.0, generator=torch.Generator().manual_seed(0), output_type="np").images[0]
    return np.asarray(image, dtype=np.float64)


def test_train_py_z_image_lora_reloads_in_z_image_pipeline(tiny_z_image: Path, sample_data: Path,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_entry("train.py", PROFILE, [
        f"pretrained_model_name_or_path={tiny_z_image}", f"data_config.img_dir={sample_data}", f"output_dir={out}",
        "family=z_image", "report_to=none", "data_config.img_size=64", "data_config.num_workers=0",
        "data_config.train_batch_size=2", "max_train_steps=4", "checkpointing_steps=2", "learning_rate=1e-2",
        "lr_warmup_steps=0", "rank=4", "lora_alpha=8", "lora_target=all_linear",
        # samples from the cached embeddings (Z-Image-Turbo: CFG off by default), at step 0 and the last
        "validation.every_n_steps=4", "validation.steps=2", "validation.width=64", "validation.height=64",
        "validation.prompts=[a red circle]"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "family z_image" in result.stderr
    log = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in log] == [1, 2, 3, 4]
    assert all(math.isfinite(m["loss"]) and m["loss"] > 0 for m in log)
    assert sorted(p.parent.name for p in (out / "samples").glob("step-*/prompt-0.png")) == \
        ["step-000000", "step-000004"]

    with safe_open(str(out / "pytorch_lora_weights.safetensors"), "pt") as fh:
        keys = set(fh.keys())
    assert not any("adaLN_modulation" in k for k in keys), "modulation layers are not LoRA targets"
    assert any(k.startswith("transformer.context_refiner.") for k in keys)

    pipe = ZImagePipeline.from_pretrained(tiny_z_image)
    pipe.set_progress_bar_config(disable=True)
    base = render(pipe)
    noise = np.abs(render(pipe) - base).mean()  # the same render twice
    lora_keys_match(pipe, out, "trained")
    assert pipe.transformer.peft_config["trained"].lora_alpha == 8, "alpha survives the reload"
    change = np.abs(render(pipe) - base).mean()
    assert change > 1e-3 and change > 100 * noise, f"the LoRA changes the render ({change:.2e} vs {noise:.2e})"
