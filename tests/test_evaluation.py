"""The held-out loss (trainer/evaluation.py), over-fitting detection, keep_best and the judge
(trainer/judge.py): unit checks first, then runs of the real engine on the tiny Qwen-Image model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest

from conftest import ROOT, train_in_process
from trainer import checkpoint as ckpt
from trainer.config import load_config
from trainer.datasets import TrainingData
from trainer.evaluation import overfitting, split_held_out
from utils.errors import ConfigError, DataError

QUICKSTART = "train_configs/quickstart_tiny.yaml"
FAMILY = SimpleNamespace(name="qwen_image", uses_references=False, pixel_multiple=16)  # what scanning reads


def h(step: int, eval_loss: float, train_loss: float | None) -> Dict[str, Any]:
    return {"step": step, "eval_loss": eval_loss, "train_loss": train_loss}


# -- the detector, pruning, the config ------------------------------------------------------------------
def test_overfitting_needs_patience_evaluations_above_the_best_while_training_falls() -> None:
    rising = [h(0, 1.0, None), h(10, 0.5, 0.9), h(20, 0.6, 0.7), h(30, 0.7, 0.5)]
    assert overfitting(rising[:3], patience=2) is None, "one evaluation above the best is not enough"
    said = overfitting(rising, patience=2)
    assert said and "step 10" in said and "0.500000" in said and "0.900000 -> 0.500000" in said
    assert overfitting(rising, patience=3) is None
    flat_training = [h(0, 1.0, None), h(10, 0.5, 0.9), h(20, 0.6, 0.9), h(30, 0.7, 0.95)]
    assert overfitting(flat_training, patience=2) is None, "the training loss did not fall: not over-fitting"
    from_start = [h(0, 0.4, None), h(10, 0.5, 0.9), h(20, 0.6, 0.7)]
    assert "step 0" in overfitting(from_start, patience=2), "best before training: compared with the first after"


def test_pruning_keeps_the_protected_step_beside_the_newest(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / ckpt.STATE_NAME).write_text(json.dumps({"global_step": step, "files": {}}))
    deleted = ckpt.prune_checkpoints(tmp_path, 2, keep=[10])
    assert sorted(p.name for p in deleted) == ["checkpoint-20"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-30", "checkpoint-40"]


def test_bad_evaluation_keys_are_named(sample_data: Path) -> None:
    data = f"data_config.img_dir={sample_data}"
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / QUICKSTART, [data, "evaluation.holdout=-1", "evaluation.patience=0",
                                        "evaluation.timesteps=[0.5,1.0]", "evaluation.every_n_steps=0"])
    for expected in ("'evaluation.holdout': value -1", "'evaluation.patience': value 0",
                     "'evaluation.timesteps': value 1.0 must be in (0, 1)", "'evaluation.every_n_steps': value 0"):
        assert expected in str(err.value)
    with pytest.raises(ConfigError, match="no held-out images to evaluate on"):
        load_config(ROOT / QUICKSTART, [data, "evaluation.stop_when_overfitting=true"])
    with pytest.raises(ConfigError, match="unknown key 'evaluation.holdut'.*did you mean 'evaluation.holdout'"):
        load_config(ROOT / QUICKSTART, [data, "evaluation.holdut=2"])


# -- the held-out set ------------------------------------------------------------------------------------
def held_out(tmp_path: Path, sample_data: Path, datasets: List[Dict[str, Any]], *extra: str):
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"pretrained_model_name_or_path": "x", "data_config": {"img_size": 64},
                                  "datasets": datasets}))
    cfg = load_config(config, list(extra), default_family="qwen_image")
    data = TrainingData.scan(cfg, FAMILY)
    return data, split_held_out(cfg, FAMILY, data)


def test_holdout_draws_images_that_never_train(tmp_path: Path, sample_data: Path) -> None:
    data, held = held_out(tmp_path, sample_data, [{"img_dir": str(sample_data)}], "evaluation.holdout=2")
    assert len(held) == 2 and len(data.samples) == 4
    assert not {s.image_path for s in held} & {s.image_path for s in data.samples}
    again, held_again = held_out(tmp_path, sample_data, [{"img_dir": str(sample_data)}], "evaluation.holdout=2")
    assert [s.image_path for s in held_again] == [s.image_path for s in held], "seeded: the same draw"
    _, other = held_out(tmp_path, sample_data, [{"img_dir": str(sample_data)}], "evaluation.holdout=2",
                        "evaluation.seed=5")
    assert {s.image_path for s in other} != {s.image_path for s in held}


def test_holdout_larger_than_the_data_is_a_clear_error(tmp_path: Path, sample_data: Path) -> None:
    with pytest.raises(DataError, match=r"'evaluation.holdout': 6 held-out image\(s\) of the 6 .* leaves none"):
        held_out(tmp_path, sample_data, [{"img_dir": str(sample_data)}], "evaluation.holdout=6")


def test_an_eval_dataset_that_overlaps_or_differs_in_size_is_warned_about(tmp_path: Path, sample_data: Path,
                                                                          logs: List[Dict[str, Any]]) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("img1.png", "img1.txt", "img4.png", "img4.txt"):
        shutil.copy(sample_data / name, copy / name)
    data, held = held_out(tmp_path, sample_data, [{"img_dir": str(sample_data)},
                                                  {"img_dir": str(copy), "role": "eval", "img_size": 48}])
    assert len(held) == 2 and len(data.samples) == 6, "role: eval images are evaluated, never trained on"
    warnings = [r["message"] for r in logs if r["level"].name == "WARNING"]
    overlap = next(w for w in warnings if "also training images" in w)
    assert str(copy / "img1.png") in overlap and str(sample_data / "img1.png") in overlap
    size = next(w for w in warnings if "a size no training image has" in w)
    assert "img1.png 48x48" in size and "64x64" in size
