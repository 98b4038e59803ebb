"""What a run folder holds, read for the page: state, progress, metrics, samples, checkpoints, logs.

Everything is read from the files the engine writes (``trainer/run_dir.py``, ``trainer/run_lock.py``)
and tolerates their absence, since older run folders lack the newer ones:

    run.lock           {"host", "pid", "started"} while a run owns the folder
    run_status.json    {"state": running|finished|failed|stopped, "step", "max_steps", "message", "time"}
    metrics.jsonl      {"step", "loss", "lr", "time", "loss/<dataset>", ...} per line; the last may be torn
    summary.json       at the end (``trainer/reporting.py``)
    webui_launch.json  written by this page for the runs it starts (``webui/launch.py``)
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from trainer.checkpoint import list_checkpoints
from trainer.reporting import smoothed
from trainer.run_dir import CONFIG_NAME, LOG_NAME, METRICS_NAME, STATUS_NAME, SUMMARY_NAME
from trainer.run_lock import LOCK_NAME, read_lock
from webui.paths import NAME

LAUNCH_NAME = "webui_launch.json"
LAUNCH_CONFIG = "webui_config.yaml"
CHILD_LOG = "launcher.log"
STATES = ("running", "finished", "failed", "stopped")
MARKERS = (CONFIG_NAME, METRICS_NAME, STATUS_NAME, LOCK_NAME, LAUNCH_NAME, SUMMARY_NAME, LOG_NAME)
STOP_CODES = (130, 143, -2, -15)  # SIGINT / SIGTERM: the trainer checkpointed and stopped
SPEED_WINDOW = 20  # steps over which s/step is measured


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    """The JSON object in ``path``, or None when it is missing, half-written or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass
class _Tail:
    offset: int = 0
    records: List[Dict[str, Any]] = field(default_factory=list)


class MetricsReader:
    """``metrics.jsonl`` read incrementally (only the new bytes on each call). A torn last line is
    left for the next call; a file that shrank (a resumed run truncates it) is read again."""

    def __init__(self) -> None:
        self._tails: Dict[Path, _Tail] = {}

    def read(self, path: Path) -> List[Dict[str, Any]]:
        try:
            size = path.stat().st_size
        except OSError:
            self._tails.pop(path, None)
            return []
        tail = self._tails.setdefault(path, _Tail())
        if size < tail.offset:
            tail.offset, tail.records = 0, []
        if size > tail.offset:
            with open(path, "rb") as fh:
                fh.seek(tail.offset)
                chunk = fh.read(size - tail.offset)
            complete = chunk[: chunk.rfind(b"\n") + 1]
            tail.offset += len(complete)
            for line in complete.decode("utf-8", "replace").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line a crash cut short
                if isinstance(record, dict) and isinstance(record.get("step"), int):
                    tail.records.append(record)
        return tail.records


def list_run_ids(runs_dir: Path) -> List[str]:
    """Folders directly under ``runs_dir`` that hold a run (any of its files), newest first;
    symlinks leading outside ``runs_dir`` are skipped."""
    base = runs_dir.resolve()
    if not base.is_dir():
        return []
    found = []
    for entry in base.iterdir():
        if not NAME.fullmatch(entry.name) or not entry.is_dir() or not entry.resolve().is_relative_to(base):
            continue
        if any((entry / marker).exists() for marker in MARKERS):
            found.append(entry)
    found.sort(key=_changed, reverse=True)
    return [p.name for p in found]


def _changed(folder: Path) -> float:
    """When the run last wrote one of its files (0 when they vanished meanwhile)."""
    times = [0.0]
    for marker in MARKERS:
        try:
            times.append((folder / marker).stat().st_mtime)
        except OSError:
            continue
    return max(times)


def pid_alive(pid: Any) -> bool:
    """Whether process ``pid`` exists on this machine."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_alive(lock: Optional[Dict[str, Any]]) -> Optional[bool]:
    """Whether the process holding ``run.lock`` lives (None: another host's, or no lock)."""
    if not lock:
        return None
    if lock.get("host") not in (None, socket.gethostname()):
        return None
    return pid_alive(lock.get("pid"))


def run_state(folder: Path, child_alive: Optional[bool]) -> str:
    """running, finished, failed or stopped. ``child_alive`` is what the launcher knows of a child it
    started (None: not one of its children). ``run_status.json`` wins when it names an end state."""
    status = read_json(folder / STATUS_NAME) or {}
    launch = read_json(folder / LAUNCH_NAME) or {}
    alive = child_alive if child_alive is not None else lock_alive(read_lock(folder / LOCK_NAME))
    if alive is None and launch and "returncode" not in launch:  # started by an earlier server of this page
        alive = pid_alive(launch.get("pid"))
    if status.get("state") in ("finished", "failed", "stopped"):
        return status["state"]
    if alive:
        return "running"
    code = launch.get("returncode")
    if launch.get("stop_requested") or code in STOP_CODES:
        return "stopped"
    if (folder / SUMMARY_NAME).is_file():
        return "finished"
    if code not in (None, 0) or status.get("state") == "running" or (launch and not list_checkpoints(folder)):
        return "failed"  # died without saying so
    return "stopped" if list_checkpoints(folder) else "failed"


def read_config(folder: Path) -> Dict[str, Any]:
    """The run's config as plain data (the resolved ``config.yaml``, else the page's launch YAML)."""
    for name in (CONFIG_NAME, LAUNCH_CONFIG):
        try:
            data = OmegaConf.to_container(OmegaConf.load(folder / name), resolve=False)
        except Exception:  # missing, half-written or not YAML: try the next, else nothing
            continue
        if isinstance(data, dict):
            return data
    return {}


def seconds_per_step(records: List[Dict[str, Any]]) -> Optional[float]:
    """Mean seconds per step over the last ``SPEED_WINDOW`` records that carry a ``time``."""
    timed = [r for r in records[-SPEED_WINDOW:] if isinstance(r.get("time"), (int, float))]
    if len(timed) < 2 or timed[-1]["step"] <= timed[0]["step"]:
        return None
    return (timed[-1]["time"] - timed[0]["time"]) / (timed[-1]["step"] - timed[0]["step"])


def samples(folder: Path) -> List[Dict[str, Any]]:
    """Validation samples by step (``samples/step-N/prompt-i.png``); step 0 is the base model's."""
    out = []
    for step_dir in sorted((folder / "samples").glob("step-*")):
        if step_dir.is_dir() and step_dir.name[5:].isdigit():
            files = sorted(p.relative_to(folder).as_posix() for p in step_dir.glob("*.png") if not p.name.startswith("."))
            if files:
                out.append({"step": int(step_dir.name[5:]), "files": files})
    return out


def log_tail(path: Path, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    """The last ``lines`` lines of a text file ('' when missing)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, path.stat().st_size - max_bytes))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.replace("\r", "\n").splitlines()[-lines:])


def artefacts(folder: Path) -> List[str]:
    """The files at the top of the run folder and the final weights' folder, for download links."""
    names = [p.name for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")]
    names += [f"final_model/{p.name}" for p in sorted((folder / "final_model").glob("*")) if p.is_file()]
    return names


def weights_file(folder: Path, summary: Dict[str, Any]) -> Optional[str]:
    """The trained LoRA file inside the folder, when there is one."""
    outputs = summary.get("outputs") or {}
    candidates = [Path(str(outputs.get("weights", ""))).name, "pytorch_lora_weights.safetensors",
                  "adapter_model.safetensors"]
    for name in candidates:
        if name.endswith(".safetensors") and (folder / name).is_file():
            return name
    return None


def overview(folder: Path, records: List[Dict[str, Any]], child_alive: Optional[bool]) -> Dict[str, Any]:
    """One row of the runs list: state, family, model, step, losses, s/step, ETA, peak memory."""
    status = read_json(folder / STATUS_NAME) or {}
    summary = read_json(folder / SUMMARY_NAME) or {}
    cfg = read_config(folder)
    losses = [r["loss"] for r in records if isinstance(r.get("loss"), (int, float))]
    step = status.get("step") if isinstance(status.get("step"), int) else (records[-1]["step"] if records else 0)
    step = max(step, records[-1]["step"]) if records else step
    max_steps = status.get("max_steps") or cfg.get("max_train_steps")
    speed = seconds_per_step(records)
    state = run_state(folder, child_alive)
    return {
        "id": folder.name, "state": state, "message": status.get("message"),
        "family": cfg.get("family") or summary.get("family"), "model": cfg.get("pretrained_model_name_or_path"),
        "step": step, "max_steps": max_steps,
        "loss": losses[-1] if losses else None, "loss_smoothed": smoothed(losses)[-1] if losses else None,
        "s_per_step": speed,
        "eta_s": speed * (max_steps - step) if speed and state == "running" and isinstance(max_steps, int) else None,
        "peak_memory_gib": summary.get("peak_memory_gib") or None,
        "checkpoints": [p.name for p in list_checkpoints(folder)],
        "weights": weights_file(folder, summary),
    }


def detail(folder: Path, records: List[Dict[str, Any]], child_alive: Optional[bool], since: int = 0) -> Dict[str, Any]:
    """A run's page: the overview plus metrics (from record ``since`` on), samples, logs, config,
    the plan made at launch and the measured peak."""
    launch = read_json(folder / LAUNCH_NAME) or {}
    view = overview(folder, records, child_alive)
    return {
        **view, "stopping": bool(launch.get("stop_requested")) and view["state"] == "running",
        "metrics": records[since:], "metrics_total": len(records),
        "samples": samples(folder),
        "log": log_tail(folder / LOG_NAME), "launcher_log": log_tail(folder / CHILD_LOG),
        "config": read_config(folder),
        "plan": launch.get("plan"), "entry": launch.get("entry"),
        "summary": read_json(folder / SUMMARY_NAME), "artefacts": artefacts(folder),
    }
