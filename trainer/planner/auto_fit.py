"""``auto_fit: true``: before any weight loads, the fastest memory settings that the memory planner fits
into the card.

The candidates come in one fixed order of cost, the slowest last, and the first whose plan fits wins:

1. the weights in the config's precision (bf16), AdamW, with the fewest checkpointed blocks that fit
   (none at all first);
2. 8-bit W8A8 weights (torchao ``weights: auto``: fp8 or int8 matmuls, or int8 dequantized, by device at
   load time), again with the fewest checkpointed blocks;
3. + checkpoint offload (``gradient_checkpointing_cpu_offload``), 4. + 8-bit AdamW, each with the fewest
   checkpointed blocks;
5. + block swap, every block checkpointed, the fewest swapped blocks that fit;
6. 4-bit weights (quanto ``qint4``) with offload and 8-bit AdamW, the fewest checkpointed blocks, then 7. with
   block swap.

Within each, the text encoder is quantized for the cache pass (``quantize_text_encoder``) only where that
pass does not fit otherwise. The order never depends on the budget, so a smaller card never gets an
earlier (faster) candidate than a larger one. A key the user set (``TrainConfig.explicit_keys``: the YAML
or an override, not an entry script's default) keeps its value in every candidate; a quantization format
the user chose is the one every quantized candidate uses.

A plan must fit the budget less ``HEADROOM``: on a GPU the planner read 2-7% under the measured peaks
(``docs/MEMORY_PLANNER.md``, *Calibration*).
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from loguru import logger

from trainer.config import TrainConfig
from trainer.config.checks import stage_problems
from trainer.planner.model_sizes import ModelSizes, model_sizes
from trainer.planner.plan import build_plan, plan_memory
from trainer.planner.report import MemoryPlan
from trainer.planner.settings import planned_family, resolve_settings
from trainer.planner.stages import stage_plans
from utils.errors import ConfigError
from utils.sizes import parse_size

HEADROOM = 0.08  # of the budget, for the planner's error (it read 2-7% under measured GPU peaks)
# The 8-bit W8A8 format: `auto` (fp8 or int8 W8A8, or dequantized int8, by device at load time).
W8A8 = "auto"
# Each weight width's format by backend (the default backend first).
FORMATS = {8: {"torchao": W8A8, "quanto": "qfloat8"}, 4: {"quanto": "qint4", "torchao": "int4_weight_only"}}
# The keys auto_fit sets (dotted), in the order its log lists them.
FIT_KEYS = ("quantize", "quantization.backend", "quantization.weights", "gradient_checkpointing",
            "gradient_checkpointing_cpu_offload", "optimizer", "blocks_to_swap", "quantize_text_encoder")


@dataclass(frozen=True)
class Rung:
    """One step of the cost order: weight width, checkpoint offload, 8-bit AdamW, block swap."""

    name: str
    bits: int  # 16 (the config's precision), 8 or 4
    offload: bool = False
    adam8bit: bool = False
    swap: bool = False  # search the fewest swapped blocks (every block checkpointed), not checkpointed blocks


RUNGS = (Rung("unquantized weights", 16), Rung("8-bit weights", 8), Rung("8-bit weights, checkpoint offload", 8, True),
         Rung("8-bit weights, checkpoint offload, 8-bit AdamW", 8, True, True),
         Rung("8-bit weights, checkpoint offload, 8-bit AdamW, block swap", 8, True, True, True),
         Rung("4-bit weights, checkpoint offload, 8-bit AdamW", 4, True, True),
         Rung("4-bit weights, checkpoint offload, 8-bit AdamW, block swap", 4, True, True, True))


class NothingFits(ConfigError):
    """No candidate's plan fits the budget: a one-line refusal (exit code 2 in a run)."""


@dataclass(frozen=True)
class FitChoice:
    """The candidate auto_fit chose: every fit key's value, what changed, and its plan."""

    budget_gib: float
    target_gib: float  # the budget less the headroom: what the plan had to fit
    rank: int  # the candidate's place in the cost order (0: the fastest there is)
    rung: str
    values: Dict[str, Any]  # each of FIT_KEYS -> its chosen value
    changes: Dict[str, Tuple[Any, Any]]  # the keys whose value differs from the config's: (before, after)
    plan: MemoryPlan

    def apply(self, cfg: TrainConfig) -> None:
        """Set the chosen values on ``cfg`` (in place)."""
        for key, value in self.values.items():
            _set(cfg, key, value)

    def overrides(self) -> List[str]:
        """The choice as ``key=value`` overrides (what the GPU harness puts on a scaled-down model)."""
        return [f"{key}={_yaml(value)}" for key, value in self.values.items()]

    def summary(self) -> str:
        """One line: the budget, the candidate, its peak and how many keys it changed."""
        return (f"auto_fit for {self.budget_gib:.2f} GiB (plans up to {self.target_gib:.2f}: {HEADROOM:.0%} headroom "
                f"for the planner's error): {self.rung}, {self.plan.settings.checkpointed} of "
                f"{self.plan.settings.num_blocks} blocks checkpointed; GPU peak {self.plan.gpu_peak_gib:.2f} GiB; "
                f"{len(self.changes) or 'no'} key{'s' if len(self.changes) != 1 else ''} changed")

    def change_lines(self) -> List[str]:
        """Each key the choice changed: ``key: new (was old)``."""
        return [f"{key}: {_yaml(after)} (was {_yaml(before)})" for key, (before, after) in self.changes.items()]


def fit_target(budget_gib: float) -> float:
    return budget_gib * (1 - HEADROOM)


def choose_fit(cfg: TrainConfig, budget_gib: float, explicit: Optional[Sequence[str]] = None,
               spec: Optional[ModelSizes] = None, processes: int = 1, **plan_options: Any) -> FitChoice:
    """The first candidate in the cost order whose plan fits ``budget_gib`` less the headroom; the keys in
    ``explicit`` (default: ``cfg.explicit_keys``) keep the config's values. ``plan_options`` go to the planner
    (``text_tokens``, ``streamed_loading``). With ``processes`` >= 2 (one card each), where one card would
    need fewer weight bits or block swap, ``pipeline_stages: processes`` in the config's precision wins when
    each card's stage fits (``stage_fit``). Raises ``NothingFits`` in one line."""
    planned_family(cfg)  # a family the planner does not model is refused before anything is built
    spec = spec or model_sizes(cfg.pretrained_model_name_or_path, cfg.revision, cfg.family)
    fixed = set(cfg.explicit_keys if explicit is None else explicit)
    target, seen, frugal = fit_target(budget_gib), set(), None
    # The dataset is counted once: no candidate changes it (only an in-memory cache needs the count).
    options = {**plan_options, "image_count": resolve_settings(cfg, spec, **plan_options).num_images}
    for rank, (rung, values) in enumerate(candidates(cfg, fixed, spec.transformer.num_blocks)):
        key = tuple(values.items())
        if key in seen:
            continue
        seen.add(key)
        values, plan = _plan_candidate(cfg, spec, values, fixed, target, options)
        if plan.fits and (rung.bits < 16 or rung.swap or values.get("blocks_to_swap")):
            staged = stage_fit(cfg, spec, fixed, budget_gib, processes, plan_options)
            if staged is not None:
                return staged
        if plan.fits:
            changes = {k: (_get(cfg, k), v) for k, v in values.items() if _get(cfg, k) != v
                       or type(_get(cfg, k)) is not type(v)}
            final = plan_memory(_configured(cfg, values), budget_gib, spec=spec, **plan_options)
            return FitChoice(budget_gib, target, rank, rung.name, values, changes, final)
        if frugal is None or plan.gpu_peak_gib < frugal[1].gpu_peak_gib:
            frugal = (values, plan)
    raise NothingFits(_refusal(budget_gib, target, *frugal))


def candidates(cfg: TrainConfig, fixed: set, blocks: int) -> Iterator[Tuple[Rung, Dict[str, Any]]]:
    """Every candidate in the cost order, the user's keys already in place (so some repeat)."""
    for rung in RUNGS:
        for checkpointed, swap in _block_counts(rung, blocks):
            values = {"quantize": rung.bits < 16, "quantization.backend": cfg.quantization.backend,
                      "quantization.weights": cfg.quantization.weights,
                      "gradient_checkpointing": _checkpointing_value(checkpointed, blocks),
                      "gradient_checkpointing_cpu_offload": rung.offload and checkpointed > 0,
                      "optimizer": "adamw8bit" if rung.adam8bit else "adamw", "blocks_to_swap": swap,
                      "quantize_text_encoder": False}
            if rung.bits < 16:
                values["quantization.backend"], values["quantization.weights"] = _format(cfg, fixed, rung.bits)
            if cfg.disable_quantization:  # the DGX Spark switch wins over quantize: nothing to try there
                values["quantize"] = False
            values = _keep_fixed(cfg, values, fixed)
            if values["gradient_checkpointing_cpu_offload"] and values["gradient_checkpointing"] in (False, 0):
                if _given(fixed, "gradient_checkpointing_cpu_offload"):
                    continue  # offload asked for: it needs checkpointed blocks (the config refuses it without)
                values["gradient_checkpointing_cpu_offload"] = False
            yield rung, values


def _block_counts(rung: Rung, blocks: int) -> Iterator[Tuple[int, int]]:
    """(checkpointed blocks, swapped blocks) of a rung, the fastest first."""
    if rung.swap:
        yield from ((blocks, swap) for swap in range(1, blocks + 1))
    else:
        yield from ((checkpointed, 0) for checkpointed in range(blocks + 1))


def _checkpointing_value(checkpointed: int, blocks: int) -> Any:
    return True if checkpointed == blocks else False if checkpointed == 0 else checkpointed


def _format(cfg: TrainConfig, fixed: set, bits: int) -> Tuple[str, str]:
    """(backend, weights) of the ``bits``-wide candidates: the user's format when given, else the width's
    format of the user's backend, else of the default backend."""
    if _given(fixed, "quantization.weights"):
        return cfg.quantization.backend, cfg.quantization.weights
    backend = cfg.quantization.backend if _given(fixed, "quantization.backend") else next(iter(FORMATS[bits]))
    return backend, FORMATS[bits][backend]


def _keep_fixed(cfg: TrainConfig, values: Dict[str, Any], fixed: set) -> Dict[str, Any]:
    kept = {key: _get(cfg, key) if _given(fixed, key) else value for key, value in values.items()}
    if not kept["quantize"] and not kept["quantize_text_encoder"]:  # the section is unused: leave it as it is
        kept["quantization.backend"], kept["quantization.weights"] = cfg.quantization.backend, cfg.quantization.weights
    return kept


def _given(fixed: set, key: str) -> bool:
    """Whether the user set ``key`` (or a key inside it). FlyMyAI's names count for the key they set."""
    aliases = {"optimizer": ("adam8bit",), "gradient_checkpointing": ("disable_gradient_checkpointing",)}
    return any(name in fixed for name in (key, *aliases.get(key, ())))


def _plan_candidate(cfg: TrainConfig, spec: ModelSizes, values: Dict[str, Any], fixed: set, target: float,
                    options: Dict[str, Any]) -> Tuple[Dict[str, Any], MemoryPlan]:
    """The candidate's plan against ``target``; with the text encoder quantized when the cache pass does
    not fit otherwise (and the user left ``quantize_text_encoder`` open)."""
    plan = _plan(cfg, spec, values, target, options)
    if plan.fits or plan.cache_pass_gib <= target or _given(fixed, "quantize_text_encoder"):
        return values, plan
    values = {**values, "quantize_text_encoder": True}
    return values, _plan(cfg, spec, values, target, options)


def _plan(cfg: TrainConfig, spec: ModelSizes, values: Dict[str, Any], target: float,
          options: Dict[str, Any]) -> MemoryPlan:
    s = resolve_settings(_configured(cfg, values), spec, **options)
    return build_plan(spec, s, target)


def _configured(cfg: TrainConfig, values: Dict[str, Any]) -> TrainConfig:
    trial = copy.deepcopy(cfg)
    for key, value in values.items():
        _set(trial, key, value)
    return trial


def _get(cfg: TrainConfig, key: str) -> Any:
    section, _, name = key.rpartition(".")
    return getattr(getattr(cfg, section) if section else cfg, name)


def _set(cfg: TrainConfig, key: str, value: Any) -> None:
    section, _, name = key.rpartition(".")
    setattr(getattr(cfg, section) if section else cfg, name, value)


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# What to do when the leanest plan is still too large, by the phase that makes its peak.
_REMEDIES = {"the cache pass": "that pass holds the text encoder (quantized) or the VAE and the CUDA context: "
                               "encode the captions once on a larger card (the cache on disk is reused; the "
                               "planner counts the pass all the same)",
             "training": "train at a smaller data_config.img_size or data_config.train_batch_size",
             "the validation renders": "render smaller validation images (validation.width, validation.height) or "
                                       "none (validation.every_n_steps: 0)"}


def _refusal(budget: float, target: float, values: Dict[str, Any], plan: MemoryPlan) -> str:
    phases = {"the cache pass": plan.cache_pass_gib, "training": plan.training_gib,
              "the validation renders": plan.validation_gib}
    phase = max(phases, key=phases.get)
    settings = ", ".join(f"{key}: {_yaml(value)}" for key, value in values.items())
    return (f"auto_fit: nothing fits {budget:.2f} GiB (plans up to {target:.2f} GiB, {HEADROOM:.0%} headroom): the "
            f"leanest settings tried ({settings}) still plan {phases[phase]:.2f} GiB for {phase}; "
            f"{_REMEDIES[phase]}, or use a larger card (the itemised plan: --plan --gpu-memory {budget:g}GiB)")


# --------------------------------------------------------------------------- a run's budget
def run_budget(cfg: TrainConfig, card_gib: Optional[float]) -> Optional[float]:
    """The budget a run fits: ``gpu_memory`` (or ``--gpu-memory``), no more than the card when one is found;
    the card's memory when nothing is given; None on a CPU run given nothing (nothing to fit)."""
    given = parse_size(cfg.gpu_memory) if cfg.gpu_memory else None
    if given is not None and card_gib is not None and card_gib < given:
        logger.warning(f"auto_fit: gpu_memory {cfg.gpu_memory} is more than this card's {card_gib:.2f} GiB: "
                       "fitting the card")
        return card_gib
    return given if given is not None else card_gib


def fit_run(cfg: TrainConfig, card_gib: Optional[float], processes: int = 1) -> Optional[FitChoice]:
    """``auto_fit: true`` for a run about to load: choose, set the chosen keys on ``cfg`` and log them with the
    plan. A CPU run given no budget is left as configured. Raises ``ConfigError`` in one line when nothing
    fits or the run cannot be planned."""
    budget = run_budget(cfg, card_gib)
    if budget is None:
        logger.info("auto_fit: nothing to fit (no GPU, and no gpu_memory or --gpu-memory): the settings stay "
                    "as configured")
        return None
    try:
        choice = choose_fit(cfg, budget, processes=processes)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"auto_fit: the memory planner cannot plan this run ({exc}); set auto_fit: false and "
                          "choose the memory keys yourself") from None
    choice.apply(cfg)
    logger.info(choice.summary())
    for line in choice.change_lines():
        logger.info(f"auto_fit: {line}")
    logger.info("auto_fit's plan:\n" + choice.plan.format())
    return choice


def fitted(cfg: TrainConfig, budget_gib: float, **plan_options: Any) -> Tuple[TrainConfig, FitChoice]:
    """A copy of ``cfg`` with auto_fit's choice for ``budget_gib`` applied, and the choice (``--plan``)."""
    choice = choose_fit(cfg, budget_gib, **plan_options)
    return _configured(cfg, choice.values), choice


# --------------------------------------------------------------------------- two cards as one
STAGE_VALUES = {"quantize": False, "blocks_to_swap": 0, "gradient_checkpointing": True,
                "gradient_checkpointing_cpu_offload": False}  # the config's precision, nothing swapped


def stage_fit(cfg: TrainConfig, spec: ModelSizes, fixed: set, budget_gib: float, processes: int,
              plan_options: Dict[str, Any]) -> Optional[FitChoice]:
    """``pipeline_stages: processes`` (one stage a card) in the config's precision, without block swap,
    when every card's stage plan fits the target and the run can be split (the stage checks pass, the family
    has stage pieces, the user set none of these keys otherwise); else None."""
    if processes < 2 or _given(fixed, "pipeline_stages") or cfg.pipeline_stages > 1:
        return None
    values = {key: _get(cfg, key) if _given(fixed, key) else value
              for key, value in {**STAGE_VALUES, "pipeline_stages": processes}.items()}
    trial = _configured(cfg, values)
    if (stage_problems(trial) or spec.transformer.num_blocks < processes
            or importlib.util.find_spec(f"trainer.families.{cfg.family}.stage_parts") is None):
        return None
    target = fit_target(budget_gib)
    plans = stage_plans(spec, resolve_settings(trial, spec, **plan_options), processes,
                        cfg.gradient_accumulation_steps, target)
    if not all(p.plan.fits for p in plans) and not _given(fixed, "quantize_text_encoder") \
            and all(p.plan.training_gib <= target for p in plans):  # the cache pass alone does not fit
        values = {**values, "quantize_text_encoder": True}
        plans = stage_plans(spec, resolve_settings(_configured(cfg, values), spec, **plan_options), processes,
                            cfg.gradient_accumulation_steps, target)
    if not all(p.plan.fits for p in plans):
        return None
    worst = max(plans, key=lambda p: p.plan.gpu_peak_gib)
    changes = {k: (_get(cfg, k), v) for k, v in values.items() if _get(cfg, k) != v}
    return FitChoice(budget_gib, target, -1, f"unquantized weights, {processes} pipeline stages (one a card; "
                     f"card {worst.index} the fullest)", values, changes, worst.plan)
