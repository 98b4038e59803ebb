"""The form of the start page, generated from ``TrainConfig``: one entry per key, with its type,
default, choices and help, and the values a YAML profile gives them.

Scalar keys (text, integer, number, boolean, a choice) become inputs; anything else (lists, and lists
of strings or mappings such as ``validation.prompts``) is edited as YAML text, so a new field type
in the schema never breaks the form.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import OmegaConf

from trainer.config import TrainConfig

SCALARS = {str: "text", int: "integer", float: "number", bool: "boolean"}


def _kind(hint: Any) -> Tuple[str, bool]:
    """The form's kind of a type hint and whether None is allowed."""
    optional = False
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0] if len(args) == 1 else Any
    return SCALARS.get(hint, "yaml"), optional


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
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        choices = f.metadata.get("choices")
        if choices and kind != "yaml":  # a list of choices (lora_export_formats) stays YAML, its choices in the help
            kind = "choice"
        out.append({"key": f"{prefix}{f.name}", "kind": kind, "optional": optional,
                    "choices": list(choices) if choices else None, "default": to_text(default, kind),
                    "help": str(f.metadata.get("help", "")), "section": prefix.rstrip(".") or None})
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
