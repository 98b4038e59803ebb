"""GPU suite plumbing: tests marked ``gpu`` are skipped, with a one-line reason, where there is no
CUDA GPU; ``cuda`` is the device fixture of the suite. The harness is importable as ``harness``."""

from __future__ import annotations

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


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Skip every ``gpu``-marked test when there is no CUDA GPU."""
    reason = no_cuda_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cuda() -> torch.device:
    """The GPU the suite runs on (skips, for callers not marked ``gpu``, when there is none)."""
    reason = no_cuda_reason()
    if reason is not None:
        pytest.skip(reason)
    return torch.device("cuda", torch.cuda.current_device())
