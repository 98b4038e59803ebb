"""End-of-run reports: ``summary.json`` and a loss-curve PNG (drawn with Pillow, no plotting stack)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Dict, List, Optional

from PIL import Image, ImageDraw

from trainer.config import TrainConfig, config_to_yaml
from trainer.run_dir import RunFolder


def smoothed(values: List[float], beta: float = 0.9) -> List[float]:
    """Bias-corrected exponential moving average (tensorboard's smoothing)."""
    out, avg = [], 0.0
    for i, value in enumerate(values, start=1):
        avg = beta * avg + (1 - beta) * value
        out.append(avg / (1 - beta ** i))
    return out


def plot_losses(records: List[Dict[str, Any]], path: Path, size: tuple = (800, 400)) -> Path:
    """Raw (light) and smoothed (dark) loss against step."""
    width, height = size
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    margin = 40
    draw.rectangle([margin, margin // 2, width - margin // 2, height - margin], outline="black")
    if records:
        steps = [r["step"] for r in records]
        losses = [r["loss"] for r in records]
        lo, hi = min(losses), max(losses)
        span_x, span_y = max(steps[-1] - steps[0], 1), max(hi - lo, 1e-12)

        def xy(step: float, loss: float) -> tuple:
            x = margin + (step - steps[0]) / span_x * (width - 1.5 * margin)
            y = height - margin - (loss - lo) / span_y * (height - 1.5 * margin)
            return x, y

        for series, colour in ((losses, (170, 190, 230)), (smoothed(losses), (20, 60, 160))):
            points = [xy(s, v) for s, v in zip(steps, series)]
            draw.line(points if len(points) > 1 else points * 2, fill=colour, width=2)
        draw.text((margin, 2), f"loss {lo:.4f} .. {hi:.4f}, steps {steps[0]}..{steps[-1]}", fill="black")
    image.save(path)
    return path


def write_summary(folder: RunFolder, cfg: TrainConfig, seconds: float, memory: Dict[str, Any],
                  outputs: Dict[str, str], timing: Optional[Dict[str, Any]] = None) -> Path:
    """``summary.json``: config hash, steps, time (and ``timing``: start-up phases, first step,
    compile and attention choices), final loss, peak memory, output paths."""
    records = folder.read_metrics()
    losses = [r["loss"] for r in records]
    summary = {
        "config_sha256": hashlib.sha256(config_to_yaml(cfg).encode()).hexdigest(),
        "family": cfg.family,
        "training_mode": cfg.training_mode,
        "steps": records[-1]["step"] if records else 0,
        "train_seconds": round(seconds, 2),
        **(timing or {}),
        "final_loss": losses[-1] if losses else None,
        "final_loss_smoothed": smoothed(losses)[-1] if losses else None,
        "peak_memory_gib": memory.get("peak", {}),
        "outputs": outputs,
    }
    return folder.write_summary(summary)


def plot_histogram(values: List[float], path: Path, title: str, bins: int = 50, size: tuple = (600, 300)) -> Path:
    """A histogram of values in [0, 1] (the sampled noise levels) as a PNG."""
    width, height = size
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, max(0, int(v * bins)))] += 1
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    top, bar = max(counts) or 1, (width - 40) / bins
    for i, count in enumerate(counts):
        x = 20 + i * bar
        draw.rectangle([x, height - 30 - count / top * (height - 60), x + bar - 1, height - 30], fill=(40, 90, 170))
    draw.text((20, 5), title, fill="black")
    draw.text((20, height - 22), "sigma 0", fill="black")
    draw.text((width - 60, height - 22), "sigma 1", fill="black")
    image.save(path)
    return path
