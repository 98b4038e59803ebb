"""Before any weights load: the memory planner's verdict for this run on this card, or (``auto_fit: true``)
the fastest memory settings that fit it.

A run whose planned GPU peak exceeds the card (FLUX.2 [dev] in bf16 on a 24 GB card, say) would
otherwise find out minutes later, after the text encoder's cache pass, as an out-of-memory error. The
plan reads configs only (local folder, HF cache or the family's built-in copies), so this costs no
download; a family the planner does not model, or configs it cannot find, give no verdict.
"""

from __future__ import annotations

from typing import Optional

import torch
from loguru import logger

from trainer.config import TrainConfig
from utils.errors import UserError


def fit_warning(cfg: TrainConfig, gpu_memory_gib: float) -> Optional[str]:
    """The warning for a run whose plan does not fit ``gpu_memory_gib`` (None when it fits or cannot
    be planned), naming the model, both sizes, the first change that helps and how to see the plan."""
    from trainer.planner import plan_memory  # builds models on the meta device: only when asked

    try:
        plan = plan_memory(cfg, gpu_memory_gib)
    except (ValueError, FileNotFoundError, UserError):
        return None
    if plan.fits is not False:
        return None
    change = plan.advice[0] if plan.advice else "see the plan"
    return (f"pretrained_model_name_or_path '{cfg.pretrained_model_name_or_path}': the memory planner puts this "
            f"run's GPU peak at {plan.gpu_peak_gib:.2f} GiB, more than this card's {gpu_memory_gib:.2f} GiB; "
            f"first change that helps: {change}. Itemised plan: add --plan --gpu-memory "
            f"{gpu_memory_gib:.0f}GiB to this command (docs/MEMORY_PLANNER.md)")


def card_memory_gib(device: torch.device) -> Optional[float]:
    """The memory of the CUDA card ``device`` (GiB); None for any other device."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory / 2**30


def warn_if_it_does_not_fit(cfg: TrainConfig, device: torch.device) -> None:
    """On a CUDA device, log ``fit_warning`` for the device's memory before anything loads."""
    total = card_memory_gib(device)
    message = fit_warning(cfg, total) if total is not None else None
    if message:
        logger.warning(message)


def fit_to_card(cfg: TrainConfig, device: torch.device, processes: int = 1) -> None:
    """Before any weight loads: with ``auto_fit: true``, set the memory keys the user left open to the fastest
    that fit the card (``trainer/planner/auto_fit.py``; a one-line ``ConfigError`` when nothing does; with
    ``processes`` cards, ``pipeline_stages`` may be chosen); else warn when the configured run does not fit."""
    if not cfg.auto_fit:
        warn_if_it_does_not_fit(cfg, device)
        return
    from trainer.planner.auto_fit import fit_run  # builds models on the meta device: only when asked

    fit_run(cfg, card_memory_gib(device), processes)
