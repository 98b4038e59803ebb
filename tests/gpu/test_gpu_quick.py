"""The CUDA-only paths of the engine, each in seconds: two blocks at the real width (the real kernels
and shapes), 512^2. Stage 1 of the GPU pass (``benchmarks/gpu_pass.py``) runs these with the sync
check of ``tests/test_train_e2e.py`` and ``test_fsdp_smoke.py``:

    pytest -m gpu tests/gpu/test_gpu_quick.py -v

Without a GPU they are skipped, except in the pass's dry run (``GPU_PASS_DRY_RUN=1``), which runs
them on the CPU at tiny scale; the assertions that only mean something on CUDA skip themselves there.
The xdist groups let the pass run the slow ones side by side (``-n 4 --dist loadgroup``): the quanto
group waits for quanto's CUDA extension, which the pass builds in the background meanwhile.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List

import pytest
import torch

import harness
from trainer.step.async_step import arm_device_skip, step_values
from trainer.config import TrainConfig
from trainer.step.optim import build_optimizer
from trainer.platform import choose_attention
from trainer.model.quantization import is_quantized

pytestmark = [pytest.mark.gpu, pytest.mark.cpu_dry_run]
BF16 = torch.bfloat16
# Written by the pass's background build of quanto's CUDA extension: "building", "ok" or "failed: ...";
# the quanto tests wait for it until the deadline (seconds since the epoch), then skip.
QUANTO_STATUS = "GPU_PASS_QUANTO_STATUS"
QUANTO_DEADLINE = "GPU_PASS_QUANTO_DEADLINE"


@dataclass(frozen=True)
class Where:
    device: torch.device
    scale: harness.Scale
    resolution: int

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def cuda_only(self, what: str) -> None:
        if not self.cuda:
            pytest.skip(f"{what}: CUDA only (dry run on the CPU)")


@pytest.fixture(scope="module")
def where() -> Where:
    if torch.cuda.is_available():
        return Where(torch.device("cuda", torch.cuda.current_device()), harness.QUICK, 512)
    return Where(torch.device("cpu"), harness.TINY, 64)


@pytest.fixture(autouse=True)
def free_memory():
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def wait_for_quanto_build() -> None:
    """Under the pass: wait for its background build of quanto's CUDA extension (a fresh machine
    compiles it once, ~100 s); fail if it failed, skip if it is not done by the deadline."""
    status_file = os.environ.get(QUANTO_STATUS)
    if not status_file:
        return
    deadline = float(os.environ.get(QUANTO_DEADLINE, "0"))
    while True:
        status = Path(status_file).read_text().strip() if Path(status_file).is_file() else "building"
        if status.startswith("failed"):
            pytest.fail(f"quanto's CUDA extension did not build: {status}")
        if not status.startswith("building"):
            return
        if time.time() > deadline:
            pytest.skip("quanto's CUDA extension was still building (a fresh machine's first build); "
                        "the pass's memory stages run these kernels at full size")
        time.sleep(1.0)


def quantized_types(rig: harness.Rig) -> List[str]:
    """Class names of the blocks' quantized weights (LoRA's own matrices are not quantized)."""
    return [type(m.weight).__name__ for b in rig.blocks for name, m in b.named_modules()
            if isinstance(m, torch.nn.Linear) and "lora_" not in name and is_quantized(m.weight)]


# The 24 GB profile as it was before auto_fit (which now chooses torchao's W8A8 there): quanto's qfloat8
# blocks, 8-bit AdamW, every block checkpointed with its input offloaded. Given as keys, auto_fit keeps them.
QUANTO = ["quantize=true", "quantization.backend=quanto", "quantization.weights=qfloat8", "optimizer=adamw8bit",
          "gradient_checkpointing=true", "gradient_checkpointing_cpu_offload=true"]


@pytest.mark.timeout(150)
@pytest.mark.xdist_group("quanto")
def test_24gb_profile_runs_quanto_fp8_marlin_with_8bit_adamw_and_offload(where: Where) -> None:
    """The 24 GB profile's parts on CUDA with quanto (``QUANTO``): qfloat8 blocks through quanto's fp8 Marlin
    GEMM (which refused the fp32 LayerNorm output at f24b9c6), bitsandbytes 8-bit AdamW, checkpointed block
    inputs offloaded on a side stream."""
    wait_for_quanto_build()
    seen = {}

    def inspect(rig: harness.Rig) -> None:
        seen.update(weights=quantized_types(rig), optimizer=type(rig.optimizer).__name__,
                    offload=rig.cfg.gradient_checkpointing_cpu_offload)

    report = harness.memory_profile("24gb", where.device, scale=where.scale, resolution=where.resolution, steps=3,
                                    inspect=inspect, overrides=QUANTO)
    print(report.summary())
    assert len(report.steps.losses) == 3 and report.steps.finite, report.steps.losses
    assert seen["offload"] and seen["weights"]
    where.cuda_only("fp8 Marlin weights and bitsandbytes' CUDA optimizer")
    counts = {name: seen["weights"].count(name) for name in set(seen["weights"])}
    print(f"quantized block weights: {counts}")
    assert counts.get("MarlinF8QBytesTensor", 0) > 0.9 * len(seen["weights"]), counts
    assert "8bit" in seen["optimizer"], seen["optimizer"]
    assert report.device_peak_gib is not None and report.device_peak_gib > 0


@pytest.mark.timeout(150)
@pytest.mark.xdist_group("quanto")
def test_block_swap_of_quantized_blocks_trains_like_resident_blocks(where: Where) -> None:
    """The 16 GB profile (one of two blocks swapped at this scale) against the same profile with no
    block swapped: the same losses. At f24b9c6 a swapped quantized weight's data stayed on the CPU."""
    wait_for_quanto_build()
    loads = []
    swapped = harness.memory_profile("16gb", where.device, scale=where.scale, resolution=where.resolution, steps=3,
                                     inspect=lambda rig: loads.append(rig.swapper.loads if rig.swapper else 0),
                                     overrides=QUANTO)
    resident = harness.memory_profile("16gb", where.device, scale=where.scale, resolution=where.resolution, steps=3,
                                      overrides=[*QUANTO, "blocks_to_swap=0"])
    print(swapped.summary())
    print(resident.summary())
    assert swapped.blocks_to_swap == 1 and resident.blocks_to_swap == 0
    assert loads[0] >= 2 * 3, "the swapped block came in for each forward and each recomputation"
    assert swapped.steps.finite and swapped.steps.losses == pytest.approx(resident.steps.losses, rel=1e-2)


@pytest.mark.timeout(150)
@pytest.mark.xdist_group("compile")
def test_compiled_blocks_train_like_eager_blocks(where: Where) -> None:
    """``compile: true`` compiles the blocks (first step includes it) and trains as eager does."""
    where.cuda_only("torch.compile with inductor's GPU kernels")
    reports, compiled = {}, {}
    for setting in ("true", "false"):
        with harness.rig_session("qwen_image", where.device, BF16, scale=where.scale, resolution=where.resolution,
                                 overrides=[f"compile={setting}"]) as rig:
            compiled[setting] = rig.compiled
            reports[setting] = harness.run_steps(rig, 4, where.resolution)
        print(f"compile={setting}: {reports[setting].summary()}")
    assert compiled == {"true": True, "false": False}
    assert reports["true"].finite
    assert reports["true"].losses[0] == pytest.approx(reports["false"].losses[0], rel=2e-2)
    assert reports["true"].losses == pytest.approx(reports["false"].losses, rel=5e-2)


@pytest.mark.timeout(90)
@pytest.mark.xdist_group("engine")
def test_offloaded_checkpoint_inputs_train_like_plain_checkpointing(where: Where) -> None:
    """``gradient_checkpointing_cpu_offload`` copies the kept block inputs to pinned host memory on a
    side stream and back for the recomputation: the same losses as plain checkpointing."""
    runs = {flag: harness.lora_steps("qwen_image", steps=3, resolution=where.resolution, dtype=BF16,
                                     device=where.device, scale=where.scale,
                                     overrides=[f"gradient_checkpointing_cpu_offload={flag}", "compile=false"])
            for flag in ("true", "false")}
    print(runs["true"].summary())
    assert runs["true"].finite and runs["true"].losses == pytest.approx(runs["false"].losses, rel=1e-2)


@pytest.mark.timeout(90)
@pytest.mark.xdist_group("engine")
def test_attention_is_timed_and_the_fastest_correct_kernel_goes_first(where: Where) -> None:
    """``attention_backend: auto`` on CUDA times the available SDPA kernels on Qwen-Image's real
    attention shape at 1024^2 and puts a correct one first (not the math fallback)."""
    where.cuda_only("the measured attention choice")
    shape = harness.attention_shape("qwen_image", 1024)
    choice = choose_attention(TrainConfig(), None, shape, where.device, BF16)
    print(choice.name, choice.reason)
    assert "measured" in choice.reason and choice.name != "math", choice.reason
    assert choice.priority[0] == choice.name and choice.priority[-1] == "math"


@pytest.mark.timeout(90)
@pytest.mark.xdist_group("engine")
def test_flux2_lora_gradients_and_steps(where: Where) -> None:
    """FLUX.2 [klein] blocks at the real width: every LoRA tensor gets a finite non-zero gradient,
    no base weight one, and steps give finite losses."""
    _gradients_and_steps(where, "flux2", ["compile=false"])


@pytest.mark.timeout(90)
@pytest.mark.xdist_group("engine")
def test_krea2_lora_gradients_and_steps(where: Where) -> None:
    """Krea 2 blocks at the real width (GQA attention with its output gate, shared modulation, text fusion
    at the real width) with all_linear LoRA: every LoRA tensor gets a finite non-zero gradient, no base weight
    one, and steps give finite losses."""
    _gradients_and_steps(where, "krea2", ["compile=false", "lora_target=all_linear"])


def _gradients_and_steps(where: Where, family: str, overrides: list) -> None:
    """Every LoRA tensor gets a finite non-zero gradient, no base weight one; three steps are finite."""
    with harness.rig_session(family, where.device, BF16, scale=where.scale, resolution=where.resolution,
                             overrides=overrides) as rig:
        grads = harness.gradient_flow(rig, where.resolution)
        steps = harness.run_steps(rig, 3, where.resolution)
    print(grads.summary())
    print(steps.summary())
    assert grads.ok, grads.summary()
    assert steps.finite, steps.losses


@pytest.mark.timeout(90)
@pytest.mark.xdist_group("engine")
def test_qwen_image21_lora_gradients_and_steps(where: Where) -> None:
    """Qwen-Image-2.1 blocks at the real width (block-causal attention over the joint sequence, the shared
    modulation, the zero-centred text norm) with all_linear LoRA: every LoRA tensor gets a finite non-zero
    gradient, no base weight one, and steps give finite losses (text-to-image: a random batch has no slots)."""
    _gradients_and_steps(where, "qwen_image21", ["compile=false", "lora_target=all_linear"])


@pytest.mark.timeout(60)
@pytest.mark.xdist_group("engine")
def test_fused_adamw_skips_a_non_finite_step_on_the_device(where: Where) -> None:
    """The sync-free step's guard: fused AdamW told on the device that the step's loss is NaN leaves
    the weights, the moments and the step count as they were."""
    params = [torch.nn.Parameter(torch.randn(64, 64, device=where.device)) for _ in range(3)]
    optimizer = build_optimizer(TrainConfig(learning_rate=0.1), params)
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    optimizer.step()
    before, state = [p.detach().clone() for p in params], copy.deepcopy([optimizer.state[p] for p in params])
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    nan = torch.tensor(float("nan"), device=where.device)
    arm_device_skip(optimizer, step_values(nan, nan))
    optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)), "the skipped step changed the weights"
    assert all(torch.equal(optimizer.state[p]["step"], s["step"]) for p, s in zip(params, state))
