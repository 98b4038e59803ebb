"""``print_plan``: the plan the command line prints (``python -m trainer.planner``, any entry script's
``--plan``), as a table or one JSON object (``--json``), with auto_fit's choice above it when the config
asks for ``auto_fit: true``. Exit codes: 0 fits (or no budget), 1 does not fit, 2 the plan cannot be made."""

from __future__ import annotations

import copy
import json
import sys
from typing import Any, Dict, Optional, Tuple

from trainer.config import QUANTO_WEIGHTS, TrainConfig
from trainer.planner.auto_fit import NothingFits, fitted
from trainer.planner.model_sizes import model_sizes
from trainer.planner.plan import plan_memory
from trainer.planner.settings import planned_family, resolve_settings
from trainer.planner.stages import format_stages, stage_plans, stages_json, traffic
from utils.errors import UserError
from utils.sizes import parse_size


def print_plan(cfg: TrainConfig, gpu_memory: Optional[str] = None, *, as_json: bool = False,
               pipeline_stages: int = 1, processes: int = 1, **options: Any) -> int:
    """Print the plan of ``cfg`` for ``gpu_memory`` (else the config's ``gpu_memory``); with ``auto_fit: true``
    and a budget, the plan of auto_fit's choice, which is shown first (for a launch of ``processes``: maybe
    pipeline stages); with ``pipeline_stages`` > 1 (the flag, else the config's key), each card's plan of that
    split (``stages.py``). ``options`` go to ``plan_memory``."""
    fit: Dict[str, Any] = {}
    try:
        budget = parse_size(gpu_memory) if gpu_memory else parse_size(cfg.gpu_memory) if cfg.gpu_memory else None
        stages = pipeline_stages if pipeline_stages > 1 else cfg.pipeline_stages
        if stages > 1:
            return _print_stages(cfg, budget, stages, as_json, options)
        if cfg.auto_fit:
            cfg = _flags_as_keys(cfg, options)
        try:
            cfg, fit = _auto_fit(cfg, budget, {**options, "processes": processes})
        except NothingFits as exc:
            fit = {"error": str(exc)}
        if cfg.pipeline_stages > 1:  # auto_fit chose a split: each card's plan, below the choice
            return _print_stages(cfg, budget, cfg.pipeline_stages, as_json, options, fit)
        plan = plan_memory(cfg, budget, **options)
    except (ValueError, FileNotFoundError, UserError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps({**plan.as_json(), "auto_fit": fit or None}))
    else:
        print(_fit_lines(fit) + plan.format())
    return 1 if plan.fits is False or "error" in fit else 0


def _print_stages(cfg: TrainConfig, budget: Optional[float], stages: int, as_json: bool,
                  options: Dict[str, Any], fit: Optional[Dict[str, Any]] = None) -> int:
    """Each card's plan of a pipeline split over ``stages`` cards and the traffic per step (the config as
    written, or as auto_fit chose it: ``fit``, shown first)."""
    spec = model_sizes(cfg.pretrained_model_name_or_path, cfg.revision, planned_family(cfg).name)
    s = resolve_settings(cfg, spec, **options)
    micro = cfg.gradient_accumulation_steps
    plans, flow = stage_plans(spec, s, stages, micro, budget), traffic(spec, s, stages, micro, budget)
    print(json.dumps({**stages_json(plans, flow), "auto_fit": fit or None}) if as_json
          else _fit_lines(fit or {}) + format_stages(plans, flow, micro))
    return 1 if any(p.plan.fits is False for p in plans) else 0


def _auto_fit(cfg: TrainConfig, budget: Optional[float], options: Dict[str, Any]) -> Tuple[TrainConfig, Dict[str, Any]]:
    """``cfg`` with auto_fit's choice applied, and what to say about it; ``cfg`` as it is when auto_fit is off
    or has nothing to fit."""
    if not cfg.auto_fit:
        return cfg, {}
    if options.get("device") == "cpu":
        return cfg, {"nothing_to_fit": "a CPU run: there is no GPU memory to fit"}
    if budget is None:
        return cfg, {"nothing_to_fit": "no budget: give --gpu-memory or gpu_memory (--plan does not look for a GPU)"}
    fitted_cfg, choice = fitted(cfg, budget, **{k: v for k, v in options.items() if k != "device"})
    return fitted_cfg, {"budget_gib": choice.budget_gib, "target_gib": round(choice.target_gib, 2),
                        "candidate": choice.rung, "rank": choice.rank, "summary": choice.summary(),
                        "chosen": choice.values, "changed": {k: list(v) for k, v in choice.changes.items()},
                        "change_lines": choice.change_lines()}


def _flags_as_keys(cfg: TrainConfig, options: Dict[str, Any]) -> TrainConfig:
    """The planner's --blocks-to-swap and --quantization as config keys the user set (auto_fit keeps them)."""
    swap, weights = options.pop("blocks_to_swap", None), options.pop("quantization", None)
    if swap is None and weights is None:
        return cfg
    cfg = copy.deepcopy(cfg)
    keys = set(cfg.explicit_keys)
    if swap is not None:
        cfg.blocks_to_swap = swap
        keys.add("blocks_to_swap")
    if weights is not None:
        cfg.quantize = weights not in ("none", "no", "")
        if cfg.quantize:
            cfg.quantization.backend = "quanto" if weights in QUANTO_WEIGHTS else "torchao"
            cfg.quantization.weights = weights
        keys |= {"quantize", "quantization.backend", "quantization.weights"}
    cfg.explicit_keys = frozenset(keys)
    return cfg


def _fit_lines(fit: Dict[str, Any]) -> str:
    """auto_fit's choice (or why there is none), for above the table."""
    if not fit:
        return ""
    if "error" in fit:
        return f"{fit['error']}\n\n"
    if "nothing_to_fit" in fit:
        return f"auto_fit: nothing to fit ({fit['nothing_to_fit']}); the plan of the settings as configured\n\n"
    return "\n".join([fit["summary"]] + [f"  {line}" for line in fit["change_lines"]]) + "\n\n"
