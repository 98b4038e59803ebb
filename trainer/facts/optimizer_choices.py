"""The facts of each ``optimizer:`` choice, in one table: its package and pip line, whether it is
schedule-free or adapts its own step size, whether it runs on sharded weights, and the bytes of state
it keeps (the memory planner's figure). ``trainer/step/optim.py`` builds them; ``trainer/config/checks.py`` checks
the keys against this table. Nothing here imports an optimizer package (nor torch): it is on ``trainer/``'s
ground floor (``trainer/facts/``); ``trainer.step.optimizer_specs`` is its old import path.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence

SLICE = 11  # Prodigy + schedule-free keeps its step-size statistics on every 11th element (bf16)


@dataclass(frozen=True)
class Matrix:
    """``count`` trained 2-D weights of shape (rows, cols). ``hidden``: inside the repeated blocks
    (Muon orthogonalises these); ``starts_zero``: all zeros at the start (LoRA B), where Prodigy
    keeps no copy of the initial weights."""

    rows: int
    cols: int
    count: int = 1
    hidden: bool = True
    starts_zero: bool = False

    @property
    def numel(self) -> int:
        return self.rows * self.cols * self.count


@dataclass(frozen=True)
class TrainedShapes:
    """What an optimizer steps: the 2-D weights, the elements of every other weight (biases, norms,
    DoRA magnitudes) and the bytes per element of the trained weights."""

    matrices: Sequence[Matrix]
    other: int = 0
    element_bytes: int = 4

    @property
    def numel(self) -> int:
        return sum(m.numel for m in self.matrices) + self.other


def _moments(n: int) -> Callable[[TrainedShapes], float]:
    """``n`` full-size tensors in the weights' dtype per weight (AdamW: 2, Prodigy: 4)."""
    return lambda s: n * s.element_bytes * s.numel


def _adamw8bit(s: TrainedShapes) -> float:
    """Two 8-bit moments, each with an fp32 scale per 256-element block."""
    return (2 + 2 * 4 / 256) * s.numel


def _adafactor(s: TrainedShapes) -> float:
    """A row and a column second moment per matrix; whole vectors otherwise."""
    return s.element_bytes * (sum((m.rows + m.cols) * m.count for m in s.matrices) + s.other)


def _prodigy(s: TrainedShapes) -> float:
    """Both Adam moments, the step-size accumulator ``s`` and the initial weights ``p0`` (a scalar
    for a weight that starts at zero)."""
    zero = sum(m.numel for m in s.matrices if m.starts_zero)
    return s.element_bytes * (4 * s.numel - zero)


def _prodigy_schedulefree(s: TrainedShapes) -> float:
    """``z`` (the weights' dtype), a factored fp32 second moment per matrix with a side of 32 or more
    (else a full one), and bf16 ``s``/``p0`` on every 11th element."""
    total = s.element_bytes * s.numel  # z
    for m in s.matrices:
        factored = max(m.rows, m.cols) >= 32
        total += 4 * (m.rows + m.cols) * m.count if factored else s.element_bytes * m.numel
        total += 2 * math.ceil(m.rows * m.cols / SLICE) * m.count * (1 if m.starts_zero else 2)
    return total + s.element_bytes * s.other + 2 * 2 * math.ceil(s.other / SLICE)


def _muon(s: TrainedShapes) -> float:
    """One momentum buffer for the hidden matrices (Muon), AdamW's two moments for the rest."""
    hidden = sum(m.numel for m in s.matrices if m.hidden)
    return s.element_bytes * (hidden + 2 * (s.numel - hidden))


@dataclass(frozen=True)
class OptimizerChoice:
    """One ``optimizer:`` value."""

    name: str
    label: str  # as the planner and logs show it
    state_bytes: Callable[[TrainedShapes], float]
    package: Optional[str] = None  # the module it needs; None: always there (or a fallback exists)
    requirement: str = ""  # its pip line, as in requirements.txt
    schedule_free: bool = False  # trains at one point, evaluates at another (optimizer.train()/eval())
    adaptive: bool = False  # finds its own step size: learning_rate multiplies it (1.0 is usual)
    shards: bool = True  # runs on FSDP/DeepSpeed-sharded weights

    def missing(self) -> Optional[str]:
        """The pip command that installs the package when it is not installed, else None."""
        if self.package is None or importlib.util.find_spec(self.package) is not None:
            return None
        return f"pip install '{self.requirement}'"


OPTIMIZERS: Dict[str, OptimizerChoice] = {spec.name: spec for spec in (
    OptimizerChoice("adamw", "AdamW", _moments(2)),
    # bitsandbytes is optional: without it the 8-bit request falls back to AdamW with a warning.
    OptimizerChoice("adamw8bit", "8-bit AdamW", _adamw8bit),
    OptimizerChoice("adafactor", "Adafactor", _adafactor),
    OptimizerChoice("prodigy", "Prodigy", _prodigy, "prodigyopt", "prodigyopt>=1.1.2,<1.2", adaptive=True,
                  shards=False),
    OptimizerChoice("prodigy_schedulefree", "Prodigy + schedule-free", _prodigy_schedulefree, "prodigyplus",
                  "prodigy-plus-schedule-free>=2.0.1,<2.1", schedule_free=True, adaptive=True, shards=False),
    OptimizerChoice("adamw_schedulefree", "schedule-free AdamW", _moments(2), "schedulefree",
                  "schedulefree>=1.4.1,<1.5", schedule_free=True, shards=False),
    OptimizerChoice("muon", "Muon + AdamW", _muon, "torch.optim._muon", "torch>=2.9", shards=False),  # torch's own
)}

OptimizerSpec = OptimizerChoice  # its name before the *Spec -> *Choice rename
