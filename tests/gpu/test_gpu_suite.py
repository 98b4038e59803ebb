"""GPU validation on full-size random-weight transformers (no download): ``pytest -m gpu tests/gpu -v``.

Every test here is marked ``gpu`` and is skipped with a one-line reason where there is no CUDA GPU
(``tests/gpu/conftest.py``). ``-s`` shows each measurement's summary line; ``benchmarks/gpu_report.py``
runs the same measurements and writes them to ``docs/GPU_RESULTS.md``.
"""

from __future__ import annotations

import math

import pytest
import torch

import harness
from utils.cuda_utils import feature_rule, supports_feature

pytestmark = pytest.mark.gpu

RESOLUTION = 1024
BF16 = torch.bfloat16


@pytest.mark.parametrize("family", harness.FAMILIES)
def test_quick_iteration(family: str, cuda: torch.device) -> None:
    """10 LoRA steps at 1024^2 in bf16 with gradient checkpointing: finite losses, times, peak."""
    report = harness.lora_steps(family, steps=10, resolution=RESOLUTION, dtype=BF16, checkpointing=True, device=cuda)
    print(report.summary())
    assert len(report.losses) == 10 and report.finite, report.losses
    assert report.median_step_s > 0 and report.peak_gib is not None
    assert report.peak_gib < torch.cuda.get_device_properties(cuda).total_memory / harness.GIB


@pytest.mark.parametrize("family", ["qwen_image", "flux"])
def test_loss_convergence(family: str, cuda: torch.device) -> None:
    """100 steps overfitting one fixed sample: the loss falls by CONVERGENCE_FACTOR."""
    report = harness.convergence(family, steps=100, resolution=RESOLUTION, dtype=BF16, device=cuda)
    print(report.summary())
    assert report.ok, report.summary()


def test_loss_convergence_low_memory(cuda: torch.device) -> None:
    """The 24 GB profile (auto_fit's choice for 24 GiB: W8A8 blocks, checkpointing with offloaded inputs)
    overfits the fixed sample as bf16 does."""
    report = harness.convergence("qwen_image", steps=100, resolution=RESOLUTION, dtype=BF16, device=cuda,
                                 profile="24gb")
    print(report.summary())
    assert report.ok, report.summary()


@pytest.mark.parametrize("family", harness.FAMILIES)
def test_gradient_flow(family: str, cuda: torch.device) -> None:
    """Every LoRA tensor gets a finite non-zero gradient; no base weight gets one."""
    with harness.rig_session(family, cuda, BF16) as rig:
        report = harness.gradient_flow(rig, resolution=512)
    print(report.summary())
    assert report.ok, report.summary()


@pytest.mark.parametrize("profile", sorted(harness.PROFILES))
def test_memory_profile(profile: str, cuda: torch.device) -> None:
    """The low-memory profiles (the 24 GB / 16 GB ones with auto_fit's choice for their card) stay below
    their budgets, and the memory planner predicts the peak within +-15%."""
    report = harness.memory_profile(profile, cuda, resolution=RESOLUTION)
    print(report.summary())
    assert report.within_budget, report.summary()
    if report.planned_gib is not None:
        assert abs(report.plan_error) <= 0.15, report.summary()


def test_checkpoint_cpu_offload_lowers_the_peak(cuda: torch.device) -> None:
    """gradient_checkpointing_cpu_offload moves the kept block inputs (Qwen-Image at 1024^2: 60 x
    4224 tokens x 3072 x 2 B = 1.45 GiB) to host memory: the peak falls by most of that, and the
    losses are those of plain checkpointing."""
    plain = harness.lora_steps("qwen_image", steps=4, resolution=RESOLUTION, dtype=BF16, device=cuda)
    offloaded = harness.lora_steps("qwen_image", steps=4, resolution=RESOLUTION, dtype=BF16, device=cuda,
                                   overrides=["gradient_checkpointing_cpu_offload=true"])
    print(plain.summary())
    print(offloaded.summary())
    kept = 60 * (plain.image_tokens + plain.text_tokens) * 3072 * 2 / harness.GIB
    assert offloaded.peak_gib < plain.peak_gib - 0.7 * kept, (plain.peak_gib, offloaded.peak_gib, kept)
    assert offloaded.losses == pytest.approx(plain.losses, rel=1e-2)


@pytest.mark.parametrize("family", ["qwen_image", "flux"])
def test_attention_backends(family: str, cuda: torch.device) -> None:
    """Each available SDPA backend matches the math kernel within bf16 tolerance; the engine's auto
    choice is the fastest (within 10%)."""
    report = harness.compare_attention_backends(family, cuda, BF16, RESOLUTION)
    print(report.summary())
    bad = [r for r in report.results if not r.correct(report.tolerance)]
    assert not bad, f"backends off the math reference: {bad}"
    assert report.auto_is_fastest(), f"auto picked {report.auto}, fastest is {report.fastest}: {report.summary()}"


def test_fp8_training(cuda: torch.device) -> None:
    """fp8 matmuls for the blocks' image-stream linears (frozen fp8 weights) run without NaN where the GPU
    supports them."""
    if not supports_feature("fp8_training"):
        pytest.skip(f"fp8 training not supported here: it needs {feature_rule('fp8_training')}")
    report = harness.fp8_smoke("qwen_image", steps=5, resolution=RESOLUTION, device=cuda)
    print(report.reason, report.steps.summary() if report.steps else "")
    assert report.ran, report.reason
    assert report.ok and all(math.isfinite(x) for x in report.steps.losses), report.steps.losses
