"""Memory planner: an itemised estimate of peak GPU and host memory for a training config, before
any weight is loaded.

    python -m trainer.planner --config train_configs/train_lora.yaml --gpu-memory 24GiB [key=value ...]
    python train.py --config train_configs/train_lora.yaml --plan --gpu-memory 24GiB   (any entry script)

Only configs are read: the components' ``config.json`` from a local diffusers folder or from the HF
cache (a hub id, ``local_files_only``), else the published configs the family specs hold
(``FamilySpec.hub_configs``), so a laptop with nothing downloaded can still plan for the real model.
Parameter counts are exact: each component is built on the meta device from its config. Activations
follow per-block formulas (``docs/MEMORY_PLANNER.md``) that the tests check against the tensors
autograd really saves in the diffusers blocks; a family whose blocks have no layout in its spec is
refused in one line. GPU constants (CUDA context, workspace, fragmentation) are assumptions that have
not been measured on a GPU yet; the host baseline was measured on this project's CPU machine.

Split by concern: ``model`` (configs, meta-device sizes), ``settings`` (assumptions, the run's
settings from the trainer's own rules), ``activations`` (LoRA layout, per-block formulas), ``plan``
(the items of each phase, advice), ``report`` (the plan's result: peaks, verdict, table, JSON),
``auto_fit`` (the fastest settings that fit a card), ``entry`` (what the command line prints) and
``__main__`` (the command line).
"""

from trainer.planner.activations import estimate_activations, lora_layout
from trainer.planner.model_sizes import ModelSizes, model_sizes, read_model_configs
from trainer.planner.entry import print_plan
from trainer.planner.plan import build_plan, plan_memory
from trainer.planner.report import MemoryItem, MemoryPlan
from trainer.planner.settings import Settings, load_plan_config, parse_size, resolve_settings

__all__ = [
    "MemoryItem", "MemoryPlan", "ModelSizes", "Settings", "build_plan", "estimate_activations",
    "load_plan_config", "lora_layout", "model_sizes", "parse_size", "plan_memory", "print_plan",
    "read_model_configs", "resolve_settings",
]
