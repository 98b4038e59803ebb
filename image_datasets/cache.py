"""Content-addressed cache of text embeddings and latents, in memory or on disk as safetensors.

An entry's key hashes what produced it (model, family, caption text or image bytes, size), so a
changed caption or image is re-encoded and an unchanged one never is, across runs.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Dict, Iterable, Optional

import torch
from safetensors.torch import load, save_file

Tensors = Dict[str, torch.Tensor]


def cache_key(*parts: object) -> str:
    """A stable hex key from the parts that determine an entry's content."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(str(part).encode("utf-8"))
        digest.update(b"\x00")
    return digest.hexdigest()


class FeatureCache:
    """Tensors by key: a dict in memory, or one safetensors file per key under ``directory`` (of which
    ``hold`` keeps chosen entries in memory too)."""

    def __init__(self, name: str, directory: Optional[Path] = None):
        self.name = name
        self.directory = Path(directory) / name if directory is not None else None
        self._memory: Dict[str, Tensors] = {}
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / key[:2] / f"{key}.safetensors"

    def __contains__(self, key: str) -> bool:
        if self.directory is None:
            return key in self._memory
        return self._path(key).is_file()

    def get(self, key: str) -> Tensors:
        """The tensors stored under ``key`` (on the CPU)."""
        if key in self._memory or self.directory is None:
            return self._memory[key]
        # Read whole, then parse: for files this small a memory map costs more than the read.
        return load(self._path(key).read_bytes())

    def nbytes(self, keys: Iterable[str]) -> int:
        """Bytes on disk of the entries ``keys`` (0 for an in-memory cache)."""
        return 0 if self.directory is None else sum(self._path(key).stat().st_size for key in keys)

    def hold(self, keys: Iterable[str]) -> None:
        """Read the entries ``keys`` now and serve them from memory from then on."""
        for key in keys:
            self._memory[key] = self.get(key)

    def put(self, key: str, tensors: Tensors) -> None:
        """Store CPU copies; on disk through a temporary file renamed into place (never half-written)."""
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        if self.directory is None:
            self._memory[key] = tensors
            return
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
