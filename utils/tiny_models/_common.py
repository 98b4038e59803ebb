"""Shared plumbing for the tiny-model builders: seeding, saving, sizes."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

M = TypeVar("M", bound=torch.nn.Module)


def component_seed(seed: int, name: str) -> int:
    """A seed per component, so changing one component's size leaves the others' weights alone."""
    return zlib.crc32(f"{seed}:{name}".encode())


def init_model(factory: Callable[[], M], seed: int, name: str) -> M:
    """Build a randomly initialised model deterministically, in eval mode, without touching the caller's RNG.

    Models built from a config start in train mode; T5 dropout would make generation non-deterministic.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(component_seed(seed, name))
        model = factory()
    return model.eval()


def folder_size(path: str | Path) -> int:
    """Total size in bytes of the files under `path`."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
