"""Where a run reports: the console and ``train.log`` (loguru), and the experiment trackers
(tensorboard, wandb) through accelerate."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Dict, List

from accelerate import Accelerator
from loguru import logger

from trainer.config import TrainConfig

TRACKERS = {"none": [], "tensorboard": ["tensorboard"], "wandb": ["wandb"], "all": ["tensorboard", "wandb"]}


def available_trackers(report_to: str | None) -> List[str]:
    """The trackers ``report_to`` asks for that are installed (one warning per missing one)."""
    available = []
    for name in TRACKERS[report_to or "none"]:
        if importlib.util.find_spec(name) is None:
            logger.warning(f"report_to asks for {name} but it is not installed; not logging to it "
                           f"(pip install {name})")
        else:
            available.append(name)
    return available


def setup_logging(is_main: bool, log_file: Path) -> None:
    """INFO to the console from the main process (warnings from the others); everything to ``log_file``."""
    logger.remove()
    logger.add(sys.stderr, level="INFO" if is_main else "WARNING",
               format="<green>{time:HH:mm:ss}</green> | <level>{level: <7}</level> | {message}")
    if is_main:
        logger.add(log_file, level="DEBUG")


def init_trackers(accelerator: Accelerator, cfg: TrainConfig) -> None:
    """Start the accelerator's trackers with the config as hyper-parameters (wandb: entity, run name)."""
    if not accelerator.log_with:
        return
    init = {"wandb": {k: v for k, v in {"entity": cfg.wandb_entity, "name": cfg.wandb_run_name}.items() if v}}
    config = flat_scalars(json.loads(json.dumps(dataclasses.asdict(cfg), default=str)))
    accelerator.init_trackers(cfg.wandb_project or cfg.tracker_project_name, config=config, init_kwargs=init)


def flat_scalars(data: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """Config as flat scalar hyper-parameters, as tensorboard's hparams accept."""
    flat: Dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(flat_scalars(value, f"{prefix}{key}."))
        elif isinstance(value, (int, float, str, bool)):
            flat[f"{prefix}{key}"] = value
        elif value is not None:
            flat[f"{prefix}{key}"] = str(value)
    return flat
