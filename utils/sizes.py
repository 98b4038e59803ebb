"""Memory sizes as people write them (``24GiB``, ``24 GB``, ``16``): the planner's ``--gpu-memory`` and
the config's ``gpu_memory`` read them the same way."""

from __future__ import annotations

import re

GIB = 2**30

_UNITS = {"": GIB, "g": GIB, "gi": GIB, "gib": GIB, "gb": 1e9, "m": 2**20, "mi": 2**20, "mib": 2**20,
          "mb": 1e6, "t": 2**40, "ti": 2**40, "tib": 2**40, "tb": 1e12}


def parse_size(text: str | float | int) -> float:
    """A memory size in GiB: ``"24GiB"``, ``"24 GB"`` (10^9 bytes), ``"16"`` (GiB), ``"512MiB"``."""
    if isinstance(text, (int, float)):
        return float(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}; write e.g. 24GiB, 24GB, 16 (GiB) or 512MiB")
    return float(match.group(1)) * _UNITS[unit] / GIB
