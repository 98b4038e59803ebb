"""The platform layer's config switches change what the engine does (not islands)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import train_in_process
from trainer.config import TrainConfig
from trainer.families import SPECS
from trainer.platform import choose_attention, maybe_fp8, prepare_environment, requested_features


def test_unified_memory_sets_allocator_and_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    monkeypatch.setenv("QWEN_TRAINER_UNIFIED_MEMORY", "0")
    policy = prepare_environment(TrainConfig(unified_memory=True))
    import os

    conf = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    assert "expandable_segments:True" in conf and "max_split_size_mb:512" in conf, "user setting kept"
    assert policy.unified_memory and not policy.pin_memory and policy.keep_encoders


def test_discrete_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QWEN_TRAINER_UNIFIED_MEMORY", "0")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    policy = prepare_environment(TrainConfig())
    assert not policy.unified_memory and not policy.keep_encoders
    assert policy.pin_memory == torch.cuda.is_available()
    assert prepare_environment(TrainConfig(disable_cpu_offload=True)).keep_encoders


def test_attention_switches(logs: list, monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer.platform as platform

    model = torch.nn.Linear(2, 2)
    assert choose_attention(TrainConfig(attention_backend="math"), model).name == "math"
    assert any("Attention backend: math" in r["message"] for r in logs)
    seen = []
    real = platform.select_attention_backend
    monkeypatch.setattr(platform, "select_attention_backend",
                        lambda requested, exclude: seen.append((requested, set(exclude))) or real(requested, exclude=exclude))
    choose_attention(TrainConfig(), model)
    cfg = TrainConfig()
    cfg.cuda_features.enable_cudnn_sdp = False
    cfg.cuda_features.enable_flash_attention_3 = True
    choose_attention(cfg, model)
    assert seen == [("auto", {"flash3"}), ("auto", {"cudnn"})]


def test_fp8_without_support_says_so(logs: list) -> None:
    cfg = TrainConfig()
    cfg.cuda_features.enable_fp8_training = True
    if torch.cuda.is_available():
        pytest.skip("checks the message on machines without fp8 support")
    assert maybe_fp8(cfg, torch.nn.Linear(16, 16), SPECS["qwen_image"]) is False
    assert any("fp8 training needs an sm_89+ GPU" in r["message"] for r in logs)
    assert "fp8" in requested_features(cfg)


# The linears fp8 converts in each block list: image-stream (or joint-stream) attention and MLP, by the family
# spec's layout; modulation and the text stream stay (review gpu-performance-2d769dd, L3: fp8 buys nothing at
# one row per sample or ~128-512 text tokens). Z-Image's spec has no layout: none converted.
FP8_BLOCK_LINEARS = {
    "qwen_image": {"transformer_blocks": {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                                          "img_mlp.net.0.proj", "img_mlp.net.2"}},
    "flux": {"transformer_blocks": {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2"},
             "single_transformer_blocks": {"attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out"}},
    "krea2": {"transformer_blocks": {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_gate", "attn.to_out.0",
                                     "ff.gate", "ff.up", "ff.down"}},
    "z_image": {},
}


@pytest.mark.parametrize("family", list(FP8_BLOCK_LINEARS))
def test_fp8_converts_the_image_stream_attention_and_mlp_of_the_familys_blocks(family: str) -> None:
    """fp8 picks, in every block list of the full-size model (meta device), exactly the image-stream
    attention and MLP linears: no modulation (``img_mod.1``, ``norm1.linear``), no text stream
    (``add_q_proj``, ``txt_mlp``), nothing outside the blocks."""
    import diffusers
    from accelerate import init_empty_weights

    from trainer.platform import fp8_linears

    config = SPECS[family].reference_checkpoint()["transformer/config.json"]
    with init_empty_weights():
        model = getattr(diffusers, config["_class_name"]).from_config(config)
    names = fp8_linears(model, SPECS[family])
    want = {f"{attribute}.{index}.{name}" for attribute, layers in FP8_BLOCK_LINEARS[family].items()
            for index in range(len(getattr(model, attribute))) for name in layers}
    assert names == want
    assert not any("mod" in n or "add_" in n or "txt" in n or "context" in n for n in names)


def test_fp8_on_a_lora_run_stores_the_heavy_linears_in_float8(monkeypatch: pytest.MonkeyPatch, logs: list) -> None:
    """A LoRA run (frozen base): the chosen linears become the frozen-fp8 layer (fp8 data stored once, no
    torchao float8 training module casting the weight per call), eager included; the modulation and text
    linears stay bf16."""
    import diffusers

    import trainer.platform as platform
    from trainer.model.quantized_linear import QuantizedLinear

    monkeypatch.setattr(platform, "supports_feature", lambda name: True)
    config = {**SPECS["qwen_image"].reference_checkpoint()["transformer/config.json"], "num_layers": 1,
              "num_attention_heads": 2, "attention_head_dim": 16, "joint_attention_dim": 32}
    model = diffusers.QwenImageTransformer2DModel.from_config(config).to(torch.bfloat16)
    cfg = TrainConfig()
    cfg.cuda_features.enable_fp8_training = True
    assert maybe_fp8(cfg, model, SPECS["qwen_image"], compiled=False)
    block = model.transformer_blocks[0]
    assert type(block.attn.to_q) is QuantizedLinear and block.attn.to_q.weight.qdata.dtype == torch.float8_e4m3fn
    assert type(block.img_mlp.net[2]) is QuantizedLinear
    assert type(block.img_mod[1]) is torch.nn.Linear and type(block.attn.add_q_proj) is torch.nn.Linear
    assert any("6 image-stream attention and MLP linears" in r["message"] for r in logs)


def test_engine_honours_offload_and_checkpointing_switches(tiny_qwen_image: Path, sample_data: Path,
                                                           tmp_path: Path) -> None:
    trainer = train_in_process(
        "train_configs/quickstart_tiny.yaml", "qwen_image", f"pretrained_model_name_or_path={tiny_qwen_image}",
        f"data_config.img_dir={sample_data}", f"output_dir={tmp_path}", "max_train_steps=1", "report_to=none",
        "disable_cpu_offload=true", "disable_gradient_checkpointing=true", "attention_backend=math")
    assert trainer.family.text_pipe is not None and trainer.family.vae is not None, "encoders kept resident"
    assert not trainer.accelerator.unwrap_model(trainer.transformer).is_gradient_checkpointing
    assert trainer.attention.name == "math"
    summary = trainer.monitor.summary()
    assert set(summary["phases"]) == {"cache_pass", "load_transformer", "train_loop"}
    assert summary["peak"]["host_peak_rss_gib"] > 0.1


def test_auto_attention_is_timed_on_a_gpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer.platform as platform
    from utils.attention import AttentionChoice

    timed = []

    def fake_measure(choice, shape, device, dtype):
        timed.append((shape, device.type))
        return AttentionChoice("math", "measured", priority=("math",))

    monkeypatch.setattr(platform, "measured_choice", fake_measure)
    shape = (1, 24, 4224, 128)
    assert choose_attention(TrainConfig(), None, shape, torch.device("cpu")).name != "math"
    assert choose_attention(TrainConfig(), None, shape, torch.device("cuda")).name == "math"
    assert choose_attention(TrainConfig(attention_backend="flash"), None, shape, torch.device("cuda")).name == "flash"
    assert timed == [(shape, "cuda")], "only auto on a GPU is timed"


def test_compile_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer.platform as platform
    from utils.errors import ConfigError
    from trainer.model.quantization import QuantizationChoice

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    quanto, torchao = QuantizationChoice("quanto", "qfloat8"), QuantizationChoice("torchao", "int8_weight_only")
    monkeypatch.setattr(platform, "_has_triton", lambda: True)
    decide = lambda spec=None, device=gpu, **keys: platform.compile_decision(TrainConfig(**keys), device, spec)[0]  # noqa: E731
    assert decide() and decide(torchao), "auto: on for CUDA, torchao blocks included"
    assert all(decide(QuantizationChoice("torchao", w)) for w in ("int8_w8a8", "float8_w8a8", "auto")), \
        "the W8A8 blocks compile: inductor fuses their quantization and epilogue"
    assert not decide(quanto) and not decide(device=cpu), "auto: off for quanto blocks and on the CPU"
    assert decide(quanto, compile=True) and decide(device=cpu, compile=True), "an explicit true wins"
    assert not decide(compile=False)
    assert not decide(max_train_steps=12) and decide(max_train_steps=12, compile=True), "a short run stays eager"
    flux, qwen = SPECS["flux"], SPECS["qwen_image"]
    on, why = platform.compile_decision(TrainConfig(), gpu, None, flux)
    assert not on and "illegal memory access" in why, "FLUX.1-dev's compiled backward failed on an H200"
    assert platform.compile_decision(TrainConfig(compile=True), gpu, None, flux)[0], "an explicit true wins"
    assert platform.compile_decision(TrainConfig(), gpu, None, qwen)[0]
    monkeypatch.setattr(platform, "_has_triton", lambda: False)
    assert not decide()
    with pytest.raises(ConfigError, match="triton"):
        decide(compile=True)


def test_fp8_of_the_full_model_is_refused_without_compile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Full fine-tuning trains the weights, so torchao's float8 training casts them per call: eager it was
    4.2x slower than bf16. A LoRA run stores them in fp8 once and may stay eager."""
    import trainer.platform as platform
    from trainer.config import load_config
    from utils.errors import ConfigError

    monkeypatch.setattr(platform, "supports_feature", lambda name: True)
    cfg = TrainConfig(training_mode="full")
    cfg.cuda_features.enable_fp8_training = True
    with pytest.raises(ConfigError, match="4.37 s/step against 1.04 s/step"):
        maybe_fp8(cfg, torch.nn.Linear(16, 16), SPECS["qwen_image"], compiled=False)
    base = ["pretrained_model_name_or_path=x/y", f"data_config.img_dir={Path.cwd()}", f"output_dir={tmp_path}",
            "cuda_features.enable_fp8_training=true", "compile=false"]
    with pytest.raises(ConfigError, match="enable_fp8_training.*compile"):
        load_config(None, base + ["training_mode=full"])
    assert load_config(None, base).cuda_features.enable_fp8_training


@pytest.mark.e2e
def test_compiled_and_eager_steps_agree(tiny_qwen_image: Path, one_shape_data: Path, tmp_path: Path) -> None:
    """compile: true (inductor on the CPU here) trains the same trajectory as eager, and the run
    reports its first step (the compilation) and where its start-up seconds went."""
    import json

    from conftest import ONE_SHAPE, read_losses

    args = [f"pretrained_model_name_or_path={tiny_qwen_image}", f"data_config.img_dir={one_shape_data}",
            "max_train_steps=4", "report_to=none", "lora_dropout=0", ONE_SHAPE]
    from torch._dynamo.utils import counters

    eager = train_in_process("train_configs/quickstart_tiny.yaml", "qwen_image", *args, f"output_dir={tmp_path / 'e'}")
    graphs_before = counters["stats"]["unique_graphs"]
    compiled = train_in_process("train_configs/quickstart_tiny.yaml", "qwen_image", *args, "compile=true",
                                f"output_dir={tmp_path / 'c'}")
    graphs = counters["stats"]["unique_graphs"] - graphs_before
    assert not eager.compiled and compiled.compiled
    assert all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in compiled.transformer.transformer_blocks)
    assert read_losses(tmp_path / "c") == pytest.approx(read_losses(tmp_path / "e"), rel=1e-4, abs=1e-6)
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    assert summary["compiled"] and summary["first_step_s"] == compiled.first_step_s
    # The blocks' forward (with grad, and its recomputation in backward) became compiled graphs, shared by both
    # blocks, one per gradient mode (block 0's input needs no gradient, block 1's does): not one per block per step
    # (one batch shape: each new one would add a graph per mode).
    assert graphs == 2, graphs
    assert set(summary["wall_seconds"]) >= {"setup", "prepare_data", "setup_model", "train"}
