"""GPU suite plumbing: tests marked ``gpu`` are skipped, with a one-line reason, where there is no
CUDA GPU; ``cuda`` is the device fixture of the suite. The harness is importable as ``harness``.

The GPU pass's dry run (``benchmarks/gpu_pass.py --dry-run``, which sets ``GPU_PASS_DRY_RUN=1``)
runs the tests also marked ``cpu_dry_run`` on the CPU at tiny scale, so its plumbing is tested
without a GPU; their CUDA-only assertions skip themselves there."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List

import pytest
import torch

HERE = Path(__file__).resolve().parent
for path in (HERE.parents[1], HERE):  # the repository (trainer, utils) and this folder (harness)
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from harness import no_cuda_reason  # noqa: E402

DRY_RUN = "GPU_PASS_DRY_RUN"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cpu_dry_run: a gpu test that the GPU pass's dry run runs on the CPU")
    config.addinivalue_line("markers", "timeout(seconds): per-test limit (pytest-timeout, where installed)")
    config.addinivalue_line("markers", "xdist_group(name): tests that share a pytest-xdist worker")


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Skip every ``gpu``-marked test when there is no CUDA GPU (but ``cpu_dry_run`` ones in a dry run)."""
    reason = no_cuda_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    dry_run = os.environ.get(DRY_RUN) == "1"
    for item in items:
        if item.get_closest_marker("gpu") is not None and not (dry_run and item.get_closest_marker("cpu_dry_run")):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cuda() -> torch.device:
    """The GPU the suite runs on (skips, for callers not marked ``gpu``, when there is none)."""
    reason = no_cuda_reason()
    if reason is not None:
        pytest.skip(reason)
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def quiet_logs():
    """The engine's INFO lines (attention choice, LoRA size) would flood the CPU tests' output."""
    from loguru import logger

    logger.disable("trainer")
    logger.disable("utils")
    yield
    logger.enable("trainer")
    logger.enable("utils")
