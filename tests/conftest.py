"""Shared fixtures: tiny models and sample data, built once per test session (offline, CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from image_datasets.sample_data import make_sample_dataset  # noqa: E402
from utils.tiny_models import build_tiny_pipeline  # noqa: E402


@pytest.fixture(scope="session")
def tiny_qwen_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen-Image pipeline folder (real classes, diffusers layout)."""
    return build_tiny_pipeline("qwen_image", tmp_path_factory.mktemp("models") / "tiny-qwen-image", seed=0)


@pytest.fixture(scope="session")
def sample_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six 64-pixel image/caption pairs (png, jpg, webp; one landscape)."""
    return make_sample_dataset(tmp_path_factory.mktemp("data") / "sample", size=64, count=6)


def run_entry(script: str, config: str, overrides: List[str], launcher: bool = True,
              timeout: int = 600) -> subprocess.CompletedProcess:
    """Run an entry script as a user would (through ``accelerate launch`` on the CPU)."""
    prefix = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"] if launcher \
        else [sys.executable]
    cmd = prefix + [str(ROOT / script), "--config", str(ROOT / config), *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
