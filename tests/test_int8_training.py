"""LoRA training on an int8 W8A8 base (``quantization: {backend: torchao, weights: int8_w8a8}``) through
the real engine on the tiny models: it converges like the unquantized run, its LoRA loads into a plain
diffusers pipeline, a resume is bit-equal (with block swap and gradient checkpointing), and every
family trains on it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, List

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline
from safetensors.torch import load_file

from conftest import lora_keys_match, read_losses, train_in_process
from trainer.families import SPECS
from trainer.model.quantized_linear import Int8Linear, int8_matmul_works

pytestmark = pytest.mark.e2e

QUICKSTART = "train_configs/quickstart_tiny.yaml"
INT8 = ["quantize=true", "quantization.backend=torchao", "quantization.weights=int8_w8a8"]


@pytest.fixture
def int_mm_calls(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """One entry per ``torch._int_mm`` call (the int8 layer's matmuls)."""
    int8_matmul_works(torch.device("cpu"))
    calls: List[int] = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape[0]) or real(a, b))
    return calls


def int8_layers(trainer) -> List[torch.nn.Module]:
    model = trainer.accelerator.unwrap_model(trainer.transformer)
    return [m for m in model.modules() if isinstance(m, Int8Linear)]


def qwen_args(model: Path, data: Path, out: Path, *extra: str) -> List[str]:
    return [f"pretrained_model_name_or_path={model}", f"data_config.img_dir={data}", f"output_dir={out}",
            "report_to=none", *extra]


def test_int8_lora_converges_like_the_unquantized_run_and_loads_in_diffusers(
        tiny_qwen_image: Path, sample_data: Path, tmp_path: Path, int_mm_calls: List[int]) -> None:
    """Overfitting one image: the loss falls as far with the int8 base as with the fp32 one (the last 20 steps' mean within 25%, both below 70% of the first 20 steps'), and the file
    is a plain diffusers LoRA (no quantization in its keys; the unquantized pipeline loads it with no
    unexpected or missing keys)."""
    one = tmp_path / "one"
    one.mkdir()
    for name in ("img1.png", "img1.txt"):
        shutil.copy(sample_data / name, one / name)
    settings = ["max_train_steps=100", "learning_rate=3e-3", "rank=16", "lora_target=all_linear",
                "checkpointing_steps=1000", "data_config.caption_dropout_rate=0"]
    runs = {}
    for name, extra in (("fp32", []), ("int8", INT8)):
        int_mm_calls.clear()
        trainer = train_in_process(QUICKSTART, "qwen_image", *qwen_args(tiny_qwen_image, one, tmp_path / name,
                                                                         *settings, *extra))
        runs[name] = np.array(read_losses(tmp_path / name))
        if name == "int8":
            assert len(int8_layers(trainer)) > 20, "every block linear is int8"
            assert len(int_mm_calls) > 100 * 20 * 2, "forward and input-gradient matmuls ran in int8"
    first, last = {n: v[:20].mean() for n, v in runs.items()}, {n: v[-20:].mean() for n, v in runs.items()}
    print({n: (round(first[n], 4), round(last[n], 4)) for n in runs})
    assert all(last[n] < 0.7 * first[n] for n in runs)
    assert abs(last["int8"] - last["fp32"]) < 0.25 * last["fp32"], f"int8 {last['int8']:.4f} vs fp32 {last['fp32']:.4f}"

    keys = load_file(str(tmp_path / "int8" / "pytorch_lora_weights.safetensors")).keys()
    assert all(".lora_A." in k or ".lora_B." in k for k in keys), "only LoRA factors, no int8 data or scales"
    lora_keys_match(QwenImagePipeline.from_pretrained(tiny_qwen_image), tmp_path / "int8", "int8")


def test_int8_resume_with_block_swap_and_checkpointing_is_bit_equal(tiny_qwen_image: Path, sample_data: Path,
                                                                     tmp_path: Path) -> None:
    """Four steps straight, and two then a resume to four: the same LoRA bit for bit and the same losses,
    with one of the two blocks swapped, gradient checkpointing with offloaded inputs, and LoRA dropout."""
    def run(out: Path, steps: int, *extra: str) -> None:
        train_in_process(QUICKSTART, "qwen_image", *qwen_args(
            tiny_qwen_image, sample_data, out, *INT8, f"max_train_steps={steps}", "checkpointing_steps=2",
            "overwrite_output_dir=false", "mixed_precision=bf16", "blocks_to_swap=1", "lora_dropout=0.1",
            "disable_gradient_checkpointing=false", "gradient_checkpointing_cpu_offload=true", *extra))

    run(tmp_path / "straight", 4)
    run(tmp_path / "resumed", 2)
    run(tmp_path / "resumed", 4, "resume_from_checkpoint=latest")
    want = load_file(str(tmp_path / "straight" / "pytorch_lora_weights.safetensors"))
    got = load_file(str(tmp_path / "resumed" / "pytorch_lora_weights.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert read_losses(tmp_path / "resumed") == read_losses(tmp_path / "straight")


def test_block_swap_gives_the_resident_losses(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    runs = {}
    for name, swap in (("resident", 0), ("swapped", 1)):
        train_in_process(QUICKSTART, "qwen_image", *qwen_args(
            tiny_qwen_image, sample_data, tmp_path / name, *INT8, "max_train_steps=3", f"blocks_to_swap={swap}",
            "mixed_precision=bf16"))
        runs[name] = read_losses(tmp_path / name)
    assert runs["resident"] == runs["swapped"]


FAMILY_PROFILES = {
    "qwen_image": QUICKSTART, "qwen_image_edit": "train_configs/quickstart_edit_tiny.yaml",
    "flux": "train_configs/quickstart_flux_tiny.yaml", "flux2": "train_configs/quickstart_flux2_tiny.yaml",
    "kandinsky5": "train_configs/train_kandinsky5_lora.yaml", "z_image": "train_configs/train_z_image_lora.yaml",
    "krea2": "train_configs/quickstart_krea2_tiny.yaml",
    "qwen_image21": "train_configs/quickstart_qwen_image21_tiny.yaml",
}


@pytest.mark.parametrize("name", list(SPECS))
def test_every_family_trains_on_int8_blocks(name: str, tiny_model: Callable[[str], Path],
                                            request: pytest.FixtureRequest, tmp_path: Path,
                                            int_mm_calls: List[int]) -> None:
    """Two bf16 steps per family with its blocks in int8, gradient checkpointing on: finite losses, every
    linear of its blocks an ``Int8Linear`` under peft's LoRA, and the int8 matmuls ran."""
    data = request.getfixturevalue("edit_data" if SPECS[name].uses_references else "sample_data")
    out = tmp_path / "run"
    trainer = train_in_process(FAMILY_PROFILES[name], name, *qwen_args(
        tiny_model(name), data, out, *INT8, f"family={name}", "data_config.img_size=64", "max_train_steps=2",
        "mixed_precision=bf16", "disable_gradient_checkpointing=false", "lora_target=all_linear",
        "checkpointing_steps=1000", "validation.every_n_steps=0", "data_config.num_workers=0"))
    losses = read_losses(out)
    assert len(losses) == 2 and all(np.isfinite(losses))
    model = trainer.accelerator.unwrap_model(trainer.transformer)
    blocks = [b for attr in SPECS[name].block_attributes for b in getattr(model, attr)]
    linears = [m for b in blocks for n, m in b.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" not in n]
    assert linears and all(isinstance(m, Int8Linear) for m in linears)
    assert int_mm_calls
