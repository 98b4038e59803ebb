"""End-of-run reports: ``summary.json``, the loss curve (matplotlib, imported only when plotting) and
the timestep histogram (Pillow)."""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from loguru import logger
from PIL import Image, ImageDraw

from trainer.config import TrainConfig, config_to_yaml
from trainer.reporting.metric_logging import read_metrics
from trainer.run_folder.run_dir import RunFolder


def smoothed(values: List[float], beta: float = 0.9) -> List[float]:
    """Bias-corrected exponential moving average (tensorboard's smoothing)."""
    out, avg = [], 0.0
    for i, value in enumerate(values, start=1):
        avg = beta * avg + (1 - beta) * value
        out.append(avg / (1 - beta ** i))
    return out


def loss_series(records: List[Dict[str, Any]]) -> Dict[str, Tuple[List[int], List[float]]]:
    """Each loss the metrics carry (``loss``, then each ``loss/<dataset>`` and ``loss/regularization``
    in the order first seen): the steps it was logged at and its finite values."""
    series: Dict[str, Tuple[List[int], List[float]]] = {}
    for record in records:
        for key, value in record.items():
            if (key == "loss" or key.startswith("loss/")) and isinstance(value, (int, float)) and math.isfinite(value):
                steps, values = series.setdefault(key, ([], []))
                steps.append(record["step"])
                values.append(float(value))
    return series


def plot_losses(records: List[Dict[str, Any]], path: Path, size: Tuple[float, float] = (8.0, 4.0)) -> Path:
    """The loss against step with axes, ticks and a legend: the overall loss (raw, light; smoothed,
    dark) and, for a run of several datasets, each dataset's and the regularisation loss (smoothed).
    ``size`` in inches at 100 dpi. matplotlib is imported here only (Agg canvas, no display):
    training never pays its import."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    series = loss_series(records)
    if "loss" in series:
        steps, values = series.pop("loss")
        axes.plot(steps, values, color="#aabee6", linewidth=1, label="loss")
        axes.plot(steps, smoothed(values), color="#143ca0", linewidth=2, label="loss (smoothed)")
    if len(series) > 1 or any(key.endswith("/regularization") for key in series):  # one dataset: the same curve
        for key, (steps, values) in series.items():
            axes.plot(steps, smoothed(values), linewidth=1.5, linestyle="--" if key == "loss/regularization" else "-",
                      label=f"{key} (smoothed)")
    held_out = [(r["step"], r["eval_loss"]) for r in records
                if isinstance(r.get("eval_loss"), (int, float)) and math.isfinite(r["eval_loss"])]
    if held_out:  # the held-out loss (trainer/evaluation/held_out.py), its lowest point marked
        axes.plot(*zip(*held_out), color="#dc2626", marker="o", markersize=3, linewidth=1.5, label="held-out loss")
        best = min(held_out, key=lambda p: p[1])
        axes.plot(*best, marker="*", markersize=12, color="#dc2626", linestyle="none",
                  label=f"best held-out (step {best[0]})")
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title("training and held-out loss" if held_out else "training loss")
    axes.grid(True, alpha=0.3)
    if axes.lines:
        axes.legend(loc="best", fontsize="small")
    tmp = path.with_name(f".{path.name}.tmp")
    figure.savefig(tmp, format="png")
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def write_summary(folder: RunFolder, cfg: TrainConfig, seconds: float, memory: Dict[str, Any],
                  outputs: Dict[str, str], timing: Optional[Dict[str, Any]] = None, *, steps: int,
                  final_loss: Optional[float] = None) -> Path:
    """``summary.json``: config hash, steps and final loss (from the run's own state: ``metrics.jsonl``
    may have been cleaned up or rotated meanwhile), time (and ``timing``: start-up phases, first step,
    compile and attention choices, the datasets and what the run drew of each), the smoothed final
    loss of the logged curve, peak memory, output paths."""
    losses = [r["loss"] for r in read_metrics(folder.metrics) if "loss" in r]  # (evaluation lines have none)
    summary = {
        "config_sha256": hashlib.sha256(config_to_yaml(cfg).encode()).hexdigest(),
        "family": cfg.family,
        "training_mode": cfg.training_mode,
        "steps": steps,
        "train_seconds": round(seconds, 2),
        **(timing or {}),
        "final_loss": final_loss if final_loss is not None else (losses[-1] if losses else None),
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


def plot_timestep_density(cfg: TrainConfig, family: Any, sizes: List[Tuple[int, int]], output_dir: Path) -> Path:
    """``timestep_density.png``: what the configured sampler and shift draw, at the most common size."""
    import torch

    from trainer.data.features import latent_shape
    from trainer.step.training_step import draw_sigmas

    size = max(set(sizes), key=sizes.count)
    sigmas = draw_sigmas(cfg, family, latent_shape(family, size, 20_000), torch.Generator().manual_seed(0))
    return plot_histogram(sigmas.tolist(), output_dir / "timestep_density.png",
                          f"{cfg.timestep_sampling} + shift {cfg.timestep_shift} at {size[0]}x{size[1]}")


@dataclass
class RunClock:
    """Where a run's seconds go, as the summary reports them."""

    wall: Dict[str, Optional[float]] = field(default_factory=dict)  # per phase of the run (start-up included)
    first_step_s: Optional[float] = None  # includes compiling the blocks when compiled
    last_step_at: float = 0.0  # the last step's end (perf_counter)
    postfix_at: float = 0.0  # when the progress bar last showed the loss and lr
    train_seconds: float = 0.0  # the loop's


def log_train_time(steps: int, seconds: float, first_step_s: Optional[float], compiled: bool) -> None:
    """The loop's time per step, and the first step's apart (compilation, warm-up) when there are more."""
    if steps:
        logger.info(f"trained {steps} steps in {seconds:.1f} s ({seconds / steps:.3f} s/step)")
    if steps > 1 and first_step_s is not None:
        later = (seconds - first_step_s) / (steps - 1)
        logger.info(f"first step {first_step_s:.1f} s" + (" (compiling the blocks)" if compiled else "")
                    + f", then {later:.3f} s/step")


def log_wall_time(wall: Dict[str, Optional[float]]) -> None:
    """Where the run's seconds went, start-up included (imports, set-up, cache pass, loading)."""
    shown = ", ".join(f"{name} {secs:.1f} s" for name, secs in wall.items() if secs is not None)
    logger.info(f"wall time: {shown}")


def process_age_s() -> Optional[float]:
    """Seconds since this process started (Linux ``/proc``; None elsewhere): the start-up before the engine."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
