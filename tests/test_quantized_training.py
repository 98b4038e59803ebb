"""LoRA training on an 8-bit W8A8 base (``quantization: {backend: torchao, weights: int8_w8a8 | float8_w8a8 | auto}``)
through the real engine on the tiny models: int8 converges like the unquantized run, fp8 tracks it step by
step, their LoRA loads into a plain diffusers pipeline, a resume is bit-equal (with block swap and gradient
checkpointing), block swap gives the resident losses, a 24 GB-profile-like run on ``auto`` makes no
host-synchronizing call in the quantized layer, and every family trains on both formats."""

from __future__ import annotations

import json
import shutil
import traceback
from pathlib import Path
from typing import Callable, List

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

import trainer.model.quantized_linear as ql
from conftest import lora_keys_match, read_losses, train_in_process
from trainer.engine import Trainer
from trainer.families import SPECS
from trainer.model.quantized_linear import FLOAT8, INT8, QuantizedLinear

pytestmark = pytest.mark.e2e

QUICKSTART = "train_configs/quickstart_tiny.yaml"
TORCHAO = ["quantize=true", "quantization.backend=torchao"]
INT8_W8A8, FP8 = TORCHAO + ["quantization.weights=int8_w8a8"], TORCHAO + ["quantization.weights=float8_w8a8"]
FORMATS = {"int8_w8a8": (INT8_W8A8, torch.int8), "float8_w8a8": (FP8, torch.float8_e4m3fn)}
each_format = pytest.mark.parametrize("weights", list(FORMATS))
# Per step, the fp8 run's loss against the fp32 run's: within 1%. Measured on the tiny Qwen-Image (20 steps,
# learning rate 3e-3, every linear with LoRA): at most 0.19% apart (int8_w8a8: 0.03%). A wrong scale or
# layout in any of the ~40 quantized linears changes the loss by tens of percent from the first step.
STEP_TOLERANCE = 0.01


@pytest.fixture
def mm8_calls(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """One entry (the rows) per ``torch._int_mm`` or ``torch._scaled_mm`` call: the 8-bit layers' matmuls."""
    for storage in (INT8, FLOAT8):
        ql.kernel_check(torch.device("cpu"), storage)
    calls: List[int] = []
    real_int, real_scaled = torch._int_mm, torch._scaled_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape[0]) or real_int(a, b))
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **kw: calls.append(a.shape[0]) or real_scaled(a, b, **kw))
    return calls


def quantized_layers(trainer, dtype: torch.dtype) -> List[torch.nn.Module]:
    """The trained model's ``QuantizedLinear`` layers whose weight data is ``dtype``."""
    model = trainer.accelerator.unwrap_model(trainer.transformer)
    return [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.weight.qdata.dtype == dtype]


def qwen_args(model: Path, data: Path, out: Path, *extra: str) -> List[str]:
    return [f"pretrained_model_name_or_path={model}", f"data_config.img_dir={data}", f"output_dir={out}",
            "report_to=none", *extra]


def test_int8_lora_converges_like_the_unquantized_run_and_loads_in_diffusers(
        tiny_qwen_image: Path, sample_data: Path, tmp_path: Path, mm8_calls: List[int]) -> None:
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
    for name, extra in (("fp32", []), ("int8", INT8_W8A8)):
        mm8_calls.clear()
        trainer = train_in_process(QUICKSTART, "qwen_image", *qwen_args(tiny_qwen_image, one, tmp_path / name,
                                                                         *settings, *extra))
        runs[name] = np.array(read_losses(tmp_path / name))
        if name == "int8":
            assert len(quantized_layers(trainer, torch.int8)) > 20, "every block linear is int8"
            assert len(mm8_calls) > 100 * 20 * 2, "forward and input-gradient matmuls ran in int8"
    first, last = {n: v[:20].mean() for n, v in runs.items()}, {n: v[-20:].mean() for n, v in runs.items()}
    print({n: (round(first[n], 4), round(last[n], 4)) for n in runs})
    assert all(last[n] < 0.7 * first[n] for n in runs)
    assert abs(last["int8"] - last["fp32"]) < 0.25 * last["fp32"], f"int8 {last['int8']:.4f} vs fp32 {last['fp32']:.4f}"

    keys = load_file(str(tmp_path / "int8" / "pytorch_lora_weights.safetensors")).keys()
    assert all(".lora_A." in k or ".lora_B." in k for k in keys), "only LoRA factors, no int8 data or scales"
    lora_keys_match(QwenImagePipeline.from_pretrained(tiny_qwen_image), tmp_path / "int8", "int8")


def test_fp8_lora_tracks_the_unquantized_run_and_loads_in_diffusers(tiny_qwen_image: Path, sample_data: Path,
                                                                    tmp_path: Path, mm8_calls: List[int]) -> None:
    """30 steps from the same seed, fp32 base against float8_w8a8 base: every step's loss within
    ``STEP_TOLERANCE``; both matmuls of every block linear ran in fp8; the file is a plain diffusers LoRA
    (no fp8 data or scales in its keys; the unquantized pipeline loads it with no unexpected or missing keys);
    summary.json names the format and the kernel."""
    settings = ["max_train_steps=30", "learning_rate=3e-3", "rank=16", "lora_target=all_linear",
                "checkpointing_steps=1000", "data_config.caption_dropout_rate=0"]
    runs = {}
    for name, extra in (("fp32", []), ("fp8", FP8)):
        mm8_calls.clear()
        trainer = train_in_process(QUICKSTART, "qwen_image", *qwen_args(tiny_qwen_image, sample_data, tmp_path / name,
                                                                         *settings, *extra))
        runs[name] = np.array(read_losses(tmp_path / name))
        if name == "fp8":
            layers = len(quantized_layers(trainer, torch.float8_e4m3fn))
            assert layers > 20, "every block linear is fp8"
            assert len(mm8_calls) >= 30 * layers * 2, "forward and input-gradient matmuls ran in fp8"
    gap = np.abs(runs["fp8"] - runs["fp32"]) / runs["fp32"]
    print(f"largest per-step gap {100 * gap.max():.3f}% at step {gap.argmax() + 1}")
    assert len(gap) == 30 and gap.max() < STEP_TOLERANCE

    keys = load_file(str(tmp_path / "fp8" / "pytorch_lora_weights.safetensors")).keys()
    assert all(".lora_A." in k or ".lora_B." in k for k in keys), "only LoRA factors, no fp8 data or scales"
    lora_keys_match(QwenImagePipeline.from_pretrained(tiny_qwen_image), tmp_path / "fp8", "fp8")
    summary = json.loads((tmp_path / "fp8" / "summary.json").read_text())
    assert summary["quantization"] == {"backend": "torchao", "weights": "float8_w8a8", "matmul": "float8"}
    assert json.loads((tmp_path / "fp32" / "summary.json").read_text())["quantization"] is None


@each_format
def test_resume_with_block_swap_and_checkpointing_is_bit_equal(weights: str, tiny_qwen_image: Path, sample_data: Path,
                                                                tmp_path: Path) -> None:
    """Four steps straight, and two then a resume to four: the same LoRA bit for bit and the same losses,
    with one of the two blocks swapped (its 8-bit weights travel to the host and back), gradient checkpointing
    with offloaded inputs, and LoRA dropout."""
    def run(out: Path, steps: int, *extra: str) -> None:
        train_in_process(QUICKSTART, "qwen_image", *qwen_args(
            tiny_qwen_image, sample_data, out, *FORMATS[weights][0], f"max_train_steps={steps}", "checkpointing_steps=2",
            "overwrite_output_dir=false", "mixed_precision=bf16", "blocks_to_swap=1", "lora_dropout=0.1",
            "disable_gradient_checkpointing=false", "gradient_checkpointing_cpu_offload=true", *extra))

    run(tmp_path / "straight", 4)
    run(tmp_path / "resumed", 2)
    run(tmp_path / "resumed", 4, "resume_from_checkpoint=latest")
    want = load_file(str(tmp_path / "straight" / "pytorch_lora_weights.safetensors"))
    got = load_file(str(tmp_path / "resumed" / "pytorch_lora_weights.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert read_losses(tmp_path / "resumed") == read_losses(tmp_path / "straight")


@each_format
def test_block_swap_gives_the_resident_losses(weights: str, tiny_qwen_image: Path, sample_data: Path,
                                              tmp_path: Path) -> None:
    runs = {}
    for name, swap in (("resident", 0), ("swapped", 1)):
        train_in_process(QUICKSTART, "qwen_image", *qwen_args(
            tiny_qwen_image, sample_data, tmp_path / name, *FORMATS[weights][0], "max_train_steps=3", f"blocks_to_swap={swap}",
            "mixed_precision=bf16"))
        runs[name] = read_losses(tmp_path / name)
    assert runs["resident"] == runs["swapped"]


# Calls that make a GPU step wait for the host, or build tables on the host: a scalar read (.item(), bool of
# a tensor, torch.equal), data-dependent shapes (nonzero), a tensor made from Python values (torch.tensor:
# lift_fresh), indexing with a tensor of indices (quanto's Marlin unpacking did that with CPU-built tables).
SYNCING = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
           torch.ops.aten.equal.default, torch.ops.aten.nonzero.default, torch.ops.aten.lift_fresh.default,
           torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default}
LAYER_FILE = "trainer/quantization/w8a8_linear.py"


def test_a_24gb_like_run_on_auto_makes_no_host_sync_in_the_quantized_layer(
        tiny_qwen_image: Path, sample_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU twin of ``test_steps_on_cuda_make_no_synchronizing_call`` (test_train_e2e.py) for the 24 GB
    profile's recipe: blocks quantized with ``weights: auto`` (fp8 here), 8-bit AdamW, gradient checkpointing
    with the kept inputs offloaded, bf16. Over the training loop, the quantized layer's own code runs no
    op that synchronizes or builds tables on the host, the device checks are not run again (cached), and
    its fp8 matmuls ran. summary.json says what auto became and why."""
    layer_ops: List[str] = []

    class LayerOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in SYNCING or func is torch.ops.aten._scaled_mm.default:
                frames = [f for f in traceback.extract_stack()[:-1] if f.filename.endswith(LAYER_FILE)]
                if frames:
                    layer_ops.append(f"{func.__name__} at line {frames[-1].lineno}")
            return func(*args, **(kwargs or {}))

    def checked_again(device: torch.device) -> None:
        raise AssertionError(f"the device check ran again inside the loop ({device})")

    loop = Trainer._loop

    def watched(self, progress) -> None:
        with pytest.MonkeyPatch.context() as inside:
            inside.setattr(ql, "_probe_float8", checked_again)
            inside.setattr(ql, "_probe_int8", checked_again)
            with LayerOps():
                loop(self, progress)

    monkeypatch.setattr(Trainer, "_loop", watched)
    out = tmp_path / "run"
    trainer = train_in_process(QUICKSTART, "qwen_image", *qwen_args(
        tiny_qwen_image, sample_data, out, "quantize=true", "quantization.backend=torchao", "quantization.weights=auto",
        "optimizer=adamw8bit", "mixed_precision=bf16", "disable_gradient_checkpointing=false",
        "gradient_checkpointing_cpu_offload=true", "max_train_steps=3", "checkpointing_steps=1000"))
    assert len(quantized_layers(trainer, torch.float8_e4m3fn)) > 20
    syncing = [op for op in layer_ops if not op.startswith("_scaled_mm")]
    assert syncing == [], f"host-synchronizing ops in the quantized layer: {sorted(set(syncing))}"
    assert len(layer_ops) >= 3 * 20 * 2, "the fp8 matmuls ran in the loop"
    summary = json.loads((out / "summary.json").read_text())["quantization"]
    assert summary["weights"] == "float8_w8a8" and summary["requested"] == "auto"
    assert summary["reason"].startswith("CPU:") and summary["matmul"] == "float8"


FAMILY_PROFILES = {
    "qwen_image": QUICKSTART, "qwen_image_edit": "train_configs/quickstart_edit_tiny.yaml",
    "flux": "train_configs/quickstart_flux_tiny.yaml", "flux2": "train_configs/quickstart_flux2_tiny.yaml",
    "kandinsky5": "train_configs/train_kandinsky5_lora.yaml", "z_image": "train_configs/train_z_image_lora.yaml",
    "krea2": "train_configs/quickstart_krea2_tiny.yaml",
    "qwen_image21": "train_configs/quickstart_qwen_image21_tiny.yaml",
    "wan": "train_configs/quickstart_wan_tiny.yaml",
}


@each_format
@pytest.mark.parametrize("name", list(SPECS))
def test_every_family_trains_on_8bit_blocks(weights: str, name: str, tiny_model: Callable[[str], Path],
                                            request: pytest.FixtureRequest, tmp_path: Path,
                                            mm8_calls: List[int]) -> None:
    """Two bf16 steps per family with its blocks in int8 or fp8, gradient checkpointing on: finite losses,
    every linear of its blocks a ``QuantizedLinear`` with 8-bit data under peft's LoRA, and the 8-bit
    matmuls ran."""
    data = request.getfixturevalue("edit_data" if SPECS[name].uses_references else "sample_data")
    out = tmp_path / "run"
    # A video family trains on clips too (the profile's folder is the user's: the test's clips instead).
    clips = [f"data_config.video_dir={request.getfixturevalue('sample_videos')}"] if SPECS[name].trains_video else []
    trainer = train_in_process(FAMILY_PROFILES[name], name, *qwen_args(
        tiny_model(name), data, out, *FORMATS[weights][0], *clips, f"family={name}", "data_config.img_size=64",
        "max_train_steps=2",
        "mixed_precision=bf16", "disable_gradient_checkpointing=false", "lora_target=all_linear",
        "checkpointing_steps=1000", "validation.every_n_steps=0", "data_config.num_workers=0"))
    losses = read_losses(out)
    assert len(losses) == 2 and all(np.isfinite(losses))
    model = trainer.accelerator.unwrap_model(trainer.transformer)
    blocks = [b for attr in SPECS[name].block_attributes for b in getattr(model, attr)]
    linears = [m for b in blocks for n, m in b.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" not in n]
    assert linears and all(isinstance(m, QuantizedLinear) and m.weight.qdata.dtype == FORMATS[weights][1]
                           for m in linears)
    assert mm8_calls
