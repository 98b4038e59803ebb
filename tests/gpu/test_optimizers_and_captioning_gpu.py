"""Issue 33 on a GPU (``pytest -m gpu tests/gpu/test_optimizers_and_captioning_gpu.py -v -s``): every
optimizer's steps and exact state round trip on CUDA (fp32 and bf16 weights), and the captioner on a
tiny random Qwen3-VL in bf16, 8-bit and 4-bit (bitsandbytes). Each test prints one line to compare."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from image_datasets.captioning import CaptionOptions, Captioner, caption_folder, read_caption
from trainer.config import TrainConfig
from trainer.step.optim import build_optimizer, evaluation_weights, training_weights
from trainer.step.optimizer_specs import OPTIMIZERS
from utils.tiny_models import build_tiny_vlm

pytestmark = pytest.mark.gpu
LEARNING_RATE = {"prodigy": 1.0, "prodigy_schedulefree": 1.0, "adafactor": 1e-2}


def _model(device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(device, dtype)


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, first: int, count: int) -> None:
    for step in range(first, first + count):
        x = torch.randn(32, 256, generator=torch.Generator().manual_seed(step)).to(model[0].weight)
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_resumes_bit_equal_on_cuda(name: str, dtype: torch.dtype, cuda: torch.device) -> None:
    if name == "adamw8bit" and dtype == torch.bfloat16:
        pytest.skip("8-bit AdamW keeps fp32 weights in this project (LoRA and full fine-tuning)")
    extra = {"lr_scheduler": "constant", "lr_warmup_steps": 0} if OPTIMIZERS[name].schedule_free else {}
    cfg = TrainConfig(optimizer=name, learning_rate=LEARNING_RATE.get(name, 1e-3), **extra)
    model = _model(cuda, dtype)
    optimizer = build_optimizer(cfg, model.parameters(), blocks=[model])
    training_weights(optimizer)
    start = time.perf_counter()
    _steps(model, optimizer, 0, 5)
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - start) / 5
    with evaluation_weights(optimizer):
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        buffer = io.BytesIO()
        torch.save(optimizer.state_dict(), buffer)
    _steps(model, optimizer, 5, 5)
    resumed = _model(cuda, dtype)
    resumed.load_state_dict(weights)
    again = build_optimizer(cfg, resumed.parameters(), blocks=[resumed])
    buffer.seek(0)
    again.load_state_dict(torch.load(buffer, weights_only=False))
    training_weights(again)
    _steps(resumed, again, 5, 5)
    print(f"{name} {dtype}: {per_step * 1e3:.1f} ms/step (includes the first)")
    for (key, want), got in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.isfinite(want).all() and torch.equal(want, got), f"{name}: {key} differs after the resume"


@pytest.mark.parametrize("quantization", [None, "8bit", "4bit"])
def test_captioner_bf16_and_bitsandbytes(quantization: str, cuda: torch.device, tmp_path: Path) -> None:
    model = build_tiny_vlm(tmp_path / "vlm")
    for i, colour in enumerate(("red", "green", "blue")):
        Image.new("RGB", (96, 64 + 32 * i), colour).save(tmp_path / f"img{i}.png")
    options = CaptionOptions(model=str(model), max_new_tokens=8, batch_size=2, quantization=quantization,
                             device=str(cuda), trigger_word="ohwx")
    captioner = Captioner.load(options)
    assert captioner.model.device.type == "cuda" and captioner.model.dtype == torch.bfloat16
    start = time.perf_counter()
    report = caption_folder(tmp_path, options, captioner, progress=False)
    print(f"captioner {quantization or 'bf16'}: {len(report.captioned)} images in {time.perf_counter() - start:.2f} s, "
          f"{torch.cuda.max_memory_allocated() / 2**20:.0f} MiB peak")
    assert len(report.captioned) == 3 and not report.failed, report.summary()
    assert all(read_caption(p).startswith("ohwx, ") for p in report.captioned)
