"""The GPU harness trains what the engine trains: both assemble the run with ``trainer.assembly``, so
the harness's optimizer has the engine's parameter groups (Muon's block matrices included) and its
schedule. Runs on the CPU, on the tiny Qwen-Image pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Tuple

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


def engine_groups(cfg: Any) -> Tuple[List[Tuple[str, float, float, List[str]]], float]:
    """The engine's optimizer as its set-up builds it (no step), and the learning rate it would apply."""
    from accelerate.state import AcceleratorState

    from trainer.engine import Trainer

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        trainer = Trainer(cfg)
        trainer.setup()
        trainer.prepare_data()
        trainer.setup_model()
        model = trainer.accelerator.unwrap_model(trainer.transformer)
        return groups(trainer.raw_optimizer, model), trainer.lr_scheduler.get_last_lr()[0]
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


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
            "mixed_precision=null", f"data_config.img_dir={sample_data}", f"output_dir={tmp_path / 'run'}"])
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
