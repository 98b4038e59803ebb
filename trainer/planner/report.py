"""The plan's result: its items by phase, the peaks, the verdict against a budget, and the printed table
(``plan.py`` computes it, ``advise`` adds the changes that make it fit)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from trainer.planner.settings import Settings


@dataclass(frozen=True)
class MemoryItem:
    """One line of the plan."""

    name: str
    gib: float
    note: str = ""
    section: str = "training"  # "cache pass" | "training" | "validation render" (GPU) | "host"
    counted: bool = True  # False: shown for reference, not part of the peak (another phase)


@dataclass
class MemoryPlan:
    """Itemised peak-memory estimate of one training run (GiB)."""

    title: str
    items: List[MemoryItem]
    cache_pass_gib: float  # GPU peak while the text encoder / VAE encode the dataset
    training_gib: float  # GPU peak during training steps
    host_gib: float  # peak resident host memory of the training process
    validation_gib: float = 0.0  # GPU peak while rendering validation samples (0: none)
    gpu_memory_gib: Optional[float] = None
    fits: Optional[bool] = None
    advice: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    settings: Optional[Settings] = None

    @property
    def gpu_peak_gib(self) -> float:
        """The GPU peak: the largest phase (the encoders are freed before training; validation renders
        run between steps, when no activations are alive)."""
        return max(self.cache_pass_gib, self.training_gib, self.validation_gib)

    def section(self, name: str) -> List[MemoryItem]:
        return [item for item in self.items if item.section == name]

    def format(self) -> str:
        """The plan as an aligned table, then the verdict, advice and assumptions."""
        width = max([len(i.name) for i in self.items] + [36]) + 2
        lines = [self.title, ""]
        cpu = self.settings is not None and self.settings.device == "cpu"
        device = "device (CPU run: host memory)" if cpu else "GPU"
        for section, total_name, total in (("cache pass", "cache pass peak", self.cache_pass_gib),
                                           ("training", "training peak", self.training_gib),
                                           ("validation render", "validation peak", self.validation_gib),
                                           ("host", "host peak", self.host_gib)):
            rows = self.section(section)
            if not rows:
                continue
            header = f"{device}, {section}" if section != "host" else "host (RAM of the training process)"
            lines.append(f"{header:<{width}}{'GiB':>8}   note")
            lines += [_row(i, width) for i in rows]
            lines.append(f"  {total_name:<{width - 2}}{total:>8.2f}")
            lines.append("")
        lines.append(self.verdict())
        if self.advice:
            lines.append("To fit, change (cumulative, each with the new estimate):")
            lines += [f"  - {a}" for a in self.advice]
        if self.notes:
            lines.append("Assumptions:")
            lines += [f"  - {n}" for n in self.notes]
        return "\n".join(lines)

    def verdict(self) -> str:
        """One line: the peaks, and whether they fit the budget."""
        peak = (f"GPU peak {self.gpu_peak_gib:.2f} GiB (the largest phase), "
                f"host peak {self.host_gib:.2f} GiB")
        if self.fits is None:
            return f"{peak}. Give --gpu-memory to check the fit."
        budget = f"{self.gpu_memory_gib:.2f} GiB"
        return f"{peak}: {'fits' if self.fits else 'does NOT fit'} {budget}."


def _row(item: MemoryItem, width: int) -> str:
    gib = f"{item.gib:8.2f}" if item.counted else f"({item.gib:.2f})".rjust(8)
    return f"  {item.name:<{width - 2}}{gib}   {item.note}".rstrip()
