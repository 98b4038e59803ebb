"""Wan 2.2 A14B's two experts: ``transformer`` denoises the high-noise steps (``t >= boundary_ratio * 1000``),
``transformer_2`` the rest, as ``WanPipeline.__call__`` switches them. ``train_expert`` picks which train:
``both`` (each sample's drawn timestep picks the expert it trains, as the pipeline would use it), ``high_noise``
or ``low_noise`` (only that expert is loaded, and timesteps are drawn only from its range).

The trained experts travel through the engine as one module (``WanExperts``): its forward routes each sample to
its expert, and ``lora_files`` tells the LoRA saver to write one file per expert, each in diffusers' usual
``transformer.``-prefixed layout: the high-noise file loads with ``pipe.load_lora_weights(folder)``, the low-noise
one with ``pipe.load_lora_weights(folder, weight_name=LOW_NOISE_FILE, load_into_transformer_2=True)``."""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from utils.errors import ConfigError

EXPERTS = ("both", "high_noise", "low_noise")
HIGH_NOISE_FILE = "pytorch_lora_weights.safetensors"  # diffusers' default name: what load_lora_weights reads
LOW_NOISE_FILE = "pytorch_lora_weights_transformer_2.safetensors"


def boundary_of(model_index: Mapping[str, Any]) -> Optional[float]:
    """The checkpoint's expert boundary (a fraction of the 1000 training timesteps), or None for a checkpoint of
    one transformer (``transformer_2`` absent or ``[null, null]`` in its model_index.json)."""
    second = model_index.get("transformer_2")
    if not second or second[0] is None or model_index.get("boundary_ratio") is None:
        return None
    return float(model_index["boundary_ratio"])


def experts_to_train(choice: Optional[str], boundary: Optional[float], model_path: str) -> Tuple[str, ...]:
    """The checkpoint's subfolders that train (``transformer`` is the high-noise expert); ``choice`` is the
    config's ``train_expert`` (None: both where there are two)."""
    if boundary is None:
        if choice is not None:
            raise ConfigError(f"key 'train_expert': value '{choice}' needs a two-expert checkpoint (Wan 2.2 A14B); "
                              f"'{model_path}' has one transformer and no transformer_2: remove the key")
        return ("transformer",)
    return {"high_noise": ("transformer",), "low_noise": ("transformer_2",)}.get(
        choice or "both", ("transformer", "transformer_2"))


def sigma_range(experts: Tuple[str, ...], boundary: Optional[float]) -> Tuple[float, float]:
    """The noise levels the trained experts see: all of them, or one expert's side of the boundary (the pipeline
    runs ``transformer`` while ``1000 * sigma >= 1000 * boundary``)."""
    if boundary is None or len(experts) == 2:
        return (0.0, 1.0)
    return (boundary, 1.0) if experts == ("transformer",) else (0.0, boundary)


class WanExperts(torch.nn.Module):
    """The trained expert(s) of a two-expert checkpoint as one module (``transformer`` high noise,
    ``transformer_2`` low noise; one of them may be absent when only the other trains). Its forward takes the
    transformer's arguments and runs each sample through the expert its timestep belongs to."""

    def __init__(self, boundary: float, transformer: Optional[torch.nn.Module] = None,
                 transformer_2: Optional[torch.nn.Module] = None):
        super().__init__()
        self.boundary = boundary
        self.transformer = transformer
        self.transformer_2 = transformer_2

    def experts(self) -> List[torch.nn.Module]:
        """The loaded experts, high noise first."""
        return [m for m in (self.transformer, self.transformer_2) if m is not None]

    def lora_files(self) -> List[Tuple[str, str, torch.nn.Module]]:
        """``(file name, parameter prefix, expert)`` for each trained expert: its own LoRA file (adapters.py)."""
        named = (("transformer", HIGH_NOISE_FILE), ("transformer_2", LOW_NOISE_FILE))
        return [(file, f"{name}.", getattr(self, name)) for name, file in named if getattr(self, name) is not None]

    @property
    def config(self) -> Any:
        return self.experts()[0].config  # the experts share one config (attention shapes read it)

    @property
    def device(self) -> torch.device:
        return self.experts()[0].device  # both on one device (validation renders read it, as of a transformer)

    @property
    def dtype(self) -> torch.dtype:
        return self.experts()[0].dtype

    @property
    def peft_config(self) -> Dict[str, Any]:
        return self.experts()[0].peft_config

    def add_adapter(self, config: Any) -> None:
        """The same LoRA config on each expert (each its own adapter weights)."""
        for expert in self.experts():
            expert.add_adapter(copy.deepcopy(config))

    def enable_gradient_checkpointing(self, *args: Any, **kwargs: Any) -> None:
        for expert in self.experts():
            expert.enable_gradient_checkpointing(*args, **kwargs)

    def set_attention_backend(self, backend: str) -> None:
        for expert in self.experts():
            expert.set_attention_backend(backend)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, return_dict: bool = False,
                **kwargs: Any) -> Tuple[torch.Tensor]:
        """``timestep`` is one per sample (``1000 * sigma``). A batch on one side of the boundary runs its expert
        as is; a mixed batch runs each expert on its samples and puts the predictions back in order."""
        high = timestep >= self.boundary * 1000
        if bool(high.all()) or bool((~high).all()):
            expert = self._expert(bool(high[0]))
            return expert(hidden_states=hidden_states, timestep=timestep, return_dict=False, **kwargs)
        out = torch.empty_like(hidden_states)
        for side in (True, False):
            rows = high.nonzero().flatten() if side else (~high).nonzero().flatten()
            part = {k: v[rows] if torch.is_tensor(v) and v.shape[:1] == timestep.shape[:1] else v
                    for k, v in kwargs.items()}
            out[rows] = self._expert(side)(hidden_states=hidden_states[rows], timestep=timestep[rows],
                                           return_dict=False, **part)[0].to(out.dtype)
        return (out,)

    def _expert(self, high_noise: bool) -> torch.nn.Module:
        """The expert of that side; an expert trained alone takes every timestep it is given (training draws only
        its own, but a held-out loss at configured ``evaluation.timesteps`` or a render may reach the other side)."""
        expert = self.transformer if high_noise else self.transformer_2
        return expert if expert is not None else self.experts()[0]
