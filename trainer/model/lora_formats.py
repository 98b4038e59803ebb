"""LoRA file formats other than diffusers': ComfyUI's.

ComfyUI reads a LoRA for a diffusion model whose keys name the model's own modules under
``diffusion_model.``: ``diffusion_model.<module>.lora_A.weight`` / ``.lora_B.weight`` (peft naming,
which ComfyUI's loader maps like ``lora_down`` / ``lora_up``) plus ``diffusion_model.<module>.alpha``,
a scalar it uses to scale ``B @ A`` by ``alpha / rank``. Storing alpha per module is what keeps an
alpha != rank LoRA right there (diffusers keeps it in the file's metadata instead). Where ComfyUI's model
names a module otherwise (Krea 2), the family spec's ``comfyui_names`` renames it.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Dict, Sequence, Tuple

import torch
from safetensors.torch import save_file

PREFIX = "diffusion_model."


def comfyui_module(module: str, renames: Sequence[Tuple[str, str]] = ()) -> str:
    """A diffusers module name as ComfyUI's model names it: the first rename whose regex full-matches it."""
    for pattern, replacement in renames:
        if re.fullmatch(pattern, module):
            return re.sub(rf"^(?:{pattern})$", replacement, module)
    return module


def to_comfyui(state_dict: Dict[str, torch.Tensor], metadata: Dict[str, Any],
               renames: Sequence[Tuple[str, str]] = ()) -> Dict[str, torch.Tensor]:
    """peft-named LoRA weights -> ComfyUI keys (modules renamed by ``renames``) with one ``alpha`` per module."""
    alpha_default = float(metadata["lora_alpha"])
    patterns = {**(metadata.get("alpha_pattern") or {})}
    out: Dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        module, _, tail = key.removeprefix("transformer.").partition(".lora_")
        name = f"{comfyui_module(module, renames)}.lora_{tail}"
        out[PREFIX + name] = value.detach().to("cpu").contiguous()
        if tail.startswith("A."):
            alpha = next((float(a) for pat, a in patterns.items() if module.endswith(pat)), alpha_default)
            if metadata.get("use_rslora"):
                alpha *= value.shape[0] ** 0.5  # ComfyUI scales by alpha / rank; rsLoRA by alpha / sqrt(rank)
            out[f"{PREFIX}{comfyui_module(module, renames)}.alpha"] = torch.tensor(alpha)
    return out


def from_comfyui(state_dict: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, torch.Tensor]]:
    """ComfyUI keys -> ``{module name: {"lora_A", "lora_B", "alpha"}}`` (how ComfyUI groups them)."""
    modules: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        if not key.startswith(PREFIX):
            raise KeyError(f"{key}: not a diffusion_model key")
        name = key[len(PREFIX):]
        for part in (".lora_A.weight", ".lora_B.weight", ".alpha"):
            if name.endswith(part):
                modules.setdefault(name[: -len(part)], {})[part.strip(".").split(".")[0]] = value
                break
        else:
            raise KeyError(f"{key}: not a LoRA key ComfyUI knows")
    return modules


def save_comfyui_lora(path: Path, state_dict: Dict[str, torch.Tensor], metadata: Dict[str, Any],
                      renames: Sequence[Tuple[str, str]] = ()) -> Path:
    """Write the ComfyUI file atomically, with the adapter config and ``lora_scale`` in its metadata."""
    tensors = to_comfyui(state_dict, metadata, renames)
    info = {"format": "pt", "lora_adapter_metadata": json.dumps(metadata, default=str), "lora_scale": "1.0"}
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=info)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
