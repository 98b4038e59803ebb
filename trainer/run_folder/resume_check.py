"""What a checkpoint records about its run, and what a resume may change.

Each checkpoint's ``trainer_state.json`` holds the resolved config and fingerprints of the base model
and the dataset. A resume compares them with the new run:

- a change that would silently corrupt the run (what the trained weights *are*: family, base model,
  training mode, adapter type, rank, alpha, targets, optimizer) is refused, naming key, old and new;
- any other change (learning rate, scheduler, max steps, dataset, ...) is applied from the
  checkpoint's step on and logged as such; a new learning rate, schedule or optimizer setting
  (betas, weight decay, Prodigy's ``d_coef``) really applies (the optimizer state would otherwise
  bring the old one back);
- ``max_train_steps`` below the checkpoint's step is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from loguru import logger

from image_datasets.dataset import Sample
from trainer.run_folder import checkpoint as ckpt
from trainer.config import TrainConfig
from trainer.step.optim import apply_settings
from utils.errors import ConfigError, UserError

# What the trained weights are: a resume with another value would train something else.
REFUSED = ("family", "training_mode", "adapter_type", "rank", "lora_alpha", "lora_target", "lora_target_modules",
           "use_dora", "use_rslora", "trainable_modules", "optimizer", "revision")
# Where the run is, not how it trains.
IGNORED = ("resume_from_checkpoint", "output_dir", "overwrite_output_dir", "logging_dir", "report_to", "ddp_timeout")
_EDGE = 1 << 20  # bytes of tensor data hashed at each end of a weight file


def record(cfg: TrainConfig, model_path: str, samples: Sequence[Sample], saved: Dict[str, Any]) -> Dict[str, Any]:
    """The loop position ``saved`` plus the config and fingerprints, for ``trainer_state.json``."""
    return {**saved, "config": _flat(cfg),
            "fingerprints": {"base_model": model_fingerprint(model_path), "dataset": dataset_fingerprint(samples)}}


def refuse_incompatible(checkpoint: Optional[Path], cfg: TrainConfig, model_path: str) -> None:
    """Before anything loads: refuse a resume whose changes the checkpoint cannot carry."""
    if checkpoint is not None:
        refuse(ckpt.read_state(checkpoint), checkpoint, cfg, model_path)


def refuse(state: Dict[str, Any], checkpoint: Path, cfg: TrainConfig, model_path: str) -> None:
    """``refuse_incompatible`` on the checkpoint's ``trainer_state.json`` already read (``state``)."""
    step = state["global_step"]
    if cfg.max_train_steps < step:
        raise ConfigError(
            f"key 'max_train_steps': {cfg.max_train_steps} is below the step of {checkpoint} ({step}); raise it, or "
            "resume from an earlier checkpoint with resume_from_checkpoint=<its folder>")
    old = state.get("config")
    if not isinstance(old, dict):
        logger.warning(f"{checkpoint} records no config (an older checkpoint): changes since it cannot be checked")
        return
    new = _flat(cfg)
    problems = [f"key '{k}': the checkpoint trained with {_effective(old, k)!r}, this run has {_effective(new, k)!r}"
                for k in REFUSED if k in old and _effective(old, k) != _effective(new, k)]
    old_model = state.get("fingerprints", {}).get("base_model")
    if old_model and old_model != model_fingerprint(model_path):
        problems.append(f"key 'pretrained_model_name_or_path': the checkpoint trained on "
                        f"{old.get('pretrained_model_name_or_path')!r} ({old_model[:12]}), this run has "
                        f"{model_path!r} ({model_fingerprint(model_path)[:12]}): another base model")
    if problems:
        raise ConfigError(f"cannot resume from {checkpoint}: " + "; ".join(problems)
                          + " (a resume must train the same weights: restore these values, or start a new run "
                          "in another output_dir)")


def load(checkpoint: Path, load_state: Callable[[str], Any], cfg: TrainConfig, samples: Sequence[Sample],
         scheduler: Any) -> None:
    """``accelerator.load_state`` with an error naming the checkpoint, then the allowed changes applied
    (the new learning rate and schedule) and every change logged. (The engine's resume does these steps
    as parts of its run state: ``trainer/run_folder/checkpointer.py``.)"""
    state = ckpt.read_state(checkpoint)
    fresh = fresh_rates(scheduler)
    load_files(checkpoint, load_state)
    reapply_settings(scheduler, fresh, cfg)
    for line in changes(state, cfg, samples):
        logger.warning(f"resume from {checkpoint.name}: {line}")


def load_files(checkpoint: Path, load_state: Callable[[str], Any]) -> None:
    """``load_state(checkpoint)`` (accelerate's), its failure one line naming the checkpoint."""
    try:
        load_state(str(checkpoint))
    except Exception as exc:  # torch / safetensors / accelerate errors of a damaged or foreign checkpoint
        if isinstance(exc, UserError):
            raise
        raise UserError(f"cannot resume from {checkpoint}: {type(exc).__name__}: {_first_line(exc)} (resume from "
                        "an earlier checkpoint with resume_from_checkpoint=<its folder>, or start a new run)") from None


def fresh_rates(scheduler: Any) -> List[float]:
    """The new config's learning rate(s), read before a restored scheduler replaces them."""
    return list(_inner(scheduler).base_lrs)


def reapply_settings(scheduler: Any, fresh: List[float], cfg: TrainConfig) -> None:
    """After the optimizer and scheduler state are restored: the new config's learning rate, schedule and
    other optimizer keys apply (the restored state would otherwise bring the old ones back)."""
    _apply_schedule(scheduler, fresh)
    apply_settings(_inner(scheduler).optimizer, cfg)


def changes(state: Dict[str, Any], cfg: TrainConfig, samples: Sequence[Sample]) -> List[str]:
    """What this run changes against the checkpoint's ``state`` (config keys, the dataset), one line each."""
    old, new = state.get("config"), _flat(cfg)
    lines: List[str] = []
    if isinstance(old, dict):
        lines += [f"{line}: applied from step {state['global_step']}" for k in sorted(set(old) | set(new))
                  if k not in REFUSED and k not in IGNORED for line in _diff(k, old.get(k), new.get(k))]
    old_data = state.get("fingerprints", {}).get("dataset")
    if old_data and old_data != dataset_fingerprint(samples):
        lines.append(f"the dataset changed since the checkpoint (now {len(samples)} samples): training continues "
                     "on the new one")
    return lines


def _diff(key: str, old: Any, new: Any) -> List[str]:
    """What changed under ``key``, one line per value: a list of sections (``datasets``, validation
    prompts) item by item and key by key (``datasets[0].repeats changed 3 -> 1``), items matched by
    name where they have one, so removing one dataset does not read as every later one changing."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [line for k in [*old, *(k for k in new if k not in old)]
                for line in _diff(f"{key}.{k}", old.get(k), new.get(k))]
    if isinstance(old, list) and isinstance(new, list) and any(isinstance(i, dict) for i in old + new):
        return _list_diff(key, old, new)
    return [] if old == new else [f"{key} changed {old!r} -> {new!r}"]


def _list_diff(key: str, old: List[Any], new: List[Any]) -> List[str]:
    def name(item: Any, index: int) -> Any:
        return item.get("name") if isinstance(item, dict) and item.get("name") else index

    old_names, new_names = [name(i, n) for n, i in enumerate(old)], [name(i, n) for n, i in enumerate(new)]
    if len(set(old_names)) < len(old_names) or len(set(new_names)) < len(new_names):
        old_names, new_names = list(range(len(old))), list(range(len(new)))  # no unique names: by position
    lines = [f"{key}[{n}]{_label(item)} removed" for n, (item, label) in enumerate(zip(old, old_names))
             if label not in new_names]
    for n, (item, label) in enumerate(zip(new, new_names)):
        if label not in old_names:
            lines.append(f"{key}[{n}]{_label(item)} added")
        else:
            lines += _diff(f"{key}[{n}]", old[old_names.index(label)], item)
    return lines


def _label(item: Any) -> str:
    """A list item as the change lines show it: its name and folder, or its value."""
    if isinstance(item, dict):
        shown = {k: item[k] for k in ("name", "img_dir", "prompt") if item.get(k)}
        return f" ({', '.join(f'{k} {v!r}' for k, v in shown.items())})" if shown else ""
    return f" ({item!r})"


def _apply_schedule(scheduler: Any, fresh: List[float]) -> None:
    """Restored optimizer and scheduler state carry the old learning rate: put the new config's base
    rate back and recompute the current rate with the (new) schedule at the restored step."""
    inner = _inner(scheduler)
    lambdas = getattr(inner, "lr_lambdas", None)
    if lambdas is None or len(fresh) != len(inner.base_lrs):
        return
    inner.base_lrs = fresh
    rates = [base * fn(inner.last_epoch) for base, fn in zip(fresh, lambdas)]
    for group, base, rate in zip(inner.optimizer.param_groups, fresh, rates):
        group["initial_lr"], group["lr"] = base, rate
    inner._last_lr = rates


def _inner(scheduler: Any) -> Any:
    return getattr(scheduler, "scheduler", scheduler)  # accelerate's wrapper holds torch's


def _flat(cfg: TrainConfig) -> Dict[str, Any]:
    """The config as one level of dotted keys (JSON values)."""
    flat: Dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(dataclasses.asdict(cfg), "")  # the values as loaded: nothing in them is resolved again
    return json.loads(json.dumps(flat, default=str))


def _effective(config: Dict[str, Any], key: str) -> Any:
    if key == "lora_alpha" and config.get(key) is None:
        return config.get("rank")  # the default alpha is the rank
    return config.get(key)


@lru_cache(maxsize=8)
def model_fingerprint(model_path: str) -> str:
    """sha256 of the transformer's config and, for each weight file, its size, safetensors header and
    the first and last MiB of its data: another model of the same shape differs there, and a 40 GB
    model is not read whole. A hub id stands for itself."""
    folder = Path(model_path) / "transformer"
    folder = folder if folder.is_dir() else Path(model_path)
    if not folder.is_dir():
        return hashlib.sha256(model_path.encode()).hexdigest()
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.json")) + sorted(folder.glob("*.safetensors")):
        digest.update(path.name.encode())
        size = path.stat().st_size
        digest.update(str(size).encode())
        with open(path, "rb") as fh:
            if path.suffix == ".json":
                digest.update(fh.read())
                continue
            header = int.from_bytes(fh.read(8), "little")  # safetensors: 8-byte length, JSON header, data
            fh.seek(0)
            digest.update(fh.read(8 + header + _EDGE))
            fh.seek(max(0, size - _EDGE))
            digest.update(fh.read())
    return digest.hexdigest()


def dataset_fingerprint(samples: Sequence[Sample]) -> str:
    """sha256 of every sample's key, caption, training size and file size."""
    digest = hashlib.sha256()
    for s in sorted(samples, key=lambda s: s.key):
        size = s.image_path.stat().st_size if s.image_path.is_file() else -1
        digest.update(json.dumps([s.key, s.caption, list(s.size), size]).encode())
    return digest.hexdigest()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""
