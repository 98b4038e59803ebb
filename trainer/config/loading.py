"""Loading a profile: YAML (a file, never code) with ``key=value`` overrides, FlyMyAI's names translated,
every problem (unknown keys, resolver calls, wrong types, impossible values) reported at once, each
blamed on the override that caused it. OmegaConf reads with no resolver registered (``no_resolvers``)."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, TypeVar

import yaml
from loguru import logger
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from utils.errors import ConfigError
from trainer.config.checks import config_problems
from trainer.config.interpolation import interpolations, no_resolvers, strings
from trainer.config.schema import (DESIGN_NOTE_KEYS, FLYMYAI_KEYS, FOLDER_KEYS, REGULARIZATION, DataConfig, DatasetEntry,
                                   FlyMyAIKeys, TrainConfig, ValidationPrompt, dataset_name)


MAX_CONFIG_BYTES = 4 * 2**20  # a training config is a few KiB; past this it is the wrong file
T = TypeVar("T")


def load_config(
    path: str | os.PathLike | None,
    overrides: List[str] | None = None,
    default_family: Optional[str] = None,
    profile_defaults: Optional[Dict[str, Any]] = None,
) -> TrainConfig:
    """Load a YAML profile, apply ``key=value`` overrides, and validate it against the schema.

    ``default_family`` is the entry script's family, used when the YAML names none;
    ``profile_defaults`` are the entry script's defaults (the YAML and overrides win over them).
    Raises one ``ConfigError`` naming every bad key or value: unknown keys, resolver calls, wrong types
    and impossible values together. OmegaConf has no resolvers while it reads (``no_resolvers``).
    """
    with no_resolvers():
        return _load(path, list(overrides or []), default_family, profile_defaults or {})


def _load(path: str | os.PathLike | None, overrides: List[str], default_family: Optional[str],
          profile_defaults: Dict[str, Any]) -> TrainConfig:
    user = _read_yaml(path) if path is not None else OmegaConf.create({})
    explicit = _explicit_keys(OmegaConf.to_container(user, resolve=False), overrides)
    given = {key.split(".")[0] for key in explicit}
    if profile_defaults:
        user = OmegaConf.merge(_without_other_names(OmegaConf.create(profile_defaults), set(user)), user)
    source = str(path) if path is not None else "<overrides>"
    if overrides:
        user = _apply_overrides(_without_other_names(user, {item.partition("=")[0].strip() for item in overrides}),
                                overrides, source)
    raw = OmegaConf.to_container(user, resolve=False)
    # Every problem is collected before any is reported: a key that is unknown, calls a resolver or has
    # the wrong type is dropped (and named), so that the keys after it are still checked.
    problems = _unknown_keys(raw, TrainConfig, also=FLYMYAI_KEYS) + _resolver_calls(raw)
    for problem in problems:
        _drop(raw, problem.key)
    compat = _dropping_type_errors(flymyai_compat, raw, problems)
    raw, translated = compat if compat is not None else (raw, [])
    problems += [Problem(_named_key(p), p) for p in translated]
    raw = _typed_items(raw, problems)
    cfg = _dropping_type_errors(_typed_config, raw, problems)
    if cfg is None:  # not even the rest builds a config: what was found is all there is to say
        raise _config_error(source, problems, overrides)
    _finish(cfg, default_family)
    dropped = [problem.key for problem in problems if problem.key]
    value_problems, notes = _problems_yielding_defaults(cfg, profile_defaults, given)
    problems += [Problem(_named_key(p), p) for p in value_problems if not _within(_named_key(p), dropped)]
    if problems:
        raise _config_error(source, problems, overrides)
    for note in notes:
        logger.info(note)
    cfg.explicit_keys = frozenset(FLYMYAI_TARGETS.get(key, key) for key in explicit)
    return cfg


# A setting with two names (FlyMyAI's, the schema's): a layer above (the YAML over an entry script's defaults,
# an override over the YAML) that gives one name replaces the other below it; given together, they must agree.
OTHER_NAME = {"gradient_checkpointing": "disable_gradient_checkpointing",
              "disable_gradient_checkpointing": "gradient_checkpointing"}


def _without_other_names(lower: DictConfig, upper: Set[str]) -> DictConfig:
    """``lower`` without the other name of each key of ``upper``, the layer that goes on top of it."""
    for key in upper & set(OTHER_NAME):
        if OTHER_NAME[key] not in upper and OTHER_NAME[key] in lower:
            lower.pop(OTHER_NAME[key])
    return lower


# Where each FlyMyAI key lands in the schema (flymyai_compat): setting one sets that key.
FLYMYAI_TARGETS = {"adam8bit": "optimizer", "disable_gradient_checkpointing": "gradient_checkpointing",
                   "train_batch_size": "data_config.train_batch_size", "disable_sampling": "validation.every_n_steps",
                   "sample_every": "validation.every_n_steps", "sample_width": "validation.width",
                   "sample_height": "validation.height", "sample_steps": "validation.steps"}


def _explicit_keys(yaml: Any, overrides: List[str]) -> Set[str]:
    """The keys the user set, dotted (``quantization.weights``, and ``quantization`` too): every key of the
    YAML down to its leaves (not into lists), and each override's key."""
    keys: Set[str] = set()

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items() if isinstance(node, dict) else ():
            keys.add(f"{prefix}{key}")
            walk(value, f"{prefix}{key}.")

    walk(yaml, "")
    for item in overrides:
        parts = item.partition("=")[0].strip().split(".")
        keys.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return keys


class Problem(NamedTuple):
    """One problem of a config: the key it names (dotted, ``datasets[0].repeats``) and its message."""

    key: str
    message: str


def _config_error(source: str, problems: List[Problem], overrides: List[str]) -> ConfigError:
    return ConfigError(f"{source}: " + "; ".join(_blame_overrides([p.message for p in problems], overrides)))


def _within(key: str, dropped: List[str]) -> bool:
    """Whether ``key`` is a dropped key or inside one: its value problem is about its default, not the
    user's value, which was named already."""
    return any(key == other or key.startswith((f"{other}.", f"{other}[")) for other in dropped)


def _named_key(message: str) -> str:
    match = re.search(r"key '([^']+)'", message)
    return match.group(1) if match else ""


def _finish(cfg: TrainConfig, default_family: Optional[str]) -> None:
    """What the schema cannot say: prompts typed again from loaded values (escaped, so a literal ``${...}``
    in one stays one), datasets named, the entry script's family, YAML 1.1's ``no``."""
    cfg.validation.prompts = [_typed(ValidationPrompt, _escaped(p if isinstance(p, dict) else {"prompt": p}))
                              for p in cfg.validation.prompts]
    _name_datasets(cfg.datasets)
    if cfg.family is None:
        cfg.family = default_family
    if cfg.mixed_precision in ("False", "false"):  # YAML 1.1 reads a bare `no` as false
        cfg.mixed_precision = "no"


def merged_with_schema(schema: type, *configs: Any) -> DictConfig:
    """``OmegaConf.merge(OmegaConf.structured(schema), *configs)``, from a schema config built once per
    dataclass: building ``TrainConfig``'s takes ~20 ms of CPU, and a load builds it several times (one per
    type-error round; the web page checks every request with one). ``OmegaConf.merge`` copies its first
    argument, so the shared one is never changed."""
    return OmegaConf.merge(_structured_once(schema), *configs)


@functools.lru_cache(maxsize=None)
def _structured_once(schema: type) -> DictConfig:
    return OmegaConf.structured(schema)


def _typed_config(raw: Dict[str, Any]) -> TrainConfig:
    return OmegaConf.to_object(merged_with_schema(TrainConfig, raw))  # type: ignore[return-value]


def _dropping_type_errors(build: Callable[[Dict[str, Any]], T], raw: Dict[str, Any],
                          problems: List[Problem], prefix: str = "") -> Optional[T]:
    """``build(raw)``, each OmegaConf type error it raises named in ``problems`` and its key dropped from
    ``raw`` before the next try (OmegaConf stops at the first); None when a key cannot be dropped."""
    for _ in range(_MAX_TYPE_ERRORS):
        try:
            return build(raw)
        except OmegaConfBaseException as exc:
            problem = _describe_type_error(exc, prefix)
            problems.append(problem)
            if not _drop(raw, problem.key[len(prefix):]):
                return None
    return None


_MAX_TYPE_ERRORS = 200  # more keys than a config has: each round drops one


def _drop(data: Any, key: str) -> bool:
    """Remove ``key`` (``a.b``, ``a[0].b``) from the plain containers ``data``; whether it was there."""
    parts: List[Any] = [int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", key)]
    for part in parts[:-1]:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return False
    if parts and isinstance(data, dict) and parts[-1] in data:
        del data[parts[-1]]
        return True
    return False


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
        merged_with_schema(FlyMyAIKeys, given))
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
    if old.disable_gradient_checkpointing is not None:
        problems += _checkpointing_switch(raw, old.disable_gradient_checkpointing)
    return raw, problems


def _checkpointing_switch(raw: Dict[str, Any], disable: bool) -> List[str]:
    """FlyMyAI's ``disable_gradient_checkpointing`` written as ``gradient_checkpointing`` (into ``raw``), or the
    problem when both are given and disagree (true with a number of blocks, false with false or 0)."""
    given = raw.get("gradient_checkpointing")
    if given is None:
        raw["gradient_checkpointing"] = not disable
        return []
    if isinstance(given, (bool, int)) and (given not in (False, 0)) == disable:
        return [f"key 'disable_gradient_checkpointing': value {str(disable).lower()} contradicts "
                f"gradient_checkpointing: {str(given).lower()}; set one of them (gradient_checkpointing: true, false "
                "or a number of blocks)"]
    return []


def _resolver_calls(raw: Dict[str, Any]) -> List[Problem]:
    """Every value of the YAML and overrides (``raw``: parsed, unresolved) that calls an OmegaConf
    resolver, as OmegaConf's grammar reads it (``\\${oc.env:X}`` and ``${oc.${key}:X}`` included). A config
    is data: the environment never reaches a run's files or trackers. A reference to another key
    (``${output_dir}/cache``) is data too and stays allowed."""
    problems = []
    for key, value in strings(raw):
        calls = interpolations(value)[0]
        if calls:
            what = (f"calls the OmegaConf resolver '{calls[0]}'" if calls != ["?"]
                    else "is not a valid interpolation")
            problems.append(Problem(key, f"key '{key}': {_short(value)!r} {what}; a config is data, so the "
                                    "environment and resolvers are not read: write the value itself (or \\${...} "
                                    "for a literal ${...})"))
    return problems


def _short(text: str, chars: int = 80) -> str:
    return text if len(text) <= chars else text[:chars] + "..."


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


def _unknown_keys(data: Any, schema: type, prefix: str = "", also: Sequence[str] = ()) -> List[Problem]:
    """Keys neither in the schema nor in ``also``, each with the closest valid key when there is one."""
    if not isinstance(data, dict):
        return []
    fields = {f.name: f for f in dataclasses.fields(schema)}
    problems: List[Problem] = []
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key in also:
            continue
        if key not in fields and not prefix and key in DESIGN_NOTE_KEYS:
            problems.append(Problem(full, f"key '{key}' is from the early design notes and not a setting here: "
                                          f"{DESIGN_NOTE_KEYS[key]}"))
            continue
        if key not in fields:
            guess = difflib.get_close_matches(str(key), [*fields, *also], n=1, cutoff=0.6)
            hint = f" (did you mean '{prefix}{guess[0]}'?)" if guess else ""
            problems.append(Problem(full, f"unknown key '{full}'{hint}"))
            continue
        sub = fields[key].default_factory if fields[key].default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub):
            problems += _unknown_keys(value, sub, prefix=f"{full}.")
        item = fields[key].metadata.get("item")
        if item is not None and isinstance(value, list):  # a list of sections: each entry by its index
            for index, entry in enumerate(value):
                problems += _unknown_keys(entry, item, prefix=f"{full}[{index}].")
    return problems


def _typed_items(raw: Dict[str, Any], problems: List[Problem]) -> Dict[str, Any]:
    """``raw`` with each ``datasets`` entry filled with data_config's folder keys it leaves out, and
    the problems of its list items (a wrong type, an entry that is not a mapping) added to ``problems``,
    each named by its index (OmegaConf's own message would name the key without its list and index);
    a bad item is dropped, a bad key of an item too."""
    data = raw.get("data_config") if isinstance(raw.get("data_config"), dict) else {}
    entries = raw.get("datasets")
    if entries:
        if data.get("img_dir"):
            problems.append(Problem("", "keys 'datasets' and 'data_config.img_dir': give the folders as datasets "
                                    "entries, or one folder as data_config.img_dir, not both"))
        defaults = {key: data[key] for key in FOLDER_KEYS if key in data}
        raw["datasets"] = [{**defaults, **entry} if isinstance(entry, dict) else entry for entry in entries]
    validation = raw.get("validation") if isinstance(raw.get("validation"), dict) else {}
    for key, items, schema, plain in (
            ("datasets", raw.get("datasets") or [], DatasetEntry, ()),
            ("validation.prompts", validation.get("prompts") or [], ValidationPrompt, (str,))):
        for index, item in enumerate(items):
            if isinstance(item, dict):
                _dropping_type_errors(lambda values, schema=schema: _typed(schema, values), item, problems,
                                      prefix=f"{key}[{index}].")
            elif not isinstance(item, plain):
                problems.append(Problem(f"{key}[{index}]", f"key '{key}[{index}]': expected a mapping of keys to "
                                        f"values, got {item!r}"))
        items[:] = [item for item in items if isinstance(item, (dict, *plain))]
    return raw


def _typed(schema: type, values: Dict[str, Any]) -> Any:
    """``values`` as an instance of the dataclass ``schema`` (OmegaConf's type conversion and checks)."""
    return OmegaConf.to_object(merged_with_schema(schema, values))


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


def _describe_type_error(exc: OmegaConfBaseException, prefix: str = "") -> Problem:
    key = prefix + (getattr(exc, "full_key", None) or "?")
    message = str(exc).splitlines()[0]
    section = re.search(r"is not a subclass of (\w+)", message)
    if section and not getattr(exc, "full_key", None):  # a value where a section belongs (data_config=5)
        key = prefix + next((f.name for f in dataclasses.fields(TrainConfig)
                    if getattr(f.default_factory, "__name__", None) == section.group(1)), "?")
        return Problem(key, f"key '{key}': is a section (a mapping of keys), not a single value")
    if "incompatible with type hint 'Union[bool, int]'" in message:  # gradient_checkpointing
        value = re.search(r"Value '(.*?)'", message)
        return Problem(key, f"key '{key}': value '{value.group(1) if value else '?'}' is not true, false or a "
                            "whole number")
    match = re.search(r"Value '(.*?)' (?:of type '.*?' )?could not be converted to (\w+)", message)
    if match:
        kind = {"Integer": "integer", "Float": "number", "Boolean": "boolean (true/false)"}
        return Problem(key, f"key '{key}': value '{match.group(1)}' is not a valid "
                            f"{kind.get(match.group(2), match.group(2))}")
    return Problem(key, f"key '{key}': {message}")
