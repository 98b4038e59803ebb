"""What a run folder holds, read for the page: state, progress, metrics, samples, checkpoints, logs.

Everything is read from the files the engine writes (``trainer/run_folder/run_dir.py``, ``trainer/run_folder/run_lock.py``)
and tolerates their absence, since older run folders lack the newer ones:

    run.lock           {"host", "pid", "started"} while a run owns the folder
    run_status.json    {"state": running|finished|failed|stopped, "step", "max_steps", "message", "time"}
    metrics.jsonl      {"step", "loss", "lr", "time", "loss/<dataset>", ...} per line; the last may be torn;
                       evaluation lines carry "eval_loss" (and "eval_loss/sigma_<level>") instead of "loss"
    summary.json       at the end (``trainer/reporting/summary.py``)
    webui_launch.json  written by this page for the runs it starts or queues (``webui/runner.py``):
                       {"entry", "overrides", "created", "max_steps", "plan", "queued", "queued_at",
                        "cancelled", "argv", "pid", "started", "device", "returncode", "ended",
                        "stop_requested", "launch_error"}
    webui_config.yaml  the YAML text the page launched with (the overrides are in the record)

The state shown is the live process's while it lives (``starting`` until the trainer has written its
own status since this launch, then ``running``), else the end state the run wrote since this launch,
else what the launcher's exit code says.
"""

from __future__ import annotations

import copy
import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import OmegaConf

from trainer.run_folder.checkpoint import list_checkpoints
from trainer.reporting.summary import smoothed
from trainer.run_folder.run_dir import CONFIG_NAME, LOG_NAME, METRICS_NAME, STATUS_NAME, SUMMARY_NAME
from trainer.run_folder.run_lock import LOCK_NAME, live_owner
from webui.children import read_json, recorded_alive
from webui.paths import NAME

LAUNCH_NAME = "webui_launch.json"
LAUNCH_CONFIG = "webui_config.yaml"
CHILD_LOG = "launcher.log"
STATES = ("queued", "starting", "running", "finished", "failed", "stopped", "cancelled")
ACTIVE = ("queued", "starting", "running")  # a run in these states owns its folder
END_STATES = ("finished", "failed", "stopped")
MARKERS = (CONFIG_NAME, METRICS_NAME, STATUS_NAME, LOCK_NAME, LAUNCH_NAME, SUMMARY_NAME, LOG_NAME)
STOP_CODES = (130, 143, -2, -15)  # SIGINT / SIGTERM: the trainer checkpointed and stopped
SPEED_WINDOW = 20  # steps over which s/step is measured
CONFIG_CACHE_SIZE = 2048  # run folders whose parsed config is kept (then the cache starts again)
_CONFIGS: Dict[Path, Tuple[Tuple[Optional[Tuple[int, int, int]], ...], Dict[str, Any]]] = {}


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


def status_of_this_launch(status: Dict[str, Any], launch: Dict[str, Any]) -> bool:
    """Whether ``run_status.json`` was written since the page's latest launch of the run (always,
    for a run the page never launched)."""
    started = launch.get("started")
    return not isinstance(started, (int, float)) or (isinstance(status.get("time"), (int, float))
                                                     and status["time"] >= started)


def stop_pending(folder: Path, launch: Dict[str, Any]) -> bool:
    """A stop was sent to this launch and the trainer has it: it was up then, or is not up yet. (A
    second signal to a trainer that got one exits without its checkpoint; a trainer that took the
    lock after the stop never saw it, since the launcher had no trainer to pass it to.)"""
    if not launch.get("stop_requested"):
        return False
    owner = live_owner(folder)
    return not (owner and owner["started"] > (launch.get("stopped") or 0))


def run_state(folder: Path, child_alive: Optional[bool]) -> str:
    """One of ``STATES``. ``child_alive`` is what the launcher knows of a child it started (None: not
    one of its children). A live process wins over what the files said before it started."""
    status = read_json(folder / STATUS_NAME) or {}
    launch = read_json(folder / LAUNCH_NAME) or {}
    if launch.get("queued"):
        return "queued"
    fresh = status_of_this_launch(status, launch)
    locked = live_owner(folder) is not None
    alive = child_alive if child_alive is not None else bool(locked or recorded_alive(launch))
    if alive:  # the trainer is up once it has written its status or taken the lock since this launch
        return "running" if (fresh and status) or locked else "starting"
    if fresh and status.get("state") in END_STATES:  # a CLI run's resume queued and cancelled: still its end
        return status["state"]
    if launch.get("cancelled") and "started" not in launch:
        return "cancelled"
    code = launch.get("returncode")
    if launch.get("launch_error"):
        return "failed"
    if launch.get("stop_requested") or code in STOP_CODES:
        return "stopped"
    if (folder / SUMMARY_NAME).is_file() and (code == 0 or not launch):
        return "finished"
    if code not in (None, 0) or (fresh and status.get("state") == "running") or (launch and not list_checkpoints(folder)):
        return "failed"  # died without saying so
    return "stopped" if list_checkpoints(folder) else "failed"


def read_config(folder: Path) -> Dict[str, Any]:
    """The run's config as plain data: the ``config.yaml`` the run wrote at its latest start, else
    what the page launched or queued (its YAML with the overrides applied). Never resolved. Parsed
    again only when one of the files it comes from changed (the runs list asks for every run's,
    every poll, and OmegaConf takes milliseconds per file)."""
    signature = tuple(_file_signature(folder / name) for name in (LAUNCH_NAME, CONFIG_NAME, LAUNCH_CONFIG))
    cached = _CONFIGS.get(folder)
    if cached is None or cached[0] != signature:
        if len(_CONFIGS) >= CONFIG_CACHE_SIZE:
            _CONFIGS.clear()
        cached = _CONFIGS[folder] = (signature, _parse_config(folder))
    return copy.deepcopy(cached[1])  # the caller's to change


def _file_signature(path: Path) -> Optional[Tuple[int, int, int]]:
    """What changes when a file is written (atomic writes make a new inode): None when it is missing."""
    try:
        found = path.stat()
    except OSError:
        return None
    return found.st_ino, found.st_mtime_ns, found.st_size


def _parse_config(folder: Path) -> Dict[str, Any]:
    launch = read_json(folder / LAUNCH_NAME) or {}
    written = folder / CONFIG_NAME
    launched = launch.get("created") or launch.get("started")
    try:
        current = not launched or written.stat().st_mtime >= max(launch.get("started") or 0, launch.get("queued_at") or 0)
    except OSError:
        current = False
    if current:
        data = _load_yaml(written)
        if data is not None:
            return data
    data = _load_yaml(folder / LAUNCH_CONFIG)
    if data is None:
        return _load_yaml(written) or {}
    try:
        merged = OmegaConf.merge(OmegaConf.create(data), OmegaConf.from_dotlist(list(launch.get("overrides") or [])))
        return OmegaConf.to_container(merged, resolve=False)  # type: ignore[return-value]
    except Exception:  # an override the run itself refused: show the YAML as it was
        return data


def _load_yaml(path: Path) -> Optional[Dict[str, Any]]:
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:  # missing, half-written or not YAML
        return None
    return data if isinstance(data, dict) else None


def seconds_per_step(records: List[Dict[str, Any]]) -> Optional[float]:
    """Median seconds per step over the last ``SPEED_WINDOW`` records that carry a ``time`` (the
    median, so that a validation pass or a checkpoint between two steps does not set the ETA)."""
    timed = [r for r in records[-SPEED_WINDOW:] if isinstance(r.get("time"), (int, float))]
    rates = sorted((b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(timed, timed[1:])
                   if b["step"] > a["step"])
    return rates[len(rates) // 2] if rates else None


def prompt_texts(cfg: Dict[str, Any]) -> List[str]:
    """The validation prompts of a config, as text (a mapping entry's ``prompt``)."""
    prompts = (cfg.get("validation") or {}).get("prompts") or []
    return [str(p.get("prompt", "")) if isinstance(p, dict) else str(p) for p in prompts]


def samples(folder: Path, prompts: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """Validation samples by step (``samples/step-N/prompt-i.png``); step 0 is the base model's. A video
    family's sample is its animated ``prompt-i.webp`` (shown inline like an image) where there is one, else the
    PNG. Each file comes with its prompt's text when ``prompts`` has it."""
    out = []
    for step_dir in sorted((folder / "samples").glob("step-*")):
        if step_dir.is_dir() and step_dir.name[5:].isdigit():
            files = sorted(_shown(p).relative_to(folder).as_posix() for p in step_dir.glob("*.png")
                           if not p.name.startswith("."))
            if files:
                texts = [_prompt_of(Path(f).stem, prompts or []) for f in files]
                out.append({"step": int(step_dir.name[5:]), "files": files, "prompts": texts})
    return out


def _shown(png: Path) -> Path:
    """The file the page shows for a sample: the clip's animated .webp beside the PNG, else the PNG."""
    clip = png.with_suffix(".webp")
    return clip if clip.is_file() else png


def _prompt_of(stem: str, prompts: List[str]) -> Optional[str]:
    index = stem.rpartition("-")[2]
    return prompts[int(index)] if index.isdigit() and int(index) < len(prompts) else None


def checkpoints(folder: Path, records: List[Dict[str, Any]] = ()) -> List[Dict[str, Any]]:
    """Complete checkpoints, oldest first: name, step, size, the weight files inside, the held-out
    loss logged at its step (``eval_loss``) and whether it is the best of them (``best``)."""
    held_out = {r["step"]: r["eval_loss"] for r in records if isinstance(r.get("eval_loss"), (int, float))}
    out = []
    for path in list_checkpoints(folder):
        files = [p for p in path.rglob("*") if p.is_file()]
        step = int(path.name.split("-", 1)[1])
        out.append({"name": path.name, "step": step,
                    "bytes": sum(p.stat().st_size for p in files),
                    "weights": sorted(p.relative_to(folder).as_posix() for p in files if p.suffix == ".safetensors"
                                      and "optimizer" not in p.name),
                    "eval_loss": held_out.get(step), "best": False})
    scored = [c for c in out if c["eval_loss"] is not None]
    if scored:  # the checkpoint to keep (trainer/judge.py): the lowest held-out loss
        min(scored, key=lambda c: c["eval_loss"])["best"] = True
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


def timing(folder: Path, records: List[Dict[str, Any]], state: str) -> Dict[str, Optional[float]]:
    """When the run was first started (the page's record, else its first metrics line, else its
    config) and for how long it has run since (up to now while it runs, else its last sign of life)."""
    launch = read_json(folder / LAUNCH_NAME) or {}
    status = read_json(folder / STATUS_NAME) or {}
    first = records[0].get("time") if records else None
    starts = [t for t in (launch.get("first_started"), launch.get("started"), first) if isinstance(t, (int, float))]
    if not starts:
        try:
            starts = [(folder / CONFIG_NAME).stat().st_mtime]
        except OSError:
            return {"started": None, "duration_s": None}
    started = min(starts)
    if state in ("starting", "running"):
        end: Optional[float] = time.time()
    else:
        ends = [t for t in (launch.get("ended"), status.get("time"), records[-1].get("time") if records else None)
                if isinstance(t, (int, float))]
        end = max(ends) if ends else None
    return {"started": started, "duration_s": max(0.0, end - started) if end is not None else None}


def unexplained_end(folder: Path, code: Optional[int], step: int) -> str:
    """Why a run ended that wrote no end state, in plain words: the launcher's exit code (137 or -9:
    SIGKILL, which is what the kernel's out-of-memory killer sends), the step, and where it resumes."""
    if code is None:
        said = "ended without saying why"
    else:
        signum = -code if code < 0 else code - 128 if code > 128 else None
        why = " (killed: out of memory?)" if signum == signal.SIGKILL else f" (signal {signum})" if signum else ""
        said = f"exited with code {code}{why}"
    latest = list_checkpoints(folder)
    resume = f"resume from {latest[-1].name}" if latest else "no checkpoint to resume from"
    return f"{said} at step {step}; {resume}"


def overview(folder: Path, records: List[Dict[str, Any]], child_alive: Optional[bool]) -> Dict[str, Any]:
    """One row of the runs list: state, family, model, step, losses, s/step, ETA, start, duration, peak."""
    status = read_json(folder / STATUS_NAME) or {}
    launch = read_json(folder / LAUNCH_NAME) or {}
    summary = read_json(folder / SUMMARY_NAME) or {}
    cfg = read_config(folder)
    fresh = status_of_this_launch(status, launch)
    losses = [r["loss"] for r in records if isinstance(r.get("loss"), (int, float))]
    step = status.get("step") if isinstance(status.get("step"), int) else 0
    step = max(step, records[-1]["step"]) if records else step
    # what this launch asked for: the run's own status once it has written one, else the page's record
    max_steps = (status.get("max_steps") if fresh else None) or launch.get("max_steps") or cfg.get("max_train_steps")
    speed = seconds_per_step(records)
    state = run_state(folder, child_alive)
    said_why = bool(launch.get("launch_error")) or (fresh and status.get("state") in END_STATES)
    message = launch.get("launch_error") or (status.get("message") if fresh or not launch else None)
    if state == "failed" and not said_why:  # the trainer died without its last word: a stale "started"
        message = unexplained_end(folder, launch.get("returncode"), step)
    return {
        "id": folder.name, "state": state, "message": message,
        "family": cfg.get("family") or summary.get("family"), "model": cfg.get("pretrained_model_name_or_path"),
        "step": step, "max_steps": max_steps,
        "loss": losses[-1] if losses else None, "loss_smoothed": smoothed(losses)[-1] if losses else None,
        "s_per_step": speed,
        "eta_s": speed * (max_steps - step) if speed and state == "running" and isinstance(max_steps, int) else None,
        **timing(folder, records, state),
        "peak_memory_gib": summary.get("peak_memory_gib") or None,
        "checkpoints": [p.name for p in list_checkpoints(folder)],
        "weights": weights_file(folder, summary),
        "samples_count": sum(len(s["files"]) for s in samples(folder)),
    }


def detail(folder: Path, records: List[Dict[str, Any]], child_alive: Optional[bool], since: int = 0) -> Dict[str, Any]:
    """A run's page: the overview plus metrics (from record ``since`` on), samples with their
    prompts, checkpoints, logs, config, the plan made at launch and the measured peak."""
    launch = read_json(folder / LAUNCH_NAME) or {}
    view = overview(folder, records, child_alive)
    cfg = read_config(folder)
    return {
        **view, "stopping": stop_pending(folder, launch) and view["state"] in ("starting", "running"),
        "metrics": records[since:], "metrics_total": len(records),
        "samples": samples(folder, prompt_texts(cfg)), "checkpoint_files": checkpoints(folder, records),
        "log": log_tail(folder / LOG_NAME), "launcher_log": log_tail(folder / CHILD_LOG),
        "config": cfg, "queued_at": launch.get("queued_at") if view["state"] == "queued" else None,
        "plan": launch.get("plan"), "entry": launch.get("entry"),
        "summary": read_json(folder / SUMMARY_NAME), "artefacts": artefacts(folder),
    }
