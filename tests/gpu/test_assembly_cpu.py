"""The GPU harness trains what the engine trains: both assemble the run with ``trainer.assembly``, so
the harness's optimizer has the engine's parameter groups (Muon's block matrices included) and its
schedule, and both step with ``trainer/step/optimizer_step.py``, so from the same weights they end on the same
weights. Runs on the CPU, on the tiny Qwen-Image pipeline."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch

import harness

CPU = torch.device("cpu")


def groups(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> List[Tuple[str, float, float, List[str]]]:
    """Each parameter group as (optimizer class, lr, weight decay, the names of its parameters)."""
    names = {id(p): n for n, p in model.named_parameters()}
    parts = getattr(optimizer, "optimizers", [optimizer])  # Muon beside AdamW: an OptimizerGroup
    return [(type(part).__name__, group["lr"], group["weight_decay"], sorted(names[id(p)] for p in group["params"]))
            for part in parts for group in part.param_groups]


@contextlib.contextmanager
def engine_trainer(cfg: Any) -> Iterator[Any]:
    """The engine as its set-up leaves it before the first step (data, model, optimizer, schedule)."""
    from accelerate.state import AcceleratorState

    from trainer.engine import Trainer

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        trainer = Trainer(cfg)
        trainer.setup()
        trainer.prepare_data()
        trainer.setup_model()
        yield trainer
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def engine_groups(cfg: Any) -> Tuple[List[Tuple[str, float, float, List[str]]], float]:
    """The engine's optimizer as its set-up builds it (no step), and the learning rate it would apply."""
    with engine_trainer(cfg) as trainer:
        model = trainer.accelerator.unwrap_model(trainer.transformer)
        return groups(trainer.raw_optimizer, model), trainer.lr_scheduler.get_last_lr()[0]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_harness_optimizer_has_the_engines_parameter_groups(optimizer: str, tiny_qwen_image: Path,
                                                                sample_data: Path, tmp_path: Path) -> None:
    overrides = [f"optimizer={optimizer}", "learning_rate=3e-4", "adam_weight_decay=0.05", "rank=4", "lora_alpha=4",
                 "lr_scheduler=linear", "lr_warmup_steps=2", "max_train_steps=10", "validation.every_n_steps=0"]
    with harness.rig_session("qwen_image", CPU, torch.float32, model_dir=tiny_qwen_image, overrides=overrides,
                             resolution=64) as rig:
        harnessed = groups(rig.optimizer, rig.transformer)
        harness_lr = rig.lr_scheduler.get_last_lr()[0]
        cfg = harness.train_config("qwen_image", tiny_qwen_image, overrides + [
            "mixed_precision=null", f"data_config.img_dir={sample_data}", "data_config.img_size=64", f"output_dir={tmp_path / 'run'}"])
    engine, engine_lr = engine_groups(cfg)
    assert harnessed == engine
    kinds: Dict[str, int] = {}
    for kind, lr, decay, names in engine:
        kinds[kind] = kinds.get(kind, 0) + len(names)
        assert decay == 0.05 and names and all("lora" in n for n in names)
    if optimizer == "muon":  # the blocks' LoRA matrices go to Muon (without the blocks, all went to AdamW)
        assert kinds.get("Muon", 0) > 0
    else:
        assert set(kinds) == {"AdamW"}
    assert harness_lr == engine_lr == 0.0, "the linear warm-up's first step, in both"


def trainable(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_harness_step_and_the_engines_give_the_same_weights(optimizer: str, tiny_qwen_image: Path,
                                                                 sample_data: Path, tmp_path: Path) -> None:
    """From the same weights, batch, noise and noise levels, N steps of the harness (``harness.queue_step``)
    and N of the engine (``Trainer._backward``, ``_clip_gradients``, ``_step``) end on the same weights and the
    same learning rate: a GPU figure measures the step users run. The gradient norm is clipped on every step and
    the schedule warms up, so a step that skipped the clip or the schedule would end elsewhere."""
    max_norm, steps = 1e-3, 3
    overrides = [f"optimizer={optimizer}", "learning_rate=1e-2", "adam_weight_decay=0.05", "rank=4", "lora_alpha=4",
                 "lr_scheduler=linear", "lr_warmup_steps=2", "max_train_steps=10", "validation.every_n_steps=0",
                 f"max_grad_norm={max_norm}"]
    cfg = harness.train_config("qwen_image", tiny_qwen_image, overrides + [
        "mixed_precision=null", f"data_config.img_dir={sample_data}", "data_config.img_size=64", f"output_dir={tmp_path / 'run'}"])
    with harness.rig_session("qwen_image", CPU, torch.float32, model_dir=tiny_qwen_image, overrides=overrides,
                             resolution=64) as rig, engine_trainer(cfg) as trainer:
        model = trainer.accelerator.unwrap_model(trainer.transformer)
        # LoRA B starts at zero, so A's first gradients are nearly rank-deficient and Muon's orthogonalisation
        # blows their float rounding (two equal computations on two model instances) up to 1e-4: start from a
        # non-zero B, as a LoRA is a few steps in.
        with torch.no_grad():
            gen = torch.Generator().manual_seed(7)
            for name, param in rig.transformer.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
        start = trainable(rig.transformer)
        # the same start: the harness's weights are random (its base and LoRA), the engine's model takes them all
        missing, unexpected = model.load_state_dict(rig.transformer.state_dict(), strict=False)
        assert not missing and not unexpected, (missing, unexpected)
        model.train()
        engine_rig = dataclasses.replace(rig, transformer=model)  # the engine's model in the harness's forward
        batch = harness.random_batch(rig.family, rig.config, 64, CPU, torch.float32)
        norms = []
        for step in range(steps):
            noise = torch.randn(batch.latents.shape, generator=torch.Generator().manual_seed(step))
            sigmas = harness.draw_sigmas(rig, batch, torch.Generator().manual_seed(100 + step))
            values = harness.queue_step(rig, batch, torch.Generator().manual_seed(step), noise, sigmas)
            loss = harness.step_loss(engine_rig, batch, torch.Generator().manual_seed(step), noise, sigmas)
            trainer._backward(loss)
            norm = trainer._clip_gradients()
            trainer._step([loss.detach()], norm)
            assert torch.allclose(values, torch.stack([loss.detach(), norm]).float(), rtol=1e-5, atol=1e-7)
            norms.append(float(norm))
        harnessed, engine = trainable(rig.transformer), trainable(model)
        assert set(harnessed) == set(engine) == set(start) and len(start) > 10
        assert min(norms) > max_norm, "every step clipped"
        moved = max(float((harnessed[n] - start[n]).abs().max()) for n in start)
        diff = max(float((harnessed[n] - engine[n]).abs().max()) for n in start)
        # torch's Muon orthogonalises in bfloat16: a rounding-level difference between the two forwards (two model
        # instances) can flip a bf16 rounding, so its steps agree to bf16's precision (2^-7 of the move), AdamW's to 1e-6.
        tolerance = 1e-6 * max(1.0, moved) if optimizer == "adamw" else 2 ** -7 * moved
        assert moved > 1e-4 and diff <= tolerance, (moved, diff)
        assert rig.lr_scheduler.get_last_lr() == trainer.lr_scheduler.get_last_lr() != [0.0] * len(norms[:1])
