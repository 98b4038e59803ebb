"""Loading a profile: YAML (a file, never code) with ``key=value`` overrides, FlyMyAI's names translated,
unknown keys and wrong types reported at once, each problem blamed on the override that caused it."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml
from loguru import logger
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from utils.errors import ConfigError
from trainer.config.checks import config_problems
from trainer.config.schema import (DESIGN_NOTE_KEYS, FLYMYAI_KEYS, FOLDER_KEYS, REGULARIZATION, DataConfig, DatasetEntry,
                                   FlyMyAIKeys, TrainConfig, ValidationPrompt, dataset_name)


MAX_CONFIG_BYTES = 4 * 2**20  # a training config is a few KiB; past this it is the wrong file


def load_config(
    path: str | os.PathLike | None,
    overrides: List[str] | None = None,
    default_family: Optional[str] = None,
    profile_defaults: Optional[Dict[str, Any]] = None,
) -> TrainConfig:
    """Load a YAML profile, apply ``key=value`` overrides, and validate it against the schema.

    ``default_family`` is the entry script's family, used when the YAML names none;
    ``profile_defaults`` are the entry script's defaults (the YAML and overrides win over them).
    Raises ``ConfigError`` naming every bad key or value.
    """
    user = _read_yaml(path) if path is not None else OmegaConf.create({})
    given = {str(key) for key in user} | {item.partition("=")[0].strip().split(".")[0] for item in overrides or []}
    if profile_defaults:
        user = OmegaConf.merge(OmegaConf.create(profile_defaults), user)
    source = str(path) if path is not None else "<overrides>"
    if overrides:
        user = _apply_overrides(user, overrides, source)
    raw = OmegaConf.to_container(user, resolve=False)
    unknown = _unknown_keys(raw, TrainConfig, also=FLYMYAI_KEYS) + _resolver_calls(raw)
    if unknown:
        raise ConfigError(f"{source}: " + "; ".join(_blame_overrides(unknown, overrides)))
    try:
        raw, problems = flymyai_compat(raw)
        raw, item_problems = _typed_items(raw)
        if item_problems:
            raise ConfigError(f"{source}: " + "; ".join(_blame_overrides(item_problems, overrides)))
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), raw)
        cfg: TrainConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{source}: " + _blame_overrides([_describe_type_error(exc)], overrides)[0]) from None
    # Typed again from loaded values: escaped, so a literal ${...} in a prompt stays one.
    cfg.validation.prompts = [_typed(ValidationPrompt, _escaped(p if isinstance(p, dict) else {"prompt": p}))
                              for p in cfg.validation.prompts]
    _name_datasets(cfg.datasets)
    if cfg.family is None:
        cfg.family = default_family
    if cfg.mixed_precision in ("False", "false"):  # YAML 1.1 reads a bare `no` as false
        cfg.mixed_precision = "no"
    value_problems, dropped = _problems_yielding_defaults(cfg, profile_defaults or {}, given)
    problems += value_problems
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(_blame_overrides(problems, overrides)))
    for note in dropped:
        logger.info(note)
    return cfg


def _problems_yielding_defaults(cfg: TrainConfig, defaults: Dict[str, Any],
                                given: set) -> Tuple[List[str], List[str]]:
    """``config_problems(cfg)``, after each entry-script default that the user did not set and that a
    problem names is put back to the schema's default, when that clears it (the profile's own choices
    win over the script's policy: train_4090.py's gradient_checkpointing_cpu_offload under
    train_dgx_spark.yaml, which turns checkpointing off); and a line for the log per default dropped."""
    problems = config_problems(cfg)
    schema = {f.name: f for f in dataclasses.fields(TrainConfig)}
    named = [key for key in defaults if key in schema and key not in given
             and any(f"key '{key}'" in problem for problem in problems)]
    if not named:
        return problems, []
    trial = copy.deepcopy(cfg)
    for key in named:
        setattr(trial, key, schema[key].default)
    remaining = config_problems(trial)
    if any(f"key '{key}'" in problem for problem in remaining for key in named):
        return problems, []
    notes = []
    for key in named:
        why = next(problem for problem in problems if f"key '{key}'" in problem).partition(": ")[2]
        notes.append(f"{key}: {schema[key].default!r}, not the entry script's default {getattr(cfg, key)!r}, "
                     f"which this profile rules out ({why})")
        setattr(cfg, key, schema[key].default)
    return remaining, notes


def _blame_overrides(problems: List[str], overrides: Optional[List[str]]) -> List[str]:
    """Each problem whose key was given as a ``key=value`` override says so: the message starts with
    the YAML file's name, and the user would look for the bad value there in vain."""
    given = {item.partition("=")[0].strip() for item in overrides or []}
    named = [re.search(r"key '([^']+)'", problem) for problem in problems]
    return [f"{problem} (given as an override)" if key and key.group(1) in given else problem
            for problem, key in zip(problems, named)]


def flymyai_compat(raw: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """``raw`` (the merged YAML and overrides, as plain containers) with FlyMyAI's keys rewritten to
    this schema's, and the problems found on the way. ``raw`` itself is left unchanged; a value of the
    wrong type raises OmegaConf's error naming the FlyMyAI key."""
    raw = copy.deepcopy(raw)
    given = {key: raw.pop(key) for key in FLYMYAI_KEYS if key in raw}
    old: FlyMyAIKeys = OmegaConf.to_object(  # type: ignore[assignment]
        OmegaConf.merge(OmegaConf.structured(FlyMyAIKeys), given))
    problems: List[str] = []
    data = raw.get("data_config") if isinstance(raw.get("data_config"), dict) else {}
    batch = data.get("train_batch_size", DataConfig.train_batch_size)
    if old.train_batch_size is not None and old.train_batch_size != batch:
        problems.append(f"key 'train_batch_size': value {old.train_batch_size} differs from "
                        f"data_config.train_batch_size {batch}; set one of them")
    if old.adam8bit:
        raw["optimizer"] = "adamw8bit"
    if not old.disable_sampling:
        validation = raw.setdefault("validation", {})
        if isinstance(validation, dict) and validation.get("every_n_steps", 0) == 0:
            validation.update(every_n_steps=old.sample_every, width=old.sample_width, height=old.sample_height,
                              steps=old.sample_steps)
    if old.double_blocks is not None:
        problems.append("key 'double_blocks': choosing FLUX blocks is not yet supported (set double_blocks: null)")
    return raw, problems


# An OmegaConf interpolation that calls a resolver (``${oc.env:TOKEN}``, ``${oc.decode:...}``): it would
# read the environment (or run other code) into the config. ``\${...}`` is a literal and stays one.
_RESOLVER_CALL = re.compile(r"(?<!\\)\$\{\s*([A-Za-z_][\w.]*)\s*:")


def _resolver_calls(data: Any, key: str = "") -> List[str]:
    """Every value of the YAML and overrides (``data``: plain containers, unresolved) that calls an
    OmegaConf resolver. A config is data: the environment never reaches a run's files or trackers.
    A reference to another key (``${output_dir}/cache``) is data too and stays allowed."""
    if isinstance(data, dict):
        return [p for k, v in data.items() for p in _resolver_calls(v, f"{key}.{k}" if key else str(k))]
    if isinstance(data, list):
        return [p for i, v in enumerate(data) for p in _resolver_calls(v, f"{key}[{i}]")]
    match = _RESOLVER_CALL.search(data) if isinstance(data, str) else None
    if match is None:
        return []
    return [f"key '{key}': {data!r} calls the OmegaConf resolver '{match.group(1)}'; a config is data, so the "
            "environment and resolvers are not read: write the value itself (or \\${...} for a literal ${...})"]


def config_to_yaml(cfg: TrainConfig) -> str:
    """The resolved config as YAML, as saved beside a run's outputs. Its values are written as data:
    a literal ``${...}`` in one (given as ``\\${...}``) is escaped again, so reading the file back never
    resolves it."""
    return OmegaConf.to_yaml(OmegaConf.create(_escaped(dataclasses.asdict(cfg))))


def _escaped(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _escaped(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_escaped(v) for v in data]
    return data.replace("${", "\\${") if isinstance(data, str) else data


def _read_yaml(path: str | os.PathLike) -> DictConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {path.stat().st_size / 2**20:.1f} MiB is far too large for a training config "
                          f"(a few KiB; the limit is {MAX_CONFIG_BYTES // 2**20} MiB): is this the right file?")
    try:
        data = OmegaConf.load(path)  # OmegaConf uses a safe YAML loader: data, never code
    except Exception as exc:  # yaml.YAMLError and OmegaConf grammar errors
        if "node expansion exceeds" in str(exc):  # OmegaConf counts every node, aliases or not
            raise ConfigError(f"{path}: too many YAML values (over OmegaConf's limit of 10000, with aliases "
                              "expanded; a training config has a few hundred): is this the right file?") from None
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, DictConfig):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values")
    return data


def _apply_overrides(user: DictConfig, overrides: List[str], source: str) -> DictConfig:
    """``key=value`` overrides on the YAML; a key through a list item (``datasets.1.repeats=3``)
    sets that item's key."""
    indexed = [item for item in overrides if re.search(r"\.\d+(\.|=)", item.partition("=")[0] + "=")]
    user = OmegaConf.merge(user, _parse_overrides([item for item in overrides if item not in indexed]))
    _parse_overrides(indexed)  # each value is YAML, or the error names its override
    for item in indexed:
        key, _, value = item.partition("=")
        try:
            OmegaConf.update(user, key, _parse_overrides([f"v={value}"]).v, merge=True)
        except OmegaConfBaseException as exc:
            raise ConfigError(f"{source}: override {item!r}: {str(exc).splitlines()[0]}") from None
    return user


def _parse_overrides(overrides: List[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. learning_rate=2e-4)")
    for item in overrides:  # one at a time, so that the error names the bad one
        try:
            OmegaConf.from_dotlist([item])
        except (OmegaConfBaseException, yaml.YAMLError) as exc:  # a value that is not YAML: `{`, `[a, b`
            raise ConfigError(f"override {item[:200]!r}: not a valid value ({' '.join(str(exc).split())[:300]})") from None
    return OmegaConf.from_dotlist(list(overrides))


def _unknown_keys(data: Any, schema: type, prefix: str = "", also: Sequence[str] = ()) -> List[str]:
    """Keys neither in the schema nor in ``also``, each with the closest valid key when there is one."""
    if not isinstance(data, dict):
        return []
    fields = {f.name: f for f in dataclasses.fields(schema)}
    problems: List[str] = []
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key in also:
            continue
        if key not in fields and not prefix and key in DESIGN_NOTE_KEYS:
            problems.append(f"key '{key}' is from the early design notes and not a setting here: {DESIGN_NOTE_KEYS[key]}")
            continue
        if key not in fields:
            guess = difflib.get_close_matches(str(key), [*fields, *also], n=1, cutoff=0.6)
            hint = f" (did you mean '{prefix}{guess[0]}'?)" if guess else ""
            problems.append(f"unknown key '{full}'{hint}")
            continue
        sub = fields[key].default_factory if fields[key].default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub):
            problems += _unknown_keys(value, sub, prefix=f"{full}.")
        item = fields[key].metadata.get("item")
        if item is not None and isinstance(value, list):  # a list of sections: each entry by its index
            for index, entry in enumerate(value):
                problems += _unknown_keys(entry, item, prefix=f"{full}[{index}].")
    return problems


def _typed_items(raw: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """``raw`` with each ``datasets`` entry filled with data_config's folder keys it leaves out, and
    the problems of its list items (a wrong type, an entry that is not a mapping), each named by its
    index: OmegaConf's own message would name the key without its list and index."""
    problems: List[str] = []
    data = raw.get("data_config") if isinstance(raw.get("data_config"), dict) else {}
    entries = raw.get("datasets")
    if entries:
        if data.get("img_dir"):
            problems.append("keys 'datasets' and 'data_config.img_dir': give the folders as datasets entries, "
                            "or one folder as data_config.img_dir, not both")
        defaults = {key: data[key] for key in FOLDER_KEYS if key in data}
        raw["datasets"] = [{**defaults, **entry} if isinstance(entry, dict) else entry for entry in entries]
    validation = raw.get("validation") if isinstance(raw.get("validation"), dict) else {}
    for key, items, schema, plain in (
            ("datasets", raw.get("datasets") or [], DatasetEntry, ()),
            ("validation.prompts", validation.get("prompts") or [], ValidationPrompt, (str,))):
        for index, item in enumerate(items):
            if isinstance(item, plain):
                continue
            if not isinstance(item, dict):
                problems.append(f"key '{key}[{index}]': expected a mapping of keys to values, got {item!r}")
                continue
            try:
                _typed(schema, item)
            except OmegaConfBaseException as exc:
                problems.append(_describe_type_error(exc, prefix=f"{key}[{index}]."))
    return raw, problems


def _typed(schema: type, values: Dict[str, Any]) -> Any:
    """``values`` as an instance of the dataclass ``schema`` (OmegaConf's type conversion and checks)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))


def _name_datasets(entries: List[DatasetEntry]) -> None:
    """Give each entry without a name its folder's name; names that would collide (with each other,
    a given name or the regularisation loss key) get the entry's index as a suffix."""
    given = [e.name for e in entries if e.name]
    defaults = [dataset_name(e) for e in entries]
    for index, entry in enumerate(entries):
        if entry.name:
            continue
        name = defaults[index]
        taken = defaults.count(name) > 1 or name in given or name == REGULARIZATION
        entry.name = f"{name}_{index}" if taken else name


def _describe_type_error(exc: OmegaConfBaseException, prefix: str = "") -> str:
    key = prefix + (getattr(exc, "full_key", None) or "?")
    message = str(exc).splitlines()[0]
    section = re.search(r"is not a subclass of (\w+)", message)
    if section and not getattr(exc, "full_key", None):  # a value where a section belongs (data_config=5)
        key = prefix + next((f.name for f in dataclasses.fields(TrainConfig)
                    if getattr(f.default_factory, "__name__", None) == section.group(1)), "?")
        return f"key '{key}': is a section (a mapping of keys), not a single value"
    match = re.search(r"Value '(.*?)' (?:of type '.*?' )?could not be converted to (\w+)", message)
    if match:
        kind = {"Integer": "integer", "Float": "number", "Boolean": "boolean (true/false)"}
        return f"key '{key}': value '{match.group(1)}' is not a valid {kind.get(match.group(2), match.group(2))}"
    return f"key '{key}': {message}"
