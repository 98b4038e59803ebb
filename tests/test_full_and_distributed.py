"""Full fine-tuning on the shared engine, and real 2-process (gloo) runs through the same path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import numpy as np
import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

from conftest import ROOT, lora_keys_match, run_entry, train_in_process
from image_datasets.dataset import SizeGroupedBatchSampler
from trainer.run_folder import checkpoint as ckpt

QUICKSTART = "train_configs/quickstart_tiny.yaml"


def base_args(model: Path, data: Path, out: Path) -> List[str]:
    return [f"pretrained_model_name_or_path={model}", f"data_config.img_dir={data}", f"output_dir={out}",
            "report_to=none"]


def losses(out: Path) -> List[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def torchrun(script: str, args: List[str]) -> subprocess.CompletedProcess:
    """Two CPU processes on gloo, as FIELD_NOTES found works (a MULTI_CPU accelerate YAML ran one)."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
           str(ROOT / script), "--config", str(ROOT / QUICKSTART), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.e2e
def test_full_finetune_end_to_end(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "full"
    source = tiny_qwen_image / "transformer" / "diffusion_pytorch_model.safetensors"
    before = source.read_bytes()
    result = run_entry("train_full_qwen_image.py", QUICKSTART, base_args(tiny_qwen_image, sample_data, out) + [
        "max_train_steps=4", "checkpointing_steps=2", "learning_rate=1e-3", "max_shard_size=300KB"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "full fine-tuning:" in result.stderr
    assert source.read_bytes() == before, "training the memory-mapped weights never writes the base model"
    saved = out / "checkpoint-4" / "transformer"
    assert (saved / "diffusion_pytorch_model.safetensors.index.json").is_file(), "sharded with an index"
    assert ckpt.is_complete(out / "checkpoint-4")
    trained = QwenImageTransformer2DModel.from_pretrained(saved)
    base = QwenImageTransformer2DModel.from_pretrained(tiny_qwen_image, subfolder="transformer")
    changed = [n for n, p in trained.named_parameters()
               if not torch.equal(p, dict(base.named_parameters())[n])]
    assert len(changed) > 0.9 * len(list(base.parameters())), "every weight trains"
    pipe = QwenImagePipeline.from_pretrained(out / "final_model")
    image = pipe(prompt="a red circle", width=64, height=64, num_inference_steps=2, output_type="np").images[0]
    assert np.isfinite(image).all()
    final = QwenImagePipeline.from_pretrained(tiny_qwen_image, transformer=trained)
    assert final.transformer is trained


@pytest.mark.e2e
@pytest.mark.parametrize("optimizer, lr", [("adamw", 1e-3), ("adafactor", 1e-2), ("adamw8bit", 1e-3)])
def test_full_finetune_overfits(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path, optimizer: str,
                                lr: float) -> None:
    one = tmp_path / "one"
    one.mkdir()
    for name in ("img1.png", "img1.txt"):
        shutil.copy(sample_data / name, one / name)
    train_in_process(QUICKSTART, "qwen_image", *base_args(tiny_qwen_image, one, tmp_path / "o"),
                     "training_mode=full", f"optimizer={optimizer}", "max_train_steps=60", f"learning_rate={lr}",
                     "checkpointing_steps=1000", "data_config.caption_dropout_rate=0")
    values = losses(tmp_path / "o")
    assert np.mean(values[-15:]) < 0.7 * np.mean(values[:15]), f"{optimizer}: loss did not fall"


@pytest.mark.e2e
def test_full_finetune_resumes(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "r"
    args = base_args(tiny_qwen_image, sample_data, out) + ["checkpointing_steps=2", "overwrite_output_dir=false"]
    first = run_entry("train_full_qwen_image.py", QUICKSTART, args + ["max_train_steps=2"], launcher=False)
    assert first.returncode == 0, first.stderr[-2000:]
    second = run_entry("train_full_qwen_image.py", QUICKSTART,
                       args + ["max_train_steps=4", "resume_from_checkpoint=latest"], launcher=False)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stderr and [json.loads(x)["step"] for x in
                                                (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_trainable_modules_limit_what_trains(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path) -> None:
    trainer = train_in_process(QUICKSTART, "qwen_image", *base_args(tiny_qwen_image, sample_data, tmp_path),
                               "training_mode=full", r"trainable_modules=[transformer_blocks\.1\.]",
                               "max_train_steps=1")
    model = trainer.accelerator.unwrap_model(trainer.transformer)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("transformer_blocks.1.") for n in trainable)


@pytest.mark.parametrize("count", [8, 10])
def test_ranks_see_disjoint_data_covering_the_epoch(count: int) -> None:
    """accelerate shards our size-grouped batches: every sample once per epoch across both ranks.
    When the batch count is odd, the last round is evened out with a batch from the epoch's start
    (ranks must step together); that is the only repeat."""
    sizes = [(64, 64)] * 6 + [(64, 32)] * (count - 6)
    sampler = SizeGroupedBatchSampler(sizes, batch_size=2, seed=3)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        shards = [list(BatchSamplerShard(sampler, num_processes=2, process_index=r)) for r in range(2)]
        assert len(shards[0]) == len(shards[1]), "ranks step together"
        assert all(len({sizes[i] for i in b}) == 1 for shard in shards for b in shard), "one size per batch"
        rounds = list(zip(*shards))
        seen = [i for pair in rounds for b in pair for i in b]
        assert set(seen) == set(range(count)), f"epoch {epoch}: a sample was missed: {shards}"
        repeats = len(seen) - count
        assert repeats == (0 if len(batches) % 2 == 0 else len(batches[0])), f"epoch {epoch}: {shards}"


@pytest.mark.e2e
@pytest.mark.parametrize("script", ["train.py", "train_full_qwen_image.py"])
def test_two_process_run(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path, script: str) -> None:
    out = tmp_path / "ddp"
    result = torchrun(script, base_args(tiny_qwen_image, sample_data, out) + [
        "max_train_steps=4", "checkpointing_steps=2", "max_shard_size=300KB"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 process(es)" in result.stderr
    assert {p.name for p in (out / "checkpoint-4").iterdir()} >= {"random_states_0.pkl", "random_states_1.pkl"}
    assert len([json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]) == 4, "rank 0 logs once"
    if script == "train.py":
        lora_keys_match(QwenImagePipeline.from_pretrained(tiny_qwen_image), out, "ddp")
    else:
        QwenImagePipeline.from_pretrained(out / "final_model")


def test_every_accelerate_config_parses() -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    configs = sorted((ROOT / "accelerate_configs").glob("*.yaml"))
    assert {c.stem for c in configs} >= {"single_gpu", "ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3"}
    for path in configs:
        config = load_config_from_file(str(path))
        assert path.read_text().startswith("#") and "accelerate launch --config_file" in path.read_text()
        assert config.mixed_precision == "bf16"


@pytest.mark.e2e
def test_fused_backward_matches_the_plain_step_and_frees_gradients(tiny_qwen_image: Path, sample_data: Path,
                                                                   tmp_path: Path) -> None:
    """Stepping each weight inside backward gives the same weights as one optimizer step after it,
    and no gradient outlives its own weight's update."""
    runs = {}
    for fused in (False, True):
        runs[fused] = train_in_process(QUICKSTART, "qwen_image", *base_args(tiny_qwen_image, sample_data,
                                       tmp_path / str(fused)), "training_mode=full", "max_train_steps=3",
                                       "max_grad_norm=0", f"fused_backward={str(fused).lower()}",
                                       "checkpointing_steps=1000")
    plain, fused = (dict(runs[f].accelerator.unwrap_model(runs[f].transformer).named_parameters()) for f in (False, True))
    assert all(torch.allclose(plain[n], fused[n], atol=1e-6) for n in plain)
    assert any(not torch.equal(p, dict(QwenImageTransformer2DModel.from_pretrained(
        tiny_qwen_image, subfolder="transformer").named_parameters())[n]) for n, p in fused.items())


def test_fused_backward_steps_inside_backward() -> None:
    from trainer.config import TrainConfig
    from trainer.step.optim import build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    twin = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    twin.load_state_dict(model.state_dict())
    cfg = dict(training_mode="full", max_grad_norm=0.0, learning_rate=1e-2)
    fused = build_optimizer(TrainConfig(fused_backward=True, **cfg), model.parameters())
    plain = build_optimizer(TrainConfig(**cfg), twin.parameters())
    x = torch.randn(4, 8)
    model(x).pow(2).sum().backward()
    assert all(p.grad is None for p in model.parameters()), "each gradient is freed once its weight stepped"
    twin(x).pow(2).sum().backward()
    plain.step()
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(model.parameters(), twin.parameters()))
    restored = build_optimizer(TrainConfig(fused_backward=True, **cfg), model.parameters())
    restored.load_state_dict(fused.state_dict())
    assert restored.state_dict()["per_parameter"][0]["state"][0]["step"] == 1
