"""Where a run reports: the console and ``train.log`` (loguru), and which experiment trackers are
installed (the numbers they get: ``trainer/reporting/metric_logging.py``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import List

from loguru import logger


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
