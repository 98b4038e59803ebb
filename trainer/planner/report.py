"""The plan's result: its items by phase, the peaks, the verdict against a budget, and the printed table
(``plan.py`` computes it, ``advise`` adds the changes that make it fit)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

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

    def as_json(self) -> Dict[str, Any]:
        """The plan as one JSON object: the peaks in GiB as the table prints them (two decimals), the verdict,
        the settings it was made for, its items, advice and assumptions."""
        return {"fits": self.fits, "gpu_memory_gib": self.gpu_memory_gib, "gpu_peak_gib": _two(self.gpu_peak_gib),
                "host_peak_gib": _two(self.host_gib), "cache_pass_gib": _two(self.cache_pass_gib),
                "training_gib": _two(self.training_gib), "validation_gib": _two(self.validation_gib),
                "settings": settings_json(self.settings) if self.settings is not None else {},
                "items": [{"name": i.name, "gib": _two(i.gib), "section": i.section, "counted": i.counted,
                           "note": i.note} for i in self.items],
                "advice": list(self.advice), "notes": list(self.notes), "title": self.title}

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


def _two(gib: float) -> float:
    return round(gib, 2)


def settings_json(s: Settings) -> Dict[str, Any]:
    """What the plan assumed of the run's memory settings (``quantization``: the transformer's weight format,
    null when unquantized)."""
    return {"quantization": s.quantization, "quantization_backend": s.backend,
            "checkpointed_blocks": s.checkpointed, "blocks": s.num_blocks,
            "gradient_checkpointing_cpu_offload": s.offload_checkpoints, "optimizer": s.optimizer,
            "blocks_to_swap": s.blocks_to_swap, "text_encoder_quantization": s.text_encoder_quantization,
            "mixed_precision": s.precision, "img_size": s.img_size, "batch": s.batch, "device": s.device}
