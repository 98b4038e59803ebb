"""Qwen-Image-Edit on the shared engine: two references (Edit-Plus), references condition the prediction,
pairing errors (one reference, end to end: test_family_e2e.py)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import List

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPlusPipeline
from PIL import Image

from conftest import train_in_process, lora_keys_match, run_script_in_process
from trainer.engine import Trainer
from utils.qwen_processor import load_qwen_vl_processor

pytestmark = pytest.mark.e2e
CONFIG = "train_configs/quickstart_edit_tiny.yaml"


def overrides(model: Path, images: Path, out: Path, *extra: str) -> List[str]:
    return [f"pretrained_model_name_or_path={model}", f"data_config.img_dir={images}", f"output_dir={out}",
            "report_to=none", *extra]


def losses(out: Path) -> List[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def render(pipe, references: list) -> np.ndarray:
    image = references if isinstance(pipe, QwenImageEditPlusPipeline) else references[0]
    out = pipe(image=image, prompt="turn it into a red circle", width=64, height=64, num_inference_steps=2,
               generator=torch.Generator().manual_seed(0), output_type="np").images[0]
    return np.asarray(out, dtype=np.float64)


def in_process(*args: str) -> Trainer:
    return train_in_process(CONFIG, "qwen_image_edit", *args)


def refused(capsys: pytest.CaptureFixture, *args: str):
    """train_qwen_edit_lora.py in this process (as its own process it trains in test_family_e2e.py)."""
    return run_script_in_process("train_qwen_edit_lora.py", CONFIG, list(args), capsys)


def test_edit_plus_two_references(tiny_qwen_image_edit_plus: Path, edit_data_two_refs: Path,
                                  tmp_path: Path) -> None:
    out = tmp_path / "plus"
    trainer = in_process(*overrides(tiny_qwen_image_edit_plus, edit_data_two_refs, out, "max_train_steps=4",
                                    "learning_rate=5e-3"))
    assert trainer.family.pipeline_class is QwenImageEditPlusPipeline
    assert all(len(s.references) == 2 for s in trainer.samples)
    assert all(math.isfinite(x) for x in losses(out))
    pipe = QwenImageEditPlusPipeline.from_pretrained(tiny_qwen_image_edit_plus,
                                                     processor=load_qwen_vl_processor(tiny_qwen_image_edit_plus))
    refs = [Image.open(p).convert("RGB") for p in trainer.samples[0].references]
    base = render(pipe, refs)
    lora_keys_match(pipe, out, "plus")
    assert np.abs(render(pipe, refs) - base).mean() > 1e-3


def test_references_condition_the_prediction(tiny_qwen_image_edit: Path, edit_data: Path, tmp_path: Path) -> None:
    """Changing only a reference changes the text condition (vision tower) and the prediction."""
    trainer = in_process(*overrides(tiny_qwen_image_edit, edit_data, tmp_path / "a", "max_train_steps=1",
                                    "save_cache_on_disk=false"))
    a, b = trainer.samples[0], trainer.samples[1]
    cond_a = trainer.features.cached_text(a.caption, a.references)["prompt_embeds"]
    cond_b = trainer.features.cached_text(b.caption, b.references)["prompt_embeds"]
    assert cond_a.shape[0] > 20, "the prompt carries the reference's image tokens"
    assert not torch.equal(cond_a[:4], cond_b[:4]), "different references, different vision tokens"

    transformer = trainer.accelerator.unwrap_model(trainer.transformer).eval()
    noisy, sigmas = torch.randn(1, 4, 8, 8), torch.tensor([0.5])
    text = trainer.family.collate_text([{"prompt_embeds": cond_a}], torch.device("cpu"), torch.float32)
    ref = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        with_ref = trainer.family.predict(transformer, noisy, sigmas, text, [ref])
        other_ref = trainer.family.predict(transformer, noisy, sigmas, text, [ref + 1])
    assert with_ref.shape == noisy.shape
    assert not torch.allclose(with_ref, other_ref)


def test_target_without_reference_is_named(tiny_qwen_image_edit: Path, edit_data: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    data = tmp_path / "d"
    shutil.copytree(edit_data.parent, data)
    (data / "control" / "pair3.png").unlink()
    result = refused(capsys, *overrides(tiny_qwen_image_edit, data / "images", tmp_path / "out", "max_train_steps=1"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "images/pair3.png: no reference image pair3.* in control/" in result.stderr


def test_no_reference_folder_and_too_many_references(tiny_qwen_image_edit: Path, sample_data: Path,
                                                     edit_data_two_refs: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    result = refused(capsys, *overrides(tiny_qwen_image_edit, sample_data, tmp_path / "a", "max_train_steps=1"))
    assert result.returncode == 2 and "trains on reference images: set data_config.control_dir" in result.stderr
    result = refused(capsys, *overrides(tiny_qwen_image_edit, edit_data_two_refs, tmp_path / "b", "max_train_steps=1"))
    assert result.returncode == 2
    assert "QwenImageEditPipeline takes at most 1 reference image(s) per sample, but 2" in result.stderr


def test_control_dir_is_refused_for_text_to_image(sample_data: Path, edit_data: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    result = run_script_in_process("train.py", "train_configs/quickstart_tiny.yaml", [
        f"data_config.img_dir={sample_data}", f"data_config.control_dir={edit_data.parent / 'control'}"], capsys)
    assert result.returncode == 2 and "reference images are only used by the qwen_image_edit" in result.stderr
