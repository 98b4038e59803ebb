"""Every GPU-harness code path on the CPU at tiny scale (not marked ``gpu``: CI runs it), plus the
full-size architectures on the meta device (configs, shapes, FLOPs: nothing is materialised)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import harness
from trainer.families import SPECS
from trainer.families.base import load_family

CPU = torch.device("cpu")
TINY = harness.TINY
RES = 64  # 64 px -> 8 x 8 latents -> 16 image tokens


pytestmark = pytest.mark.usefixtures("quiet_logs")  # tests/gpu/conftest.py


# --------------------------------------------------------------------------- full size, meta device


@pytest.mark.parametrize("family, params, blocks", [
    ("qwen_image", 20.43e9, 60), ("qwen_image_edit", 20.43e9, 60), ("flux", 11.90e9, 19 + 38)])
def test_full_size_folder_family_and_conditions(family: str, params: float, blocks: int) -> None:
    """The config-only folder builds the real family; the meta transformer has the real size; the
    random conditions have the real shapes at 1024^2."""
    folder = harness.model_folder(family)
    fam = load_family(harness.train_config(family, folder, ["mixed_precision=bf16"]))
    model = harness.build_meta_transformer(folder)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=1e-3)
    assert len(fam.blocks(model)) == blocks
    batch = harness.random_batch(fam, dict(model.config), 1024, CPU, torch.bfloat16)
    assert batch.latents.shape == (1, 16, 128, 128)
    width = 4096 if family == "flux" else 3584
    assert batch.text["prompt_embeds"].shape == (1, batch.text_tokens, width)
    if family == "flux":
        assert batch.text["pooled_prompt_embeds"].shape == (1, 768) and batch.text_tokens == 512
    assert batch.image_tokens == 4096 * (2 if family == "qwen_image_edit" else 1)
    assert len(batch.references) == (1 if family == "qwen_image_edit" else 0)
    flops = harness.step_flops(model, blocks, batch.image_tokens, batch.text_tokens)
    assert flops.frozen_forward > 2 * 0.3 * params * batch.image_tokens  # at least the image stream


def test_qwen_image21_full_size_folder_and_text_to_image_batches() -> None:
    """Qwen-Image-2.1's config-only folder: the 7.1B transformer, unpatched 64-channel latents at 16x, and random
    text with an image_pad_mask of no slots (its references are optional: the batches are text-to-image)."""
    folder = harness.model_folder("qwen_image21")
    fam = load_family(harness.train_config("qwen_image21", folder, ["mixed_precision=bf16"]))
    model = harness.build_meta_transformer(folder)
    assert sum(p.numel() for p in model.parameters()) == 7_115_124_736 and len(fam.blocks(model)) == 32
    batch = harness.random_batch(fam, dict(model.config), 1024, CPU, torch.bfloat16)
    assert batch.latents.shape == (1, 64, 64, 64) and batch.image_tokens == 4096 and not batch.references
    assert batch.text["prompt_embeds"].shape == (1, batch.text_tokens, 4096)
    assert batch.text["image_pad_mask"].dtype == torch.bool and not batch.text["image_pad_mask"].any()


def test_flops_formula_and_mfu() -> None:
    """Qwen-Image at 1024^2: ~57 TFLOP forward through the frozen linears, ~155 TFLOP per LoRA step."""
    flops = harness.family_flops("qwen_image", 1024)
    assert flops.frozen_forward == pytest.approx(57.4e12, rel=0.02)
    assert flops.training == pytest.approx(2 * flops.frozen_forward + 3 * flops.lora_forward
                                           + 3 * flops.attention_forward)
    assert 0 < flops.lora_forward < 0.01 * flops.frozen_forward
    assert harness.peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert harness.peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert harness.peak_bf16_tflops("Some Unknown GPU") is None
    assert harness.mfu(flops, 0.45, 989.4) == pytest.approx(flops.training / 0.45 / 989.4e12)
    assert harness.mfu(flops, 0.45, None) is None


def test_token_classes() -> None:
    """From the family specs' layouts (the planner's)."""
    qwen = lambda name: harness.token_class(name, SPECS["qwen_image"])  # noqa: E731
    flux = lambda name: harness.token_class(name, SPECS["flux"])  # noqa: E731
    assert qwen("transformer_blocks.3.attn.to_q") == "image"
    assert qwen("transformer_blocks.3.attn.add_k_proj") == "text"
    assert qwen("transformer_blocks.3.txt_mlp.net.2") == "text"
    assert qwen("transformer_blocks.3.img_mod.1") == "sample"
    assert qwen("transformer_blocks.3.attn.to_q.lora_A.default") == "image"
    assert qwen("txt_in") == "text" and qwen("time_text_embed.timestep_embedder.linear_1") == "sample"
    assert flux("single_transformer_blocks.0.proj_mlp") == "joint"
    assert flux("single_transformer_blocks.0.norm.linear") == "sample"
    assert flux("context_embedder") == "text" and flux("x_embedder") == "image"


# --------------------------------------------------------------------------- tiny scale, real steps


def test_materialise_is_block_wise_and_deterministic() -> None:
    folder = harness.model_folder("qwen_image", TINY)
    fam = load_family(harness.train_config("qwen_image", folder))
    models = [harness.build_transformer(fam, folder, CPU, torch.float32, seed=3) for _ in range(2)]
    assert not any(p.is_meta for p in models[0].parameters())
    assert all(torch.equal(a, b) for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values(), strict=True))
    norm = models[0].transformer_blocks[0].attn.norm_q.weight
    assert torch.equal(norm, torch.ones_like(norm))


@pytest.mark.parametrize("family", harness.FAMILIES)
def test_lora_steps(family: str) -> None:
    report = harness.lora_steps(family, steps=3, resolution=RES, dtype=torch.float32, device=CPU, scale=TINY)
    assert len(report.step_times) == 3 and report.finite
    assert report.trainable_params > 0 and report.peak_gib is None  # no device memory on the CPU
    assert report.median_step_s > 0 and family in report.summary()


def test_lora_steps_bf16_without_checkpointing() -> None:
    report = harness.lora_steps("flux", steps=2, resolution=RES, dtype=torch.bfloat16, checkpointing=False,
                                device=CPU, scale=TINY)
    assert report.finite and report.dtype == "bfloat16" and not report.checkpointing


def test_tiny_pipeline_folder(tiny_qwen_image: Path) -> None:
    """A tiny pipeline folder (utils.tiny_models) works in place of the config-only folder."""
    report = harness.lora_steps("qwen_image", steps=2, resolution=RES, dtype=torch.float32, device=CPU,
                                model_dir=tiny_qwen_image)
    assert report.finite and report.image_tokens == 16


@pytest.mark.parametrize("family", harness.FAMILIES)
def test_gradient_flow(family: str) -> None:
    with harness.rig_session(family, CPU, torch.float32, scale=TINY) as rig:
        report = harness.gradient_flow(rig, RES)
    assert report.ok, report.summary()


def test_gradient_check_catches_problems() -> None:
    """The check itself: a frozen weight with a gradient, and a LoRA tensor without one, are reported."""
    with harness.rig_session("qwen_image", CPU, torch.float32, scale=TINY) as rig:
        named = dict(rig.transformer.named_parameters())
        base = next(n for n in named if "lora_" not in n)
        named[base].grad = torch.ones_like(named[base])
        report = harness.inspect_gradients(rig.transformer)
    assert not report.ok and report.base_with_grad == [base] and report.missing


def test_convergence_runs_the_fixed_sample() -> None:
    report = harness.convergence("qwen_image", steps=15, resolution=RES, dtype=torch.float32, device=CPU,
                                 scale=TINY, lr=1e-2, factor=1.05)
    assert len(report.losses) == 15 and report.ok, report.summary()


def test_convergence_with_the_24gb_profile() -> None:
    """The GPU suite's low-memory convergence check, on the CPU at tiny scale: the settings auto_fit chooses
    for the full-size model on 24 GiB (8-bit W8A8 blocks, checkpoint offload), the fixed sample's loss falls."""
    report = harness.convergence("qwen_image", steps=15, resolution=RES, dtype=torch.bfloat16, device=CPU,
                                 scale=TINY, lr=1e-2, factor=1.05, profile="24gb")
    assert len(report.losses) == 15 and report.ok, report.summary()


def test_attention_backends_on_cpu() -> None:
    report = harness.compare_attention_backends("flux", CPU, torch.bfloat16, RES, scale=TINY, repeats=2)
    names = [r.name for r in report.results]
    assert names[-1] == "math" and "flash" in names  # torch's CPU flash kernel and the math kernel
    assert all(r.correct(report.tolerance) for r in report.results), report.summary()
    assert report.auto == "flash" and report.fastest in names
    assert report.shape == (1, 2, 16 + 512, 16)


def test_fp8_smoke_skips_without_support() -> None:
    report = harness.fp8_smoke("qwen_image", device=CPU, scale=TINY)
    assert not report.ran and not report.ok and "fp8" in report.reason


def test_memory_profile_16gb_tiny() -> None:
    """The 16 GB profile as the engine builds it with auto_fit's choice for 16 GiB (8-bit blocks via ``place``,
    block swap, 8-bit AdamW or its fallback); no device memory to measure on the CPU, the planner still answers."""
    report = harness.memory_profile("16gb", CPU, scale=TINY, resolution=RES, steps=2)
    assert report.blocks_to_swap == 1 and report.steps.finite
    assert report.measured_gib is None and report.within_budget is None
    assert report.planned_gib is None or report.planned_gib > 0
    assert "16gb" in report.summary()


def test_profile_top_kernels() -> None:
    with harness.rig_session("qwen_image", CPU, torch.float32, scale=TINY) as rig:
        prof = harness.profile_top_kernels(rig, RES, steps=1)
    top = prof.top(5)
    assert len(top) == 5 and prof.wall_s > 0 and prof.busy_s > 0 and prof.device == "cpu"
    assert top[0].self_ms >= top[-1].self_ms and sum(r.share for r in prof.rows) == pytest.approx(1.0)
    shares = prof.shares()
    assert shares["attention"] > 0 and shares["gemm"] > 0 and sum(shares.values()) == pytest.approx(1.0)
    assert harness.kernel_category("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert harness.kernel_category("flash_bwd_kernel") == "attention"
    assert harness.kernel_category("multi_tensor_apply_kernel") == "optimizer"
    assert harness.kernel_category("vectorized_elementwise_kernel") == "other"


def test_a_profiles_auto_fit_choice_is_made_for_its_full_size_model() -> None:
    """The 24 GB profile's settings on the rig: auto_fit's choice for Qwen-Image at 24 GiB (the tiny model would
    fit any card unquantized), block counts scaled to the tiny model's 2 blocks, the given keys kept."""
    full = harness.profile_settings("train_configs/train_lora_4090.yaml", "qwen_image", harness.FULL)
    assert "quantize=true" in full and "auto_fit=false" in full and "gradient_checkpointing=58" in full
    tiny = harness.profile_settings("train_configs/train_lora_4090.yaml", "qwen_image", TINY, ["optimizer=adamw8bit"])
    assert "gradient_checkpointing=2" in tiny and tiny[-2] == "blocks_to_swap=0" and "optimizer=adamw8bit" in tiny


def test_machine_facts_and_scales() -> None:
    facts = harness.machine_facts()
    assert facts["torch"] == torch.__version__ and "gpu" in facts
    assert harness.rope_axes(128) == [16, 56, 56] and sum(harness.rope_axes(16)) == 16
    assert harness.transformer_config("flux", TINY)["num_single_layers"] == 2
    assert harness.scaled_swap(20, "qwen_image", harness.FULL) == 20
    assert math.isclose(harness.PROFILES["24gb"][1], 22.0)


def test_gpu_tests_skip_with_one_line_reason() -> None:
    reason = harness.no_cuda_reason()
    if torch.cuda.is_available():
        assert reason is None
    else:
        assert reason.startswith("no CUDA GPU") and "\n" not in reason


def test_gpu_report_dry_run(tmp_path: Path) -> None:
    """benchmarks/gpu_report.py end to end on tiny CPU models (the lighter sections)."""
    from benchmarks import gpu_report

    argv = ["--dry-run", "--sections", "machine", "steps", "memory", "attention", "fp8", "startup",
            "--families", "qwen_image", "--steps", "2", "--out", str(tmp_path / "report.md")]
    out = gpu_report.main(argv)
    text = out.read_text()
    for title in ("## Machine", "## Step time and MFU at 64^2", "### Profile: Qwen-Image", "## Attention backends",
                  "## fp8 training", "## Low-memory profiles", "## Start-up of a tiny run"):
        assert title in text
    assert "`python benchmarks/gpu_report.py --dry-run --families qwen_image --steps 2 --sections steps`" in text
    assert "| Qwen-Image | on | auto (eager) |" in text and "| Qwen-Image | on | off (eager) |" in text
    assert "| Qwen-Image | off |" in text
    memory_rows = [line for line in text.splitlines() if line.startswith(tuple(f"| {p} |" for p in harness.PROFILES))]
    qwen_rows = [row for row in gpu_report.MEMORY_ROWS if row[0] not in harness.PROFILE_FAMILIES]  # --families
    assert len(memory_rows) == len(qwen_rows) < len(gpu_report.MEMORY_ROWS)
    assert not any("failed" in r for r in memory_rows)
    startup_rows = [line for line in text.splitlines() if line.startswith("| python |")]
    assert len(startup_rows) == 2 and not any("failed" in r for r in startup_rows), startup_rows


@pytest.mark.parametrize("family", ["qwen_image", "flux"])
def test_a_step_neither_casts_nor_copies_frozen_weights(family: str) -> None:
    """Frozen weights are stored in the compute dtype, so a bf16 step reads them as they are: no
    cast or copy of a frozen weight per step (those would be whole-model copies on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    with harness.rig_session(family, CPU, torch.bfloat16, scale=TINY, resolution=RES) as rig:
        frozen = {t.untyped_storage().data_ptr() for _, t in rig.transformer.named_parameters() if not t.requires_grad}
        assert all(p.dtype == torch.bfloat16 for p in rig.transformer.parameters() if not p.requires_grad)
        copies = {"frozen": 0, "all": 0}

        copy_ops = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten.clone.default)

        class Copies(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in copy_ops:
                    source = args[1] if func is torch.ops.aten.copy_.default else args[0]
                    copies["all"] += 1
                    copies["frozen"] += source.untyped_storage().data_ptr() in frozen
                return func(*args, **(kwargs or {}))

        batch = harness.random_batch(rig.family, rig.config, RES, CPU, torch.bfloat16)
        gen = torch.Generator().manual_seed(0)
        harness.train_step(rig, batch, gen)  # the first step creates the optimizer state
        with Copies():
            harness.train_step(rig, batch, gen)
    assert copies["all"] > 10 and copies["frozen"] == 0, copies


def test_flux2_klein_9b_scale_and_profile() -> None:
    """``KLEIN_9B`` turns FLUX.2's reference (klein 4B) transformer into klein 9B's published config, and the
    FLUX.2 memory profile runs as its own family."""
    nine = SPECS["flux2"].hub_configs["black-forest-labs/FLUX.2-klein-base-9B"]["transformer/config.json"]
    published = {k: v for k, v in nine.items() if k != "_class_name"}
    assert harness.transformer_config("flux2", harness.KLEIN_9B) == published
    yaml, _ = harness.PROFILES["flux2_klein"]
    assert harness.PROFILE_FAMILIES["flux2_klein"] == "flux2" and "flux2" in yaml


def test_gpu_report_takes_the_klein_9b_scale_for_flux2_only() -> None:
    """`--scale klein9b` measures FLUX.2 [klein] 9B; asked of another family it stops, saying why."""
    from benchmarks import gpu_report

    args = gpu_report.parse_args(["--families", "flux2", "--scale", "klein9b", "--sections", "steps"])
    assert gpu_report.run_scale(args) is harness.KLEIN_9B
    assert gpu_report.run_scale(gpu_report.parse_args(["--families", "flux2"])) is harness.FULL
    with pytest.raises(SystemExit, match="--families flux2 only"):
        gpu_report.run_scale(gpu_report.parse_args(["--families", "qwen_image", "--scale", "klein9b"]))


def test_quantized_step_benchmark_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/quantized_step.py on the tiny model: every row measured, written as markdown and as
    one JSON line each; the torchao rows really multiplied in 8 bits, each with its kernel (the old int8
    row on the transposed kernel, with the fused one's numbers), bf16 and qfloat8 did not; a spent budget
    skips rows and says so."""
    import json

    from benchmarks import quantized_step

    out = tmp_path / "quant.md"
    quantized_step.main(["--device", "cpu", "--steps", "3", "--out", str(out)])
    rows = [json.loads(line) for line in (tmp_path / "quant.md.jsonl").read_text().splitlines()]
    torchao = ["int8_w8a8_old", "int8_w8a8", "float8_w8a8"]
    assert [(r["part"], r["format"]) for r in rows] == [("layer", f) for f in ["bf16", *torchao] * 2] + [
        ("model", f) for f in ["bf16", *torchao]] + [("layer", "qfloat8")] * 2 + [("model", "qfloat8")]
    assert all(r["status"] == "ok" for r in rows), [r["status"] for r in rows]
    layers = [r for r in rows if r["part"] == "layer"]
    models = {r["format"]: r["values"] for r in rows if r["part"] == "model"}
    kernels = {"bf16": "bf16 matmul", "int8_w8a8_old": "int8_transposed", "int8_w8a8": "int8",
               "float8_w8a8": "float8", "qfloat8": "quanto"}
    assert all(r["values"]["kernel"] == kernels[r["format"]] for r in layers)
    assert all(r["values"]["out_error"] < (0.05 if "8" in r["format"] else 0.01) for r in layers)
    assert all(models[f]["mm8_per_step"] > 0 for f in torchao) and models["bf16"]["mm8_per_step"] == 0
    assert models["qfloat8"]["mm8_per_step"] == 0
    assert models["int8_w8a8_old"]["loss_last"] == models["int8_w8a8"]["loss_last"], "the same numbers"
    assert all(models[f]["weights_mib"] < 0.8 * models["bf16"]["weights_mib"] for f in torchao)
    assert all(v["finite"] and v["s_per_step"] > 0 and v["train_peak_gib"] > 0 for v in models.values())
    text = out.read_text()
    assert "| Qwen-Image | float8_w8a8 | off (eager) |" in text and "## One linear layer" in text

    quantized_step.main(["--device", "cpu", "--steps", "3", "--parts", "model", "--formats", "bf16", "int8_w8a8",
                         "--time-budget", "0", "--out", str(out)])
    rows = [json.loads(line) for line in (tmp_path / "quant.md.jsonl").read_text().splitlines()]
    assert [r["status"].split(" (")[0] for r in rows] == ["skipped: time budget"] * 2
