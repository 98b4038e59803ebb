"""The arithmetic of a step measurement (``tests/gpu/step_anatomy.py``) on the CPU: the kernel classifier on real
CUDA kernel names and on a CPU profile of a tiny LoRA run, the median without the flush interval, the host time,
MFU and HFU with the recompute counted."""

from __future__ import annotations

import pytest
import torch

import harness
import step_anatomy as sa

CPU = torch.device("cpu")
RANK = 4  # not 16: the tiny model's image tokens (16 at 64^2) would look like LoRA's rank


pytestmark = pytest.mark.usefixtures("quiet_logs")  # tests/gpu/conftest.py


# Kernel names as an H100/H200 profile of the Qwen-Image step shows them (cuBLAS, cuDNN, FlashAttention,
# PyTorch's own elementwise and multi-tensor kernels, inductor's triton kernels, transfers).
CUDA_KERNELS = [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off", "gemm"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>", "gemm"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>", "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)", "attention"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float>>", "elementwise"),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<direct_copy_kernel_cuda>>",
     "elementwise"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>", "elementwise"),
    ("triton_poi_fused__to_copy_add_mul_native_layer_norm_0", "elementwise"),
    ("triton_red_fused_mean_pow_rsqrt_1", "elementwise"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, 1, 1>>", "optimizer"),
    ("void at::native::lpnorm_cleanup<float, 1, float, float>", "optimizer"),
    ("Memcpy HtoD (Pinned -> Device)", "copy"),
    ("Memset (Device)", "copy"),
]


@pytest.mark.parametrize("kernel, category", CUDA_KERNELS)
def test_real_cuda_kernel_names_fall_in_their_category(kernel: str, category: str) -> None:
    assert sa.classify(kernel) == category


def test_a_gemm_is_loras_when_its_shapes_show_the_rank() -> None:
    """Forward x @ A^T (N = rank), h @ B^T (K = rank) and the weight gradients (M = rank) are LoRA's; the base
    linear at the same width, a batch dimension equal to the rank, or no rank known are not."""
    gemm = "sm90_xmma_gemm_bf16bf16_bf16f32"
    assert sa.classify(gemm, "aten::mm", [[4096, 3072], [3072, 16]], rank=16) == "lora"
    assert sa.classify(gemm, "aten::mm", [[4096, 16], [16, 3072]], rank=16) == "lora"
    assert sa.classify(gemm, "aten::mm", [[16, 4096], [4096, 3072]], rank=16) == "lora"
    assert sa.classify(gemm, "aten::addmm", [[3072], [4096, 3072], [3072, 3072], [], []], rank=16) == "gemm"
    assert sa.classify(gemm, "aten::bmm", [[16, 4096, 3072], [16, 3072, 64]], rank=16) == "gemm"
    assert sa.classify(gemm, "aten::mm", [[4096, 3072], [3072, 16]], rank=None) == "gemm"
    # attention's and elementwise kernels stay what they are whatever the shapes
    assert sa.classify("flash_fwd_kernel", "aten::_flash_attention_forward", [[1, 16, 24, 128]], 16) == "attention"
    assert sa.classify("vectorized_elementwise_kernel", "aten::mul", [[4096, 16]], 16) == "elementwise"
    # a cuBLAS helper kernel without a GEMM-like name launched by a GEMM op is GEMM time; inductor's are not
    assert sa.classify("Kernel2", "aten::mm", [[128, 64], [64, 128]], 16) == "gemm"
    assert sa.classify("triton_poi_fused_add_0", "aten::mm", [], 16) == "elementwise"


def test_a_cpu_profile_of_a_tiny_lora_step_is_broken_down_by_category() -> None:
    """One profiled step of tiny Qwen-Image (rank 4): every category but copies has time, the categories sum to
    the busy time, and the LoRA GEMMs are exactly the ones with the rank in their shapes: 2 forward per adapted
    linear, plus backward ones (each LoRA matrix gets its weight gradient)."""
    with harness.rig_session("qwen_image", CPU, torch.float32, scale=harness.TINY, resolution=64,
                             overrides=[f"rank={RANK}"]) as rig:
        adapted = sum(1 for name, _ in rig.transformer.named_modules() if name.endswith(".lora_A.default"))
        prof = harness.profile_step(rig, 64)
    assert prof.unit == "CPU" and prof.steps == 1 and adapted == 8  # 2 blocks x to_q, to_k, to_v, to_out.0
    parts = prof.by_category()
    assert set(parts) == set(sa.CATEGORIES)
    assert all(parts[c] > 0 for c in ("gemm", "attention", "elementwise", "lora", "optimizer")), parts
    assert sum(parts.values()) == pytest.approx(prof.busy_ms)
    lora = [k for k in prof.kernels if k.category == "lora"]
    assert {k.name for k in lora} <= {"aten::mm", "aten::addmm", "aten::matmul", "aten::linear"}
    mm_lora = [k for k in lora if k.name == "aten::mm"]
    assert 2 * adapted + 2 * adapted <= len(mm_lora) <= 4 * adapted * 2  # fwd A, B; bwd: a weight grad each
    assert any(k.category == "gemm" and k.name == "aten::addmm" for k in prof.kernels)  # the base linears
    summary = prof.summary()
    assert summary["busy_ms"] == pytest.approx(prof.busy_ms, abs=1e-3) and summary["top"][0]["ms_per_step"] > 0


def test_the_median_drops_the_flush_interval_and_the_warm_up() -> None:
    """With a lag of one the last interval is the GPU's tail (0.0255 s at a8112a6), not a step."""
    times = [16.85, 0.4786, 0.4846, 0.48, 0.4863, 0.4775, 0.492, 0.0255]
    assert sa.steady_intervals(times, 2, flush_interval=True) == [0.4846, 0.48, 0.4863, 0.4775, 0.492]
    assert sa.steady_intervals(times, 2, flush_interval=False) == times[2:]
    report = harness.StepReport("qwen_image", "H200", "bfloat16", 1024, 1, True, "cudnn", 4096, 128, 1, times,
                                [1.0] * 8, None, None, readout_lag=1, host_times=[9.0, 0.5, 0.47, 0.46, 0.48, 0.45,
                                                                                  0.47, 0.49])
    assert report.median_step_s == pytest.approx(0.4846)  # 0.4823 with the flush interval in
    assert report.flush_tail_s == pytest.approx(0.0255)
    assert report.host_ms == pytest.approx(470.0)  # median of the steps after the first two
    cpu = harness.StepReport("qwen_image", "cpu", "float32", 64, 1, False, "math", 16, 8, 1, [3.0, 1.0, 2.0, 4.0],
                             [1.0] * 4, None, None)
    assert cpu.steady_times == [2.0, 4.0] and cpu.flush_tail_s is None and cpu.host_ms is None


def test_mfu_and_hfu_count_the_recompute_of_the_checkpointed_blocks() -> None:
    """The review's figures: 154.9 TFLOP model, +70.8 recompute, 0.482 s on a 989.4 TFLOP/s peak: MFU 32.5%,
    HFU 47.3%; half the blocks checkpointed counts half the recompute; none: HFU = MFU."""
    full = sa.Utilisation(154.9e12, 70.8e12, sa.recompute_fraction(True, 60), 0.482, 989.4)
    assert full.mfu == pytest.approx(0.3248, abs=5e-4) and full.hfu == pytest.approx(0.4733, abs=5e-4)
    half = sa.Utilisation(154.9e12, 70.8e12, sa.recompute_fraction(30, 60), 0.40, 989.4)
    assert half.hardware_flops == pytest.approx(190.3e12)
    assert sa.recompute_fraction(False, 60) == sa.recompute_fraction(0, 60) == 0.0
    assert sa.recompute_fraction(90, 60) == 1.0
    none = sa.Utilisation(154.9e12, 70.8e12, 0.0, 0.35, 989.4)
    assert none.hfu == none.mfu == pytest.approx(0.4473, abs=5e-4)
    assert sa.Utilisation(1e12, 0, 0, 1.0, None).mfu is None


def test_the_anatomy_record_says_which_side_limits_the_step() -> None:
    gpu = sa.Breakdown([sa.KernelTime("sm90_xmma_gemm", 300.0, "gemm"), sa.KernelTime("flash_fwd", 100.0, "attention"),
                        sa.KernelTime("triton_poi", 60.0, "elementwise")], steps=1, unit="device")
    u = sa.Utilisation(154.9e12, 70.8e12, 1.0, 0.482, 989.4)
    host_bound = sa.StepAnatomy(0.482, 475.0, 25.5, u, gpu).fields()
    assert host_bound["gpu_busy_ms"] == 460.0 and host_bound["bound"] == "host"
    assert host_bound["gpu_busy_of_step"] == pytest.approx(0.954, abs=1e-3)
    assert host_bound["breakdown_ms"] == {"gemm": 300.0, "attention": 100.0, "elementwise": 60.0, "lora": 0.0,
                                          "optimizer": 0.0, "copy": 0.0}
    assert host_bound["mfu"] == pytest.approx(0.3248, abs=1e-4) and host_bound["hw_tflop_per_step"] == 225.7
    assert host_bound["explained_of_step"] == pytest.approx(0.985, abs=1e-3)  # 475 ms of 482
    assert sa.StepAnatomy(0.482, 120.0, 400.0, u, gpu).fields()["bound"] == "gpu"
    assert sa.StepAnatomy(0.920, 120.0, 400.0, u, gpu).fields()["explained_of_step"] == pytest.approx(0.5)
    cpu = sa.Breakdown([sa.KernelTime("aten::mm", 5.0, "gemm")], unit="CPU")
    assert sa.StepAnatomy(1.0, 500.0, None, u, cpu).fields()["gpu_busy_ms"] is None  # CPU op time is no GPU time
