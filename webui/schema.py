"""The form of the start page, generated from ``TrainConfig``: one entry per key, with its type,
default, choices and help, and the values a YAML profile gives them.

Scalar keys (text, integer, number, boolean, a choice) become inputs; anything else (lists, and lists
of strings or mappings such as ``validation.prompts``) is edited as YAML text, so a new field type
in the schema never breaks the form.

Each key's one-line help is the schema's own: a field's ``help`` metadata, else the comment beside
it or just above it in ``trainer/config/schema.py``. ``COMMON`` are the keys the form shows first, as
ai-toolkit's and OneTrainer's forms do (model, data, steps, learning rate, rank, resolution,
samples); the rest are under "advanced".
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import json
import tokenize
import typing
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import OmegaConf

from trainer.config import TrainConfig

SCALARS = {str: "text", int: "integer", float: "number", bool: "boolean"}
COMMON = {  # key: the label the form gives it, in the form's order
    "pretrained_model_name_or_path": "model",
    "data_config.img_dir": "dataset folder",
    "data_config.trigger_word": "trigger word",
    "max_train_steps": "steps",
    "learning_rate": "learning rate",
    "rank": "LoRA rank",
    "data_config.img_size": "resolution",
    "validation.prompts": "sample prompts",
    "validation.every_n_steps": "sample every N steps",
    "checkpointing_steps": "checkpoint every N steps",
}


@functools.lru_cache(maxsize=None)
def field_comments(cls: type) -> Dict[str, str]:
    """The comment of each field of a dataclass in its source: the one on its line, else the block
    of comment lines right above it (a lone comment after a blank line heads a group of keys, and is
    not any one key's)."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    comments = {tok.start[0] - 1: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO("".join(lines)).readline)
                if tok.type == tokenize.COMMENT}
    names = {f.name for f in dataclasses.fields(cls)}
    out: Dict[str, str] = {}
    for number, line in enumerate(lines):
        name = line[4:].split(":", 1)[0].strip() if line.startswith("    ") and not line.startswith("     ") else ""
        if name not in names:
            continue
        if number in comments and not line.lstrip().startswith("#"):
            out[name] = comments[number]
            continue
        above = []
        at = number - 1
        while at >= 0 and lines[at].lstrip().startswith("#"):
            above.insert(0, comments.get(at, ""))
            at -= 1
        heading = len(above) == 1 and (at < 0 or not lines[at].strip())
        if above and not heading:
            out[name] = " ".join(above)
    return out


def _kind(hint: Any) -> Tuple[str, bool]:
    """The form's kind of a type hint and whether None is allowed."""
    optional = False
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0] if len(args) == 1 else Any
    return SCALARS.get(hint, "yaml"), optional


def _comment(cls: type, name: str) -> str:
    """A field's comment, from the class that declares it (or a base class)."""
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass) and name in field_comments(klass):
            return field_comments(klass)[name]
    return ""


@functools.lru_cache(maxsize=None)
def schema_fields(cls: type = TrainConfig, prefix: str = "") -> List[Dict[str, Any]]:
    """Every key of ``cls`` (sections flattened to dotted keys), in the schema's order."""
    hints = typing.get_type_hints(cls)
    out: List[Dict[str, Any]] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += schema_fields(hint, f"{prefix}{f.name}.")
            continue
        kind, optional = _kind(hint)
        key = f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        choices = f.metadata.get("choices")
        if choices and kind != "yaml":  # a list of choices (lora_export_formats) stays YAML, its choices in the help
            kind = "choice"
        out.append({"key": key, "kind": kind, "optional": optional,
                    "choices": list(choices) if choices else None, "default": to_text(default, kind),
                    "help": str(f.metadata.get("help") or _comment(cls, f.name)),
                    "section": prefix.rstrip(".") or None, "common": key in COMMON, "label": COMMON.get(key, key),
                    "order": list(COMMON).index(key) if key in COMMON else None})
    return out


def to_text(value: Any, kind: str = "yaml") -> Optional[str]:
    """A value as the form shows it: scalars as text, anything else as one line of flow YAML/JSON;
    None as null (the field's auto/off)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float)) and kind != "yaml":
        return str(value)
    return json.dumps(value)


def yaml_values(text: str) -> Dict[str, Optional[str]]:
    """The dotted keys a YAML text sets and their values as form text (unknown keys included, so the
    check that follows names them)."""
    data = OmegaConf.to_container(OmegaConf.create(text or "{}"), resolve=False)
    if not isinstance(data, dict):
        raise ValueError("the top level must be a mapping of keys to values")
    return _flat(data)


def override_values(overrides: List[str]) -> Dict[str, Optional[str]]:
    """The form's values of ``key=value`` overrides (a run's, to start a new run like it)."""
    data = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)), resolve=False)
    return _flat(data if isinstance(data, dict) else {})


def _flat(data: Dict[str, Any]) -> Dict[str, Optional[str]]:
    kinds = {f["key"]: f["kind"] for f in schema_fields()}
    flat: Dict[str, Optional[str]] = {}

    def walk(node: Dict[str, Any], prefix: str) -> None:
        for key, value in node.items():
            full = f"{prefix}{key}"
            if isinstance(value, dict) and full not in kinds:
                walk(value, f"{full}.")
            else:
                flat[full] = to_text(value, kinds.get(full, "yaml"))

    walk(data, "")
    return flat
